"""Where sessions live: the ``SessionStore`` protocol, and its implementations.

The interface is async and returns data (no callbacks), so a shared store (Redis, for several replicas)
fits behind it without changing its callers: ``memory.MemoryStore`` is the embedded default. Every
implementation must pass ``tests/test_store_contract.py``.

Waiting for news is part of the contract: ``read`` returns the session's ``version``; ``wait(version)``
returns as soon as the session has changed since that version (or at once if it already has). A reader
that loops read -> send -> wait therefore never misses an append that happened while it was sending.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mcpresume.resume import SessionView
from mcpresume.session import Claim, NewEvent, ReadResult, SessionAccess, StreamOrigin
from mcpresume.sse import SSERun
from mcpresume.window import Evicted


@dataclass(frozen=True, slots=True)
class OpenedStream:
    number: int
    epoch: str
    priming_seq: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    sessions: int
    window_events: int
    window_bytes: int
    attached: int


class SessionStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool: ...

    async def create_session(self, session_id: str, now: float, credential: bytes | None = None) -> str:
        """Start tracking a session (a fresh epoch even if the id was seen before); returns the epoch.
        ``credential``: the digest of the credentials of the request that began it (None: it began without
        any, and no credentials are checked in it). Raises
        ``TooManySessions`` at ``max_sessions``."""
        ...

    async def access(self, session_id: str) -> SessionAccess | None:
        """The session's epoch and the credentials bound to it (None: session unknown)."""
        ...

    async def accept_credential(
        self, session_id: str, epoch: str, digest: bytes, protocol_version: str | None
    ) -> None:
        """The upstream accepted these credentials in incarnation ``epoch`` (it answered a ping with them, or
        they are accepted there already): remember them (the last few) and ``protocol_version``, the
        MCP-Protocol-Version a ping in the session carries. Nothing if the epoch is not current."""
        ...

    async def has_session(self, session_id: str) -> bool: ...

    # ``epoch`` (where a method takes it): the incarnation the caller's request belongs to. When it is not
    # the session's current one (the upstream re-issued the id meanwhile), the call finds no session: work
    # of an ended incarnation never touches the new one.

    async def delete_session(self, session_id: str, epoch: str | None = None) -> bool: ...

    async def claim(
        self,
        session_id: str,
        request_keys: Sequence[str],
        max_live_streams: int | None = None,
        epoch: str | None = None,
    ) -> Claim | None:
        """Record request ids before forwarding them (None: session unknown); ``LIMITED`` when the session
        already has ``max_live_streams`` live streams."""
        ...

    async def release(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        """Forget a claim whose request never reached the upstream."""
        ...

    async def settle(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        """Mark a claim answered without a stream (application/json): a re-send is refused, not forwarded."""
        ...

    async def open_stream(
        self,
        session_id: str,
        origin: StreamOrigin,
        request_keys: Sequence[str],
        now: float,
        epoch: str | None = None,
        *,
        priming: bool = True,
    ) -> OpenedStream | None:
        """Start a stream with its priming event (``priming=False``: none, for clients of revisions before
        2025-11-25); ``priming_seq`` is that event's seq (or the seq its first event may take)."""
        ...

    async def standalone_stream(self, session_id: str) -> int | None:
        """The live standalone (GET) stream of the session, if one is being pumped."""
        ...

    async def append(self, session_id: str, stream: int, events: Sequence[NewEvent], now: float) -> Evicted:
        """Append to a live stream; returns what the window evicted to make room."""
        ...

    async def append_run(self, session_id: str, stream: int, run: SSERun, now: float) -> Evicted:
        """Append a run of upstream message events to a live stream (the hot path, see sse.SSERun)."""
        ...

    async def end_stream(self, session_id: str, stream: int, now: float) -> None: ...

    async def group_streams(self, session_id: str, streams: Sequence[int]) -> None:
        """Record that one client view follows ``streams`` together (POST + ``Last-Event-ID``): the view
        of any of them then names the others (``StreamView.group``), and a re-attach follows them all."""
        ...

    async def view(self, session_id: str, stream: int) -> SessionView | None:
        """What the resume decision needs, for a cursor naming ``stream`` (None: session unknown)."""
        ...

    async def read(self, session_id: str, streams: Sequence[int], after: int) -> ReadResult | None:
        """The next events after ``after`` on ``streams``, in seq order (None: session gone)."""
        ...

    def wait(self, session_id: str, version: int, timeout: float) -> Awaitable[bool]:
        """Resolve True when the session changed since ``version`` or was dropped, False after ``timeout``
        (the memory store's may be up to a quarter second late). An awaitable, so a store can hand out a
        bare future: a parked view then holds no coroutine frame in the store."""
        ...

    async def attach(self, session_id: str, now: float, limit: int | None = None) -> bool:
        """Count a client view of the session; False (nothing counted) when ``limit`` views are open."""
        ...

    async def detach(self, session_id: str, now: float) -> None: ...

    async def add_reader(self, session_id: str, streams: Sequence[int], position: int) -> int:
        """Register an attached reader's position (flow control); returns its token."""
        ...

    async def move_reader(self, session_id: str, token: int, position: int) -> None: ...

    async def remove_reader(self, session_id: str, token: int) -> None: ...

    async def wait_for_room(
        self,
        session_id: str,
        count: int,
        size: int,
        timeout: float,
        *,
        keep_undelivered: bool = False,
        stream: int | None = None,
    ) -> bool:
        """Wait until appending would evict nothing a reader has yet to send (and, with
        ``keep_undelivered``, nothing never delivered); False if ``timeout`` passed first."""
        ...

    async def drop_lagging_readers(self, session_id: str, count: int, size: int) -> int:
        """Forget the readers that keep an append of that size from fitting; returns how many."""
        ...

    async def reap(self, now: float) -> tuple[list[str], Evicted]:
        """Drop expired sessions and expired events; returns the dropped session ids and the evictions."""
        ...

    async def session_count(self) -> int:
        """How many sessions are tracked (cheap: checked on every initialize)."""
        ...

    async def stats(self) -> StoreStats: ...
