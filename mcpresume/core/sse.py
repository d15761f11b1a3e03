"""Server-sent events: an incremental parser and the few serializers the proxy needs (pure).

Theory of operation
-------------------
The proxy reads every upstream SSE byte, so the parser works on ``bytes`` and never decodes: field values
are handed on byte-for-byte (invalid UTF-8 included), and JSON decoding is somebody else's business.

Parsing follows the WHATWG HTML standard, section "Server-sent events", subsection "Interpreting an event
stream" (cited below as *WHATWG*). Per chunk, ``SSEParser.feed`` does work proportional to the chunk only:

1. Line endings are normalised to LF, only when the chunk contains a CR at all: when every CR is half of a
   CRLF, by deleting the CRs (one ``replace``), else with two C-level ``replace`` calls. A CR that ends a
   chunk is remembered, so an LF starting the next chunk is dropped: CRLF split
   across two reads is one line ending, not a line ending plus a blank line.
2. ``split(b"\\n")`` cuts the chunk into complete lines plus an unterminated tail. The tail is kept as a
   list of pieces, and an event's data lines are kept as a list, so an event that arrives in many small
   chunks is joined exactly once, when it completes: nothing buffered is ever re-scanned.
3. Each complete line is interpreted (comment / field / blank line = dispatch) with fast paths for the
   canonical ``data: ``, ``id: `` and ``event: `` spellings; ``data:`` lines are nearly all the bytes of an
   MCP stream.

The hot path (``feed_batched``) skips the per-event work for what servers actually send: when the complete
events of a chunk are all message events of one spelling (``[id][event] data``, one non-empty data line;
``[event] data data...``, several; or the general one of ``_RUN_GENERAL``: several data lines, comments,
keep-alive blocks, ``data:`` unspaced),
one ``findall`` takes them all and they come back as one ``SSERun``, the lines as they arrived, from which
the proxy frames its own events without an object per event. The run is accepted only if its matches tile
the chunk exactly, which makes them the events the line parser would read; otherwise the canonical events
before the first other one form the run and the rest goes the ways above. ``feed`` returns the same events
as ``SSEEvent`` objects.

Most answers to a tool call are short: a priming event (SEP-1699) and the response, or the
response alone, whole in the upstream's first read. From an event boundary such a chunk (``_SHORT``: the
spellings the SDKs write, one data line, nothing else, within the size limit) is read by one match
(``_short``) into exactly what the general path returns for it (the priming event, the message as a run of
one event of the spelling the general path would take), without its tries of every spelling on the
priming event. Anything else in the chunk (a comment, another field, a third event) leaves it to the
general path.

A block is returned when it has an effect on a WHATWG client: a data field (a message), or a valid id (moves
the cursor; SEP-1699 "priming" blocks have no message) or a valid retry. Blocks with only comments, unknown
fields, an ``event`` field or ignored values yield nothing.

Size limit: an event's size is the sum, over its non-comment lines, of the line length plus one byte for its
terminator (CRLF and LF count the same, so the verdict does not depend on the upstream's line endings), plus
the bytes of the line still being read. A comment line is not kept, so it only counts while it is being
read. The size never depends on how the stream is chunked: the bytes of an unterminated line never count
more than the same line will once it is complete. Going over ``max_event_bytes`` raises ``EventTooLarge``
and fails the parser for good: the proxy never buffers on past the limit.

If events completed earlier in the same chunk as the overflow, ``feed`` returns them first and the error is
raised by the next ``feed`` or ``close``, so no complete event is lost to a later, oversized one.

The parser reports each event's own ``id`` (``None`` when the event carried none); the stream's cursor
("last event ID buffer", which WHATWG keeps across events) is the caller's to track.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Final

from mcpresume.core.errors import EventTooLarge

__all__ = [
    "EventTooLarge",
    "SSEEvent",
    "SSEParser",
    "SSERun",
    "encode_comment",
    "encode_frame",
    "encode_retry",
    "frame_body",
    "frame_into",
    "frame_parts",
    "priming_block",
]

# WHATWG: "One leading U+FEFF BYTE ORDER MARK character must be ignored if any are present." The stream is
# UTF-8 decoded, which strips exactly one BOM at the very start; we do the same on bytes.
_BOM: Final = b"\xef\xbb\xbf"
_COLON: Final = 0x3A  # ord(":")
_LF: Final = 0x0A
_LONE_CR: Final = re.compile(rb"\r(?!\n)")  # a CR that ends a line by itself (or ends the chunk)

# Parser states.
_OPEN: Final = 0
_FAILED_UNREPORTED: Final = 1  # overflow seen, events returned first; the next call raises
_FAILED: Final = 2  # EventTooLarge was raised; unusable
_CLOSED: Final = 3

# A whole event as servers write it: optional id and event lines (an id before or after the event line,
# the last one wins), one "data: " line, the blank line. The id may not hold NUL (WHATWG ignores such an
# id; the line parser does that). Anything this does not match is left to the line parser.
_CANONICAL: Final = re.compile(
    rb"(?:id: ([^\n\x00]*)\n)?(?:event: ([^\n]*)\n)?(?:id: ([^\n\x00]*)\n)?data: ([^\n]*)\n\n"
)

# Runs (see SSERun): whole chunks of message events, each taken by findall() in one C-level pass. Four
# spellings, from the cheapest: no id line (no groups, so no tuple per event: servers without an event
# store, the streams the proxy exists for); the id line first (the official SDK's order); several data
# lines and no id (pretty-printed JSON, ``_RUN_MULTI``); and the general form, for any other framing
# servers write (several data lines, as pretty-printed JSON gives; data without the space; comment lines
# and comment blocks; an id line before, between or after event lines). Groups let the id line be left
# out of what is forwarded.
#
# The general form, line by line (LF endings: CR is normalised first): a message event is any event and
# comment lines, at most one id line (``id: `` and a value without NUL, as the other spellings: its line is
# what replays are checked against), more event and comment lines, then data lines, the first one with a
# value (so the data is not empty: an event with empty data is a priming event, which the line parser
# handles), then more data, event and comment lines, and the blank line. A block of event and comment lines
# only (a keep-alive) has no effect on a client: it is matched on its own (group 1) and dropped. Anything
# else (retry, unknown fields, a line without a colon, an id after the data, two id lines, empty data) is
# not matched: findall skips it, the matches do not tile the chunk, and the line parser takes it. Every
# repeat is possessive, so a line is taken whole or not at all and a failed block costs one pass.
_NOT_DATA: Final = rb"(?:event:|:)[^\n]*+\n"
_DATA: Final = rb"data:(?: [^\n]|[^ \n])[^\n]*+\n(?:(?:data:|event:|:)[^\n]*+\n)*+\n"
_ID_LINE: Final = rb"id: [^\n\x00]++\n"
# Possessive repeats of "." (any byte but LF) are the cheapest loop the regex engine has: the id line's is
# one too, and a chunk holding a NUL anywhere (which an id must not hold) takes the strict form instead.
_RUN_PLAIN: Final = re.compile(rb"(?:event: .*+\n)?data: .++\n\n")
_RUN_ID_FIRST: Final = re.compile(rb"(id: .++\n)?((?:event: .*+\n)?data: .++\n\n)")
_RUN_ID_FIRST_NO_NUL: Final = re.compile(rb"(id: [^\n\x00]++\n)?((?:event: .*+\n)?data: .++\n\n)")
# Several data lines and nothing else but an event line first: pretty-printed JSON as servers write it
# (``json.dumps(indent=2)``), in a third of the general form's time (no groups, no join per event). The first
# data line has a value, as in every spelling (empty data is a priming event: the line parser's).
_RUN_MULTI: Final = re.compile(rb"(?:event: .*+\n)?data: .++\n(?:data: .*+\n)*+\n")
_RUN_GENERAL: Final = re.compile(
    rb"((?:"
    + _NOT_DATA
    + rb")*+\n)|((?:"
    + _NOT_DATA
    + rb")*+)("
    + _ID_LINE
    + rb")?((?:"
    + _NOT_DATA
    + rb")*+"
    + _DATA
    + rb")"
)
_PLAIN, _ID_FIRST, _GENERAL, _MULTI = 0, 1, 2, 3
# A keep-alive block (comment lines only) where an event starts: what _without_keepalives takes out.
_KEEPALIVE: Final = re.compile(rb"\n\n(?::[^\n]*+\n)++\n")
_ORDERS: Final = (
    (_PLAIN, _ID_FIRST, _MULTI, _GENERAL),
    (_ID_FIRST, _PLAIN, _MULTI, _GENERAL),
    (_GENERAL, _MULTI, _PLAIN, _ID_FIRST),
    (_MULTI, _PLAIN, _ID_FIRST, _GENERAL),
)
# Where a run of each spelling can start: what an anchored match of the first event must find before a
# findall over the whole chunk is worth trying (a findall that fails to tile has scanned it all).
_STARTS: Final = (
    re.compile(rb"(?:event: .*\n)?data: .+\n\n"),
    re.compile(rb"(?:id: [^\n\x00]+\n)?(?:event: .*\n)?data: .+\n\n"),
    re.compile(
        rb"(?:" + _NOT_DATA + rb")*+(?:\n|(?:" + _ID_LINE + rb")?(?:" + _NOT_DATA + rb")*+" + _DATA + rb")"
    ),
    re.compile(rb"(?:event: .*\n)?data: .+\n(?:data: .*\n)*\n"),
)
# The longest run of events of one spelling from a position: where a chunk that is not all canonical stops
# being so. Possessive quantifiers: a line is taken whole or not at all, so a failed event costs one pass.
_PREFIXES: Final = tuple(
    re.compile(rb"(?:" + pattern + rb")++")
    for pattern in (
        rb"(?:event: .*+\n)?data: .++\n\n",
        rb"(?:id: [^\n\x00]++\n)?(?:event: .*+\n)?data: .++\n\n",
        rb"(?:" + _NOT_DATA + rb")*+(?:\n|(?:" + _ID_LINE + rb")?(?:" + _NOT_DATA + rb")*+" + _DATA + rb")",
        rb"(?:event: .*+\n)?data: .++\n(?:data: .*+\n)*+\n",
    )
)
# A short answer whole in one read, as servers write it (``SSEParser._short``): an optional priming event
# (SEP-1699: an id, an empty data line, a retry before or after it) then an optional message event (an id
# and an event line in either order, or either, or neither; one data line with a value). Groups: the
# priming's id, its retries, the message, its id and event (id first), its event and id (event first), its
# data. Both retries: the last one wins, as in the line parser. Anything else is the general path's.
_SHORT: Final = re.compile(
    rb"(?:id: ([^\n\x00]*)\n(?:retry: ([0-9]{1,9})\n)?data: \n(?:retry: ([0-9]{1,9})\n)?\n)?"
    rb"((?:id: ([^\n\x00]+)\n(?:event: ([^\n]*)\n)?|event: ([^\n]*)\n(?:id: ([^\n\x00]+)\n)?)?"
    rb"data: ([^\n]+)\n\n)?"
)
_FIRST: Final = itemgetter(0)
_SECOND: Final = itemgetter(1)
_THIRD: Final = itemgetter(2)
_WITHOUT_ID: Final = itemgetter(1, 3)


# Not frozen: a frozen dataclass costs ~3.5x more to construct (its __init__ goes through
# object.__setattr__), and one is built per upstream event on the hot path. Treat it as immutable.
@dataclass(slots=True)
class SSEEvent:
    """One dispatched event block, as raw bytes."""

    data: bytes  # the data lines joined with LF, no trailing LF; b"" if there was no data field
    event: bytes | None  # the last ``event`` field's value, None if none (b"" is kept as b"")
    id: bytes | None  # the last valid ``id`` field of THIS event; b"" resets the client's cursor
    retry: int | None  # the last all-digits ``retry`` value, None if none
    has_data: bool  # at least one ``data`` field (``data:`` with an empty value counts)


class SSERun:
    """Consecutive message events, kept as the bytes they arrived in (LF endings): per event its block
    without its id line (event, data and comment lines, blank line), and its id line (b"" if none; ``ids``
    is None when no event has one). ``general``: the blocks are of any spelling the parser accepts in a run
    (see ``_RUN_GENERAL``), else each is ``[event: X] data: Y`` and the blank line. A client parsing
    ``id: <cursor>`` then the block gets the upstream's event with our id: that is how the proxy forwards a
    run (``frame_parts``), with no per-event object."""

    __slots__ = ("_event", "_source", "blocks", "general", "ids", "size")

    def __init__(
        self,
        blocks: list[bytes],
        ids: list[bytes] | None,
        size: int,
        source: tuple[bytes, int, int] | None = None,
        *,
        general: bool = False,
        event: SSEEvent | None = None,
    ) -> None:
        self.blocks = blocks
        self.ids = ids
        self.size = size  # the bytes of the blocks (what a window keeps: the upstream id lines aside)
        self._source = source  # (chunk, start, end): the run is chunk[start:end]
        self.general = general
        self._event = event  # a run of one event parsed already (``SSEParser._short``): what events() gives

    def __len__(self) -> int:
        return len(self.blocks)

    def split(self, start: int, stop: int) -> SSERun:
        """Events ``start:stop``."""
        blocks = self.blocks[start:stop]
        ids = None if self.ids is None else self.ids[start:stop]
        return SSERun(blocks, ids, sum(map(len, blocks)), general=self.general)

    def keep(self, kept: list[int]) -> SSERun:
        """The events at the indexes ``kept`` (in order)."""
        ids = self.ids
        blocks = [self.blocks[i] for i in kept]
        ids = None if ids is None else [ids[i] for i in kept]
        return SSERun(blocks, ids, sum(map(len, blocks)), general=self.general)

    def _bytes(self) -> tuple[bytes, int, int]:
        """(buffer, start, end): the run's events as one buffer, each one's blocks ended by a blank line
        (``\n\n``) and no other: the chunk they came in, or their blocks joined."""
        if self._source is None:
            joined = b"".join(self.blocks)
            return joined, 0, len(joined)
        return self._source

    def suspects(self, prefix: bytes, markers: Sequence[bytes]) -> list[int]:
        """The indexes of the events whose data does not start with ``prefix`` and whose bytes (the id
        line included) hold one of ``markers``, none of which may hold LF: so every event whose data holds
        one is found, whatever the data's spelling over lines. A few C-level scans for the whole run (each
        ``find`` goes from the last event found on), then a little work per event found."""
        chunk, begin, end = self._bytes()
        found: list[int] = []
        index = 0
        pos = begin
        starts = (b"data: " + prefix, b"data:" + prefix)
        while pos < end:
            hits = [hit for hit in (chunk.find(marker, pos, end) for marker in markers) if hit >= 0]
            if not hits:
                break
            hit = min(hits)
            index += chunk.count(b"\n\n", pos, hit)
            first = chunk.rfind(b"\n\n", begin, hit)
            first = begin if first < 0 else first + 2  # where the event starts
            last = chunk.find(b"\n\n", hit, end) + 2  # where it ends
            line = first if chunk.startswith(b"data:", first) else chunk.find(b"\ndata:", first, last) + 1
            if not chunk.startswith(starts, line):
                found.append(index)
            index += 1
            pos = last
        return found

    def all_start_with(
        self, prefixes: tuple[bytes, ...], first: int = 0, *, but_last: bool = False
    ) -> int | None:
        """Whether every event's data starts with one of ``prefixes`` (spelled over ``data: `` lines; the
        needles of ``_data_needles``): if so the index of the prefix counted last (the one to count first
        next time), else None. ``prefixes[first]`` is counted first: usually one C-level count. Sound
        because each needle occurs at most once per event, and none where another does: in a run of one
        data line per event, a needle is a data line's start; in a general run, it begins with the blank
        line before an event (the run is counted with one in front), and the id lines are left out.
        ``but_last``: every event but the last one (its bytes are not counted)."""
        blocks = self.blocks
        wanted = len(blocks) - 1 if but_last else len(blocks)
        if wanted <= 0:
            return first
        # The last event's bytes, left out with but_last: its block, and its id line where the bytes hold it.
        last = len(blocks[-1]) if but_last else 0
        head = -1  # the needle found at the very start of the bytes, with no LF before it
        if not self.general:
            chunk, start, end = self._bytes()
            if self._source is not None and self.ids is not None and but_last:
                last += len(self.ids[-1])
            end -= last
            needles = _data_needles(prefixes, False)
            if start:
                start -= 1  # the LF that ends the event before the run
            else:
                head = next((k for k, n in enumerate(needles) if chunk.startswith(n[1:])), -1)
        elif self._source is not None and self.ids is None:
            chunk, start, end = self._source
            end -= last
            needles = _data_needles(prefixes, True)
            if start >= 2 and chunk[start - 2 : start] == b"\n\n":
                start -= 2
            else:
                chunk, start, end = b"\n\n" + chunk[start:end], 0, end - start + 2
        else:
            chunk = b"\n\n" + b"".join(blocks[:wanted])
            start, end = 0, len(chunk)
            needles = _data_needles(prefixes, True)
        total = 0
        if first >= len(needles):  # a hint from a run of the other kind
            first = 0
        for k in (first, *(i for i in range(len(needles)) if i != first)):
            total += chunk.count(needles[k], start, end) + (k == head)
            if total == wanted:
                return k
        return None

    def events(self) -> list[SSEEvent]:
        """The same events as SSEEvent objects, as the line parser returns them."""
        if self._event is not None:
            return [self._event]
        ids = self.ids or [b""] * len(self.blocks)
        if self.general:
            parser = SSEParser(1 + max(map(len, self.blocks)) + max(map(len, ids)))
            return [
                parser._lines(id_line + block)[0] for block, id_line in zip(self.blocks, ids, strict=True)
            ]
        events = []
        for block, id_line in zip(self.blocks, ids, strict=True):
            lines = block[:-2].split(b"\n")
            name = lines[-2][7:] if len(lines) > 1 else None
            events.append(SSEEvent(lines[-1][6:], name, id_line[4:-1] or None, None, True))
        return events

    def last_id(self) -> bytes | None:
        """The id of the last event that carried one."""
        for id_line in reversed(self.ids or ()):
            if id_line:
                return id_line[4:-1]
        return None


@functools.cache
def _data_needles(prefixes: tuple[bytes, ...], at_event_start: bool) -> tuple[bytes, ...]:
    """For ``SSERun.all_start_with``: what the bytes of a run hold where an event's data starts with one of
    ``prefixes`` (an LF in a prefix is a new ``data: `` line): per prefix, its first data line after an LF
    (a run of one data line per event: each prefix holding no LF; the others can never be found), or, at
    an event's start (the blank line before it, then nothing or ``event: message``), its data lines."""
    spelled = [b"data: " + prefix.replace(b"\n", b"\ndata: ") for prefix in prefixes]
    if not at_event_start:
        return tuple(b"\n" + line if b"\n" not in line else b"\n\x00" for line in spelled)
    return tuple(b"\n\n" + lead + line for lead in (b"", b"event: message\n") for line in spelled)


