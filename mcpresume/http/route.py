"""Owner routing's shell (several replicas over one store): a request of a session is served here,
forwarded to its owner (``replicas/hop.py``), refused, or served while the lost owner's sessions are taken
over.

``core.route.route`` decides (its table is that module's docstring); ``hop.plan`` asks the store what it
needs. ``Routing.route`` carries the decision out; ``Routing.take_over`` is the takeover: the store's atomic
claim of a lost replica's sessions picks one winner, whose pumps resume their streams
(``streams/starter.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from mcpresume.core.credentials import Access, access
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, SESSION_HEADER
from mcpresume.core.route import Forward, Refuse, Serve, TakeOver
from mcpresume.core.session import SessionAccess
from mcpresume.http.context import ProxyContext
from mcpresume.http.credentials import presented, upstream_knows
from mcpresume.process.logs import log_id
from mcpresume.replicas.hop import plan
from mcpresume.streams.starter import PumpStarter

log = logging.getLogger("mcpresume.proxy")


@dataclass(frozen=True, slots=True)
class Routed:
    """How routing ended: ``answer``, the response (forwarded or refused), or None: served here. ``asked``:
    routing read the session's access record (a re-attach), ``access`` what it said (None: unknown), so the
    handler does not read it again."""

    answer: web.StreamResponse | None = None
    asked: bool = False
    access: SessionAccess | None = None


HERE = Routed()


class Routing:
    def __init__(self, ctx: ProxyContext, pumps: PumpStarter) -> None:
        self.ctx = ctx
        self.pumps = pumps

    async def route(self, request: web.Request, body: bytes, request_id: str | int | None = None) -> Routed:
        """Where a request of a session is served (with one replica, no ``advertise_url``: here)."""
        ctx = self.ctx
        hop = ctx.hop
        if hop is None:
            return HERE
        here = ctx.settings.replica
        routed = await self._needs_upstream(request)
        needs_upstream = routed.access is not None and _verify(ctx, request, routed.access)
        decision = await plan(ctx.store, request, here, ctx.clock(), needs_upstream=needs_upstream)
        if isinstance(decision, TakeOver):
            await self.take_over(decision.owner)
            routed = HERE  # what it read may have changed (a session retired): the handler reads again
            decision = await plan(ctx.store, request, here, ctx.clock(), takeover_tried=True)
        match decision:
            case Forward(url=url):
                with ctx.drain.upstream_wait(standalone=request.method == "GET"):
                    return Routed(await hop.forward(request, body, url, request_id))
            case Refuse(error=error):
                return Routed(ctx.reject(request, error, request_id))
            case Serve(lost_owner=str(owner)):
                # Served without waiting for the takeover: the drain holds the task (step 5).
                ctx.drain.spawn(self.take_over(owner), name="mcpresume-takeover")
        return routed

    async def _needs_upstream(self, request: web.Request) -> Routed:
        """A re-attach: the session's access record (served here, the handler needs it too; whether serving
        it here would ask the upstream, a ping for credentials new to the session, routing needs)."""
        session_id = request.headers.get(SESSION_HEADER)
        if request.method != "GET" or session_id is None or LAST_EVENT_ID_HEADER not in request.headers:
            return HERE
        return Routed(asked=True, access=await self.ctx.store.access(session_id))

    async def take_over(self, owner: str) -> None:
        """A replica's lease is gone: its sessions become this replica's (the store picks one winner),
        and their live streams are pumped here."""
        ctx = self.ctx
        orphans = await ctx.store.take_over(owner, ctx.settings.replica)
        ctx.metrics.takeovers.labels("taken" if orphans else "nothing_left").inc()
        # Where this replica's upstream never saw a session (the sidecar layout), it is retired first: its
        # streams end with an error each (their resumes get 404), and new requests get 404.
        for orphan in {o.session_id: o for o in orphans}.values():
            record = orphan.pump
            if not await upstream_knows(ctx, record.path_qs, record.resume_headers):
                await ctx.store.retire(orphan.session_id, orphan.epoch)
                log.info(
                    "session %s: this replica's upstream does not know it; retired", log_id(orphan.session_id)
                )
        self.pumps.adopt(orphans, taken_from=owner)


def _verify(ctx: ProxyContext, request: web.Request, granted: SessionAccess) -> bool:
    """Serving the request would ask the upstream about its credentials (``core.credentials.access``)."""
    return access(granted.credentials, presented(ctx, request)) is Access.VERIFY
