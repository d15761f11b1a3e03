"""The GET executor: carries out what ``core/get.py`` decides (a relay, a rejection, a view from the
window, the standalone stream joined or opened), fetching what the plan needs first.

``Openings`` holds, by session, the standalone GETs being opened here (a second cursor-less GET waits for the
one being opened and joins its stream instead of opening another: one upstream GET per session) and the GETs
not yet placed (``Ahead``, from the moment one reaches the proxy): a POST of the session waits for those, each
``ORDER_WAIT`` at most, so the upstream sees the session's requests in the order they reached the proxy
(invariant #12). A GET is placed once it has what it came for: the upstream's answer head to the GET it
opened (the upstream has the stream then), a live stream joined, a view from the window, or a refusal.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Final, assert_never

from aiohttp import web

from mcpresume.core.cursor import encode_cursor
from mcpresume.core.errors import SessionGone, UnknownSession, UpstreamSessionLost
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
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, PROTOCOL_VERSION_HEADER, SESSION_HEADER
from mcpresume.core.session import SessionAccess, StreamOrigin
from mcpresume.core.sse import encode_frame, priming_block
from mcpresume.http import reinit
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.credentials import authorize, remember_version, trusted
from mcpresume.http.forward import SSE, passthrough, relay, upstream_headers
from mcpresume.http.incoming import (
    SSE_HEADERS,
    client_sse_headers,
    primes_of,
    primes_version,
    pump_record,
    stateless,
)
from mcpresume.http.resume import decide_cursor, resume_preface
from mcpresume.http.route import Routed
from mcpresume.http.view import ViewPlan, attach_view, release_view, reserve_view, serve_view
from mcpresume.process.logs import log_id
from mcpresume.streams.pump import PumpJob
from mcpresume.streams.starter import PumpStarter
from mcpresume.streams.upstream import UpstreamAnswer

log = logging.getLogger("mcpresume.proxy")

# How long, at most from its arrival, a GET of a session holds the session's POSTs that come after it, until
# it is placed (a standalone GET opened upstream: a few milliseconds, the store's calls, a new connection and
# the upstream's answer head): the upstream sees them in the order they reached the proxy (servers that send
# requests on the standalone stream need it open before the call that triggers them), and a GET that cannot
# connect, whose head does not come, or that another replica serves, holds the session's calls no longer.
#
# From its arrival: a POST that came after the GET can reach the upstream before the GET has even asked the
# store what it is (a shared store's round trips). Until its answer head: written is not enough, the GET goes
# out on a new connection and the POST on an open one, and the upstream often reads the POST first (the
# suite's TypeScript fixture server lost 9 elicitations in 100 so). The head says the upstream has taken it
# (the SDKs' servers register the stream before they answer).
ORDER_WAIT: Final = 1.0


class Ahead:
    """A GET of a session, from its arrival until it is placed (``settle``) or ``ORDER_WAIT`` has passed: the
    session's POSTs that come meanwhile wait for it (``Openings.after_gets``). Holds nothing once ended (a
    standalone view's handler keeps it for the stream's life)."""

    __slots__ = ("_by_session", "_placed", "_session_id", "_timer")

    def __init__(self, by_session: dict[str, set[asyncio.Future[bool]]], session_id: str | None) -> None:
        self._by_session = by_session
        self._session_id = session_id
        # True once placed; False when ORDER_WAIT passed first. None: ended (or no session: nothing waits).
        self._placed: asyncio.Future[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if session_id is not None:
            loop = asyncio.get_running_loop()
            self._placed = loop.create_future()
            by_session.setdefault(session_id, set()).add(self._placed)
            self._timer = loop.call_later(ORDER_WAIT, self._end, False)

    def settle(self) -> None:
        """Placed: the POSTs that came after it may go (called again: nothing)."""
        self._end(True)

    def _end(self, placed: bool) -> None:
        future, timer, self._placed, self._timer = self._placed, self._timer, None, None
        if future is None or timer is None or self._session_id is None:
            return
        timer.cancel()
        future.set_result(placed)
        ahead = self._by_session[self._session_id]
        ahead.discard(future)
        if not ahead:
            del self._by_session[self._session_id]  # no set kept per session: only while GETs are ahead


class Openings:
    """The standalone GETs being opened here, and the GETs not yet placed, by session."""

    def __init__(self) -> None:
        # Being opened: a second cursor-less GET waits for it and joins its stream.
        self.opening: dict[str, asyncio.Future[None]] = {}
        # The GETs not yet placed (each an Ahead's future): a POST of the session waits for them.
        self._ahead: dict[str, set[asyncio.Future[bool]]] = {}

    def arrive(self, request: web.Request) -> Ahead:
        """A GET reached the proxy: called before anything is awaited for it, so that every POST of its
        session that comes after it waits for it."""
        return Ahead(self._ahead, request.headers.get(SESSION_HEADER))

    async def after_gets(self, session_id: str) -> None:
        """Wait until the session's GETs not yet placed are placed, each ORDER_WAIT at most after it came."""
        ahead = self._ahead.get(session_id)
        if not ahead:
            return
        done, _ = await asyncio.wait(list(ahead))  # never cancels them: other POSTs may wait too
        if not all(placed.result() for placed in done):
            log.info(
                "session %s: a GET of the session was not placed within %s s (the upstream's answer head to "
                "the standalone GET it opens); a request that came after it goes ahead of it",
                log_id(session_id),
                ORDER_WAIT,
            )