def frame_parts(prefix: bytes, first_seq: int, blocks: Sequence[bytes]) -> list[bytes]:
    """What ``b"".join`` turns into the events' frames: per event, ``prefix`` + seq + LF (the proxy's id
    line, the cursor) then the event's block (an event without an id line); seqs from ``first_seq`` on.
    Two parts per event, one of them made for it (the hot path writes with ``frame_into``)."""
    parts: list[bytes] = [b""] * (2 * len(blocks))
    parts[0::2] = [prefix + b"%d\n" % seq for seq in range(first_seq, first_seq + len(blocks))]
    parts[1::2] = blocks
    return parts


# A seq's digits and the LF that ends its id line, by value: a seq's last three digits (zero-padded) for a
# seq of 1000 and more, and a seq under 1000 whole. ``frame_into`` writes a run's cursors from these and
# one prefix per thousand seqs, so a read makes no bytes object per event (making one per event, as
# ``frame_parts`` does, was most of a read's work: 120 ns of 137 per 256 B event). 2,000 objects
# (about 80 KiB), made once.
_LOW_DIGITS: Final = [b"%03d\n" % value for value in range(1000)]
_SMALL_DIGITS: Final = [b"%d\n" % value for value in range(1000)]


def frame_into(parts: list[bytes], prefix: bytes, first_seq: int, blocks: Sequence[bytes]) -> None:
    """Append to ``parts`` what ``b"".join`` turns into the events' frames, the same bytes as
    ``frame_parts``' in three parts per event: ``prefix`` and the seq's thousands (one object per thousand
    seqs), the seq's last digits and LF (``_LOW_DIGITS``), the event's block. Seqs are never negative."""
    if first_seq < 0:
        raise ValueError("a seq is never negative")
    count = len(blocks)
    done = 0
    seq = first_seq
    while done < count:
        high, low = divmod(seq, 1000)
        take = min(count - done, 1000 - low)
        piece = [prefix + b"%d" % high if high else prefix] * (3 * take)
        piece[1::3] = (_LOW_DIGITS if high else _SMALL_DIGITS)[low : low + take]
        piece[2::3] = blocks if take == count else blocks[done : done + take]
        parts += piece
        done += take
        seq += take


