"""Owner routing's shell (several replicas over one store): a request of a session is served here,
forwarded to its owner (``replicas/hop.py``), refused, or served while the lost owner's sessions are taken
over.

``core.route.route`` decides (its table is that module's docstring); ``hop.plan`` asks the store what it
needs. ``Routing.route`` carries the decision out; ``Routing.take_over`` is the takeover: the store's atomic
claim of a lost replica's sessions picks one winner, whose pumps resume their streams
(``streams/starter.py``), under a new fence (the old owner's late writes are refused).

A lapsed lease is not enough to take a replica's sessions over: a store outage longer than the lease lapses
every lease while every replica lives. The takeover needs evidence gathered while the store answers:

1. the owner does not answer a direct liveness check at its registered URL (``Hop.probe``): a process
   killed, stopped or frozen does not; one that does is alive (``owner_alive``), and the request goes to
   it, lease or not;
2. this replica has seen the store answer every renewal for a whole lease (``Lease.answered_for``): a live
   owner renews within a third of a lease once the store is back, so a lease still lapsed after that is
   the owner's own silence, not the store's (else ``too_soon``: the request is 503 ``owner_lost``, retry;
   this guards against a check that failed on the way between replicas, not at the owner).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from mcpresume.core.credentials import Access, access
from mcpresume.core.headers import LAST_EVENT_ID_HEADER
from mcpresume.core.route import Forward, Refuse, Serve, TakeOver
from mcpresume.core.session import SessionAccess
from mcpresume.http.context import DID, HOPPED_TO, Action, ProxyContext
from mcpresume.http.credentials import presented, upstream_knows
from mcpresume.process.config import Settings
from mcpresume.process.logs import log_id
from mcpresume.replicas.hop import decide, routed_session
from mcpresume.streams.starter import PumpStarter

log = logging.getLogger("mcpresume.proxy")


@dataclass(frozen=True, slots=True)
class Routed:
    """How routing ended: ``answer``, the response (forwarded or refused), or None: served here. ``asked``:
    routing read the session's access record with its owner (``Registry.owner_and_access``), ``access`` what
    it said (None: unknown), so the handler does not read it again (a POST's, a GET's; a DELETE reads it
    after the upstream answered)."""

    answer: web.StreamResponse | None = None
    asked: bool = False
    access: SessionAccess | None = None


HERE = Routed()


class Routing:
    def __init__(self, ctx: ProxyContext, pumps: PumpStarter) -> None:
        self.ctx = ctx
        self.pumps = pumps
        # One takeover at a time per lost owner: the requests that meet it meanwhile share its verdict.
        self._takeovers: dict[str, asyncio.Task[str | None]] = {}
        self._alive: set[str] = set()  # owners with a lapsed lease that answered (logged once each)

    async def route(
        self, request: web.Request, session_id: str | None, body: bytes, request_id: str | int | None = None
    ) -> Routed:
        """Where a request of a session (``session_id``: its ``Mcp-Session-Id``, read at admission) is served
        (with one replica, no ``advertise_url``: here)."""
        ctx = self.ctx
        hop = ctx.hop
        if hop is None:
            return HERE
        here = ctx.settings.replica
        asked = routed_session(request, session_id)
        if asked is None:
            return HERE
        # The owner and the access record in one read: routing needs the owner, the handler the record (a
        # re-attach's routing too: whether serving it here would ask the upstream, a ping for credentials
        # new to the session). Nothing this request does between the two changes the session.
        owner, granted = await ctx.store.owner_and_access(asked.session_id)
        routed = Routed(asked=True, access=granted)
        needs_upstream = granted is not None and _reattach(request) and _verify(ctx, request, granted)
        decision = await decide(
            ctx.store, request, asked, owner, here, ctx.clock(), needs_upstream=needs_upstream
        )
        if isinstance(decision, TakeOver):
            alive_at = await self.take_over(decision.owner)
            routed = HERE  # what it read may have changed (a session retired): the handler reads again
            # The owner's URL when it answered alive (its lease lapsed in a store outage): it serves.
            answered = None if alive_at is None else (decision.owner, alive_at)
            owner = await ctx.store.owner(asked.session_id)
            decision = await decide(
                ctx.store, request, asked, owner, here, ctx.clock(), takeover_tried=True, answered=answered
            )
        match decision:
            case Forward(url=url):
                request[DID], request[HOPPED_TO] = Action.HOPPED, url
                with ctx.drain.upstream_wait(standalone=request.method == "GET"):
                    return Routed(await hop.forward(request, body, url, request_id))
            case Refuse(error=error):
                return Routed(ctx.reject(request, error, request_id))
            case Serve(lost_owner=str(lost)):
                # Served without waiting for the takeover: the drain holds the task (step 5).
                ctx.drain.spawn(self._lost(lost), name="mcpresume-takeover")
        return routed

    async def _lost(self, owner: str) -> None:
        await self.take_over(owner)

    async def take_over(self, owner: str) -> str | None:
        """A replica's lease is gone: on evidence that the replica is (module docstring), its sessions
        become this replica's (the store picks one winner) and their live streams are pumped here. The
        owner's URL when it answered a liveness check instead (nothing taken); else None. Concurrent calls
        for one owner share one takeover."""
        running = self._takeovers.get(owner)
        if running is None:
            running = self._takeovers[owner] = asyncio.ensure_future(self._take_over(owner))
            running.add_done_callback(lambda _: self._takeovers.pop(owner, None))
        return await asyncio.shield(running)

    async def _take_over(self, owner: str) -> str | None:
        ctx, lease, hop = self.ctx, self.ctx.lease, self.ctx.hop
        entry = await ctx.store.replica_entry(owner)
        if (
            entry is not None
            and hop is not None
            and await hop.probe(entry.url, probe_timeout(ctx.settings)) == owner
        ):
            ctx.metrics.takeovers.labels("owner_alive").inc()
            if owner not in self._alive:
                self._alive.add(owner)
                log.warning(
                    "replica %s's lease lapsed, but it answers at %s: its requests go to it, nothing is "
                    "taken over (is its store connection failing?)",
                    owner,
                    entry.url,
                )
            return entry.url
        self._alive.discard(owner)
        if lease is not None and (answered := lease.answered_for(ctx.clock())) < lease.ttl:
            ctx.metrics.takeovers.labels("too_soon").inc()
            log.info(
                "replica %s's lease lapsed and it does not answer, but the store has answered this replica "
                "for %.1f s only of a lease's %.0f s: not taking its sessions over yet",
                owner,
                answered,
                lease.ttl,
            )
            return None
        orphans = await ctx.store.take_over(owner, ctx.settings.replica)
        ctx.metrics.takeovers.labels("taken" if orphans else "nothing_left").inc()
        # Where this replica's upstream never saw a session (the sidecar layout), it is retired first: its
        # streams end with an error each (their resumes get 404), and new requests get 404.
        reinit_off = ctx.settings.upstream_session_lost == "end"
        for orphan in {o.session_id: o for o in orphans}.values():
            record = orphan.pump
            # Under upstream_session_lost = "reinitialize" it is kept: its next POST begins it again here.
            if reinit_off and not await upstream_knows(ctx, record.path_qs, record.resume_headers):
                await ctx.store.retire(orphan.session_id, orphan.epoch, orphan.fence)
                log.info(
                    "session %s: this replica's upstream does not know it; retired", log_id(orphan.session_id)
                )
        self.pumps.adopt(orphans, taken_from=owner)
        return None


def probe_timeout(settings: Settings) -> float:
    """How long a liveness check of another replica waits for its answer: half a lease (a replica whose
    loop stalls longer than that would lose its lease to a pause of that length anyway), at least the
    connect timeout."""
    return max(settings.connect_timeout, settings.owner_lease_ttl / 2)


def _reattach(request: web.Request) -> bool:
    """A GET with a cursor: routing serves it here unless serving it would ask the upstream."""
    return request.method == "GET" and LAST_EVENT_ID_HEADER in request.headers


def _verify(ctx: ProxyContext, request: web.Request, granted: SessionAccess) -> bool:
    """Serving the request would ask the upstream about its credentials (``core.credentials.access``)."""
    return access(granted.credentials, presented(ctx, request)) is Access.VERIFY
