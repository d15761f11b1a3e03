"""This process's copies of what it appended to the Redis store: the bodies, by their field in the session's
bodies hash (``Bodies``), and each session's last append (``Copies.read``).

A field's name is unique (an append's: this process's random token and a counter; a priming event's: its
session's random epoch and its seq), written once and never changed, only deleted when its events leave the
window: a copy is never stale, so a view of this process reads the bodies its pumps appended without a round
trip for them. Bounded by bytes, least recently used out first.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from mcpresume.core.session import ReadResult
from mcpresume.core.window import Segment

CACHE_BYTES: Final = 32 << 20


class Bodies:
    __slots__ = ("_items", "capacity", "size")

    def __init__(self, capacity: int = CACHE_BYTES) -> None:
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self.capacity = capacity
        self.size = 0

    def put(self, field: bytes, body: bytes) -> None:
        if len(body) > self.capacity:
            return
        old = self._items.pop(field, None)
        if old is not None:
            self.size -= len(old)
        self._items[field] = body
        self.size += len(body)
        while self.size > self.capacity:
            _, dropped = self._items.popitem(last=False)
            self.size -= len(dropped)

    def get(self, field: bytes) -> bytes | None:
        body = self._items.get(field)
        if body is not None:
            self._items.move_to_end(field)
        return body

    def __len__(self) -> int:
        return len(self._items)


def split(blob: bytes, offset: int, lengths: Sequence[int]) -> tuple[list[bytes], int]:
    """The bodies of a run, cut from ``blob`` (a field's value) from ``offset`` on, and their bytes."""
    blocks: list[bytes] = []
    start = offset
    for length in lengths:
        blocks.append(blob[offset : offset + length])
        offset += length
    return blocks, offset - start


@dataclasses.dataclass(frozen=True, slots=True)
class LastAppend:
    """One append this process made: its events' first seq, their stream, sizes and bodies' field, when,
    their bytes, the session's version after it, the last seq of its stream evicted so far (then), and
    whether it ended its stream in the same call (``append_and_end``: two changes of the version)."""

    first: int
    stream: int
    lengths: array[int]
    field: bytes
    at: float
    size: int
    version: int
    evicted_through: int = 0
    ended: bool = False
    made: float = dataclasses.field(default_factory=time.monotonic)  # for ``FRESH`` s only

    @property
    def end(self) -> int:
        """The seq after its last event."""
        return self.first + len(self.lengths)

    @property
    def before(self) -> int:
        """The session's version before it."""
        return self.version - 2 if self.ended else self.version - 1


# ``Copies.read`` answers only this long after an append: every eviction is a script (which forgets the
# copies, or, an append of this process, says how far its stream is evicted) but one, Redis expiring the
# events key, which an append puts off by the window's age limit plus 60 s.
FRESH: Final = 1.0
# A session's last appends kept for reads: a view one or a few appends behind its pump reads them here too.
RECENT: Final = 8


class Copies:
    """The bodies this process holds; each session's last appends by this process (``RECENT`` at most, one
    after the other: consecutive seqs and versions) while nothing else is known to have changed the session
    since; and the sessions' epochs (the cursors a read writes)."""

    __slots__ = ("bodies", "epochs", "recent")

    def __init__(self) -> None:
        self.bodies = Bodies()
        self.recent: dict[str, list[LastAppend]] = {}
        self.epochs: dict[str, bytes] = {}

    def appended(self, session_id: str, copy: LastAppend) -> None:
        """This process's append, just made: the session's history since the one before it, if that is the
        last known change; else the first of a new run."""
        recent = self.recent.get(session_id)
        if recent and recent[-1].version == copy.before and recent[-1].end == copy.first:
            if recent[-1].stream != copy.stream:
                recent.clear()  # one stream's at a time: a read of it then needs no other stream's facts
            elif len(recent) == RECENT:
                del recent[0]
            recent.append(copy)
        else:
            self.recent[session_id] = [copy]

    def changed(self, session_id: str) -> None:
        """The session changed otherwise than by this process's appends (or may have): reads go to Redis."""
        self.recent.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self.recent.pop(session_id, None)
        self.epochs.pop(session_id, None)

    def read(
        self, session_id: str, streams: Sequence[int], after: int, max_events: int, max_bytes: int
    ) -> ReadResult | None:
        """The read, answered here, when its reader is within this process's last appends to the session and
        nothing else is known to have changed the session since the first of them: the events after the
        position are those appends' (seqs are the session's, so none of another stream can be in between),
        none of those was evicted (the last append says how far its stream is), and the answer is the
        store's as of the last append's version (a change since, of this process or another, is news after
        that version: the view reads again). As many events as a read from Redis would give (``max_events``,
        ``max_bytes``, at least one). A view keeping up with a stream of this process's pump then costs no
        round trip per read. Complete when the last append ended its stream, the read's only one, and the
        read takes all of it (the view of a one-event answer: its priming event, from the stream's opening,
        and its response). None: ask Redis."""
        recent = self.recent.get(session_id)
        if not recent:
            return None
        last = recent[-1]
        if last.stream not in streams or not after + 1 < last.end or after < last.evicted_through:
            return None  # (evicted past the reader: Redis says how, a gap)
        if last.ended and any(number != last.stream for number in streams):
            return None  # whether the others ended too: Redis
        now = time.monotonic()
        if now - last.made > FRESH:
            del self.recent[session_id]
            return None
        while now - recent[0].made > FRESH:
            del recent[0]
        if recent[0].first > after + 1:
            return None
        epoch = self.epochs.get(session_id)
        if epoch is None:
            return None
        segments: list[Segment] = []
        events = size = 0
        more = False
        for copy in recent:
            if copy.end <= after + 1:
                continue
            blob = self.bodies.get(copy.field)
            if blob is None:
                return None
            skip = max(0, after + 1 - copy.first)
            count = len(copy.lengths)
            whole_fits = size + copy.size <= max_bytes or (not events and count == 1)
            if not skip and events + count <= max_events and whole_fits:
                # the usual case: the whole append (as a read from Redis takes a whole entry)
                blocks, _ = split(blob, 0, copy.lengths)
                segments.append(Segment.of(copy.stream, copy.first, blocks, copy.at, copy.size))
                events += count
                size += copy.size
                continue
            offset = sum(copy.lengths[:skip]) if skip else 0
            taken = 0
            taken_bytes = 0
            for length in copy.lengths[skip:]:
                if events >= max_events or (events > 0 and size + length > max_bytes):
                    more = True
                    break
                taken += 1
                taken_bytes += length
                events += 1
                size += length
            if taken:
                blocks, _ = split(blob, offset, copy.lengths[skip : skip + taken])
                segments.append(Segment.of(copy.stream, copy.first + skip, blocks, copy.at, taken_bytes))
            if more:
                break
        return ReadResult(segments, last.ended and not more, False, last.version, more, epoch)