def _match_run(spelling: int, chunk: bytes, start: int, end: int) -> SSERun | None:
    """``chunk[start:end]`` as a run of events of one spelling, or None if the matches do not tile it (a
    byte skipped means an event that is not of the spelling: the matches are then not the events)."""
    size = end - start
    source = (chunk, start, end)
    if spelling == _PLAIN:
        blocks = _RUN_PLAIN.findall(chunk, start, end)
        return SSERun(blocks, None, size, source) if sum(map(len, blocks)) == size else None
    if spelling == _MULTI:  # blocks of the general kind (several data lines), without its cost
        blocks = _RUN_MULTI.findall(chunk, start, end)
        return SSERun(blocks, None, size, source, general=True) if sum(map(len, blocks)) == size else None
    if spelling == _ID_FIRST:
        pattern = _RUN_ID_FIRST if chunk.find(b"\x00", start, end) < 0 else _RUN_ID_FIRST_NO_NUL
        pairs = pattern.findall(chunk, start, end)
        # The two lists are needed anyway: their sizes are the tiling check (half the cost of a pass over
        # the pairs' parts first).
        ids = list(map(_FIRST, pairs))
        blocks = list(map(_SECOND, pairs))
        blocks_size = sum(map(len, blocks))
        if blocks_size + sum(map(len, ids)) != size:
            return None
        return SSERun(blocks, ids, blocks_size, source)
    parts = _RUN_GENERAL.findall(chunk, start, end)
    general = list(map(b"".join, map(_WITHOUT_ID, parts)))  # a keep-alive block gives b""
    id_lines = list(map(_THIRD, parts))
    matched = sum(map(len, general)) + sum(map(len, id_lines))
    if b"" in general:
        matched += sum(map(len, map(_FIRST, parts)))
    if matched != size:
        return None
    if b"" not in general:
        return SSERun(
            general, id_lines if any(id_lines) else None, size - sum(map(len, id_lines)), source, general=True
        )
    # Keep-alive blocks: dropped, and the chunk is no longer the events' bytes.
    id_lines = list(compress(id_lines, general))
    general = list(filter(None, general))
    return SSERun(general, id_lines if any(id_lines) else None, sum(map(len, general)), general=True)


