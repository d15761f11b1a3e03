"""Cursors: the client-facing SSE event ids the proxy issues (pure).

Theory of operation
-------------------
A cursor names one event of one session: ``<epoch>-<stream>-<seq>``, for example ``q7m2k4xa2c3d-2-41``.

* ``epoch``: 12 characters of lowercase RFC 4648 base32 (60 random bits), drawn afresh for every
  incarnation of a session. A cursor of another session, of an earlier session that reused the same
  session id, or minted by a proxy before a restart carries another epoch, so it is recognised as
  *foreign*, never misread as a position.
* ``stream``: the session-local number of the stream the event belongs to (the spec, 2025-11-25: event
  ids "SHOULD encode sufficient information to identify the originating stream").
* ``seq``: the session's single monotonic sequence, shared by all its streams, so ids are unique across
  every stream of the session as the spec requires.

Parsing is strict: exactly this grammar, canonical decimals (no sign, no leading zero), bounded lengths.
Anything else is not a cursor the proxy issued and is rejected as malformed; nothing is guessed.
The whole id is visible ASCII, so it is safe in a ``Last-Event-ID`` header.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Final

EPOCH_LEN: Final = 12
_EPOCH_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz234567"
# seq and stream are bounded to 2**63 - 1 (19 digits): far beyond any session's life, and the bound keeps a
# hostile header from making us build a huge int.
MAX_COUNTER: Final = 2**63 - 1
_CURSOR_RE: Final = re.compile(rb"([a-z2-7]{12})-(0|[1-9][0-9]{0,18})-(0|[1-9][0-9]{0,18})")
# The longest cursor this grammar admits; a header longer than that is rejected before any regex work.
MAX_CURSOR_LEN: Final = EPOCH_LEN + 2 + 19 + 19


@dataclass(frozen=True, slots=True)
class Cursor:
    epoch: str
    stream: int
    seq: int

    def encode(self) -> str:
        return f"{self.epoch}-{self.stream}-{self.seq}"


@dataclass(frozen=True, slots=True)
class CursorParseError:
    """Why a ``Last-Event-ID`` is not a cursor (a value, not an exception: the decision table consumes it)."""

    detail: str


def new_epoch() -> str:
    """A fresh random epoch (60 bits from the OS CSPRNG)."""
    return "".join(secrets.choice(_EPOCH_ALPHABET) for _ in range(EPOCH_LEN))


def encode_cursor(epoch: str, stream: int, seq: int) -> bytes:
    """The wire form, as bytes for the SSE writer (hot path: no Cursor object)."""
    return f"{epoch}-{stream}-{seq}".encode("ascii")


def id_line_prefix(epoch: bytes, stream: int) -> bytes:
    """``id: `` and the wire form up to the seq: the seq and LF complete the id line of a stream's event
    (the hot path writes many events of one stream with one prefix)."""
    return b"id: %s-%d-" % (epoch, stream)


def parse_cursor(raw: str | bytes) -> Cursor | CursorParseError:
    """Parse a ``Last-Event-ID`` strictly. Returns a ``Cursor`` or the reason it is not one."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError:
            return CursorParseError("not ASCII")
    if len(raw) > MAX_CURSOR_LEN:
        return CursorParseError(f"longer than {MAX_CURSOR_LEN} bytes")
    match = _CURSOR_RE.fullmatch(raw)
    if match is None:
        return CursorParseError("not of the form <epoch>-<stream>-<seq>")
    stream, seq = int(match[2]), int(match[3])
    if stream > MAX_COUNTER or seq > MAX_COUNTER:
        return CursorParseError("counter out of range")
    return Cursor(match[1].decode("ascii"), stream, seq)
