"""Cursors: round trips, and a strict parser that accepts only what the proxy issues."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core import cursor as cursor_module
from mcpresume.core.cursor import (
    EPOCH_LEN,
    MAX_COUNTER,
    MAX_CURSOR_LEN,
    Cursor,
    CursorParseError,
    encode_cursor,
    id_line_prefix,
    new_epoch,
    parse_cursor,
)

ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
EPOCH = "q7m2k4xa2c3d"

epochs = st.text(alphabet=ALPHABET, min_size=EPOCH_LEN, max_size=EPOCH_LEN)
counters = st.integers(min_value=0, max_value=MAX_COUNTER)


@settings(deadline=None, max_examples=200)
@given(epoch=epochs, stream=counters, seq=counters)
def test_round_trip(epoch: str, stream: int, seq: int) -> None:
    wire = encode_cursor(epoch, stream, seq)
    cursor = Cursor(epoch, stream, seq)
    assert wire == cursor.encode().encode("ascii")
    assert len(wire) <= MAX_CURSOR_LEN
    assert parse_cursor(wire) == cursor
    assert parse_cursor(wire.decode("ascii")) == cursor
    assert id_line_prefix(epoch.encode(), stream) + b"%d\n" % seq == b"id: " + wire + b"\n"


def test_examples() -> None:
    assert parse_cursor("q7m2k4xa2c3d-2-41") == Cursor("q7m2k4xa2c3d", 2, 41)
    assert parse_cursor(b"q7m2k4xa2c3d-0-0") == Cursor("q7m2k4xa2c3d", 0, 0)


def test_the_documented_example_is_a_cursor() -> None:
    doc = cursor_module.__doc__ or ""
    example = re.search(r"for example ``([^`]+)``", doc)
    assert example is not None
    assert isinstance(parse_cursor(example[1]), Cursor)


def test_extreme_counters_round_trip() -> None:
    wire = encode_cursor(EPOCH, MAX_COUNTER, MAX_COUNTER)
    assert len(wire) == MAX_CURSOR_LEN
    assert parse_cursor(wire) == Cursor(EPOCH, MAX_COUNTER, MAX_COUNTER)


def _valid(stream: str = "2", seq: str = "41", epoch: str = EPOCH) -> str:
    return f"{epoch}-{stream}-{seq}"


REJECTED = {
    "empty": "",
    "only dashes": "--",
    "leading zero in stream": _valid(stream="02"),
    "leading zero in seq": _valid(seq="041"),
    "double zero": _valid(seq="00"),
    "plus sign": _valid(seq="+41"),
    "minus sign": _valid(seq="-41"),
    "negative stream": _valid(stream="-2"),
    "leading space": " " + _valid(),
    "trailing space": _valid() + " ",
    "trailing newline": _valid() + "\n",
    "trailing CRLF": _valid() + "\r\n",
    "inner space": _valid(seq=" 41"),
    "tab": _valid(seq="\t41"),
    "uppercase epoch": _valid(epoch=EPOCH.upper()),
    "one uppercase letter": _valid(epoch="Q" + EPOCH[1:]),
    "epoch not base32 (digit 1)": _valid(epoch="1" + EPOCH[1:]),
    "epoch not base32 (digit 8)": _valid(epoch="8" + EPOCH[1:]),
    "short epoch": _valid(epoch=EPOCH[:-1]),
    "long epoch": _valid(epoch=EPOCH + "a"),
    "no epoch": "-2-41",
    "missing seq": f"{EPOCH}-2",
    "missing seq after dash": f"{EPOCH}-2-",
    "extra part": _valid() + "-7",
    "underscore separator": f"{EPOCH}_2_41",
    "colon separator": f"{EPOCH}:2:41",
    "hex seq": _valid(seq="0x29"),
    "decimal point": _valid(seq="41.0"),
    "exponent": _valid(seq="4e1"),
    "non-ASCII digit": _valid(seq="4\u0661"),  # ARABIC-INDIC DIGIT ONE: str.isdigit() says True
    "fullwidth digit": _valid(seq="\uff14\uff11"),
    "non-ASCII letter in epoch": _valid(epoch="\u00e9" + EPOCH[1:]),
    "NUL": _valid() + "\x00",
    "seq over 2**63-1": _valid(seq=str(MAX_COUNTER + 1)),
    "stream over 2**63-1": _valid(stream=str(MAX_COUNTER + 1)),
    "19 nines": _valid(seq="9" * 19),
    "20 digits": _valid(seq="1" + "0" * 19),
    "over-long": _valid(seq="1" * 1000),
    "over-long padding": _valid() + "a" * MAX_CURSOR_LEN,
}


@pytest.mark.parametrize("raw", list(REJECTED.values()), ids=list(REJECTED))
def test_rejected_as_str_and_bytes(raw: str) -> None:
    assert isinstance(parse_cursor(raw), CursorParseError)
    assert isinstance(parse_cursor(raw.encode("utf-8")), CursorParseError)


def test_rejections_say_why() -> None:
    not_ascii = parse_cursor(_valid(seq="4\u0661"))
    too_long = parse_cursor(_valid(seq="1" * 1000))
    out_of_range = parse_cursor(_valid(seq=str(MAX_COUNTER + 1)))
    bad_form = parse_cursor(_valid(seq="041"))
    assert isinstance(not_ascii, CursorParseError) and "ASCII" in not_ascii.detail
    assert isinstance(too_long, CursorParseError) and str(MAX_CURSOR_LEN) in too_long.detail
    assert isinstance(out_of_range, CursorParseError) and "range" in out_of_range.detail
    assert isinstance(bad_form, CursorParseError) and "<epoch>-<stream>-<seq>" in bad_form.detail


def test_invalid_utf8_bytes_rejected() -> None:
    assert isinstance(parse_cursor(b"\xff" + _valid().encode()), CursorParseError)
    assert isinstance(parse_cursor(_valid().encode() + b"\x80"), CursorParseError)


@settings(deadline=None, max_examples=300)
@given(epoch=epochs, stream=counters, seq=counters, junk=st.text(min_size=1, max_size=4))
def test_any_appended_junk_is_rejected(epoch: str, stream: int, seq: int, junk: str) -> None:
    """A valid cursor with anything after it is not a cursor, unless the junk only extends the seq."""
    raw = encode_cursor(epoch, stream, seq).decode("ascii") + junk
    parsed = parse_cursor(raw)
    if isinstance(parsed, Cursor):
        # The only way to stay valid: the junk was more digits of the seq, still canonical and in range.
        assert junk.isascii() and junk.isdigit() and seq != 0
        assert parsed == Cursor(epoch, stream, int(str(seq) + junk))
        assert parsed.seq <= MAX_COUNTER


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.text(max_size=60), st.binary(max_size=60)))
def test_parse_never_raises_and_accepts_only_canonical(raw: str | bytes) -> None:
    parsed = parse_cursor(raw)
    if isinstance(parsed, Cursor):
        # Anything accepted re-encodes to exactly the input: there is one spelling per cursor.
        wire = raw if isinstance(raw, bytes) else raw.encode("ascii")
        assert parsed.encode().encode("ascii") == wire
        assert 0 <= parsed.stream <= MAX_COUNTER and 0 <= parsed.seq <= MAX_COUNTER
    else:
        assert isinstance(parsed, CursorParseError)


def test_new_epoch_length_and_alphabet() -> None:
    for _ in range(200):
        epoch = new_epoch()
        assert len(epoch) == EPOCH_LEN
        assert set(epoch) <= set(ALPHABET)
        # An epoch is usable in a cursor as is.
        assert parse_cursor(encode_cursor(epoch, 1, 1)) == Cursor(epoch, 1, 1)


def test_new_epoch_unique_over_1000_draws() -> None:
    epochs_drawn = {new_epoch() for _ in range(1000)}
    assert len(epochs_drawn) == 1000
    # 60 random bits: every symbol of the alphabet shows up somewhere in 12_000 draws.
    assert set("".join(epochs_drawn)) == set(ALPHABET)
