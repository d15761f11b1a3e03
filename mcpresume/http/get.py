"""The GET executor: carries out what ``core/get.py`` decides (a relay, a rejection, a view from the
window, the standalone stream joined or opened), fetching what the plan needs first.

``Openings`` holds the session's standalone GETs being opened here: a second cursor-less GET waits for the
one being opened and joins its stream instead of opening another (one upstream GET per session), and a
POST of the session waits (``ORDER_WAIT`` at most) until that GET is written to its upstream connection, so
the upstream sees the session's requests in the order they reached the proxy (invariant #12).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Final, assert_never

from aiohttp import web

from mcpresume.core.cursor import encode_cursor
from mcpresume.core.errors import SessionGone, UnknownSession
from mcpresume.core.get import (
    GetFacts,
    Join,
    Need,
    Open,
    Reject,
    Relay,
    ServeWindow,
    Standalone,
    WaitForOpening,
    plan_get,
    plan_standalone,
)
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, SESSION_HEADER
from mcpresume.core.session import SessionAccess, StreamOrigin
from mcpresume.core.sse import encode_frame, priming_block
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.credentials import authorize, remember_version, trusted
from mcpresume.http.forward import SSE, passthrough, relay, upstream_headers
from mcpresume.http.incoming import SSE_HEADERS, client_sse_headers, primes_of, pump_record, stateless
from mcpresume.http.resume import decide_cursor, resume_preface
from mcpresume.http.route import Routed
from mcpresume.http.view import ViewPlan, attach_view, release_view, reserve_view, serve_view
from mcpresume.process.logs import log_id
from mcpresume.streams.pump import PumpJob
from mcpresume.streams.starter import PumpStarter
from mcpresume.streams.upstream import UpstreamAnswer

log = logging.getLogger("mcpresume.proxy")

# How long a POST of a session waits for the session's standalone GET, being opened upstream (a new
# connection: a few milliseconds), to be sent first: the upstream sees them in the order they reached the
# proxy (servers that send requests on the standalone stream need it open before the call that triggers
# them), and a GET that cannot connect holds the session's calls no longer than this.
ORDER_WAIT: Final = 1.0


class Openings:
    """The standalone GETs being opened here, by session."""

    def __init__(self) -> None:
        # Being opened: a second cursor-less GET waits for it and joins its stream.
        self.opening: dict[str, asyncio.Future[None]] = {}
        # Of those, the ones not yet written to their upstream connection: a POST of the session waits.
        self.sending: dict[str, asyncio.Future[None]] = {}

    async def after_sent(self, session_id: str) -> None:
        """Wait (ORDER_WAIT at most) until the session's standalone GET being opened, if any, is sent."""
        sending = self.sending.get(session_id)
        if sending is None or sending.done():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ORDER_WAIT):
                await asyncio.shield(sending)


