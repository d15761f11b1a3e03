"""The same logical upstream events, in every framing a server may write them, split across reads at any
byte offset, give a client the same events (apart from framing), through each path the pump can take:
the fast one (``SSEParser.feed_batched``: runs of events kept as they came) and the slow one (the line
parser's events, one by one). Speeding up one path cannot change what a client receives."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.jsonrpc import NOTIFICATION_PREFIXES
from mcpresume.core.session import SessionState, StreamOrigin
from mcpresume.core.sse import SSEEvent, SSEParser, SSERun
from mcpresume.core.window import WindowLimits
from mcpresume.process.metrics import Metrics
from mcpresume.streams.pump import Pump, PumpJob, PumpSettings

BIG = 1 << 20
REQUEST_ID = 7


@dataclass(frozen=True)
class Logical:
    """One upstream event as a client should see it: a JSON-RPC message, an event name, an upstream id."""

    doc: dict[str, Any] | None  # None: an event with empty data (a priming event): no message to a client
    name: str | None
    id: str | None


@dataclass(frozen=True)
class Framing:
    json: str  # compact | default | pretty
    ids: bool
    id_after_name: bool
    ending: bytes  # LF, CRLF or CR
    comments: str  # none | blocks (a keep-alive block before each event) | lines (a comment line in each)
    no_space: bool  # "data:value" instead of "data: value"


FRAMINGS = [
    Framing(j, ids, after, ending, comments, no_space)
    for j in ("compact", "default", "pretty")
    for ids, after in ((False, False), (True, False), (True, True))
    for ending in (b"\n", b"\r\n", b"\r")
    for comments in ("none", "blocks", "lines")
    for no_space in (False, True)
]
NAMED = {
    "canonical": Framing("compact", False, False, b"\n", "none", False),
    "sdk-ids": Framing("compact", True, False, b"\n", "none", False),
    "json-dumps-ids": Framing("default", True, False, b"\n", "none", False),
    "crlf": Framing("compact", False, False, b"\r\n", "none", False),
    "pretty": Framing("pretty", False, False, b"\n", "none", False),
    "comments": Framing("compact", False, False, b"\n", "blocks", False),
}


def dumps(doc: dict[str, Any], spelling: str) -> str:
    if spelling == "compact":
        return json.dumps(doc, separators=(",", ":"))
    if spelling == "pretty":
        return json.dumps(doc, indent=2)
    return json.dumps(doc)


def render(events: list[Logical], framing: Framing) -> bytes:
    out = []
    for event in events:
        lines: list[bytes] = []
        if framing.comments == "lines":
            lines.append(b": note")
        if framing.ids and event.id is not None and not framing.id_after_name:
            lines.append(b"id: " + event.id.encode())
        if event.name is not None:
            lines.append(b"event: " + event.name.encode())
        if framing.ids and event.id is not None and framing.id_after_name:
            lines.append(b"id: " + event.id.encode())
        data = b"data:" if framing.no_space else b"data: "
        text = "" if event.doc is None else dumps(event.doc, framing.json)
        lines += [data + line.encode() for line in text.split("\n")]
        end = framing.ending
        block = end.join(lines) + end + end
        if framing.comments == "blocks":
            block = b": keep-alive" + end + end + block
        out.append(block)
    return b"".join(out)


def deliver(chunks: list[bytes], fast: bool) -> tuple[list[tuple[Any, bytes | None, bytes | None]], bool]:
    """Feed ``chunks`` to a pump (fast or slow path), append to a session, and read it all as a client:
    the client's events (data decoded as JSON, event name, id: the proxy's cursor), and whether the pump
    saw its response."""
    session = SessionState("s", "aaaaaaaaaaaa", WindowLimits(100_000, 1 << 30, 1e9), 1000, 0.0)
    opened = session.open_stream(StreamOrigin.POST, [f"n:{REQUEST_ID}"], 0.0)
    settings_ = PumpSettings(BIG, 30.0, 100_000, 1000, 5)
    unused: Any = None  # store and upstream: feeding the core touches neither
    pump = Pump(
        PumpJob("s", opened.stream, (REQUEST_ID,), "x"),
        unused,
        unused,
        Metrics(),
        unused,
        lambda: 0.0,
        settings_,
    )
    parser = SSEParser(BIG)
    for chunk in chunks:
        parsed: list[SSEEvent | SSERun] = list(parser.feed_batched(chunk) if fast else parser.feed(chunk))
        for batch in pump.events.feed(parsed):
            if isinstance(batch, SSERun):
                session.append_run(opened.stream, batch, 0.0)
            else:
                session.append(opened.stream, batch, 0.0)
    assert not parser.close()
    result = session.read([opened.stream], opened.seq - 1, max_events=1 << 30, max_bytes=1 << 40)
    received = SSEParser(BIG).feed(result.body())
    client = [(json.loads(e.data) if e.data else None, e.event, e.id) for e in received]
    return client, not pump.pending


def cut(stream: bytes, offsets: list[int]) -> list[bytes]:
    points = sorted({0, len(stream), *(o % (len(stream) + 1) for o in offsets)})
    return [stream[a:b] for a, b in itertools.pairwise(points)]


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ['"error"', '"result"', "result", "\\u0072", "data: x", "\n\n", "id: 3", ":", "é"]
)
params = st.dictionaries(
    st.sampled_from(["progress", "message", "error", "result", "level", "data"]), texts, max_size=3
)
notes = st.builds(
    lambda method, p: {"jsonrpc": "2.0", "method": method, "params": p},
    st.sampled_from(["notifications/progress", "notifications/message"]),
    params,
)
# Responses to other requests (they stay messages) and requests from the server.
others = st.builds(
    lambda i, r: {"jsonrpc": "2.0", "id": i, "result": r}, st.integers(100, 200), params
) | st.builds(
    lambda i: {"jsonrpc": "2.0", "id": i, "method": "sampling/createMessage", "params": {}},
    st.integers(100, 200),
)
logicals = st.lists(
    st.builds(
        Logical,
        notes | others | st.none(),
        st.sampled_from([None, "message", "progress"]),
        st.none() | st.text("abcdef0123456789-", min_size=1, max_size=8),
    ),
    max_size=12,
)
answers = st.builds(
    lambda ok: (
        {"jsonrpc": "2.0", "id": REQUEST_ID, "result": {"ok": ok}}
        if ok
        else {"jsonrpc": "2.0", "id": REQUEST_ID, "error": {"code": -1, "message": "no"}}
    ),
    st.booleans(),
)


def expected(events: list[Logical]) -> list[Any]:
    return [e.doc for e in events if e.doc is not None]


@settings(max_examples=300, deadline=None)
@given(
    logicals,
    st.one_of(st.none(), answers),
    st.sampled_from(FRAMINGS),
    st.lists(st.integers(0, 1 << 16), max_size=8),
)
def test_property_every_framing_and_chunking_and_path_gives_the_client_the_same_events(
    events: list[Logical], answer: dict[str, Any] | None, framing: Framing, offsets: list[int]
) -> None:
    if answer is not None:
        events = [*events, Logical(answer, "message", "last")]
    reference, answered = deliver([render(events, NAMED["canonical"])], fast=False)
    stream = render(events, framing)
    for fast in (True, False):
        client, seen = deliver(cut(stream, offsets), fast)
        assert client == reference  # the same data (as JSON), event names and cursors, in order
        assert seen == answered == (answer is not None)  # the response is found on every path
    assert [doc for doc, _, _ in reference[1:]] == expected(events)  # after the priming event: all of them


SAMPLE = [
    Logical(
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}, "message", "u1"
    ),
    Logical({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "error"}}, None, "u2"),
    Logical({"jsonrpc": "2.0", "id": 150, "result": {}}, "message", None),
    Logical(None, None, "u3"),
    Logical({"jsonrpc": "2.0", "id": REQUEST_ID, "result": {"x": "y"}}, "message", "u4"),
]


@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_split_offset_of_each_named_framing_gives_the_same_events(name: str) -> None:
    reference, answered = deliver([render(SAMPLE, NAMED["canonical"])], fast=False)
    assert answered and len(reference) == len(SAMPLE)  # the priming event, and all but the empty one
    stream = render(SAMPLE, NAMED[name])
    for offset in range(len(stream) + 1):
        for fast in (True, False):
            assert deliver([stream[:offset], stream[offset:]], fast) == (reference, True), (offset, fast)


def test_the_fast_path_takes_runs_in_every_named_framing() -> None:
    """Not a correctness matter (the tests above are): each named framing is read as runs, not event by
    event, so its speed is the fast path's."""
    events = [SAMPLE[0]] * 50
    for name, framing in NAMED.items():
        items = SSEParser(BIG).feed_batched(render(events, framing))
        assert [type(i) for i in items] == [SSERun], name
        assert len(items[0]) == 50, name


