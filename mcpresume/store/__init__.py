"""Where sessions live: the ``SessionStore`` port (the state every replica must share), and its
implementations.

The store holds sessions and their epochs, the sequence, streams and their states, the window, request-id
claims, stream groups and what a resume decision needs: plain data in and out, ``None`` for "session
gone", wall-clock ``now`` passed in by the caller. The port comes in the parts its callers need:
``Sessions``, ``Claims``, ``Streams``, ``Registry`` (replicas and owners), ``Inspection`` (the session
inspector's look) and the store's own ``Lifecycle``; ``SessionStore`` is all of them. What only one process
knows (the views it serves, their readers, who waits for news) is in ``mcpresume.process.local``; the two
meet in an append's ``Guard`` (``core/flow.py``). ``memory.MemoryStore`` is the embedded default. Every
implementation must pass ``tests/test_store_contract.py``.

News: ``read`` returns the session's ``version``, and the store calls the callback given to ``set_news``
with the session's new version after every change a reader may wait for (``GONE`` when the session
is dropped). A reader that loops read -> send -> ``News.wait(version)`` therefore never misses an append
that happened while it was sending.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from mcpresume.core.flow import Appended, Guard
from mcpresume.core.resume import SessionView
from mcpresume.core.session import (
    Claim,
    NewEvent,
    Orphan,
    PumpRecord,
    ReadResult,
    SessionAccess,
    StreamOrigin,
    StreamPhase,
)
from mcpresume.core.sse import SSERun
from mcpresume.core.window import Evicted

GONE: Final = -1
"""The version the news callback is told when a session is dropped (``set_news``)."""


@dataclass(frozen=True, slots=True)
class OpenedStream:
    number: int
    epoch: str
    priming_seq: int
    fence: int = 0  # the session's fence when it opened: the stream's pump writes under it


class Fenced(Exception):
    """A write under a fence that is no longer the session's: another process took the session over since
    the writer was given it (ARCHITECTURE.md, "one writer per session"). Nothing was written; the writer
    steps down from the session (its pump stops without ending the stream: the new owner pumps it)."""

    def __init__(self, session_id: str, fence: int, current: int) -> None:
        super().__init__(f"fence {fence} of the session is stale (now {current})")
        self.session_id = session_id
        self.fence = fence
        self.current = current


@dataclass(frozen=True, slots=True)
class ReplicaEntry:
    """A replica's registration, live or not: where it takes requests, which process registered it (a
    random token per process), and until when its lease holds (the store's clock)."""

    url: str
    instance: str
    lease_until: float


@dataclass(frozen=True, slots=True)
class StoreStats:
    sessions: int
    window_events: int
    window_bytes: int


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """One stream of a session, as the session inspector shows it (``Inspection.summary``). A stream gone
    (ended, its events all out of the window) is only its number and last seq."""

    number: int
    phase: StreamPhase
    last_seq: int
    origin: StreamOrigin | None = None  # None: gone
    first_seq: int | None = None
    delivered: int | None = None  # the highest seq some client was sent


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """What the session inspector shows of a session: its shape, never an event's body or a credential."""

    epoch: str
    owner: str  # the replica whose upstream holds it ("": one replica)
    fence: int
    last_active: float  # the wall clock of its last activity
    retired: bool  # its upstream does not know it (a takeover's): new requests find it unknown
    window_events: int
    window_bytes: int
    oldest: tuple[int, int] | None  # (stream, seq) of the oldest event retained
    newest: tuple[int, int] | None
    streams: tuple[StreamSummary, ...]  # by number
    in_flight: int  # request ids claimed and not answered yet
    answered: int  # request ids answered without a stream (a JSON answer)
    streamed: int  # request ids whose answer is a stream


class StoreMetrics(Protocol):
    """What a store reports of its own calls (``process.metrics.Metrics`` is one)."""

    def store_call(self, op: str, seconds: float) -> None:
        """A call to the store took ``seconds``."""
        ...

    def store_error(self, op: str) -> None:
        """A call to the store failed (it did not answer, or refused)."""
        ...


class Lifecycle(Protocol):
    """The store as a whole: started, closed, checked; its news, its housekeeping, its size (the daemon's)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool: ...

    def set_news(self, news: Callable[[str, int], None]) -> None:
        """Call ``news(session_id, version)`` after every change a reader may wait for (each listener set:
        several proxies may share one store in a process)."""
        ...

    async def reap(self, now: float) -> tuple[list[str], Evicted]:
        """Drop expired sessions and expired events; returns the dropped session ids and the evictions."""
        ...

    async def session_count(self) -> int:
        """How many sessions are tracked (cheap: checked on every initialize)."""
        ...

    async def stats(self) -> StoreStats: ...


class Sessions(Protocol):
    """Sessions and their incarnations: begun, found, their credentials, dropped, retired, touched."""

    async def create_session(
        self, session_id: str, now: float, credential: bytes | None = None, owner: str = ""
    ) -> str:
        """Start tracking a session (a fresh epoch even if the id was seen before); returns the epoch.
        ``credential``: the digest of the credentials of the request that began it (None: it began without
        any, and no credentials are checked in it); ``owner``: the replica whose upstream holds it. Raises
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

    async def retire(self, session_id: str, epoch: str, fence: int | None = None) -> None:
        """The session's upstream does not know it (after a takeover, in the sidecar layout): its request ids
        are claimed no more (``claim``: None, so a request is answered 404 ``unknown_session``), while
        re-attaches still read what the window keeps, to the streams' ends. Nothing when ``fence`` (the
        retiring owner's) is no longer the session's: a later owner decides."""
        ...

    async def touch(self, session_ids: Sequence[str], now: float) -> None:
        """Client activity: a view attached or left, or is still open. An idle session expires
        ``session_ttl`` after its last touch."""
        ...


class Claims(Protocol):
    """Request-id claims: exactly once per request in a session (invariant #8)."""

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
        """Record request ids before forwarding them (None: session unknown); ``LIMITED`` when the session
        already has ``max_live_streams`` live streams. ``digests``: each request's
        (``jsonrpc.request_digest``), in the order of ``request_keys``, kept with its claim: an id claimed
        again is a re-send only for the same request (``SessionState.claim`` says what each case gets).
        ``now``: a ``NEW`` claim is also client activity at ``now`` (``touch``, in the same round trip)."""
        ...

    async def release(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        """Forget a claim whose request is known never to have reached the upstream."""
        ...

    async def settle(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        """Mark a claim answered without a stream (application/json): a re-send is refused, not forwarded."""
        ...

    async def abandon(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        """Mark a claim whose request was sent upstream and got no answer: it may have run, so a re-send is
        refused (``outcome_unknown``), never forwarded."""
        ...


class Streams(Protocol):
    """A session's streams and their window: opened, appended to, ended, grouped, read from a position,
    delivered."""

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
        """Start a stream with its priming event (``priming=False``: none, for clients of revisions before
        2025-11-25); ``priming_seq`` is that event's seq (or the seq its first event may take). ``pump``:
        how to read its upstream again after a restart (``orphans``)."""
        ...

    async def standalone_stream(self, session_id: str) -> int | None:
        """The live standalone (GET) stream of the session, if one is being pumped."""
        ...

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
        """Append to a live stream, unless that would evict what ``guard`` protects (then nothing is
        appended: ``Appended.blocked``); returns what the window evicted to make room. ``upstream_cursor``:
        the upstream's last event id among them (kept for ``orphans``); RESPONSE events' keys are kept as
        answered. ``fence``: the writer's (``OpenedStream.fence``, ``Orphan.fence``): a stale one raises
        ``Fenced`` and nothing is written (None: unfenced)."""
        ...

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
        """``append`` of a stream's last events (one or more), and ``end_stream`` in the same call (one store
        round trip) when the append passes; refused by ``guard``, neither (``Appended.blocked``)."""
        ...

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
        """``append`` for a run of upstream message events (the hot path, see sse.SSERun)."""
        ...

    async def end_stream(self, session_id: str, stream: int, now: float, fence: int | None = None) -> None:
        """No more appends to the stream; the session is touched as of ``now`` (never backwards).
        ``fence`` as ``append``: a stale one raises ``Fenced``."""
        ...

    async def cancel_requests(self, session_id: str, stream: int, request_keys: Sequence[str]) -> None:
        """The client cancelled these requests of ``stream``, and the proxy closes the stream unanswered: a
        re-send of their ids is refused (``ClaimOutcome.CANCELLED``). Ids claimed by another stream (of a
        new incarnation, say) are left as they are."""
        ...

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

    async def mark_delivered(self, session_id: str, streams: Sequence[int], seq: int) -> None:
        """A client was sent everything of ``streams`` up to ``seq`` (``StreamView.delivered``). May return
        before the store has it, provided every later call of this process sees it."""
        ...


class Registry(Protocol):
    """The replica registry and who owns which session (one replica: trivial)."""

    async def owner(self, session_id: str) -> str | None:
        """The replica id of the session's owner (None: session unknown)."""
        ...

    async def owner_and_access(self, session_id: str) -> tuple[str | None, SessionAccess | None]:
        """``owner`` and ``Sessions.access`` of the session, read at one instant: what routing reads of a
        request's session and its handler then needs, in one call (one round trip on Redis)."""
        ...

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        """Register (or renew) ``replica_id`` at ``url`` until ``now + ttl``, by the process ``instance``."""
        ...

    async def replica_entry(self, replica_id: str) -> ReplicaEntry | None:
        """The replica's registration whether its lease holds or not (None: never registered, released
        on a drain, or pruned)."""
        ...

    async def prune_replicas(self, before: float) -> list[str]:
        """Forget the registrations whose lease ended before ``before`` (replicas long dead); their ids."""
        ...

    async def replica_url(self, replica_id: str, now: float) -> str | None:
        """Where the replica takes requests, while its lease holds (None: it expired or was released)."""
        ...

    async def release_replica(self, replica_id: str) -> None: ...

    async def live_replicas(self, now: float) -> int: ...

    async def orphans(self, owner: str) -> list[Orphan]:
        """The live streams (with a pump record) of the sessions ``owner`` owns: after that replica restarted,
        or its lease expired, nobody may be pumping them."""
        ...

    async def take_over(self, owner: str, by: str) -> list[Orphan]:
        """Make ``by`` the owner of every session ``owner`` owns, atomically (of replicas racing to take a
        dead one's sessions over, one wins each), and return their orphans (``orphans``) to pump."""
        ...

    async def lost_owners(self, now: float) -> list[str]:
        """The replicas that own sessions and hold no live lease (dead, or released it on a drain)."""
        ...


class Inspection(Protocol):
    """What the session inspector reads (the admin port, ``inspect_token``): a look that changes nothing (no
    expiry, no activity, no news)."""

    async def session_ids(self, offset: int, limit: int) -> list[str]:
        """A page of the session ids tracked, oldest first."""
        ...

    async def summary(self, session_id: str) -> SessionSummary | None:
        """The session's shape as the store holds it (None: unknown)."""
        ...


class Recipes(Protocol):
    """``upstream_session_lost = "reinitialize"``: what it takes to begin a session again upstream
    (``core.reinit.Recipe``, encoded), kept with the session and dropped with it. Written only on an
    initialize and the session-shaping requests, never on the request path of any other."""

    async def recipe(self, session_id: str, epoch: str) -> bytes | None:
        """The session's recipe (None: none kept, or ``epoch`` is not the session's incarnation)."""
        ...

    async def keep_recipe(self, session_id: str, epoch: str, expected: bytes | None, recipe: bytes) -> bool:
        """Compare and set: ``recipe`` replaces the one kept only while it is still ``expected`` (what the
        caller read; None: none kept) in incarnation ``epoch``. False: another request of the session (on
        any replica) wrote first, or the incarnation ended: the caller reads again and folds again."""
        ...

    async def map_upstream(self, session_id: str, epoch: str, expected: str | None, upstream_id: str) -> bool:
        """Compare and set the upstream's id of the session (``SessionAccess.upstream_id``), once it was
        begun again upstream: only while it is still ``expected`` (None: the client's own), in incarnation
        ``epoch``. False: another replica mapped it first (its upstream session is the session's: one
        upstream session per client session), or the incarnation ended."""
        ...


class SessionStore(Lifecycle, Sessions, Claims, Streams, Registry, Inspection, Recipes, Protocol):
    """The whole port, as a backend implements it and the daemon holds it; each caller is given the part it
    needs (``Streams`` a pump, ``Registry`` a lease)."""