class Gets:
    def __init__(self, ctx: ProxyContext, pumps: PumpStarter, openings: Openings) -> None:
        self.ctx = ctx
        self.pumps = pumps
        self.openings = openings

    async def serve(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        """Decided by ``core.get.plan_get`` (its tables), carried out here: fetch what it needs, then do it.
        ``routed``: what routing read already (the session's access record, for a re-attach)."""
        ctx = self.ctx
        session_id = request.headers.get(SESSION_HEADER)
        cursor_header = request.headers.get(LAST_EVENT_ID_HEADER)
        facts = GetFacts(session_id is not None, stateless(request, None), cursor_header is not None)
        granted: SessionAccess | None = None
        while isinstance(step := plan_get(facts), Need):
            assert session_id is not None  # plan_get relays a request without one
            match step:
                case Need.ACCESS:
                    granted = routed.access if routed.asked else await ctx.store.access(session_id)
                    if granted is not None:  # history, live events, a 409's facts: to accepted credentials
                        refused = await authorize(ctx, request, session_id, granted)
                        if refused is not None:
                            return refused
                    facts = replace(facts, asked=True, known=granted is not None)
                case Need.RESUME:
                    assert cursor_header is not None
                    facts = replace(
                        facts, resumed=await decide_cursor(ctx, session_id, cursor_header, granted)
                    )
                case _:  # pragma: no cover
                    assert_never(step)
        del facts  # planned: not held by the frame of a view that stays open
        match step:
            case Relay():
                return await passthrough(ctx, request, None)
            case Reject(error=error):
                return ctx.reject(request, error, None)
            case Standalone(replaces=replaced):
                assert session_id is not None and granted is not None  # planned for a known session
                if replaced is not None:
                    # The upstream's standalone GET ended (it closed it, or it could not be resumed) and the
                    # client has all of it: the session's server-to-client channel goes on in a new one, as a
                    # client connected to the upstream directly would get (a re-attach to the ended one would
                    # answer an empty stream to every retry, and no server message would arrive again).
                    log.info(
                        "session %s: standalone stream %d ended; a new one", log_id(session_id), replaced
                    )
                return await self._standalone(request, session_id, granted)
            case ServeWindow():
                assert session_id is not None and cursor_header is not None
                log.info(
                    "session %s re-attaches to stream %d after %d",
                    log_id(session_id),
                    step.streams[0],
                    step.after,
                )
                preface = resume_preface(ctx, request, cursor_header, step.streams[0])
                plan = ViewPlan(
                    step.streams,
                    step.after,
                    SSE_HEADERS,
                    preface,
                    replay_through=step.replay_through,
                    standalone=step.standalone,
                )
                return await attach_view(ctx, request, session_id, plan)
            case _:  # pragma: no cover
                assert_never(step)

    async def _standalone(
        self, request: web.Request, session_id: str, granted: SessionAccess
    ) -> web.StreamResponse:
        """GET without a cursor: the standalone stream, live events only (no history is replayed)."""
        refused = await reserve_view(self.ctx, request, session_id)
        if refused is not None:
            return refused  # before any upstream GET is opened for it
        try:
            # Planned in a call that returns: a held view keeps no frame of the opening.
            plan = await self._standalone_plan(request, session_id, granted)
            if isinstance(plan, ViewPlan):
                return await serve_view(self.ctx, request, session_id, plan)
            return await relay(self.ctx, request, plan)  # the upstream's answer when it opened no stream
        finally:
            await release_view(self.ctx, session_id)

    async def _standalone_plan(
        self, request: web.Request, session_id: str, granted: SessionAccess
    ) -> ViewPlan | UpstreamAnswer:
        """Join the session's live standalone stream at its head, or open it (one upstream GET per session,
        and its pump); the upstream's response when that GET did not open an SSE stream."""
        ctx, openings = self.ctx, self.openings
        while True:  # join, wait or open: core.get.plan_standalone decides, each time the store is read
            live = await ctx.store.standalone_stream(session_id)
            view = None if live is None else await ctx.store.view(session_id, live)
            opening = openings.opening.get(session_id)
            planned = plan_standalone(
                live, view, granted.epoch, opening=opening is not None, primes=primes_of(request)
            )
            match planned:
                case Join(stream=stream, head=head, primed=primed):
                    # One upstream GET per session: a second client view joins the live stream at its head.
                    request[DID] = Action.JOINED
                    preface = b""
                    if primed:
                        cursor = encode_cursor(granted.epoch, stream, head)
                        preface = encode_frame(cursor, priming_block(ctx.settings.retry_ms))
                    return ViewPlan((stream,), head, SSE_HEADERS, preface, standalone=True)
                case Reject(error=error):
                    raise error
                case WaitForOpening():
                    assert opening is not None
                    await asyncio.shield(opening)  # then look again: joined, or that open failed
                case Open():
                    break
                case _:  # pragma: no cover
                    assert_never(planned)
        loop = asyncio.get_running_loop()
        opened_here: asyncio.Future[None] = loop.create_future()
        openings.opening[session_id] = opened_here
        sent: asyncio.Future[None] = loop.create_future()
        openings.sending[session_id] = sent

        def on_sent() -> None:  # the GET is written: the session's POSTs may go
            if not sent.done():
                sent.set_result(None)
            if openings.sending.get(session_id) is sent:
                del openings.sending[session_id]

        plan: ViewPlan | None = None
        upstream: UpstreamAnswer | None = None
        try:
            with ctx.drain.upstream_wait(standalone=True):
                upstream = answer = await ctx.upstream.open_get(
                    request.path_qs, upstream_headers(request), on_sent
                )
            if answer.status == 404 and trusted(ctx, request, granted):
                # Forgotten (the upstream says so to credentials accepted in it): the client re-initializes,
                # told so by the proxy's own 404 (with its reason), as for any session it no longer tracks.
                await ctx.drop_session(session_id, granted.epoch)
                raise UnknownSession(SessionGone.UPSTREAM_FORGOT)
            opened = None
            if answer.status == 200 and answer.content_type == SSE:
                await remember_version(ctx, request, session_id, granted)
                now = ctx.clock()
                record = pump_record(ctx, request, session_id, ())
                opened = await ctx.store.open_stream(
                    session_id,
                    StreamOrigin.GET,
                    (),
                    now,
                    granted.epoch,
                    priming=primes_of(request),
                    pump=record,
                )
                if opened is None:  # ended meanwhile: never relayed raw (the upstream's own event ids)
                    raise UnknownSession(SessionGone.ENDED_WHILE_OPENING)
            if opened is not None:
                reader = ctx.local.add_reader(session_id, [opened.number], opened.priming_seq - 1)
                job = PumpJob.of(session_id, opened.number, record, log_id(session_id), opened.fence)
                # The head is read before the pump starts reading the body (which lets go of it).
                plan = ViewPlan(
                    (opened.number,),
                    opened.priming_seq - 1,
                    client_sse_headers(ctx, answer),
                    reader=reader,
                    standalone=True,
                )
                self.pumps.start(job, answer, standalone=True)
                upstream = None  # the pump owns it now
        except BaseException:
            if upstream is not None:
                upstream.release()
            raise
        finally:
            on_sent()  # sent, or it never will be: nothing waits for it any more
            del openings.opening[session_id]
            opened_here.set_result(None)  # waiters look again: they join this stream, or try themselves
        return answer if plan is None else plan
