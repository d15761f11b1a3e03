"""Tests for mcpresume.core.sse: the WHATWG event-stream rules one by one, then properties over chunkings."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.errors import EventTooLarge
from mcpresume.core.sse import (
    SSEEvent,
    SSEParser,
    SSERun,
    encode_comment,
    encode_event,
    encode_frame,
    encode_retry,
    frame_body,
    frame_into,
    frame_parts,
    priming_block,
)
from tests.support.short_answers import short_answers

BIG = 1 << 20
FAST = settings(max_examples=150, deadline=None)


def parse(stream: bytes, limit: int = BIG) -> list[SSEEvent]:
    parser = SSEParser(limit)
    events = parser.feed(stream)
    assert parser.close() is False
    return events


def parse_chunks(chunks: list[bytes], limit: int = BIG) -> tuple[list[SSEEvent], bool]:
    parser = SSEParser(limit)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events, parser.close()


def split_at(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(points)]


def msg(
    data: bytes, event: bytes | None = None, id: bytes | None = None, retry: int | None = None
) -> SSEEvent:
    return SSEEvent(data=data, event=event, id=id, retry=retry, has_data=True)


# -- unit tests: one per rule --------------------------------------------------------------------------------


def test_simple_event() -> None:
    assert parse(b"event: message\nid: 7\ndata: hello\n\n") == [msg(b"hello", b"message", b"7")]


def test_multiple_data_lines_joined_with_lf_no_trailing_lf() -> None:
    assert parse(b"data: a\ndata: b\ndata:\n\n") == [msg(b"a\nb\n")]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_each_line_ending(ending: bytes) -> None:
    stream = ending.join([b"id: 1", b"data: x", b"data: y", b"", b"data: z", b"", b""])
    assert parse(stream) == [msg(b"x\ny", id=b"1"), msg(b"z")]


def test_mixed_line_endings() -> None:
    assert parse(b"data: a\r\ndata: b\rdata: c\n\r\n") == [msg(b"a\nb\nc")]


def test_cr_lf_split_across_chunks_is_one_line_ending() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n") == []  # the LF completes the CRLF: no blank line, no dispatch
    assert parser.feed(b"data: b\r") == []
    assert parser.feed(b"") == []  # an empty read in between must not forget the CR
    assert parser.feed(b"\ndata: c\r") == []
    assert parser.feed(b"\r") == [msg(b"a\nb\nc")]  # CR then CR: a genuine blank line
    assert parser.close() is False


def test_lf_after_cr_only_skipped_once() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\n") == [msg(b"a")]


def test_cr_inside_chunk_followed_by_lf_in_same_chunk() -> None:
    assert parse(b"data: a\r\n\r\ndata: b\r\r") == [msg(b"a"), msg(b"b")]


def test_leading_bom_skipped() -> None:
    assert parse(b"\xef\xbb\xbfdata: a\n\n") == [msg(b"a")]


def test_leading_bom_split_across_chunks() -> None:
    events, incomplete = parse_chunks([b"\xef", b"", b"\xbb", b"\xbfdata: a\n\n"])
    assert events == [msg(b"a")]
    assert incomplete is False


def test_only_one_bom_skipped_and_only_at_stream_start() -> None:
    # The second BOM becomes part of the field name "\xef\xbb\xbfdata", an unknown field.
    assert parse(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\nid: 1\n\n") == [SSEEvent(b"", None, b"1", None, False)]
    assert parse(b"data: \xef\xbb\xbfx\n\n") == [msg(b"\xef\xbb\xbfx")]


def test_partial_bom_prefix_that_is_not_a_bom_is_kept() -> None:
    # The held bytes turn out not to be a BOM: they stay part of the first line, field "\xefdata" (unknown).
    events, _ = parse_chunks([b"\xef", b"data: a\n\ndata: b\n\n"])
    assert events == [msg(b"b")]
    events, _ = parse_chunks([b"\xef\xbb", b"\xbedata: a\n\ndata: b\n\n"])
    assert events == [msg(b"b")]
    events, _ = parse_chunks([b"\xef\xbb", b"\ndata: a\n\n"])
    assert events == [msg(b"a")]


def test_comments_ignored() -> None:
    assert parse(b": hello\ndata: a\n:\n: data: b\n\n") == [msg(b"a")]


def test_comment_only_block_yields_nothing() -> None:
    assert parse(b": ping\n\n:\n\n\n\n\n") == []


def test_one_leading_space_removed_only() -> None:
    assert parse(b"data:  two\ndata:none\ndata:\tTab\n\n") == [msg(b" two\nnone\n\tTab")]


def test_field_without_colon_has_empty_value() -> None:
    assert parse(b"data\ndata\n\n") == [msg(b"\n")]
    assert parse(b"id\ndata: x\n\n") == [msg(b"x", id=b"")]


def test_value_after_first_colon_keeps_later_colons() -> None:
    assert parse(b'data: {"a": "b:c"}\nevent:x:y\n\n') == [msg(b'{"a": "b:c"}', event=b"x:y")]


def test_data_with_empty_value_has_data() -> None:
    assert parse(b"data:\n\n") == [SSEEvent(b"", None, None, None, True)]
    assert parse(b"data: \n\n") == [SSEEvent(b"", None, None, None, True)]


def test_unknown_fields_ignored() -> None:
    assert parse(b"foo: bar\nData: no\ndata : no\ndata: yes\n\n") == [msg(b"yes")]


def test_block_with_only_ignored_fields_yields_nothing() -> None:
    assert parse(b"foo: bar\n\nevent: x\n\nretry: soon\n\nid: a\x00b\n\n") == []


def test_last_event_field_wins_and_resets_between_events() -> None:
    assert parse(b"event: a\nevent: b\ndata: 1\n\ndata: 2\n\n") == [msg(b"1", event=b"b"), msg(b"2")]


def test_empty_event_field_kept_as_empty() -> None:
    assert parse(b"event:\ndata: 1\n\n") == [msg(b"1", event=b"")]


def test_id_is_per_event() -> None:
    assert parse(b"id: 1\ndata: a\n\ndata: b\n\n") == [msg(b"a", id=b"1"), msg(b"b")]


def test_last_id_wins() -> None:
    assert parse(b"id: 1\nid: 2\ndata: a\n\n") == [msg(b"a", id=b"2")]


def test_empty_id_is_kept_as_empty() -> None:
    assert parse(b"id:\ndata: a\n\n") == [msg(b"a", id=b"")]
    assert parse(b"id: \n\n") == [SSEEvent(b"", None, b"", None, False)]


def test_id_with_nul_is_ignored() -> None:
    assert parse(b"id: a\x00b\ndata: x\n\n") == [msg(b"x")]
    # An earlier valid id in the same event survives an ignored one.
    assert parse(b"id: 1\nid: \x00\ndata: x\n\n") == [msg(b"x", id=b"1")]
    assert parse(b"id:2\nid:\x00\ndata: x\n\n") == [msg(b"x", id=b"2")]  # without the optional space


def test_retry_digits_only() -> None:
    stream = (
        b"retry: 1500\ndata: a\n\n"
        b"retry: 15s\ndata: b\n\n"
        # int() would accept the last two; WHATWG does not.
        b"retry: -1\nretry:+1\nretry: 1.5\nretry: 1_0\nretry: 5 \ndata: c\n\n"
    )
    assert parse(stream) == [msg(b"a", retry=1500), msg(b"b"), msg(b"c")]


def test_retry_rejects_non_ascii_digits_and_empty() -> None:
    # "\xd9\xa1" is ARABIC-INDIC DIGIT ONE in UTF-8: not an ASCII digit; "retry:" is empty.
    assert parse(b"retry: \xd9\xa1\nretry:\nretry:  5\ndata: a\n\n") == [msg(b"a")]


def test_retry_leading_zeros_and_huge() -> None:
    assert parse(b"retry: 000\n\n") == [SSEEvent(b"", None, None, 0, False)]
    assert parse(b"retry: " + b"0" * 6000 + b"42\n\n") == [SSEEvent(b"", None, None, 42, False)]
    # Too many digits for int(): ignored, like any unusable value, and never raises.
    assert parse(b"retry: 7\nretry: " + b"9" * 6000 + b"\n\n") == [SSEEvent(b"", None, None, 7, False)]


def test_priming_block_without_data_is_returned() -> None:
    assert parse(b"id: 42\n\n") == [SSEEvent(b"", None, b"42", None, False)]
    assert parse(b"retry: 100\n\n") == [SSEEvent(b"", None, None, 100, False)]
    assert parse(b"id: 1\nretry: 5\nevent: e\n\n") == [SSEEvent(b"", b"e", b"1", 5, False)]


def test_several_blank_lines_dispatch_once() -> None:
    assert parse(b"data: a\n\n\n\n\ndata: b\n\n") == [msg(b"a"), msg(b"b")]


def test_invalid_utf8_survives() -> None:
    junk = b"\xff\xfe\x80\xc3(\xed\xa0\x80\xf8\x88\x80\x80\x80"
    stream = b"event: " + junk + b"\nid: " + junk + b"\ndata: " + junk + b"\n\n"
    assert parse(stream) == [msg(junk, event=junk, id=junk)]
    assert parse(encode_frame(junk, frame_body(junk, junk))) == [msg(junk, event=junk, id=junk)]


def test_nul_in_data_and_event_is_kept() -> None:
    assert parse(b"event: a\x00\ndata: \x00\n\n") == [msg(b"\x00", event=b"a\x00")]


def test_feed_returns_only_completed_events_in_order() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"data: 1\n\ndata: 2\n\ndata: 3\n") == [msg(b"1"), msg(b"2")]
    assert parser.buffered == len(b"data: 3\n")
    assert parser.feed(b"\n") == [msg(b"3")]
    assert parser.buffered == 0


def test_buffered_counts_unterminated_line() -> None:
    parser = SSEParser(BIG)
    parser.feed(b"data: ab")
    assert parser.buffered == 8
    parser.feed(b"cd")
    assert parser.buffered == 10
    parser.feed(b"\ndata")
    assert parser.buffered == 11 + 4
    assert parser.feed(b"\n\n") == [msg(b"abcd\n")]
    assert parser.buffered == 0


def test_big_event_in_tiny_chunks() -> None:
    payload = bytes(range(256)).replace(b"\n", b"").replace(b"\r", b"") * 200
    stream = b"data: " + payload + b"\ndata: " + payload + b"\n\n"
    parser = SSEParser(BIG)
    events: list[SSEEvent] = []
    for i in range(0, len(stream), 7):
        events.extend(parser.feed(stream[i : i + 7]))
    assert events == [msg(payload + b"\n" + payload)]
    assert parser.close() is False


# -- close() -------------------------------------------------------------------------------------------------


def test_close_discards_incomplete_event_and_reports_it() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"data: a\n\ndata: b\n") == [msg(b"a")]
    assert parser.close() is True


def test_close_reports_unterminated_line() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"data: a\n\nda") == [msg(b"a")]
    assert parser.close() is True


def test_close_reports_pending_data_less_fields() -> None:
    parser = SSEParser(BIG)
    parser.feed(b"id: 5\n")
    assert parser.close() is True


def test_close_clean_stream() -> None:
    for stream in (b"", b"data: a\n\n", b"data: a\n\n: keepalive\n", b"data: a\n\n: partial comm", b"\r"):
        parser = SSEParser(BIG)
        parser.feed(stream)
        assert parser.close() is False, stream


def test_close_with_pending_bom_prefix() -> None:
    parser = SSEParser(BIG)
    assert parser.feed(b"\xef\xbb") == []
    assert parser.buffered == 2
    assert parser.close() is True


def test_close_twice_and_feed_after_close() -> None:
    parser = SSEParser(BIG)
    parser.feed(b"data: x")
    assert parser.close() is True
    assert parser.close() is False
    assert parser.buffered == 0
    with pytest.raises(RuntimeError):
        parser.feed(b"data: y\n\n")


# -- size limit ----------------------------------------------------------------------------------------------


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SSEParser(0)


def test_oversized_single_line_raises_before_its_end() -> None:
    parser = SSEParser(100)
    assert parser.feed(b"data: " + b"x" * 50) == []
    with pytest.raises(EventTooLarge) as info:
        parser.feed(b"x" * 50)  # 106 bytes held, no LF seen yet
    assert info.value.limit == 100
    with pytest.raises(EventTooLarge):  # unusable afterwards
        parser.feed(b"\n\n")
    assert parser.close() is True


def test_oversized_multi_line_event_raises() -> None:
    parser = SSEParser(100)
    with pytest.raises(EventTooLarge):
        for _ in range(20):
            parser.feed(b"data: 0123456789\n")  # 17 bytes a line: 6 lines = 102 > 100


def test_event_exactly_at_limit_passes_one_over_raises() -> None:
    body = b"data: " + b"x" * 93 + b"\n"  # 100 bytes counting the LF
    assert parse(body + b"\n", limit=100) == [msg(b"x" * 93)]
    with pytest.raises(EventTooLarge):
        SSEParser(99).feed(body + b"\n")


def test_crlf_counts_as_one_byte() -> None:
    body = b"data: " + b"x" * 93 + b"\r\n"
    assert parse(body + b"\r\n", limit=100) == [msg(b"x" * 93)]


def test_limit_is_per_event_not_per_stream() -> None:
    parser = SSEParser(20)
    for _ in range(100):
        assert parser.feed(b"data: 0123456789\n\n") == [msg(b"0123456789")]
    assert parser.close() is False


def test_comment_lines_count_only_while_read() -> None:
    parser = SSEParser(20)
    for _ in range(100):  # keep-alive comments without a blank line: no event grows
        assert parser.feed(b": keepalive 0123\n") == []
    assert parser.feed(b"data: x\n\n") == [msg(b"x")]
    with pytest.raises(EventTooLarge):
        parser.feed(b": " + b"c" * 30 + b"\n")  # but one comment line must still fit


def test_overflow_after_complete_events_in_same_chunk_defers_the_error() -> None:
    parser = SSEParser(30)
    assert parser.feed(b"data: ok\n\ndata: " + b"x" * 40) == [msg(b"ok")]
    with pytest.raises(EventTooLarge):
        parser.feed(b"\n\n")


def test_deferred_overflow_raised_by_close() -> None:
    parser = SSEParser(30)
    assert parser.feed(b"data: ok\n\ndata: " + b"x" * 40 + b"\n\n") == [msg(b"ok")]
    with pytest.raises(EventTooLarge):
        parser.close()
    assert parser.close() is True  # reported once; afterwards close() just says "incomplete"


# -- serializers ---------------------------------------------------------------------------------------------


def test_frame_body_exact_bytes() -> None:
    assert frame_body(b'{"a":1}') == b'event: message\ndata: {"a":1}\n\n'
    assert frame_body(b"a\nb", None) == b"data: a\ndata: b\n\n"
    assert frame_body(b"", None) == b"data: \n\n"
    assert frame_body(b"a\n", b"x") == b"event: x\ndata: a\ndata: \n\n"


def test_frame_body_rejects_cr_and_bad_event() -> None:
    with pytest.raises(ValueError):
        frame_body(b"a\rb")
    with pytest.raises(ValueError):
        frame_body(b"a", b"x\ny")


def test_encode_frame_exact_bytes() -> None:
    assert encode_frame(b"s1.5", frame_body(b"x")) == b"id: s1.5\nevent: message\ndata: x\n\n"
    for bad in (b"a\nb", b"a\rb", b"a\x00b"):
        with pytest.raises(ValueError):
            encode_frame(bad, b"data: x\n\n")


def test_priming_frame() -> None:
    assert encode_frame(b"c0", priming_block(None)) == b"id: c0\ndata: \n\n"
    assert encode_frame(b"c0", priming_block(2500)) == b"id: c0\nretry: 2500\ndata: \n\n"
    assert parse(encode_frame(b"c0", priming_block(2500))) == [SSEEvent(b"", None, b"c0", 2500, True)]
    with pytest.raises(ValueError):
        priming_block(-1)


def test_encode_comment() -> None:
    assert encode_comment(b"ping") == b": ping\n\n"
    assert parse(encode_comment(b"ping") + encode_comment(b"")) == []
    for bad in (b"a\nb", b"a\r"):
        with pytest.raises(ValueError):
            encode_comment(bad)


def test_encode_retry() -> None:
    assert encode_retry(3000) == b"retry: 3000\n\n"
    assert parse(encode_retry(3000)) == [SSEEvent(b"", None, None, 3000, False)]
    with pytest.raises(ValueError):
        encode_retry(-5)


# -- properties ----------------------------------------------------------------------------------------------

# Field values: any bytes except the line-ending bytes (invalid UTF-8 included).
value = st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
id_value = value.map(lambda b: b.replace(b"\x00", b""))
ending = st.sampled_from([b"\n", b"\r\n", b"\r"])
UNKNOWN = [b"foo", b"Data", b"ID", b"retry2", b"datum", b"events"]


@dataclass
class Model:
    data: list[bytes]
    event: bytes | None
    id: bytes | None
    retry: int | None

    def expected(self) -> SSEEvent:
        return SSEEvent(b"\n".join(self.data), self.event, self.id, self.retry, bool(self.data))


@st.composite
def models(draw: st.DrawFn) -> Model:
    m = Model(
        data=draw(st.lists(value, max_size=4)),
        event=draw(st.none() | value),
        id=draw(st.none() | id_value),
        retry=draw(st.none() | st.integers(0, 10**12)),
    )
    if not m.data and m.id is None and m.retry is None:
        m.data = [b""]  # a block with no effect yields nothing; covered by unit tests
    return m


@st.composite
def field_line(draw: st.DrawFn, name: bytes, val: bytes) -> bytes:
    """One of the equivalent spellings of a field line."""
    forms = [name + b": " + val]
    if not val.startswith(b" "):
        forms.append(name + b":" + val)
    if not val:
        forms.append(name)
    return draw(st.sampled_from(forms))


@st.composite
def model_lines(draw: st.DrawFn, m: Model) -> list[bytes]:
    """The non-blank lines of one event block: data lines in order, other fields anywhere, plus decoys
    (earlier values overridden by the last one, ignored fields, comments)."""
    lines = [draw(field_line(b"data", d)) for d in m.data]

    def insert(line: bytes) -> None:
        lines.insert(draw(st.integers(0, len(lines))), line)

    # Fields are inserted so the real one ends up after any decoy of the same name.
    for name, real in ((b"event", m.event), (b"id", m.id)):
        if real is not None:
            pos = draw(st.integers(0, len(lines)))
            lines.insert(pos, draw(field_line(name, real)))
            if draw(st.booleans()):
                lines.insert(draw(st.integers(0, pos)), draw(field_line(name, draw(value))))
    if m.retry is not None:
        insert(draw(field_line(b"retry", str(m.retry).encode())))
    for _ in range(draw(st.integers(0, 2))):
        insert(draw(field_line(draw(st.sampled_from(UNKNOWN)), draw(value))))
    for _ in range(draw(st.integers(0, 2))):
        insert(draw(st.sampled_from([b"id: a\x00", b"retry: 1x", b"retry: -3", b"retry:"])))
    for _ in range(draw(st.integers(0, 2))):
        insert(b":" + draw(value))
    return lines


def peak_size(lines: list[bytes]) -> int:
    """The smallest limit the parser accepts for this block (its documented measure): the non-comment lines,
    one byte per terminator; a comment line only counts, on top of the lines before it, while it is read."""
    running = peak = 0
    for line in lines:
        if line.startswith(b":"):
            peak = max(peak, running + len(line))
        else:
            running += len(line) + 1
            peak = max(peak, running)
    return peak


def serialize(data: st.DataObject, blocks: list[list[bytes]], extra_blank: bool = True) -> bytes:
    """Write blocks with arbitrary line endings. A CR-terminated line followed by an LF-terminated blank line
    would be one CRLF, so that one combination is written as CR + CRLF instead."""
    draw = data.draw
    out: list[bytes] = []
    prev = b""

    def put(line: bytes) -> None:
        nonlocal prev
        term = draw(ending)
        if prev == b"\r" and not line and term == b"\n":
            term = b"\r\n"
        out.append(line + term)
        prev = term

    for block in blocks:
        for line in block:
            put(line)
        put(b"")
        if extra_blank:
            for _ in range(draw(st.integers(0, 1))):  # comment-only blocks and extra blank lines
                if draw(st.booleans()):
                    put(b": " + draw(value))
                put(b"")
    return b"".join(out)


def chunkings(data: st.DataObject, stream: bytes) -> list[bytes]:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    return split_at(stream, cuts)


@FAST
@given(st.data(), st.lists(models(), max_size=5), st.booleans())
def test_property_roundtrip_any_endings_comments_chunking(
    data: st.DataObject, ms: list[Model], bom: bool
) -> None:
    blocks = [data.draw(model_lines(m)) for m in ms]
    stream = serialize(data, blocks)
    if bom:
        stream = b"\xef\xbb\xbf" + stream
    events, incomplete = parse_chunks(chunkings(data, stream))
    assert events == [m.expected() for m in ms]
    assert incomplete is False


@FAST
@given(st.data(), st.lists(models(), min_size=1, max_size=4))
def test_property_cr_lf_split_across_chunks(data: st.DataObject, ms: list[Model]) -> None:
    blocks = [data.draw(model_lines(m)) for m in ms]
    stream = b"".join(b"".join(line + b"\r\n" for line in block) + b"\r\n" for block in blocks)
    # Cut between every CR and its LF (and possibly elsewhere): still one line ending each.
    cuts = [i + 1 for i in range(len(stream)) if stream[i : i + 1] == b"\r"]
    cuts += data.draw(st.lists(st.integers(0, len(stream)), max_size=5))
    events, incomplete = parse_chunks(split_at(stream, cuts))
    assert events == [m.expected() for m in ms]
    assert incomplete is False


data_value = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b""))


@FAST
@given(
    st.data(),
    st.lists(st.tuples(data_value, st.none() | value, id_value), max_size=5),
)
def test_property_frame_roundtrip(
    data: st.DataObject, frames: list[tuple[bytes, bytes | None, bytes]]
) -> None:
    stream = b"".join(encode_frame(id, frame_body(d, ev)) for d, ev, id in frames)
    events, incomplete = parse_chunks(chunkings(data, stream))
    assert events == [SSEEvent(d, ev, id, None, True) for d, ev, id in frames]
    assert incomplete is False


@FAST
@given(
    st.data(),
    st.lists(
        st.one_of(
            st.tuples(st.just("frame"), data_value, id_value),
            st.tuples(st.just("priming"), id_value, st.none() | st.integers(0, 10**9)),
            st.tuples(st.just("comment"), value),
            st.tuples(st.just("retry"), st.integers(0, 10**9)),
        ),
        max_size=6,
    ),
)
def test_property_all_serializers_roundtrip(data: st.DataObject, items: list[tuple[object, ...]]) -> None:
    stream = b""
    expected: list[SSEEvent] = []
    for item in items:
        match item:
            case ("frame", bytes(d), bytes(id)):
                stream += encode_frame(id, frame_body(d))
                expected.append(SSEEvent(d, b"message", id, None, True))
            case ("priming", bytes(id), retry):
                assert retry is None or isinstance(retry, int)
                stream += encode_frame(id, priming_block(retry))
                expected.append(SSEEvent(b"", None, id, retry, True))
            case ("comment", bytes(text)):
                stream += encode_comment(text)
            case ("retry", int(n)):
                stream += encode_retry(n)
                expected.append(SSEEvent(b"", None, None, n, False))
            case _:
                raise AssertionError(item)
    events, incomplete = parse_chunks(chunkings(data, stream))
    assert events == expected
    assert incomplete is False


@FAST
@given(st.data(), models(), st.lists(models(), max_size=2))
def test_property_size_limit_exact(data: st.DataObject, big: Model, others: list[Model]) -> None:
    lines = data.draw(model_lines(big))
    size = peak_size(lines)
    # Smaller events before and after must not matter: the limit is per event, not per stream.
    other_blocks = [data.draw(model_lines(m)) for m in others]
    other_blocks = [b for b in other_blocks if peak_size(b) < size]
    blocks = [*other_blocks, lines, *other_blocks]
    stream = serialize(data, blocks, extra_blank=False)
    chunks = chunkings(data, stream)

    events, incomplete = parse_chunks(chunks, limit=size)  # exactly at the limit: fine
    assert len(events) == len(blocks)
    assert events[len(other_blocks)] == big.expected()
    assert incomplete is False

    parser = SSEParser(size - 1)  # one byte less: EventTooLarge, whatever the chunking
    got: list[SSEEvent] = []
    with pytest.raises(EventTooLarge):
        for chunk in chunks:
            got.extend(parser.feed(chunk))
        parser.close()
    # Exactly the events before the oversized one were delivered, each intact.
    assert got == events[: len(other_blocks)]


@FAST
@given(st.integers(1, 300), st.integers(1, 64))
def test_property_oversized_single_line_raises_any_chunking(limit: int, step: int) -> None:
    stream = b"data: " + b"x" * limit + b"\n\n"
    parser = SSEParser(limit)
    offsets = iter(range(0, len(stream), step))
    with pytest.raises(EventTooLarge):
        for i in offsets:
            assert parser.feed(stream[i : i + step]) == []
    # It raised in the chunk holding byte number limit + 1, not later.
    assert i <= limit < i + step


@FAST
@given(st.data(), st.lists(models(), max_size=3), models())
def test_property_close_discards_incomplete_event(data: st.DataObject, ms: list[Model], last: Model) -> None:
    blocks = [data.draw(model_lines(m)) for m in ms]
    stream = serialize(data, blocks, extra_blank=False)
    tail_lines = [line for line in data.draw(model_lines(last)) if not line.startswith(b":")]
    tail = b"\n".join(tail_lines)
    # End either mid-line or right after a line ending, but never at a blank line.
    if data.draw(st.booleans()):
        tail += b"\n"
    events, incomplete = parse_chunks(chunkings(data, stream + tail))
    assert events == [m.expected() for m in ms]
    assert incomplete is True


@FAST
@given(st.data(), st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=4))
def test_property_arbitrary_bytes_in_data_survive(data: st.DataObject, raw: list[bytes]) -> None:
    payloads = [p.replace(b"\r", b"") for p in raw]
    stream = b"".join(frame_body(p, None) for p in payloads)
    events, _ = parse_chunks(chunkings(data, stream))
    assert [e.data for e in events] == payloads


@FAST
@given(st.binary(max_size=200), st.integers(1, 50), st.data())
def test_property_chunking_never_changes_the_result(stream: bytes, limit: int, data: st.DataObject) -> None:
    """Fuzz: on arbitrary bytes, chunked parsing equals whole parsing, including EventTooLarge."""

    def run(chunks: list[bytes]) -> tuple[list[SSEEvent], bool | None]:
        parser = SSEParser(limit)
        events: list[SSEEvent] = []
        try:
            for chunk in chunks:
                events.extend(parser.feed(chunk))
            return events, parser.close()
        except EventTooLarge:
            return events, None

    whole_events, whole_end = run([stream])
    chunked_events, chunked_end = run(chunkings(data, stream))
    # On overflow both runs deliver exactly the events before the oversized one (deferring the error if
    # needed), so even then the results agree.
    assert chunked_end == whole_end
    assert chunked_events == whole_events


# -- runs: many canonical events at once (the hot path) ----------------------------------------------------


def canonical(
    data: bytes, event: bytes | None = b"message", id: bytes | None = None, id_first: bool = False
) -> bytes:
    lines = [b"data: " + data]
    if event is not None:
        lines.insert(0, b"event: " + event)
    if id is not None:
        lines.insert(0 if id_first else len(lines) - 1, b"id: " + id)
    return b"\n".join(lines) + b"\n\n"


def test_a_chunk_of_canonical_events_is_one_run_with_the_same_events() -> None:
    stream = b"".join(
        [canonical(b"a", id=b"1"), canonical(b"b", event=None), canonical(b"c", id=b"3", id_first=True)]
    )
    (run,) = SSEParser(BIG).feed_batched(stream)
    assert isinstance(run, SSERun)
    assert len(run) == 3 and run.size + sum(map(len, run.ids or ())) == len(stream) and run.last_id() == b"3"
    assert run.size == sum(map(len, run.blocks))  # what a window keeps: the upstream id lines aside
    assert run.events() == [msg(b"a", b"message", b"1"), msg(b"b"), msg(b"c", b"message", b"3")]
    assert SSEParser(BIG).feed(stream) == run.events()


def test_a_run_starts_after_a_priming_event_and_leaves_the_tail() -> None:
    stream = b"id: p\nretry: 50\ndata: \n\n" + canonical(b"a") + canonical(b"b") + b"event: message\ndata: c"
    parser = SSEParser(BIG)
    first, run = parser.feed_batched(stream)
    assert first == SSEEvent(b"", None, b"p", 50, True)
    assert isinstance(run, SSERun) and run.events() == [msg(b"a", b"message"), msg(b"b", b"message")]
    assert parser.feed(b"\n\n") == [msg(b"c", b"message")]


@pytest.mark.parametrize(
    "odd",
    [
        b"data: x\ndata: y\n\n",  # two data lines
        b": comment\n\n",
        b"data: \n\n",  # empty data
        b"id: \ndata: x\n\n",  # an id that resets
        b"retry: 5\ndata: x\n\n",
        b"data:x\n\n",  # another spelling
        b"id: a\x00b\ndata: x\n\n",  # an id the client ignores
        b"foo: bar\ndata: x\n\n",
    ],
)
def test_a_chunk_that_is_not_all_canonical_gives_the_line_parsers_events(odd: bytes) -> None:
    stream = canonical(b"a") + odd + canonical(b"b") + canonical(b"c")
    items = SSEParser(BIG).feed_batched(stream)
    line_by_line = SSEParser(BIG)  # fed one line at a time, no chunk ever holds a whole event
    expected = [event for line in stream.splitlines(keepends=True) for event in line_by_line.feed(line)]
    exploded = [e for item in items for e in (item.events() if isinstance(item, SSERun) else [item])]
    assert exploded == expected == SSEParser(BIG).feed(stream)


def test_run_size_limit_is_per_event() -> None:
    events = [canonical(b"x" * 40) for _ in range(10)]  # 62 bytes each, 620 in all
    size = len(events[0]) - 1  # as the line parser counts it: without the blank line's LF
    (run,) = SSEParser(size).feed_batched(b"".join(events))
    assert isinstance(run, SSERun) and len(run) == 10
    parser = SSEParser(size)
    assert parser.feed(b"".join(events) + canonical(b"x" * 41)) == [msg(b"x" * 40, b"message")] * 10
    with pytest.raises(EventTooLarge):
        parser.close()


def test_frame_parts_give_each_event_our_cursor_and_drop_the_upstream_id() -> None:
    (run,) = SSEParser(BIG).feed_batched(canonical(b"a", id=b"u1") + canonical(b"b", event=None, id=b"u2"))
    assert isinstance(run, SSERun)
    parts = frame_parts(b"id: c-", 7, run.blocks)
    assert parts == [b"id: c-7\n", b"event: message\ndata: a\n\n", b"id: c-8\n", b"data: b\n\n"]
    assert parse(b"".join(parts)) == [msg(b"a", b"message", b"c-7"), msg(b"b", None, b"c-8")]
    assert frame_parts(b"id: c-", 1, []) == []
    assert run.split(1, 2).events() == [msg(b"b", None, b"u2")]


@FAST
@given(
    st.lists(
        st.tuples(
            st.one_of(
                st.integers(0, 3000),
                st.integers(0, 5).map(lambda k: 10**k * 1000 - 2),  # just under a thousand's boundary
                st.integers(0, 2**63),
            ),
            st.integers(0, 2100),
        ),
        max_size=3,
    )
)
def test_property_frame_into_writes_the_cursors_frame_parts_writes(segments: list[tuple[int, int]]) -> None:
    """The hot path's framing (digits from tables, one prefix per thousand seqs) gives the bytes of the
    plain one, whatever the seqs (across thousands, from 0, huge) and however many segments go in one
    write."""
    parts: list[bytes] = []
    expected: list[bytes] = []
    for index, (first_seq, count) in enumerate(segments):
        blocks = [b"data: %d\n\n" % k for k in range(count)]
        prefix = b"id: e-%d-" % index
        frame_into(parts, prefix, first_seq, blocks)
        expected += frame_parts(prefix, first_seq, blocks)
    assert b"".join(parts) == b"".join(expected)
    assert len(parts) == 3 * sum(count for _, count in segments)


def test_frame_into_refuses_a_negative_seq() -> None:
    with pytest.raises(ValueError):
        frame_into([], b"id: c-", -1, [b"data: x\n\n"])


@FAST
@given(st.data(), st.lists(models(), max_size=8), st.lists(st.booleans(), max_size=8))
def test_property_runs_give_the_same_events_as_the_line_parser(
    data: st.DataObject, ms: list[Model], plain: list[bool]
) -> None:
    """Canonical blocks mixed with any other blocks, cut anywhere: the batched feed, exploded, equals the
    events of the model, whatever was taken as a run."""
    blocks = []
    expected = []
    for m, simple in zip(ms, plain + [False] * len(ms), strict=False):
        if simple and len(m.data) == 1 and m.data[0] and m.retry is None and m.id != b"":
            blocks.append(canonical(m.data[0], m.event, m.id, id_first=data.draw(st.booleans())))
        else:
            blocks.append(b"\n".join(data.draw(model_lines(m))) + b"\n\n")
        expected.append(m.expected())
    stream = b"".join(blocks)
    parser = SSEParser(BIG)
    got: list[SSEEvent] = []
    for chunk in chunkings(data, stream):
        for item in parser.feed_batched(chunk):
            if isinstance(item, SSERun):
                assert item.size == sum(map(len, item.blocks))  # the bytes a window will keep
                half = len(item) // 2
                for part in (item.split(0, half), item.keep(list(range(half, len(item))))):
                    assert part.size == sum(map(len, part.blocks))
            got.extend(item.events() if isinstance(item, SSERun) else [item])
    assert got == expected
    assert parser.close() is False


def test_runs_with_and_without_ids_and_the_pattern_follows_the_stream() -> None:
    parser = SSEParser(BIG)
    (plain,) = parser.feed_batched(canonical(b"a") + canonical(b"b", event=None))
    assert isinstance(plain, SSERun) and plain.ids is None and plain.last_id() is None
    assert plain.blocks == [b"event: message\ndata: a\n\n", b"data: b\n\n"]
    (with_ids,) = parser.feed_batched(canonical(b"c", id=b"1") + canonical(b"d", event=None))
    assert isinstance(with_ids, SSERun) and with_ids.ids == [b"id: 1\n", b""] and with_ids.last_id() == b"1"
    assert with_ids.blocks == [b"event: message\ndata: c\n\n", b"data: d\n\n"]
    (again,) = parser.feed_batched(canonical(b"e"))  # the id pattern is tried first now: still right
    assert isinstance(again, SSERun) and again.events() == [msg(b"e", b"message")]


@pytest.mark.parametrize("lead", [b"", b"id: p\ndata: \n\n"])
def test_keep_picks_the_events_of_a_run(lead: bytes) -> None:
    note = b'{"jsonrpc":"2.0","method":"n"}'
    stream = lead + b"".join(
        [
            canonical(note),
            canonical(note, event=None, id=b"7"),
            canonical(b"x" + note),
            canonical(b'{"jsonrpc":"2.0","id":1,"result":{}}', event=None),
        ]
    )
    run = SSEParser(BIG).feed_batched(stream)[-1]
    assert isinstance(run, SSERun) and len(run) == 4
    assert run.keep([0, 3]).events() == [run.events()[0], run.events()[3]]


@pytest.mark.parametrize("order", ["plain", "id first", "id after event", "mixed"])
def test_every_spelling_is_one_run_and_a_stream_may_change_spelling(order: str) -> None:
    def one(k: int) -> bytes:
        spelling = order if order != "mixed" else ("plain", "id first", "id after event")[k % 3]
        if spelling == "plain":
            return canonical(b"%d" % k)
        return canonical(b"%d" % k, id=b"u%d" % k, id_first=spelling == "id first")

    parser = SSEParser(BIG)
    for start in (0, 10, 20):  # later chunks start with the spelling that matched last
        stream = b"".join(one(k) for k in range(start, start + 10))
        (run,) = parser.feed_batched(stream)
        assert isinstance(run, SSERun) and len(run) == 10
        assert run.events() == SSEParser(BIG).feed(stream)
        frames = b"".join(frame_parts(b"id: c-", 1, run.blocks))
        assert [e.data for e in parse(frames)] == [b"%d" % k for k in range(start, start + 10)]


@pytest.mark.parametrize("id_first", [None, True, False])
def test_a_chunk_with_one_odd_event_is_a_run_the_odd_event_and_a_run(id_first: bool | None) -> None:
    def one(k: int) -> bytes:
        return canonical(b"%d" % k, id=None if id_first is None else b"u%d" % k, id_first=bool(id_first))

    odd = b"retry: 10\ndata: two\ndata: lines\n\n"  # a retry: for the pump to see (no run holds one)
    stream = b"".join(one(k) for k in range(3)) + odd + b"".join(one(k) for k in range(3, 6))
    items = SSEParser(BIG).feed_batched(stream)
    assert [len(i) if isinstance(i, SSERun) else "event" for i in items] == [3, "event", 3]
    exploded = [e for i in items for e in (i.events() if isinstance(i, SSERun) else [i])]
    assert exploded == SSEParser(BIG).feed(stream)
    assert exploded[3] == SSEEvent(b"two\nlines", None, None, 10, True)


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.binary(max_size=8).filter(lambda b: not set(b) & set(b"\r\n\x00"))),
            st.one_of(st.none(), st.integers(0, 10**6)),
            st.one_of(st.none(), st.sampled_from([b"message", b"", b"x y"])),
            st.one_of(st.none(), st.binary(max_size=30).filter(lambda b: b"\r" not in b)),
        ),
        max_size=5,
    )
)
def test_an_event_written_again_reads_back_as_the_same_event(
    specs: list[tuple[bytes | None, int | None, bytes | None, bytes | None]],
) -> None:
    """``encode_event`` (the tasks relay's framing): every event the parser returns, written again and parsed,
    is that event again, whatever was in it."""
    first = SSEParser(1 << 20)
    wire = b""
    for id_, retry, name, data in specs:
        wire += b"id: " + id_ + b"\n" if id_ is not None else b""
        wire += b"retry: %d\n" % retry if retry is not None else b""
        wire += b"event: " + name + b"\n" if name is not None else b""
        wire += b"".join(b"data: " + line + b"\n" for line in data.split(b"\n")) if data is not None else b""
        wire += b"\n"
    events = first.feed(wire)
    again = SSEParser(1 << 20)
    assert again.feed(b"".join(encode_event(e) for e in events)) == events


# -- a short answer whole in one read (SSEParser._short) against the general path ----------------------------


class GeneralParser(SSEParser):
    """The parser without the short answer's way: every chunk down the general path."""

    __slots__ = ()

    def _short(self, chunk: bytes) -> None:
        return None


def described(items: list[SSEEvent | SSERun]) -> list[object]:
    """What a consumer can tell of the parser's items: each event, and each run's every field."""
    return [
        (item.blocks, item.ids, item.size, item._source, item.general, item.events())
        if isinstance(item, SSERun)
        else item
        for item in items
    ]


def parser_state(parser: SSEParser) -> dict[str, object]:
    return {name: getattr(parser, name) for name in SSEParser.__slots__}


def fed_both(
    chunks: list[bytes], limit: int = BIG, spelling: int = 0, keepalives: bool = False
) -> tuple[list[object], list[object], SSEParser, SSEParser]:
    """The items and parsers of the parser and the general path, fed the same chunks (their spelling
    hints set first), each outcome an item list or the error."""
    outcomes: list[list[object]] = []
    parsers: list[SSEParser] = []
    for parser in (SSEParser(limit), GeneralParser(limit)):
        parser._spelling, parser._keepalives = spelling, keepalives
        outcome: list[object] = []
        for chunk in chunks:
            try:
                outcome.append(described(parser.feed_batched(chunk)))
            except EventTooLarge as exc:
                outcome.append(repr(exc))
        outcomes.append(outcome)
        parsers.append(parser)
    return outcomes[0], outcomes[1], parsers[0], parsers[1]


@settings(max_examples=600, deadline=None)
@given(
    short_answers(),
    st.sampled_from([BIG, 40, 120, 200]),
    st.integers(0, 3),
    st.booleans(),
    st.sampled_from([b"", b"id: 1\ndata: x\n\n", b'data: {"a":1}\n\ndat']),
)
def test_property_a_short_answer_gives_what_the_general_path_gives(
    body: bytes, limit: int, spelling: int, keepalives: bool, before: bytes
) -> None:
    # The same items, errors and parser state (the spelling to try first included), from a fresh parser
    # or after an earlier chunk, and for the chunk after it.
    chunks = [before, body, b'id: 9\ndata: {"b":2}\n\n'] if before else [body, b"data: z\n\n"]
    short, general, parser, reference = fed_both(chunks, limit, spelling, keepalives)
    assert short == general
    assert parser_state(parser) == parser_state(reference)


SHORT_RESPONSE = b'{"jsonrpc":"2.0","id":7,"result":{}}'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (  # a priming event then the response, each with an id (the official SDK with an event store)
            b"id: 41\ndata: \n\nid: 42\nevent: message\ndata: " + SHORT_RESPONSE + b"\n\n",
            [msg(b"", id=b"41"), msg(SHORT_RESPONSE, b"message", b"42")],
        ),
        (  # the response alone, no id (no event store)
            b"event: message\ndata: " + SHORT_RESPONSE + b"\n\n",
            [msg(SHORT_RESPONSE, b"message")],
        ),
        (  # the TypeScript SDK: a retry in its priming event, the event line before the id line
            b"id: 1\nretry: 3000\ndata: \n\nevent: message\nid: 2\ndata: " + SHORT_RESPONSE + b"\n\n",
            [msg(b"", id=b"1", retry=3000), msg(SHORT_RESPONSE, b"message", b"2")],
        ),
        (  # the Python SDK (CRLF, normalised first): the retry after the empty data line
            b"id: 1\r\ndata: \r\nretry: 500\r\n\r\nid: 2\r\nevent: message\r\ndata: "
            + SHORT_RESPONSE
            + b"\r\n\r\n",
            [msg(b"", id=b"1", retry=500), msg(SHORT_RESPONSE, b"message", b"2")],
        ),
        (  # JSON with an escaped LF inside a string: one data line still
            b'data: {"jsonrpc":"2.0","id":7,"result":{"text":"a\\nb"}}\n\n',
            [msg(b'{"jsonrpc":"2.0","id":7,"result":{"text":"a\\nb"}}')],
        ),
    ],
)
def test_a_short_answer_is_read_at_once_as_the_general_path_reads_it(
    body: bytes, expected: list[SSEEvent]
) -> None:
    parser = SSEParser(BIG)
    items = parser.feed_batched(body.replace(b"\r", b""))
    assert parser._short(body.replace(b"\r", b"")) is not None  # the short way took it
    events = [event for item in items for event in (item.events() if isinstance(item, SSERun) else [item])]
    assert events == expected
    assert parse(body) == expected
    short, general, parser, reference = fed_both([body])
    assert short == general
    assert parser_state(parser) == parser_state(reference)


