"""Flow control between a session's pumps and its attached client views (pure, process-local).

Theory of operation
-------------------
A pump appends upstream events to a session's window; the window evicts its oldest events to make room. A
client view that is reading must not lose what it has yet to send, so an append that would evict such an
event waits (a bounded time) for the view to catch up: readers set the pace, the window bounds memory.

The window is shared (a store may be another process's, or Redis), but which views are attached and how far
each has sent is known only to the process that serves them. So the two meet in one call: the pump builds a
``Guard`` from this process's readers (``Readers.guard``) and hands it to the store's append, which appends
only if nothing guarded would be evicted, atomically (no check-then-act race between pumps), and otherwise
says which readers are in the way (``Appended.blocked``). The pump then waits for a reader to move and tries
again (a shared store also says how far each reader in the way must get first, ``Appended.needs``, so a
retry that cannot pass costs no round trip: ``may_pass``), or, after ``stall_timeout``, drops the readers in
the way: their views end at their next read, which finds the gap, and their clients re-attach from their
cursors.

``keep_undelivered`` (overflow = pause) guards, besides, every event no client of the session was ever sent
(each stream's ``delivered`` mark, which the store keeps: it is shared).

Readers hold no events; a reader is (the streams it follows, the last seq it sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from mcpresume.core.window import Evicted

ReaderPosition = tuple[tuple[int, ...], int]
"""A reader: the streams it follows, and the seq of the last event it sent of them."""


@dataclass(frozen=True, slots=True)
class Guard:
    """What an append must not evict: events of a reader's streams after its position and, with
    ``keep_undelivered``, events of any stream after that stream's delivered mark."""

    readers: tuple[ReaderPosition, ...] = ()
    keep_undelivered: bool = False
    tokens: tuple[int, ...] = ()  # the readers' tokens, in the same order (the store ignores them)


@dataclass(frozen=True, slots=True)
class Appended:
    """The outcome of an append. ``blocked`` is None when the events were appended, else nothing was and it
    holds the indexes (into ``Guard.readers``) of every reader that would have lost an event (empty when
    only ``keep_undelivered`` was in the way). ``needs``, when the store says (a shared store, whose every
    retry is a round trip): per reader in ``blocked``, the seq it must have sent before a retry can pass."""

    evicted: Evicted
    blocked: tuple[int, ...] | None = None
    needs: tuple[int, ...] = ()


NOT_APPENDED: Final = Appended(Evicted())
"""An append to a session or stream that is gone: nothing appended, nothing to wait for."""


def refusal(
    would_evict: Sequence[tuple[int, int]], guard: Guard, delivered: Mapping[int, int]
) -> Appended | None:
    """``blocked_by`` as the store's answer: the readers in the way and, for each, the seq it must have sent
    (the last event of its streams the append would evict: ``Appended.needs``). None: the append may go."""
    blocked = blocked_by(would_evict, guard, delivered)
    if blocked is None:
        return None
    lost = dict(would_evict)
    needs = tuple(max(lost.get(stream, 0) for stream in guard.readers[index][0]) for index in blocked)
    return Appended(Evicted(), blocked, needs)


def blocked_by(
    would_evict: Sequence[tuple[int, int]], guard: Guard, delivered: Mapping[int, int]
) -> tuple[int, ...] | None:
    """Whether an append that would evict, of each stream, its events up to a seq (``would_evict``: (stream,
    last seq evicted) pairs) loses something ``guard`` protects: None if not, else the indexes of the
    readers in the way (``Appended.blocked``). ``delivered``: each stream's delivered mark (a stream missing
    from it was delivered nothing)."""
    if not would_evict:
        return None
    lost = dict(would_evict)
    in_the_way: list[int] = []
    for index, (streams, position) in enumerate(guard.readers):
        for stream in streams:
            if lost.get(stream, 0) > position:
                in_the_way.append(index)
                break
    if in_the_way:
        return tuple(in_the_way)
    if guard.keep_undelivered and any(last > delivered.get(stream, 0) for stream, last in lost.items()):
        return ()
    return None


def may_pass(appended: Appended, taken: Guard, current: Guard | None) -> bool:
    """Whether a retry of an append ``appended`` refused (guarded by ``taken``) can pass now that the readers
    are as in ``current``: every reader in the way has sent what ``Appended.needs`` says, or is gone. True
    when the store said nothing of what it needs (any move may be enough)."""
    if not appended.needs or current is None:
        return True
    positions = dict(zip(current.tokens, (position for _, position in current.readers), strict=True))
    blocked = appended.blocked or ()
    return all(
        positions.get(taken.tokens[index], need) >= need
        for index, need in zip(blocked, appended.needs, strict=True)
    )


class Readers:
    """This process's attached readers of one session: token -> (streams, position). The caller hands out
    the tokens (never reused)."""

    __slots__ = ("positions",)

    def __init__(self) -> None:
        self.positions: dict[int, ReaderPosition] = {}

    def add(self, token: int, streams: Sequence[int], position: int) -> None:
        self.positions[token] = (tuple(streams), position)

    def move(self, token: int, position: int) -> bool:
        """The reader sent everything of its streams up to ``position``; False if it was dropped."""
        reader = self.positions.get(token)
        if reader is None:
            return False
        self.positions[token] = (reader[0], position)
        return True

    def remove(self, token: int) -> None:
        self.positions.pop(token, None)

    def reads(self, stream: int) -> bool:
        """Whether some reader follows ``stream``."""
        return any(stream in streams for streams, _ in self.positions.values())

    def drop(self, tokens: Sequence[int]) -> int:
        """Forget these readers (they lag); returns how many were still there."""
        return sum(self.positions.pop(token, None) is not None for token in tokens)

    def guard(self, *, keep_undelivered: bool = False) -> Guard | None:
        """The guard of an append (None: nothing to protect, the store appends without a check)."""
        if not self.positions and not keep_undelivered:
            return None
        return Guard(tuple(self.positions.values()), keep_undelivered, tuple(self.positions))

    def __len__(self) -> int:
        return len(self.positions)
