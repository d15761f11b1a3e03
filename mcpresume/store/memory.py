"""The in-memory session store: the embedded default, one process, no dependencies.

Every method runs without an ``await`` between reading and changing state, so within one event loop each
call is atomic. Nothing waits in the store: it tells the news callback (``set_news``) of every change, and
those who wait park in ``process.local``.

Besides each session's own window, the store keeps the total bytes held by all windows under
``max_total_bytes``: over it, the windows of idle sessions (no client attached), least recently active
first, are trimmed, then those of active sessions. The running total is kept up to date on every change, so
the check costs nothing when under the cap; over it, the sessions to trim come off a heap (``_TrimOrder``),
so an append costs what it trims, never a pass over every session. The heap is built the first time the
total goes over the cap (one pass) and dropped when it falls under half the cap, so it costs no memory
per session while the windows are far from the cap, and a rebuild comes after at least half the cap was
appended.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from mcpresume.core.cursor import new_epoch
from mcpresume.core.errors import TooManySessions
from mcpresume.core.flow import NOT_APPENDED, Appended, Guard
from mcpresume.core.resume import SessionView
from mcpresume.core.session import (
    Claim,
    ClaimOutcome,
    NewEvent,
    Orphan,
    PumpRecord,
    ReadResult,
    SessionAccess,
    SessionState,
    StreamOrigin,
    StreamPhase,
)
from mcpresume.core.sse import SSERun
from mcpresume.core.window import Evicted, WindowLimits
from mcpresume.store import (
    GONE,
    Fenced,
    OpenedStream,
    ReplicaEntry,
    SessionSummary,
    StoreStats,
    StreamSummary,
)

T = TypeVar("T")


class _TrimOrder:
    """The sessions holding window bytes, in the order the global cap trims them: idle before active, then
    least recently active first (``SessionState.idle``, ``last_active``). A heap with lazy deletion: a
    session is pushed again whenever its place may have changed (``push``: the store calls it after every
    call that changes either, and when an empty window gets bytes), and an entry that is not its session's
    latest is skipped when it comes up. A trimmed session leaves the heap until it holds bytes again. The heap
    is rebuilt when stale entries outnumber the sessions, so it stays within about twice their number and
    each push costs O(log n) amortized."""

    def __init__(self, sessions: dict[str, SessionState]) -> None:
        """The sessions of ``sessions`` that hold window bytes."""
        self._heap: list[tuple[bool, float, int, str]] = []
        self._latest: dict[str, int] = {}  # session id -> the tie-breaker of its current entry
        self._ticket = itertools.count()
        for session in sessions.values():
            if session.window.bytes:
                ticket = next(self._ticket)
                self._latest[session.session_id] = ticket
                self._heap.append((not session.idle(), session.last_active, ticket, session.session_id))
        heapq.heapify(self._heap)

    def push(self, session: SessionState) -> None:
        ticket = next(self._ticket)
        self._latest[session.session_id] = ticket
        heapq.heappush(self._heap, (not session.idle(), session.last_active, ticket, session.session_id))

    def forget(self, session_id: str) -> None:
        self._latest.pop(session_id, None)

    def holds(self, session_id: str) -> bool:
        return session_id in self._latest

    def pop(self, sessions: dict[str, SessionState]) -> SessionState | None:
        """The next session to trim (out of the heap now), or None if none holds bytes."""
        heap, latest = self._heap, self._latest
        while heap:
            _, _, ticket, session_id = heapq.heappop(heap)
            if latest.get(session_id) == ticket:
                del latest[session_id]
                session = sessions.get(session_id)
                if session is not None:
                    return session
        return None

    def compact(self, sessions: dict[str, SessionState]) -> None:
        if len(self._heap) > 2 * len(self._latest) + 64:
            self._heap = []
            for session_id in list(self._latest):
                session = sessions.get(session_id)
                if session is None:
                    del self._latest[session_id]
                else:
                    self.push(session)


class MemoryStore:
    def __init__(
        self,
        limits: WindowLimits,
        *,
        session_ttl: float,
        max_sessions: int,
        retry_ms: int | None,
        max_total_bytes: int | None = None,
    ) -> None:
        self.limits = limits
        self.session_ttl = session_ttl
        self.max_sessions = max_sessions
        self.retry_ms = retry_ms
        self.max_total_bytes = max_total_bytes
        self._sessions: dict[str, SessionState] = {}
        self._total_bytes = 0
        self._trim_order: _TrimOrder | None = None  # while the total is near the cap (see the module doc)
        self._news: Callable[[str, int], None] = _no_news
        self._replicas: dict[str, ReplicaEntry] = {}
        self._owners: dict[str, str] = {}  # session id -> owner, when not this store's only replica ("")
        self._fences: dict[str, int] = {}  # session id -> its fence, once it changed owner (else 0)
        self._recipes: dict[str, tuple[str, bytes]] = {}  # session id -> (its epoch, its recipe)
        self._upstream_ids: dict[str, tuple[str, str]] = {}  # session id -> (its epoch, the upstream's id)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for session_id in list(self._sessions):
            self._drop(session_id)

    async def ready(self) -> bool:
        return True

    def set_news(self, news: Callable[[str, int], None]) -> None:
        previous = self._news
        if previous is _no_news:
            self._news = news  # the usual case: one listener, called directly
            return

        def both(session_id: str, version: int) -> None:  # several proxies over one store (tests)
            previous(session_id, version)
            news(session_id, version)

        self._news = both

    # -- wake-ups ----------------------------------------------------------------------------------------

    def _notify(self, session: SessionState) -> None:
        self._news(session.session_id, session.version)

    # -- byte accounting ---------------------------------------------------------------------------------

    def _mutate(self, session: SessionState, change: Callable[[SessionState], T]) -> T:
        """Apply ``change`` to ``session``, keeping the all-sessions byte total exact (and the session in
        the trim order once its window holds bytes)."""
        before = session.window.bytes
        result = change(session)
        after = session.window.bytes
        self._total_bytes += after - before
        order = self._trim_order
        if after and order is not None and not order.holds(session.session_id):
            order.push(session)
        return result

    def _moved(self, session: SessionState) -> None:
        """The session's place in the trim order may have changed (idle or not, last activity)."""
        order = self._trim_order
        if order is not None and session.window.bytes:
            order.push(session)
            order.compact(self._sessions)

    def _enforce_total(self) -> Evicted:
        evicted = Evicted()
        cap = self.max_total_bytes
        if cap is None or self._total_bytes <= cap:
            if self._trim_order is not None and (cap is None or self._total_bytes < cap // 2):
                self._trim_order = None  # far from the cap again: no memory per session for it
            return evicted
        # Idle sessions first, least recently active first; then the active ones, in the same order.
        order = self._trim_order
        if order is None:
            order = self._trim_order = _TrimOrder(self._sessions)
        while self._total_bytes > cap:
            session = order.pop(self._sessions)
            if session is None:
                break
            excess = self._total_bytes - cap
            evicted.merge(self._trim(session, max(0, session.window.bytes - excess)))
            self._notify(session)
            if session.window.bytes:  # trimmed enough before it was empty: it keeps its place
                order.push(session)
        return evicted

    def _trim(self, session: SessionState, max_bytes: int) -> Evicted:
        return self._mutate(session, lambda s: s.shed(max_bytes))

    # -- sessions ----------------------------------------------------------------------------------------

    def _drop(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if self._trim_order is not None:
            self._trim_order.forget(session_id)
        self._owners.pop(session_id, None)
        self._fences.pop(session_id, None)
        self._recipes.pop(session_id, None)
        self._upstream_ids.pop(session_id, None)
        if session is not None:
            self._total_bytes -= session.window.bytes
        self._news(session_id, GONE)
        return session is not None

    async def create_session(
        self, session_id: str, now: float, credential: bytes | None = None, owner: str = ""
    ) -> str:
        if session_id not in self._sessions and len(self._sessions) >= self.max_sessions:
            await self.reap(now)
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(
                    f"the proxy holds its maximum of {self.max_sessions} sessions",
                    max_sessions=self.max_sessions,
                )
        # A re-used id is a new incarnation: a new epoch (old cursors become foreign) and new stream numbers.
        previous = self._sessions.get(session_id)
        first_stream, first_version = (
            (1, 0) if previous is None else (previous.next_stream, previous.version + 1)
        )
        self._drop(session_id)
        epoch = new_epoch()
        self._sessions[session_id] = SessionState(
            session_id, epoch, self.limits, self.retry_ms, now, first_stream, first_version, credential
        )
        if owner:
            self._owners[session_id] = owner
        return epoch

    async def owner(self, session_id: str) -> str | None:
        return self._owner(session_id)

    async def owner_and_access(self, session_id: str) -> tuple[str | None, SessionAccess | None]:
        return self._owner(session_id), self._access(session_id)

    def _owner(self, session_id: str) -> str | None:
        return self._owners.get(session_id, "") if session_id in self._sessions else None

    # -- replicas (one process: the registry is a dict) --------------------------------------------------

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        self._replicas[replica_id] = ReplicaEntry(url, instance, now + ttl)

    async def replica_url(self, replica_id: str, now: float) -> str | None:
        entry = self._replicas.get(replica_id)
        return entry.url if entry is not None and entry.lease_until > now else None

    async def replica_entry(self, replica_id: str) -> ReplicaEntry | None:
        return self._replicas.get(replica_id)

    async def prune_replicas(self, before: float) -> list[str]:
        gone = [rid for rid, entry in self._replicas.items() if entry.lease_until < before]
        for rid in gone:
            del self._replicas[rid]
        return gone

    async def release_replica(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def live_replicas(self, now: float) -> int:
        return sum(1 for entry in self._replicas.values() if entry.lease_until > now)

    # Twin: mcpresume/store/lua/common.lua fence_ok
    def _fenced(self, session_id: str, fence: int | None) -> None:
        """Raise ``Fenced`` when ``fence`` (None: an unfenced writer) is not the session's."""
        current = self._fences.get(session_id, 0)
        if fence is not None and fence != current:
            raise Fenced(session_id, fence, current)

    async def access(self, session_id: str) -> SessionAccess | None:
        return self._access(session_id)

    def _access(self, session_id: str) -> SessionAccess | None:
        session = self._sessions.get(session_id)
        if session is None:
            return None
        mapped = self._upstream_ids.get(session_id)
        if mapped is not None and mapped[0] == session.epoch:
            return replace(session.access(), upstream_id=mapped[1])
        return session.access()

    async def accept_credential(
        self, session_id: str, epoch: str, digest: bytes, protocol_version: str | None
    ) -> None:
        session = self._incarnation(session_id, epoch)
        if session is not None:
            session.accept_credential(digest, protocol_version)

    async def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    async def recipe(self, session_id: str, epoch: str) -> bytes | None:
        kept = self._recipes.get(session_id)
        return kept[1] if kept is not None and kept[0] == epoch else None

    async def map_upstream(self, session_id: str, epoch: str, expected: str | None, upstream_id: str) -> bool:
        # Twin: lua/upstream.lua
        if self._incarnation(session_id, epoch) is None:
            return False
        mapped = self._upstream_ids.get(session_id)
        current = mapped[1] if mapped is not None and mapped[0] == epoch else None
        if current != expected:
            return False
        self._upstream_ids[session_id] = (epoch, upstream_id)
        return True

    async def keep_recipe(self, session_id: str, epoch: str, expected: bytes | None, recipe: bytes) -> bool:
        # Twin: lua/recipe.lua
        if self._incarnation(session_id, epoch) is None or await self.recipe(session_id, epoch) != expected:
            return False
        self._recipes[session_id] = (epoch, recipe)
        return True

    def session(self, session_id: str) -> SessionState | None:
        """The live state of a session, to inspect (never to change: every change goes through the port's
        methods)."""
        return self._sessions.get(session_id)

    def _incarnation(self, session_id: str, epoch: str | None) -> SessionState | None:
        """The session, if it is the incarnation ``epoch`` (any, when None)."""
        session = self._sessions.get(session_id)
        if session is None or (epoch is not None and session.epoch != epoch):
            return None
        return session

    def _open(self, session_id: str, epoch: str | None) -> SessionState | None:
        """``_incarnation``, unless retired: what new requests may use."""
        session = self._incarnation(session_id, epoch)
        return None if session is None or session.retired else session

    async def delete_session(self, session_id: str, epoch: str | None = None) -> bool:
        if self._incarnation(session_id, epoch) is None:
            return False
        return self._drop(session_id)

    async def claim(
        self,
        session_id: str,
        request_keys: Sequence[str],
        max_live_streams: int | None = None,
        epoch: str | None = None,
        *,
        digests: Sequence[bytes] = (),
        now: float | None = None,
    ) -> Claim | None:
        session = self._open(session_id, epoch)
        if session is None:
            return None
        claim = session.claim(request_keys, max_live_streams, digests)
        if now is not None and claim.outcome is ClaimOutcome.NEW and session.last_active < now:
            session.last_active = now  # as touch does
            self._moved(session)
        return claim

    async def release(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        session = self._incarnation(session_id, epoch)
        if session is not None:
            session.release(request_keys)

    async def settle(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        session = self._incarnation(session_id, epoch)
        if session is not None:
            session.settle(request_keys)

    async def abandon(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        session = self._incarnation(session_id, epoch)
        if session is not None:
            session.abandon(request_keys)

    # -- streams and events ------------------------------------------------------------------------------

    async def open_stream(
        self,
        session_id: str,
        origin: StreamOrigin,
        request_keys: Sequence[str],
        now: float,
        epoch: str | None = None,
        *,
        priming: bool = True,
        pump: PumpRecord | None = None,
    ) -> OpenedStream | None:
        session = self._incarnation(session_id, epoch)
        if session is None:
            return None
        first = self._mutate(
            session, lambda s: s.open_stream(origin, request_keys, now, priming=priming, pump=pump)
        )
        self._moved(session)
        self._enforce_total()
        self._notify(session)
        return OpenedStream(first.stream, session.epoch, first.seq, self._fences.get(session_id, 0))

    async def standalone_stream(self, session_id: str) -> int | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.standalone

    async def append(
        self,
        session_id: str,
        stream: int,
        events: Sequence[NewEvent],
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        size = sum(len(event.body) for event in events)
        self._fenced(session_id, fence)
        return self._append(
            session_id,
            stream,
            len(events),
            size,
            guard,
            upstream_cursor,
            lambda s: s.append(stream, events, now),
        )

    async def append_and_end(
        self,
        session_id: str,
        stream: int,
        events: Sequence[NewEvent],
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        appended = await self.append(session_id, stream, events, now, guard, upstream_cursor, fence)
        if appended.blocked is None:
            await self.end_stream(session_id, stream, now, fence)
        return appended

    async def append_run(
        self,
        session_id: str,
        stream: int,
        run: SSERun,
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        self._fenced(session_id, fence)
        return self._append(
            session_id,
            stream,
            len(run),
            run.size,
            guard,
            upstream_cursor,
            lambda s: s.append_run(stream, run, now),
        )

    def _append(
        self,
        session_id: str,
        stream: int,
        count: int,
        size: int,
        guard: Guard | None,
        upstream_cursor: str | None,
        append: Callable[[SessionState], Evicted],
    ) -> Appended:
        """An append of ``count`` events of ``size`` bytes, unless ``guard`` blocks it: the upstream's cursor
        kept, then the byte total, the global cap, and the session's views woken."""
        session = self._sessions.get(session_id)
        if session is None:
            return NOT_APPENDED
        if guard is not None:
            refused = session.refusal(count, size, guard)
            if refused is not None:
                return refused
        if upstream_cursor is not None:
            session.pumped_at(stream, upstream_cursor)
        evicted = self._mutate(session, append)
        evicted.merge(self._enforce_total())
        self._notify(session)
        return Appended(evicted)

    async def end_stream(self, session_id: str, stream: int, now: float, fence: int | None = None) -> None:
        self._fenced(session_id, fence)
        session = self._sessions.get(session_id)
        if session is not None:
            session.end_stream(stream, now)
            self._moved(session)
            self._notify(session)

    async def cancel_requests(self, session_id: str, stream: int, request_keys: Sequence[str]) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.cancel_requests(stream, request_keys)

    async def group_streams(self, session_id: str, streams: Sequence[int]) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.group_streams(streams)

    async def view(self, session_id: str, stream: int) -> SessionView | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.view(stream, self.session_ttl)

    async def read(self, session_id: str, streams: Sequence[int], after: int) -> ReadResult | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.read(streams, after)

    async def mark_delivered(self, session_id: str, streams: Sequence[int], seq: int) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.mark_delivered(streams, seq)

    async def touch(self, session_ids: Sequence[str], now: float) -> None:
        sessions = self._sessions
        for session_id in session_ids:
            session = sessions.get(session_id)
            if session is not None and session.last_active < now:
                session.last_active = now
                self._moved(session)

    async def orphans(self, owner: str) -> list[Orphan]:
        owners = self._owners
        found: list[Orphan] = []
        for session_id, session in self._sessions.items():
            if owners.get(session_id, "") == owner and (orphans := session.orphans()):
                found.extend(self._adopted(session_id, orphans))
        return found

    async def take_over(self, owner: str, by: str) -> list[Orphan]:
        owners = self._owners
        taken = [sid for sid, holder in owners.items() if holder == owner]
        found: list[Orphan] = []
        for session_id in taken:
            owners[session_id] = by
            found.extend(self._adopted(session_id, self._sessions[session_id].orphans()))
        return found

    def _adopted(self, session_id: str, orphans: list[Orphan]) -> list[Orphan]:
        """The session changes hands: a new fence, which ``orphans``' pumps write under."""
        fence = self._fences[session_id] = self._fences.get(session_id, 0) + 1
        return [replace(orphan, fence=fence) for orphan in orphans]

    async def lost_owners(self, now: float) -> list[str]:
        live = {rid for rid, entry in self._replicas.items() if entry.lease_until > now}
        return sorted(set(self._owners.values()) - live)

    async def retire(self, session_id: str, epoch: str, fence: int | None = None) -> None:
        session = self._incarnation(session_id, epoch)
        if session is not None and (fence is None or fence == self._fences.get(session_id, 0)):
            session.retired = True

    # -- housekeeping ------------------------------------------------------------------------------------

    async def reap(self, now: float) -> tuple[list[str], Evicted]:
        evicted = Evicted()
        dropped: list[str] = []
        for session_id, session in list(self._sessions.items()):
            if session.idle() and session.last_active + self.session_ttl <= now:
                self._drop(session_id)
                dropped.append(session_id)
                continue
            expired = self._mutate(session, lambda s: s.expire(now))
            if expired:
                evicted.merge(expired)
                self._notify(session)
        return dropped, evicted

    async def session_count(self) -> int:
        return len(self._sessions)

    async def stats(self) -> StoreStats:
        sessions = self._sessions.values()
        return StoreStats(
            sessions=len(self._sessions),
            window_events=sum(len(s.window) for s in sessions),
            window_bytes=self._total_bytes,
        )

    # -- the session inspector (``Inspection``): a look that changes nothing ---------------------------------

    async def session_ids(self, offset: int, limit: int) -> list[str]:
        return list(itertools.islice(self._sessions, max(0, offset), max(0, offset) + max(0, limit)))

    async def summary(self, session_id: str) -> SessionSummary | None:
        session = self._sessions.get(session_id)
        if session is None:
            return None
        window = session.window
        oldest, newest = window.oldest, window.newest
        streams = [
            StreamSummary(
                number,
                StreamPhase.LIVE if state.live else StreamPhase.ENDED,
                state.last_seq,
                state.origin,
                state.first_seq,
                state.delivered,
            )
            for number, state in session.streams.items()
        ]
        streams += [StreamSummary(number, StreamPhase.GONE, last_seq) for number, last_seq in session.gone]
        in_flight, answered, streamed = session.claim_counts()
        return SessionSummary(
            epoch=session.epoch,
            owner=self._owners.get(session_id, ""),
            fence=self._fences.get(session_id, 0),
            last_active=session.last_active,
            retired=session.retired,
            window_events=len(window),
            window_bytes=window.bytes,
            oldest=(oldest.stream, oldest.seq) if oldest else None,
            newest=(newest.stream, newest.seq) if newest else None,
            streams=tuple(sorted(streams, key=lambda s: s.number)),
            in_flight=in_flight,
            answered=answered,
            streamed=streamed,
        )


def _no_news(session_id: str, version: int) -> None:
    """Until the shell calls ``set_news``: nobody waits."""