def _parse_retry(value: bytes) -> int | None:
    # Caller checked value.isdigit() (bytes.isdigit is ASCII-only, False for b""). WHATWG: "If the field
    # value consists of only ASCII digits, then interpret the field value as an integer in base ten".
    # Leading zeros are stripped so that int()'s digit-count guard (sys.get_int_max_str_digits) only
    # trips on an absurd magnitude, which we ignore like any other unusable value.
    digits = value.lstrip(b"0")
    if not digits:
        return 0
    try:
        return int(digits)
    except ValueError:
        return None


class SSEParser:
    """Incremental WHATWG event-stream parser over bytes. See the module docstring."""

    __slots__ = (
        "_data",
        "_event",
        "_has_data",
        "_head",
        "_id",
        "_keepalives",
        "_max",
        "_partial",
        "_partial_len",
        "_retry",
        "_size",
        "_skip_lf",
        "_spelling",
        "_state",
    )

    def __init__(self, max_event_bytes: int) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be >= 1")
        self._max = max_event_bytes
        # Bytes of the stream start, held until we know whether they are a BOM; None once decided.
        self._head: bytes | None = b""
        self._skip_lf = False  # the previous chunk ended with CR
        self._partial: list[bytes] = []  # the unterminated line, in pieces (never an empty piece)
        self._partial_len = 0
        self._size = 0  # the current event's non-comment lines, one byte per terminator
        self._data: list[bytes] = []
        self._has_data = False
        self._event: bytes | None = None
        self._id: bytes | None = None
        self._retry: int | None = None
        self._state = _OPEN
        self._spelling = _PLAIN  # of the last run: tried first
        self._keepalives = False  # the last general run held keep-alive blocks

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete line or event (0 between events)."""
        head = len(self._head) if self._head else 0
        return head + self._size + self._partial_len

    def _fail(self) -> EventTooLarge:
        self._state = _FAILED
        self._partial = []
        self._data = []
        return EventTooLarge(self._max)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse ``chunk``; return every event completed by it, in stream order."""
        events: list[SSEEvent] = []
        for item in self.feed_batched(chunk):
            if type(item) is SSERun:
                events.extend(item.events())
            else:
                events.append(item)  # type: ignore[arg-type]
        return events

    def feed_batched(self, chunk: bytes) -> list[SSEEvent | SSERun]:
        """Like ``feed``, but consecutive canonical message events come as one ``SSERun`` (the hot path)."""
        if self._state != _OPEN:
            if self._state == _CLOSED:
                raise RuntimeError("SSEParser.feed() after close()")
            raise self._fail()

        if self._head is not None:
            head = self._head + chunk
            if len(head) < 3 and _BOM.startswith(head):
                self._head = head  # could still be a BOM split across reads
                return []
            self._head = None
            chunk = head[3:] if head.startswith(_BOM) else head

        if self._skip_lf:
            if not chunk:
                return []
            self._skip_lf = False
            # WHATWG: lines end in "a U+000D CARRIAGE RETURN U+000A LINE FEED (CRLF) character pair, a single
            # U+000A LINE FEED (LF) character, or a single U+000D CARRIAGE RETURN (CR) character". The
            # previous chunk's trailing CR already ended the line, so this LF is the second half of a CRLF.
            if chunk[0] == _LF:
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._skip_lf = chunk[-1:] == b"\r"
            # CRLF first, so a pair becomes one LF rather than two.
            if _LONE_CR.search(chunk) is None:
                # Every CR is half of a CRLF: deleting them is a twelfth of the cost of replacing the pairs
                # (a two-byte substring search and a copy). A one-byte replace (memchr, then a copy of
                # each line) is a third of translate's table lookup per byte: 9 vs 32 us per 64 KiB.
                chunk = chunk.replace(b"\r", b"")
            else:
                chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

        if self._at_boundary():
            return self._short(chunk) or self._blocks(chunk)
        # Finish the event the previous chunk left open with the line parser, then take the fast path.
        if not self._partial and chunk[:1] == b"\n":
            end = 1  # the previous chunk ended its last line; this LF is the blank line
        else:
            end = chunk.find(b"\n\n")
            if end < 0:
                return list(self._lines(chunk))
            end += 2
        events: list[SSEEvent | SSERun] = list(self._lines(chunk[:end]))
        if end == len(chunk) or self._state != _OPEN or not self._at_boundary():
            return events
        try:
            events.extend(self._blocks(chunk, end))  # from end on, without a copy of the rest
        except EventTooLarge:
            if not events:
                raise
            self._state = _FAILED_UNREPORTED
        return events

    def _at_boundary(self) -> bool:
        """Between events: nothing of a line or an event is held."""
        return (
            not self._partial
            and self._size == 0
            and not self._has_data
            and self._id is None
            and (self._event is None and self._retry is None)
        )

    def _short(self, chunk: bytes) -> list[SSEEvent | SSERun] | None:
        """A short answer whole in one read (``_SHORT``: a priming event, a message event, or both), from an
        event boundary: what ``_blocks`` returns for it, without its tries of every spelling on the priming
        event. None (nothing done) for anything else. The same items: the priming event as an SSEEvent, the
        message as a run of one event, of the spelling ``_run`` would take and leave as the one to try
        first (its table, below); within the size limit as a whole, so no event of it is too large."""
        if len(chunk) > self._max or self._keepalives:
            return None
        found = _SHORT.fullmatch(chunk)
        if found is None or not chunk:
            return None
        primed, retry, last_retry, message, id_first, event_second, event_first, id_second, data = (
            found.groups()
        )
        items: list[SSEEvent | SSERun] = []
        if primed is not None:
            retry = last_retry or retry
            items.append(SSEEvent(b"", None, primed, None if retry is None else int(retry), True))
        if message is None:
            return items
        # The spellings that read the message as a run: all four without an id line; the id line first
        # and the general one with it first; the general one alone with the event line first. ``_run`` takes
        # the first of those in the order the last spelling gives (``_ORDERS``).
        spelling = self._spelling
        if id_first is not None:
            id_, event = id_first, event_second
            if spelling not in (_ID_FIRST, _GENERAL):
                spelling = _ID_FIRST
        else:
            id_, event = id_second, event_first
            if id_ is not None:
                spelling = _GENERAL
        self._spelling = spelling
        # The message without its id line: as it came, or cut after an id line first, or made again.
        if id_ is None:
            block = message
        elif id_first is not None:
            block = message[len(id_) + 5 :]
        else:
            block = b"event: " + event + b"\ndata: " + data + b"\n\n"
        parsed = SSEEvent(data, event, id_, None, True)
        source = (chunk, found.start(4), len(chunk))
        if spelling in (_PLAIN, _MULTI):
            run = SSERun([block], None, len(block), source, general=spelling == _MULTI, event=parsed)
        else:
            id_lines = None if id_ is None else [b"id: " + id_ + b"\n"]
            if spelling == _ID_FIRST:
                id_lines = id_lines or [b""]
            run = SSERun([block], id_lines, len(block), source, general=spelling == _GENERAL, event=parsed)
        items.append(run)
        return items

    def _blocks(self, chunk: bytes, start: int = 0) -> list[SSEEvent | SSERun]:
        """The fast paths, from an event boundary (``start``). First the whole chunk as one run: one
        findall() over the complete events, accepted when its matches tile them exactly (no byte skipped,
        so each match began at an event boundary, which makes it the same event the line parser would
        read). Otherwise one event at a time: a canonical event (``[id][event][id] data`` lines, one data
        line) by one regex match; anything else (comments, retry, several data lines, other spellings, the
        unfinished tail) through the line parser, one block at a time, so every path gives the same events.
        After the first single event the rest of the chunk is tried as a run once more (a stream's first
        chunk often starts with a priming event), never more, so a chunk costs at most a few scans."""
        events: list[SSEEvent | SSERun] = []
        limit = self._max
        match = _CANONICAL.match
        pos = self._run(chunk, start, events)
        retried = False
        while True:
            found = match(chunk, pos)
            # Size as the line parser counts it: each line and its LF, the blank line not included.
            if found is not None:
                end = found.end()
                if end - pos - 1 <= limit:
                    first_id, event, last_id, data = found.groups()
                    events.append(SSEEvent(data, event, first_id if last_id is None else last_id, None, True))
                    pos = end
                    if not retried:
                        retried = True
                        pos = self._run(chunk, pos, events)
                    continue
            end = chunk.find(b"\n\n", pos)
            piece = chunk[pos:] if end < 0 else chunk[pos : end + 2]
            if not piece:
                return events
            try:
                events.extend(self._lines(piece))
            except EventTooLarge:
                if not events:
                    raise
                self._state = _FAILED_UNREPORTED  # hand over what completed; raise on the next call
                return events
            if end < 0 or self._state != _OPEN:
                return events
            pos = end + 2
            if not retried:
                retried = True
                pos = self._run(chunk, pos, events)

    def _run(self, chunk: bytes, pos: int, events: list[SSEEvent | SSERun]) -> int:
        """Take the complete events of ``chunk`` from ``pos`` as one SSERun if they all are message events
        of one spelling within the size limit, else those before the first other; returns where the caller
        goes on (``pos`` if nothing was taken). The spelling that matched last time is tried first (a
        stream writes every event the same way); another one only if its first event is there (one
        anchored match), so a chunk costs one findall, two at a change of spelling."""
        end = chunk.rfind(b"\n\n", pos) + 2
        size = end - pos
        if size < 8:  # no complete event after pos, or rfind found none
            return pos
        if self._keepalives:
            taken = self._without_keepalives(chunk, pos, end, events)
            if taken:
                return end
        order = _ORDERS[self._spelling]
        for spelling in order:
            if spelling != order[0] and _STARTS[spelling].match(chunk, pos, end) is None:
                continue
            run = _match_run(spelling, chunk, pos, end)
            if run is not None:
                self._spelling = spelling
                break
        else:
            # Not all of one spelling: take the events up to the first other one, if any. A wrong
            # spelling fails at the first event, so trying each costs little.
            for spelling in order:
                found = _PREFIXES[spelling].match(chunk, pos, end)
                if found is not None:
                    break
            else:
                return pos
            end = found.end()
            size = end - pos
            run = _match_run(spelling, chunk, pos, end)
            if run is None:  # cannot happen (the prefix is made of such events); stay on the safe side
                return pos
            self._spelling = spelling
        # Each event's size as the line parser counts it is at most its bytes less the blank line's LF
        # (comment lines, kept in a general block, count less). A general run over the limit in all is
        # left to the line parser: its keep-alive blocks are not among the blocks to measure.
        if size - 1 > self._max and (
            run.general or max(map(len, run.blocks)) + max(map(len, run.ids or [b""])) - 1 > self._max
        ):
            return pos
        if run.general and run._source is None:
            self._keepalives = True  # it held keep-alive blocks: take them out first next time
        if run.blocks:  # else keep-alive blocks only: nothing for a client
            events.append(run)
        return end

    def _without_keepalives(self, chunk: bytes, pos: int, end: int, events: list[SSEEvent | SSERun]) -> bool:
        """For a stream that sends keep-alive blocks (comment lines only) between its events: take them out
        of ``chunk[pos:end]`` (one substitution, anchored at event starts, so a comment line inside an
        event stays) and read the rest as a run of one spelling, which costs a third of the general
        spelling's match per keep-alive block. False (nothing taken, and not tried again until a general
        run holds keep-alive blocks again) if the rest is not such a run within the size limit."""
        region = _KEEPALIVE.sub(b"\n\n", b"\n\n" + chunk[pos:end])[2:]
        if len(region) - 1 > self._max:  # the line parser decides what is too large
            self._keepalives = False
            return False
        for spelling in _ORDERS[_PLAIN if self._spelling == _GENERAL else self._spelling]:
            if _STARTS[spelling].match(region) is None:
                continue
            run = _match_run(spelling, region, 0, len(region))
            if run is not None:
                if run.blocks:
                    events.append(run)
                return True
        self._keepalives = False
        return False

    def _lines(self, chunk: bytes) -> list[SSEEvent]:
        """The line-by-line parser (WHATWG "Interpreting an event stream"), on LF-only text."""
        lines = chunk.split(b"\n")
        tail = lines.pop()  # after the last LF: the unterminated start of the next line (maybe b"")
        if lines and self._partial:
            self._partial.append(lines[0])
            lines[0] = b"".join(self._partial)
            self._partial = []
            self._partial_len = 0

        events: list[SSEEvent] = []
        limit = self._max
        size = self._size
        data = self._data
        has_data = self._has_data
        event = self._event
        id_ = self._id
        retry = self._retry
        overflow = False

        for line in lines:
            if not line:
                # WHATWG: "If the line is empty (a blank line): Dispatch the event". A browser fires nothing
                # when the data buffer is empty, but the id still moves its cursor and a retry still sets
                # its reconnection time, so a data-less block with either is returned (SEP-1699 priming).
                # A block with no effect at all (comments only, or only event/unknown/ignored fields)
                # yields nothing.
                if has_data or id_ is not None or retry is not None:
                    # WHATWG appends value + LF per data line, then removes the one trailing LF: a join.
                    events.append(SSEEvent(b"\n".join(data), event, id_, retry, has_data))
                    data = []
                    has_data = False
                event = id_ = retry = None
                size = 0
                continue
            if line[0] == _COLON:
                # WHATWG: "If the line starts with a U+003A COLON character (:) - Ignore the line."
                # Not kept, so it only has to fit while being read.
                if size + len(line) > limit:
                    overflow = True
                    break
                continue
            size += len(line) + 1
            if size > limit:
                overflow = True
                break
            # Fast paths for the canonical spellings: nearly every byte of an MCP stream is on a "data: "
            # line, and most events also carry "id: " and "event: " lines.
            if line.startswith(b"data: "):
                data.append(line[6:])
                has_data = True
                continue
            if line.startswith(b"id: "):
                if b"\x00" not in line:  # WHATWG ignores an id containing NUL (see below)
                    id_ = line[4:]
                continue
            if line.startswith(b"event: "):
                event = line[7:]
                continue
            # WHATWG: "If the line contains a U+003A COLON character (:) - Collect the characters on the line
            # before the first U+003A COLON character (:), and let field be that string. Collect the
            # characters on the line after the first U+003A COLON character (:), and let value be that
            # string. If value starts with a U+0020 SPACE character, remove it from value."
            colon = line.find(b":")
            if colon < 0:
                # WHATWG: "Otherwise, the string is not empty but does not contain a U+003A COLON character
                # (:) - Process the field using the whole line as the field name, and the empty string as
                # the field value."
                name = line
                value = b""
            else:
                name = line[:colon]
                value = line[colon + 2 :] if line.startswith(b" ", colon + 1) else line[colon + 1 :]
            if name == b"data":
                data.append(value)
                has_data = True
            elif name == b"event":
                event = value
            elif name == b"id":
                # WHATWG: "If the field value does not contain U+0000 NULL, then set the last event ID
                # buffer to the field value. Otherwise, ignore the field."
                if b"\x00" not in value:
                    id_ = value
            elif name == b"retry" and value.isdigit():
                # WHATWG: "If the field value consists of only ASCII digits, [...] set the event stream's
                # reconnection time to that integer. Otherwise, ignore the field."
                parsed = _parse_retry(value)
                if parsed is not None:
                    retry = parsed
            # WHATWG: "Otherwise - The field is ignored."

        if not overflow and tail:
            self._partial.append(tail)
            self._partial_len += len(tail)
            # Holding an unterminated line is what costs memory; bound it like the complete event.
            overflow = size + self._partial_len > limit

        if overflow:
            if events:
                # Hand over what completed before the oversized event; raise on the next call.
                self._state = _FAILED_UNREPORTED
                self._partial = []
                self._data = []
                return events
            raise self._fail()

        self._size = size
        self._data = data
        self._has_data = has_data
        self._event = event
        self._id = id_
        self._retry = retry
        return events

    def close(self) -> bool:
        """End of stream. Discards an incomplete event (WHATWG: "Once the end of the file is reached, any
        pending data must be discarded. (If the file ends in the middle of an event, before the final empty
        line, the incomplete event is not dispatched.)"). Returns True iff bytes of an incomplete event were
        discarded. Raises ``EventTooLarge`` if ``feed`` returned events but has not raised yet."""
        state = self._state
        if state == _FAILED_UNREPORTED:
            raise self._fail()
        if state == _FAILED:
            return True
        if state == _CLOSED:
            return False
        # An unterminated comment line is not part of an event; anything else held is.
        partial_event = bool(self._partial) and self._partial[0][0] != _COLON
        incomplete = bool(self._head) or self._size > 0 or partial_event
        self._state = _CLOSED
        self._head = None
        self._partial = []
        self._partial_len = 0
        self._size = 0
        self._data = []
        self._has_data = False
        self._event = self._id = self._retry = None
        return incomplete