@pytest.mark.parametrize(
    "body",
    [
        b": hello\nid: 1\ndata: \n\ndata: x\n\n",  # a comment line
        b"id: 1\ndata: \n\nid: 2\ndata: x\n\ndata: y\n\n",  # a third event
        b"id: 1\ndata: \n\nevent: message\ndata: x\ndata: y\n\n",  # two data lines
        b"data: x\n\nid: 1\ndata: \n\n",  # the priming event last
        b"data: x\n",  # not ended
        b"id: 1\nretry: 1x\ndata: \n\ndata: x\n\n",  # a retry that is not one
        b"id: 1\nid: 2\ndata: x\n\n",  # two id lines
        b"data:x\n\n",  # data without the space
    ],
)
def test_anything_unusual_is_left_to_the_general_path(body: bytes) -> None:
    assert SSEParser(BIG)._short(body) is None
    short, general, parser, reference = fed_both([body])
    assert short == general
    assert parser_state(parser) == parser_state(reference)


def test_crlf_is_normalised_before_the_short_way_and_a_chunk_over_the_limit_is_not_taken() -> None:
    body = b"id: 1\r\ndata: \r\n\r\nid: 2\r\ndata: " + SHORT_RESPONSE + b"\r\n\r\n"
    assert SSEParser(BIG)._short(body) is None  # CR is the general path's, then the short way's
    short, general, parser, reference = fed_both([body])
    assert short == general and parser_state(parser) == parser_state(reference)
    small = SSEParser(len(body) - 10)
    assert small._short(body.replace(b"\r", b"")) is None
    assert [item for item in small.feed(body)] == [msg(b"", id=b"1"), msg(SHORT_RESPONSE, None, b"2")]