class Gets:
    def __init__(self, ctx: ProxyContext, pumps: PumpStarter, openings: Openings) -> None:
        self.ctx = ctx
        self.pumps = pumps
        self.openings = openings

    async def serve(self, request: web.Request, routed: Routed, ahead: Ahead) -> web.StreamResponse:
        """Decided by ``core.get.plan_get`` (its tables), carried out here: fetch what it needs, then do it.
        ``routed``: what routing read already (the session's access record, for a re-attach); ``ahead``:
        this GET as the session's POSTs wait for it (``Openings.arrive``), settled here where it is placed
        and the answer goes on (a stream); the caller settles it when this returns or raises."""
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
                ahead.settle()  # no session (or none in its revision): its POSTs do not wait for it
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
                return await self._standalone(request, session_id, granted, ahead)
            case ServeWindow():
                ahead.settle()  # a view from the window: nothing of it reaches the upstream
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
        self, request: web.Request, session_id: str, granted: SessionAccess, ahead: Ahead
    ) -> web.StreamResponse:
        """GET without a cursor: the standalone stream, live events only (no history is replayed)."""
        refused = await reserve_view(self.ctx, request, session_id)
        if refused is not None:
            return refused  # before any upstream GET is opened for it
        try:
            # Planned in a call that returns: a held view keeps no frame of the opening.
            plan = await self._standalone_plan(request, session_id, granted, ahead)
            if isinstance(plan, ViewPlan):
                return await serve_view(self.ctx, request, session_id, plan)
            return await relay(self.ctx, request, plan)  # the upstream's answer when it opened no stream
        finally:
            await release_view(self.ctx, session_id)

    async def _standalone_plan(
        self, request: web.Request, session_id: str, granted: SessionAccess, ahead: Ahead
    ) -> ViewPlan | UpstreamAnswer:
        """Join the session's live standalone stream at its head, or open it (one upstream GET per session,
        and its pump); the upstream's response when that GET did not open an SSE stream. ``ahead`` is
        settled once joined, or once the upstream answered the GET's head."""
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
                    ahead.settle()
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
        plan: ViewPlan | None = None
        upstream: UpstreamAnswer | None = None
        try:
            # A session begun again upstream (by any replica, or by this one before a restart): its GET goes
            # to the upstream session the store maps it to now (the access read just now carries it).
            reinit.learn(ctx, session_id, granted)
            with ctx.drain.upstream_wait(standalone=True):
                upstream = answer = await ctx.upstream.open_get(request.path_qs, upstream_headers(request))
            ahead.settle()  # the head came: the upstream has the stream before the session's next call
            if answer.status == 404 and reinit.recording(ctx) and trusted(ctx, request, granted):
                answer.release()  # the upstream lost the session: begin it again, open the stream there
                upstream = None
                again = await reinit.recover(ctx, request, session_id, granted)
                if not isinstance(again, SessionAccess):
                    await ctx.drop_session(session_id, granted.epoch)
                    raise again
                granted = again
                with ctx.drain.upstream_wait(standalone=True):
                    upstream = answer = await ctx.upstream.open_get(
                        request.path_qs, upstream_headers(request)
                    )
            if answer.status == 404 and trusted(ctx, request, granted):
                # Forgotten (the upstream says so to credentials accepted in it): the client re-initializes,
                # told so by the proxy's own 404 (with its reason), as for any session it no longer tracks.
                await ctx.drop_session(session_id, granted.epoch)
                raise UpstreamSessionLost()
            opened = None
            if answer.status == 200 and answer.content_type == SSE:
                version = request.headers.get(PROTOCOL_VERSION_HEADER)
                await remember_version(ctx, request, session_id, granted, version)
                now = ctx.clock()
                record = pump_record(ctx, request, session_id, (), version)
                opened = await ctx.store.open_stream(
                    session_id,
                    StreamOrigin.GET,
                    (),
                    now,
                    granted.epoch,
                    priming=primes_version(version),
                    pump=record,
                )
                if opened is None:  # ended meanwhile: never relayed raw (the upstream's own event ids)
                    raise UnknownSession(SessionGone.ENDED_WHILE_OPENING)
                await reinit.standalone_opened(ctx, session_id, granted.epoch, opened.number)
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
            del openings.opening[session_id]
            opened_here.set_result(None)  # waiters look again: they join this stream, or try themselves
        return answer if plan is None else plan
