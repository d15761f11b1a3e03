"""The window: a session's bounded ring of recent events (pure).

Theory of operation
-------------------
Every event the proxy relays on a session gets the next number of the session's one sequence and is
appended to the session's window. The window keeps events in sequence order and evicts the oldest first,
whichever limit is crossed:

* ``max_events``: count. The design note's ring of 256 events per session.
* ``max_bytes``: payload bytes (the serialized SSE frame bodies). Bounds memory regardless of event size.
* ``ttl``: age. An event older than ``ttl`` seconds is dropped on the next append or ``expire(now)``.

The newest event is never evicted by the count and bytes limits, so a single event larger than
``max_bytes`` is still delivered (``max_event_bytes`` bounds it); the bound on a session's memory is
therefore ``max(max_bytes, one event) + len(window) * fixed overhead``, and never grows with the number of
events ever emitted.

Because eviction is oldest-first across the whole session, the evicted events of any one stream are always
a prefix of that stream. So one number per stream, ``evicted_through`` (the highest evicted seq of that
stream), says whether a position is still servable: a reader positioned at ``after`` on a stream lost
nothing iff ``evicted_through <= after``.

The window never reads the clock: ``now`` is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final


class EventKind(enum.IntEnum):
    PRIMING = 0  # an id with empty data (SEP-1699): gives the client a cursor before any message
    MESSAGE = 1  # a JSON-RPC request or notification from the server
    RESPONSE = 2  # the JSON-RPC response (or error) that completes a POST stream


class EvictReason(enum.Enum):
    COUNT = "count"
    BYTES = "bytes"
    TTL = "ttl"
    GLOBAL_BYTES = "global_bytes"  # trimmed to keep all sessions under max_total_window_bytes


@dataclass(slots=True, eq=False)
class Event:
    seq: int
    stream: int
    body: bytes  # the complete SSE frame as sent, its id line (the cursor) included
    kind: EventKind
    upstream_id: bytes | None
    at: float  # when it was appended, on the caller's clock


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

    def add(self, reason: EvictReason, size: int, *, delivered: bool = True) -> None:
        tally = self.counts.setdefault(reason, [0, 0])
        tally[0] += 1
        tally[1] += size
        if not delivered:
            self.undelivered[0] += 1
            self.undelivered[1] += size

    def merge(self, other: Evicted) -> None:
        for reason, (count, size) in other.counts.items():
            tally = self.counts.setdefault(reason, [0, 0])
            tally[0] += count
            tally[1] += size
        self.undelivered[0] += other.undelivered[0]
        self.undelivered[1] += other.undelivered[1]

    def __bool__(self) -> bool:
        return bool(self.counts)


_EMPTY: Final[tuple[Event, ...]] = ()


class Window:
    """Retained events of one session, in seq order.

    One list for the whole session (no container per stream: most sessions hold a few events); a stream's
    events are found by walking back from the newest, which is what readers do: they follow the tail, and
    seqs only grow, so the walk stops at the reader's position."""

    __slots__ = ("_count", "_evicted_through", "_order", "bytes", "delivered", "limits")

    def __init__(self, limits: WindowLimits, delivered: dict[int, int] | None = None) -> None:
        self.limits = limits
        # Per stream, the highest seq some client was sent (owned by the session): only for counting
        # evictions of events no client ever received.
        self.delivered = delivered
        # A list, not a deque: an empty deque allocates a 64-slot block (~600 bytes) and most sessions hold
        # a handful of events; evictions leave from the front in one slice deletion per batch.
        self._order: list[Event] = []
        self._count: dict[int, int] = {}  # events retained per stream
        self._evicted_through: dict[int, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def oldest(self) -> Event | None:
        return self._order[0] if self._order else None

    @property
    def newest(self) -> Event | None:
        return self._order[-1] if self._order else None

    def append(self, event: Event, now: float) -> Evicted:
        """Append one event (its seq must exceed every retained seq) and enforce the limits."""
        return self.extend([event], now, len(event.body))

    def extend(self, events: list[Event], now: float, size: int | None = None) -> Evicted:
        """Append a batch of one stream's events (seqs above every retained one, ``size`` their bytes if
        known) and enforce the limits once for the batch."""
        stream = events[0].stream
        self._order.extend(events)
        self._count[stream] = self._count.get(stream, 0) + len(events)
        self.bytes += sum(len(event.body) for event in events) if size is None else size
        return self._enforce(now)

    def expire(self, now: float) -> Evicted:
        return self._enforce(now)

    def _enforce(self, now: float) -> Evicted:
        """Evict oldest-first until every limit holds (hot: inlined, one pass, no call per event)."""
        evicted = Evicted()
        order = self._order
        limits = self.limits
        max_events, max_bytes, deadline = limits.max_events, limits.max_bytes, now - limits.ttl
        if len(order) <= max_events and self.bytes <= max_bytes and (not order or order[0].at > deadline):
            return evicted
        count, evicted_through, delivered = self._count, self._evicted_through, self.delivered
        # Tallies in locals (an Enum's hash is a Python call): [events, bytes] for ttl, count, bytes.
        by_ttl, by_count, by_bytes, lost = [0, 0], [0, 0], [0, 0], [0, 0]
        held = self.bytes
        total = len(order)
        gone = 0  # events evicted: order[:gone], removed in one slice deletion at the end
        while gone < total:
            oldest = order[gone]
            left_after = total - gone
            if oldest.at <= deadline:
                tally = by_ttl
            elif left_after <= 1:
                break  # the newest event stays even when it alone is over max_bytes (see module doc)
            elif left_after > max_events:
                tally = by_count
            elif held > max_bytes:
                tally = by_bytes
            else:
                break
            gone += 1
            stream, size = oldest.stream, len(oldest.body)
            left = count[stream] - 1
            if left:
                count[stream] = left
            else:
                del count[stream]
            evicted_through[stream] = oldest.seq
            held -= size
            tally[0] += 1
            tally[1] += size
            if delivered is not None and oldest.seq > delivered.get(stream, 0):
                lost[0] += 1
                lost[1] += size
        del order[:gone]
        self.bytes = held
        for reason, tally in (
            (EvictReason.TTL, by_ttl),
            (EvictReason.COUNT, by_count),
            (EvictReason.BYTES, by_bytes),
        ):
            if tally[0]:
                evicted.counts[reason] = tally
        evicted.undelivered = lost
        return evicted

    def shed(self, max_bytes: int) -> Evicted:
        """Evict oldest-first until at most ``max_bytes`` are held (the global cap trims windows this way)."""
        evicted = Evicted()
        order, delivered, count = self._order, self.delivered, self._count
        gone = 0
        while gone < len(order) and self.bytes > max_bytes:
            event = order[gone]
            gone += 1
            left = count[event.stream] - 1
            if left:
                count[event.stream] = left
            else:
                del count[event.stream]
            self._evicted_through[event.stream] = event.seq
            self.bytes -= len(event.body)
            sent = delivered is None or event.seq <= delivered.get(event.stream, 0)
            evicted.add(EvictReason.GLOBAL_BYTES, len(event.body), delivered=sent)
        del order[:gone]
        return evicted

    def evicted_through(self, stream: int) -> int:
        """The highest evicted seq of ``stream`` (0 if none was evicted)."""
        return self._evicted_through.get(stream, 0)

    def forget_stream(self, stream: int) -> None:
        """Drop a finished stream's bookkeeping once it holds no events (keeps the window bounded)."""
        if stream not in self._count:
            self._evicted_through.pop(stream, None)

    def has_events(self, stream: int) -> bool:
        return stream in self._count

    def after(self, stream: int, seq: int) -> list[Event]:
        """The retained events of ``stream`` with a seq above ``seq``, in order."""
        return self.after_any((stream,), seq)

    def after_any(self, streams: tuple[int, ...] | frozenset[int], seq: int) -> list[Event]:
        """The retained events of any of ``streams`` with a seq above ``seq``, in seq order."""
        found: list[Event] = []
        for event in reversed(self._order):
            if event.seq <= seq:
                break
            if event.stream in streams:
                found.append(event)
        found.reverse()
        return found

    def __iter__(self) -> Iterator[Event]:
        return iter(self._order)
