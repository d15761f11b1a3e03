"""The window: a session's bounded ring of recent events (pure).

Theory of operation
-------------------
Every event the proxy relays on a session gets the next number of the session's one sequence and is
appended to the session's window. The window keeps events in sequence order and evicts the oldest first,
whichever limit is crossed:

* ``max_events``: count. 256 by default: the ring of docs/how-it-works.md's abandoned sessions.
* ``max_bytes``: payload bytes (the events' bytes as kept). Bounds memory regardless of event size.
* ``ttl``: age. An event older than ``ttl`` seconds is dropped on the next append or ``expire(now)``.

The newest event is never evicted by the count and bytes limits, so a single event larger than
``max_bytes`` is still delivered (``max_event_bytes`` bounds it); the bound on a session's memory is
therefore ``max(max_bytes, one event) + len(window) * small fixed overhead``, and never grows with the
number of events ever emitted.

Because eviction is oldest-first across the whole session, the evicted events of any one stream are always
a prefix of that stream. So one number per stream, ``evicted_through`` (the highest evicted seq of that
stream), says whether a position is still servable: a reader positioned at ``after`` on a stream lost
nothing iff ``evicted_through <= after``.

Storage: the window holds Segments, runs of consecutive events of one stream, not an object per event. An
upstream read of many small events is appended as one segment, and an event of the stream that appended
last joins its newest segment; eviction and reads cut segments at any event, and each event keeps its own
time, so every limit is exact per event. A retained event costs its bytes plus a list slot and a double.

The window does not look inside events: a session gives it each event as the upstream sent it, without
an id line (a chunk of one event without an id line is kept as is), and writes the cursor in front when the
event is sent. So no per-event copy is made to store it, and the window holds the upstream's own buffers:
for a paced stream, a copy per event interleaved with the transient chunk buffers of the same size left
glibc's heap a fifth free space (measured in bench/: 1.35x -> 1.15x RSS per payload byte).

The window never reads the clock: ``now`` is passed in.
"""

from __future__ import annotations

import enum
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol


class EventKind(enum.IntEnum):
    PRIMING = 0  # an id with empty data (SEP-1699): gives the client a cursor before any message
    MESSAGE = 1  # a JSON-RPC request or notification from the server
    RESPONSE = 2  # the JSON-RPC response (or error) that completes a POST stream


class EvictReason(enum.Enum):
    COUNT = "count"
    BYTES = "bytes"
    TTL = "ttl"
    GLOBAL_BYTES = "global_bytes"  # trimmed to keep all sessions under max_total_window_bytes


@dataclass(slots=True)
class Event:
    """One retained event, as callers outside the hot path see it (the window keeps Segments)."""

    seq: int
    stream: int
    body: bytes  # the event's bytes as appended (a session's: the SSE event without its id line)
    at: float  # when it was appended, on the caller's clock


# A segment grows by appends of its stream until this many events (a cut moves its blocks: bounded work).
MAX_SEGMENT: Final = 1024
# Below this many events a segment grows by exact-size concatenation, above it in place (amortized).
_EXACT_BELOW: Final = 16
# An append of at least this many events is a segment of its own, not joined to the newest one: its
# events are evicted together, as one segment (no sum of the evicted events' sizes, no shift of the
# events left behind), and were not copied into another's lists. Its segment costs little per event.
_OWN_SEGMENT_FROM: Final = 64