@settings(max_examples=300, deadline=None)
@given(logicals, st.sampled_from(FRAMINGS), st.booleans())
def test_property_counting_all_but_the_last_event_agrees_with_reading_each(
    events: list[Logical], framing: Framing, split: bool
) -> None:
    """``SSERun.all_start_with(..., but_last=True)``, what a pump asks when the last event of a read may be
    the stream's response, says that every other event starts like a notification only when reading each
    event says so, in every framing, for a run that is its chunk's bytes and for one split off it; and
    always says so then where the data is spelled ``data: `` with nothing but ``event: message`` before
    it (otherwise the pump finds the response by its markers)."""
    plain = not framing.no_space and framing.comments != "lines"
    for item in SSEParser(BIG).feed_batched(render(events, framing)):
        if not isinstance(item, SSERun):
            continue
        run = item.split(0, len(item)) if split else item
        others = run.events()[:-1]
        every_other = all(e.data.startswith(NOTIFICATION_PREFIXES) for e in others)
        counted = run.all_start_with(NOTIFICATION_PREFIXES, 0, but_last=True) is not None
        assert every_other or not counted
        if plain and all(e.event in (None, b"message") for e in others):
            assert counted == every_other


def test_the_response_after_notifications_and_a_response_among_them_are_both_found() -> None:
    """A read whose last event is not a notification but an earlier one is the response too: the pump's
    shortcut for a response last (counting the others) must not hide the earlier one."""
    note = Logical({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}, "message", "u1")
    answer = Logical({"jsonrpc": "2.0", "id": REQUEST_ID, "result": {}}, "message", "u2")
    other = Logical({"jsonrpc": "2.0", "id": 150, "result": {}}, "message", "u3")
    for name, framing in NAMED.items():
        for fast in (True, False):
            client, answered = deliver([render([note, note, answer, note, other], framing)], fast)
            assert answered, (name, fast)
            assert [doc for doc, _, _ in client[1:]] == [note.doc, note.doc, answer.doc, note.doc, other.doc]