def frame_body(data: bytes, event: bytes | None = b"message") -> bytes:
    """Serialize an event without its id line: ``event: X`` (unless None), one ``data:`` line per LF-separated
    line of ``data``, and the terminating blank line. The proxy prefixes ``id: <cursor>`` later."""
    # A CR would end a line early at the client (WHATWG line endings); LF in data is a line separator.
    if b"\r" in data:
        raise ValueError("SSE data must not contain CR")
    # One replace instead of split + join: every LF in data starts a new "data: " line.
    body = b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n"
    if event is None:
        return body
    if b"\r" in event or b"\n" in event:
        raise ValueError("SSE event name must not contain CR or LF")
    return b"event: " + event + b"\n" + body


def _check_id(id: bytes) -> None:
    # CR/LF would end the id line early; WHATWG clients ignore an id containing NUL.
    if b"\n" in id or b"\r" in id or b"\x00" in id:
        raise ValueError("SSE id must not contain CR, LF or NUL")


def encode_frame(id: bytes, body: bytes) -> bytes:
    """``id: <id>`` followed by a body made by ``frame_body``."""
    _check_id(id)
    return b"id: " + id + b"\n" + body


def priming_block(retry_ms: int | None) -> bytes:
    """An event with empty data, sent with an id (``encode_frame``; MCP 2025-11-25, SEP-1699 "priming"): it
    gives the client a cursor before any message, and the optional retry hint. The official MCP python
    client ignores message events with empty data but records their id."""
    if retry_ms is None:
        return b"data: \n\n"
    if retry_ms < 0:
        raise ValueError("retry_ms must be >= 0")
    return b"retry: " + str(retry_ms).encode("ascii") + b"\ndata: \n\n"


def encode_comment(text: bytes) -> bytes:
    """A comment block (``: text`` + blank line), e.g. a keep-alive. Clients ignore it."""
    if b"\n" in text or b"\r" in text:
        raise ValueError("SSE comment must not contain CR or LF")
    return b": " + text + b"\n\n"


def encode_retry(retry_ms: int) -> bytes:
    """A block that only sets the client's reconnection time."""
    if retry_ms < 0:
        raise ValueError("retry_ms must be >= 0")
    return b"retry: " + str(retry_ms).encode("ascii") + b"\n\n"


def encode_event(event: SSEEvent) -> bytes:
    """An event as parsed, written again (its id, retry, event name and data; comments are gone): what a
    relay that must stop at an event boundary sends (``http/tasks.py``: the answer before a task handle)."""
    head = b""
    if event.id is not None:
        _check_id(event.id)
        head = b"id: " + event.id + b"\n"
    if event.retry is not None:
        head += b"retry: " + str(event.retry).encode("ascii") + b"\n"
    if event.has_data:
        return head + frame_body(event.data, event.event)
    return head + (b"event: " + event.event + b"\n" if event.event is not None else b"") + b"\n"