@dataclass(slots=True, eq=False)
class Segment:
    """Consecutive events of one stream (consecutive seqs): the unit the window holds.

    An upstream read of hundreds of small events becomes one segment, and events appended one at a time
    to the stream that appended last join its newest segment, so what a retained event costs beyond its
    event is a list slot and its time (16 bytes), not an object of its own. Eviction and reads cut
    segments at any event; each event keeps its own time, so the age limit stays exact."""

    stream: int
    seq: int  # the seq of blocks[0]
    blocks: list[bytes]  # the events' bytes, of seqs seq, seq + 1, ...
    times: array[float]  # per event, when it was appended (non-decreasing)
    size: int  # bytes of blocks

    @classmethod
    def of(cls, stream: int, seq: int, blocks: list[bytes], now: float, size: int | None = None) -> Segment:
        """Events appended together at ``now`` (``size``: their bytes, when the caller knows them)."""
        if size is None:
            size = sum(map(len, blocks))
        return cls(stream, seq, blocks, array("d", (now,)) * len(blocks), size)

    @property
    def last(self) -> int:
        return self.seq + len(self.blocks) - 1

    def head_size(self, count: int) -> int:
        """The bytes of the first ``count`` events."""
        return self.size if count >= len(self.blocks) else sum(map(len, self.blocks[:count]))

    def event(self, index: int) -> Event:
        return Event(self.seq + index, self.stream, self.blocks[index], self.times[index])

    def events(self) -> list[Event]:
        return [self.event(i) for i in range(len(self.blocks))]

    def prefix(self, at_least: int, excess: int) -> tuple[int, int]:
        """The fewest leading events, at least ``at_least``, whose bytes reach ``excess``, and their bytes
        (all of them when even those do not reach it)."""
        blocks = self.blocks
        take = min(at_least, len(blocks))
        size = self.head_size(take)
        while size < excess and take < len(blocks):
            size += len(blocks[take])
            take += 1
        return take, size


class Delivered(Protocol):
    """What the window reads of a stream's record: the highest seq of it some client was sent."""

    @property
    def delivered(self) -> int: ...


@dataclass(frozen=True, slots=True)
class WindowLimits:
    max_events: int
    max_bytes: int
    ttl: float


@dataclass(slots=True)
class Evicted:
    """What one eviction pass removed, per reason: (events, bytes)."""

    counts: dict[EvictReason, list[int]] = field(default_factory=dict)
    # Of those, the events no client ever received: the number an operator must watch.
    undelivered: list[int] = field(default_factory=lambda: [0, 0])
    # The streams that lost events (None: none, or not told: the Redis store's counts): the only ones an
    # eviction can have emptied (``SessionState._forget_gone_streams``). Bookkeeping, not what was evicted:
    # two passes that evicted the same are equal.
    streams: set[int] | None = field(default=None, compare=False, repr=False)

    def merge(self, other: Evicted) -> None:
        for reason, (count, size) in other.counts.items():
            tally = self.counts.setdefault(reason, [0, 0])
            tally[0] += count
            tally[1] += size
        self.undelivered[0] += other.undelivered[0]
        self.undelivered[1] += other.undelivered[1]
        if other.streams:
            self.streams = other.streams if self.streams is None else self.streams | other.streams

    def __bool__(self) -> bool:
        return bool(self.counts)


