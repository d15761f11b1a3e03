"""A bounded in-memory `EventStore` for the official SDK's Streamable HTTP server.

The SDK (2.3.0) defines the `mcp.server.streamable_http.EventStore` interface but ships no implementation,
so this one exists for tests and demos where the *upstream itself* supports resumption (priming events,
``Last-Event-ID`` replay, server-initiated polling via ``ctx.close_sse_stream()``).

Storage is one global, insertion-ordered log capped at ``max_events`` entries; the oldest entries are evicted
first. An evicted (or never issued) ``Last-Event-ID`` replays nothing and returns ``None``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCMessage

__all__ = ["InMemoryEventStore"]


@dataclass(frozen=True, slots=True)
class _Entry:
    event_id: EventId
    stream_id: StreamId
    message: JSONRPCMessage | None  # None: a priming event (no payload, only a cursor)


class InMemoryEventStore(EventStore):
    """Bounded, process-local event log implementing the SDK's `EventStore` interface.

    Event ids look like ``<epoch>-<seq>``: the epoch is random per store instance, so ids minted by a previous
    upstream process (or another store) are never mistaken for this store's ids.
    """

    def __init__(self, max_events: int = 10_000) -> None:
        if max_events <= 0:
            raise ValueError("max_events must be positive")
        self.max_events = max_events
        self._epoch = uuid.uuid4().hex[:8]
        self._entries: dict[int, _Entry] = {}  # seq -> entry, contiguous in [_first_seq, _next_seq)
        self._seq_by_id: dict[EventId, int] = {}
        self._first_seq = 0
        self._next_seq = 0
        self.evicted = 0
        """How many entries were dropped to stay within ``max_events``."""

    # No __len__ on purpose: the SDK tests the store for truthiness (``if self._event_store:``), so an empty
    # store that is falsy would silently disable resumability.
    @property
    def size(self) -> int:
        """How many events (priming events included) are currently stored."""
        return len(self._entries)

    def stream_ids(self) -> set[StreamId]:
        """The ids of every stream that still has at least one stored event."""
        return {entry.stream_id for entry in self._entries.values()}

    def messages(self, stream_id: StreamId) -> list[JSONRPCMessage]:
        """The stored (non-priming) messages of one stream, oldest first."""
        return [
            e.message for e in self._entries.values() if e.stream_id == stream_id and e.message is not None
        ]

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        seq = self._next_seq
        self._next_seq += 1
        event_id = f"{self._epoch}-{seq}"
        self._entries[seq] = _Entry(event_id, stream_id, message)
        self._seq_by_id[event_id] = seq
        while len(self._entries) > self.max_events:
            evicted = self._entries.pop(self._first_seq)
            del self._seq_by_id[evicted.event_id]
            self._first_seq += 1
            self.evicted += 1
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        seq = self._seq_by_id.get(last_event_id)
        if seq is None:
            return None
        stream_id = self._entries[seq].stream_id
        # Walk by sequence number rather than over a snapshot: `send_callback` suspends (it writes to the SSE
        # response), so events stored for this stream while the replay is running are sent too. That narrows
        # the SDK's own replay -> live-tail hand-off window to the moment after this method returns.
        cursor = seq + 1
        while cursor < self._next_seq:
            cursor = max(cursor, self._first_seq)  # entries evicted mid-replay are gone for good
            entry = self._entries.get(cursor)
            cursor += 1
            if entry is not None and entry.stream_id == stream_id and entry.message is not None:
                await send_callback(EventMessage(entry.message, entry.event_id))
        return stream_id
