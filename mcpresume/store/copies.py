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

from mcpresume.session import ReadResult
from mcpresume.window import Segment

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
    their bytes, and the session's version after it."""

    first: int
    stream: int
    lengths: array[int]
    field: bytes
    at: float
    size: int
    version: int
    made: float = dataclasses.field(default_factory=time.monotonic)  # for ``FRESH`` s only


# ``Copies.read`` answers only this long after the append: every eviction is a script (which forgets it) but
# one, Redis expiring the events key, which an append puts off by the window's age limit plus 60 s.
FRESH: Final = 1.0


class Copies:
    """The bodies this process holds, each session's last append by this process while nothing else is
    known to have changed the session since, and the sessions' epochs (the cursors a read writes)."""

    __slots__ = ("bodies", "epochs", "last")

    def __init__(self) -> None:
        self.bodies = Bodies()
        self.last: dict[str, LastAppend] = {}
        self.epochs: dict[str, bytes] = {}

    def changed(self, session_id: str) -> None:
        """The session changed otherwise than by the last append (or may have): reads go to Redis."""
        self.last.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self.last.pop(session_id, None)
        self.epochs.pop(session_id, None)

    def read(
        self, session_id: str, streams: Sequence[int], after: int, max_events: int, max_bytes: int
    ) -> ReadResult | None:
        """The read, answered here, when its reader is at the event before this process's last append to
        the session and nothing else is known to have changed the session since: the events after the
        position are that append's (seqs are the session's, so none can be in between), none of them was
        evicted by it, and the answer is the store's as of that append's version (a change since, of this
        process or another, is news after that version: the view reads again). A view keeping up with a
        stream of this process's pump then costs no round trip per event. None: ask Redis."""
        last = self.last.get(session_id)
        if last is None or last.first != after + 1 or last.stream not in streams:
            return None
        if time.monotonic() - last.made > FRESH:
            del self.last[session_id]
            return None
        count = len(last.lengths)
        if count > max_events or (last.size > max_bytes and count > 1):
            return None
        epoch, blob = self.epochs.get(session_id), self.bodies.get(last.field)
        if epoch is None or blob is None:
            return None
        blocks, size = split(blob, 0, last.lengths)
        segment = Segment.of(last.stream, last.first, blocks, last.at, size)
        return ReadResult([segment], False, False, last.version, False, epoch)