class Window:
    """Retained events of one session, in seq order, as Segments.

    One list of segments for the whole session (no container per stream: most sessions hold a few
    events); a stream's events are found by walking back from the newest, which is what readers do: they
    follow the tail, and seqs only grow, so the walk stops at the reader's position."""

    __slots__ = ("_events", "_evicted_through", "_order", "bytes", "delivered", "limits")

    def __init__(self, limits: WindowLimits, delivered: Mapping[int, Delivered] | None = None) -> None:
        self.limits = limits
        # Per stream, the highest seq some client was sent (the session's stream records): only for counting
        # evictions of events no client ever received. A stream not in it was sent nothing.
        self.delivered = delivered
        # A list, not a deque: an empty deque allocates a 64-slot block (~600 bytes) and most sessions hold
        # a handful of segments; evictions leave from the front in one slice deletion per pass.
        self._order: list[Segment] = []
        self._events = 0
        # Per stream, the highest evicted seq; None until the first eviction (most sessions never see one).
        self._evicted_through: dict[int, int] | None = None
        self.bytes = 0

    def __len__(self) -> int:
        return self._events

    @property
    def segments(self) -> list[Segment]:
        """The retained segments, oldest first (do not modify)."""
        return self._order

    @property
    def oldest(self) -> Event | None:
        return self._order[0].event(0) if self._order else None

    @property
    def newest(self) -> Event | None:
        return self._order[-1].event(len(self._order[-1].blocks) - 1) if self._order else None

    def append(self, event: Event, now: float) -> Evicted:
        """Append one event (its seq must exceed every retained seq) and enforce the limits."""
        return self.add(Segment.of(event.stream, event.seq, [event.body], event.at), now)

    def add(self, segment: Segment, now: float) -> Evicted:
        """Append a segment (seqs above every retained one) and enforce the limits once for it. Events
        that continue the newest segment's stream join it (up to MAX_SEGMENT events)."""
        order = self._order
        newest = order[-1] if order else None
        if (
            newest is not None
            and newest.stream == segment.stream
            and newest.seq + len(newest.blocks) == segment.seq
            and len(newest.blocks) + len(segment.blocks) <= MAX_SEGMENT
            and len(segment.blocks) < _OWN_SEGMENT_FROM
        ):
            if len(newest.blocks) < _EXACT_BELOW:
                # Concatenation allocates exactly; extend would over-allocate (a 2-block list gets 8 slots),
                # which the many small segments of idle sessions would pay for.
                newest.blocks = newest.blocks + segment.blocks
                newest.times = newest.times + segment.times
            else:
                newest.blocks.extend(segment.blocks)
                newest.times.extend(segment.times)
            newest.size += segment.size
        else:
            order.append(segment)
        self._events += len(segment.blocks)
        self.bytes += segment.size
        return self._enforce(now)

    def expire(self, now: float) -> Evicted:
        return self._enforce(now)

    def _enforce(self, now: float) -> Evicted:
        """Evict oldest-first until every limit holds: whole segments while they are all over, then a cut
        of the oldest one (the newest event always stays, see the module doc)."""
        evicted = Evicted()
        order = self._order
        limits = self.limits
        max_events, max_bytes, deadline = limits.max_events, limits.max_bytes, now - limits.ttl
        if (
            self._events <= max_events
            and self.bytes <= max_bytes
            and (not order or order[0].times[0] > deadline)
        ):
            return evicted
        gone = 0
        while gone < len(order):
            segment = order[gone]
            expired = bisect_right(segment.times, deadline)  # times only grow: the expired lead
            if expired:
                self._cut(segment, expired, segment.head_size(expired), EvictReason.TTL, evicted)
                if not segment.blocks:
                    gone += 1
                    continue
            length = len(segment.blocks)
            # Never the newest event: the last segment keeps its last block.
            most = length if gone < len(order) - 1 else length - 1
            over = self._events - max_events
            if most <= 0 or (over <= 0 and self.bytes <= max_bytes):
                break
            if over > 0:
                take = min(over, most)
                self._cut(segment, take, segment.head_size(take), EvictReason.COUNT, evicted)
                if take == length:
                    gone += 1
                    continue
                most -= take
            if self.bytes > max_bytes and most > 0:
                take, size = segment.prefix(0, self.bytes - max_bytes)
                if take > most:
                    take = most
                    size = segment.head_size(take)
                self._cut(segment, take, size, EvictReason.BYTES, evicted)
                if not segment.blocks:
                    gone += 1
                    continue
            break
        del order[:gone]
        return evicted

    def _cut(self, segment: Segment, take: int, size: int, reason: EvictReason, evicted: Evicted) -> None:
        """Evict the first ``take`` events (``size`` bytes) of ``segment``, the oldest one retained."""
        if take <= 0:
            return
        stream, first = segment.stream, segment.seq
        blocks = segment.blocks
        tally = evicted.counts.setdefault(reason, [0, 0])
        tally[0] += take
        tally[1] += size
        delivered = self.delivered
        if delivered is not None:
            record = delivered.get(stream)
            through = 0 if record is None else record.delivered
            sent = min(take, max(0, through - first + 1))  # of those, delivered
            if sent < take:
                lost = evicted.undelivered
                lost[0] += take - sent
                lost[1] += sum(map(len, blocks[sent:take])) if sent else size
        del blocks[:take]
        del segment.times[:take]
        segment.seq = first + take
        segment.size -= size
        if self._evicted_through is None:
            self._evicted_through = {}
        self._evicted_through[stream] = first + take - 1
        if evicted.streams is None:
            evicted.streams = {stream}
        else:
            evicted.streams.add(stream)
        self._events -= take
        self.bytes -= size

    def would_evict(self, count: int, size: int) -> list[tuple[int, int]]:
        """What appending ``count`` events of ``size`` bytes would evict by the count and bytes limits (age
        aside): (stream, last seq evicted) for each stream that would lose events, oldest first. Empty, and
        no walk, when the append fits (the usual case)."""
        limits = self.limits
        max_events, max_bytes = limits.max_events, limits.max_bytes
        events, held = self._events + count, self.bytes + size
        if events <= max_events and held <= max_bytes:
            return []
        lost: dict[int, int] = {}
        for segment in self._order:  # oldest first: the order eviction takes
            if events <= max_events and held <= max_bytes:
                break
            take, taken = segment.prefix(max(0, events - max_events), held - max_bytes)
            if take:
                lost[segment.stream] = segment.seq + take - 1
            events -= take
            held -= taken
        return list(lost.items())

    def shed(self, max_bytes: int) -> Evicted:
        """Evict oldest-first until at most ``max_bytes`` are held (the global cap trims windows this way)."""
        evicted = Evicted()
        order = self._order
        gone = 0
        while gone < len(order) and self.bytes > max_bytes:
            segment = order[gone]
            take, size = segment.prefix(1, self.bytes - max_bytes)
            self._cut(segment, take, size, EvictReason.GLOBAL_BYTES, evicted)
            if not segment.blocks:
                gone += 1
        del order[:gone]
        return evicted

    def evicted_through(self, stream: int) -> int:
        """The highest evicted seq of ``stream`` (0 if none was evicted)."""
        through = self._evicted_through
        return through.get(stream, 0) if through else 0

    def forget_stream(self, stream: int) -> None:
        """Drop a finished stream's bookkeeping once it holds no events (keeps the window bounded)."""
        if self._evicted_through and not self.has_events(stream):
            self._evicted_through.pop(stream, None)

    def forget_emptied(self, stream: int) -> None:
        """``forget_stream`` for a caller that knows ``stream`` holds no event any more (a session knows it
        from the stream's last seq and ``evicted_through``): no walk over the segments."""
        if self._evicted_through:
            self._evicted_through.pop(stream, None)

    def has_events(self, stream: int) -> bool:
        """Whether any event of ``stream`` is retained (a walk over the segments: not for the hot path; a
        session knows it from the stream's last seq and ``evicted_through``)."""
        return any(segment.stream == stream for segment in self._order)

    def slices_after(self, streams: tuple[int, ...] | frozenset[int], seq: int) -> list[tuple[Segment, int]]:
        """The retained events of any of ``streams`` with a seq above ``seq``, in seq order, as (segment,
        index of its first such block). The segments are the window's own: copy before an await."""
        found: list[tuple[Segment, int]] = []
        for segment in reversed(self._order):
            if segment.seq + len(segment.blocks) <= seq + 1:  # its last seq is at most ``seq``
                break
            if segment.stream in streams:
                found.append((segment, max(0, seq - segment.seq + 1)))
        found.reverse()
        return found

    def after(self, stream: int, seq: int) -> list[Event]:
        """The retained events of ``stream`` with a seq above ``seq``, in order (not for the hot path)."""
        return self.after_any((stream,), seq)

    def after_any(self, streams: tuple[int, ...] | frozenset[int], seq: int) -> list[Event]:
        """The retained events of any of ``streams`` with a seq above ``seq``, in seq order."""
        return [
            segment.event(i)
            for segment, start in self.slices_after(streams, seq)
            for i in range(start, len(segment.blocks))
        ]

    def __iter__(self) -> Iterator[Event]:
        for segment in self._order:
            yield from segment.events()
