"""The aiohttp handlers: what the proxy does with each client request.

Routing
-------
* Any path other than the upstream's MCP endpoint (OAuth discovery under ``/.well-known/``, authorization
  endpoints, ...) passes through untouched, streamed both ways.
* On the MCP endpoint:

  - 2026-07-28 requests (``MCP-Protocol-Version: 2026-07-28`` or a ``server/discover`` probe) pass straight
    through; a client disconnect cancels the upstream request (in that revision closing the stream IS
    cancellation). Requests without a session id (other than ``initialize``) pass through too.
  - ``initialize``: forwarded; if the upstream answers with ``Mcp-Session-Id``, the session begins here.
  - A request with a session id the proxy does not track (reaped, deleted, or from before a restart):
    404 ``unknown_session``, not forwarded (the client re-initializes); a DELETE is still forwarded.
  - POST in a session: the request ids are claimed (exactly once per id); an SSE answer becomes a stream of
    the session, read by a pump into the window, and the client is attached to it from its priming event.
  - GET + ``Last-Event-ID`` (and POST + ``Last-Event-ID``): ``resume.decide`` re-attaches or rejects.
  - GET without it: the standalone stream, with no history.
  - DELETE: forwarded, then the session's state dropped.

Every answer the proxy makes itself (4xx/5xx) carries a JSON-RPC error body whose ``error.data.reason`` is
stable, and is logged in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final, assert_never

import aiohttp
import orjson
from aiohttp import web

from mcpresume.attach import ViewPlan, attach_view, release_view, reserve_view, serve_view
from mcpresume.authorize import (
    authorize,
    begins_with,
    credential_headers_of,
    presented,
    remember_version,
    trusted,
    upstream_knows,
)
from mcpresume.context import ProxyContext, log_id
from mcpresume.credentials import Access, access
from mcpresume.cursor import Cursor, encode_cursor, parse_cursor
from mcpresume.errors import (
    SERVER_ERROR,
    BadSessionId,
    HeadersTooLarge,
    HostNotAllowed,
    OriginNotAllowed,
    ProxyError,
    SessionGone,
    ShuttingDown,
    TooManySessions,
    UnknownSession,
    UpstreamBadResponse,
)
from mcpresume.forward import (
    SSE,
    body_stream,
    client_headers,
    passthrough,
    read_body,
    relay,
    upstream_headers,
)
from mcpresume.get_plan import (
    GetFacts,
    Join,
    Need,
    Open,
    Reject,
    Relay,
    Resumed,
    ServeWindow,
    Standalone,
    WaitForOpening,
    plan_get,
    plan_standalone,
)
from mcpresume.headers import (
    LAST_EVENT_ID_HEADER,
    PROTOCOL_VERSION_HEADER,
    SESSION_HEADER,
    SSE_RESPONSE_HEADERS,
    effective_allowed_hosts,
    header_bytes,
    host_allowed,
    valid_session_id,
)
from mcpresume.hop import plan
from mcpresume.jsonrpc import MODERN_VERSIONS, ClientMessage, error_response, parse_client_body, primes
from mcpresume.pump import Pump, PumpJob, PumpSettings
from mcpresume.resume import decide, outcome_label
from mcpresume.route import Forward, Refuse, Serve, TakeOver
from mcpresume.session import (
    Claim,
    ClaimOutcome,
    NewEvent,
    Orphan,
    PumpRecord,
    SessionAccess,
    StreamOrigin,
    claim_refusal,
)
from mcpresume.sse import encode_comment, encode_frame, encode_retry, frame_body, priming_block
from mcpresume.upstream import UpstreamAnswer
from mcpresume.window import EventKind

log = logging.getLogger("mcpresume.proxy")

_REQUEST_ANSWERS = frozenset({"application/json", SSE})
# How long a POST of a session waits for the session's standalone GET, being opened upstream (a new
# connection: a few milliseconds), to be sent first: the upstream sees them in the order they reached the
# proxy (servers that send requests on the standalone stream need it open before the call that triggers
# them), and a GET that cannot connect holds the session's calls no longer than this.
ORDER_WAIT: Final = 1.0


class Proxy:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.store = ctx.store
        self.metrics = ctx.metrics
        self.upstream = ctx.upstream
        # Sessions whose standalone upstream GET is being opened: a second cursor-less GET waits for that
        # one and joins its stream instead of opening another (one upstream GET per session).
        self._opening_standalone: dict[str, asyncio.Future[None]] = {}
        # Of those, the ones whose GET is not yet written to its upstream connection: a POST of the session
        # waits for it (ORDER_WAIT at most), so it does not overtake the GET.
        self._sending_standalone: dict[str, asyncio.Future[None]] = {}
        settings = self.settings
        self._allowed_hosts = effective_allowed_hosts(settings.allowed_hosts, settings.host)
        self._pump_settings = PumpSettings(  # one for every pump
            max_event_bytes=settings.max_event_bytes,
            stall_timeout=settings.stall_timeout,
            window_events=settings.window_events,
            retry_ms=settings.retry_ms,
            resume_attempts=settings.upstream_resume_attempts,
            pause=settings.overflow == "pause",
            session_ttl=settings.session_ttl,
        )

    # -- entry -------------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            if self.ctx.drain.started:
                raise ShuttingDown("the proxy is shutting down; retry on another replica")
            self._admit(request)
            if request.path != self.upstream.mcp_path:
                response = await self._other_path(request)
            elif request.method == "POST":
                response = await self._mcp_post(request)
            elif request.method == "GET":
                response = await self._mcp_get(request)
            elif request.method == "DELETE":
                response = await self._mcp_delete(request)
            else:
                response = await passthrough(
                    self.ctx, request, body_stream(request, self.settings.body_timeout)
                )
        except ProxyError as error:
            response = self.ctx.reject(request, error, None)
        self.metrics.requests.labels(request.method, str(response.status)).inc()
        return response

    async def _other_path(self, request: web.Request) -> web.StreamResponse:
        """Any path but the MCP endpoint: passed through as is. An MCP ``initialize`` here means the
        client and ``--upstream`` disagree on the path (a typo?): the session it begins is relayed with no
        resumption at all, so that is logged, once per session (the initialize that begins it)."""
        accept = request.headers.get("Accept", "")
        if request.method != "POST" or request.content_type != "application/json" or SSE not in accept:
            return await passthrough(self.ctx, request, body_stream(request, self.settings.body_timeout))
        # An MCP client's POST (it accepts SSE): read whole to look at, with the MCP endpoint's limits.
        body = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)
        try:
            initialize = parse_client_body(body).is_initialize
        except ProxyError:
            initialize = False  # not JSON-RPC: the upstream answers it
        if initialize:
            log.warning(
                "initialize on %s is relayed as is, with no resumption: the MCP endpoint is %s (the path of "
                "the upstream URL); does the client's URL or --upstream have the wrong path?",
                request.path[:200],
                self.upstream.mcp_path,
            )
        return await passthrough(self.ctx, request, body)

    def _admit(self, request: web.Request) -> None:
        """Checks every request passes before anything is read or forwarded."""
        settings = self.settings
        if header_bytes(request.raw_headers) > settings.max_header_bytes:
            raise HeadersTooLarge(f"request headers over {settings.max_header_bytes} bytes")
        # The spec's DNS-rebinding MUST (2025-11-25): a present Origin that is not allowed gets 403. Checked
        # on every path the proxy relays (an upstream may route /MCP or /mcp/ to its endpoint too). Origin
        # is forwarded as it came, so the upstream's own check still sees it; Host is not (the upstream gets
        # its own authority), so the proxy checks it itself, by default with the SDKs' loopback rule.
        origin = request.headers.get("Origin")
        if settings.allowed_origins and origin is not None and origin not in settings.allowed_origins:
            raise OriginNotAllowed(f"Origin {origin[:200]!r} is not allowed")
        host = request.headers.get("Host")
        if not host_allowed(host, self._allowed_hosts):
            raise HostNotAllowed(f"Host {(host or '')[:200]!r} is not allowed")
        if request.path != self.upstream.mcp_path:
            return
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is not None and not valid_session_id(session_id):
            raise BadSessionId("Mcp-Session-Id must be 1-256 visible ASCII characters")

    def _is_modern(self, request: web.Request, message: ClientMessage | None) -> bool:
        version = request.headers.get(PROTOCOL_VERSION_HEADER)
        return version in MODERN_VERSIONS or (message is not None and message.is_discover)

    async def _mcp_post(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)
        message = parse_client_body(body)
        routed = await self._routed(request, body, message.first_id)
        if routed is not None:
            return routed
        session_id = request.headers.get(SESSION_HEADER)
        if self._is_modern(request, message):
            return await passthrough(self.ctx, request, body)
        if session_id is None:
            if message.is_initialize:
                return await self._initialize(request, body, message)
            return await passthrough(self.ctx, request, body)
        cursor_header = request.headers.get(LAST_EVENT_ID_HEADER)
        if cursor_header is not None:
            # The cursor is checked before anything is forwarded (404 for a session the proxy does not know).
            return await self._post_with_cursor(request, body, message, session_id, cursor_header)
        granted = await self.store.access(session_id)
        if granted is None:
            # Not tracked (reaped, deleted, or the proxy restarted): gone, as a server says of a session it
            # does not know, and the client re-initializes (spec). Forwarding would run a re-sent request
            # twice, and relay the upstream's own event ids.
            raise UnknownSession()
        return await self._forward_in_session(request, body, message, session_id, granted)

    async def _initialize(
        self, request: web.Request, body: bytes, message: ClientMessage
    ) -> web.StreamResponse:
        return await self._forward_in_session(request, body, message, None, None)

    async def _forward_in_session(
        self,
        request: web.Request,
        body: bytes,
        message: ClientMessage,
        session_id: str | None,
        granted: SessionAccess | None,
    ) -> web.StreamResponse:
        """Forward a request in a tracked session (``granted``: its access), or an ``initialize``."""
        reserved = False
        if session_id is not None and granted is not None and message.request_keys:
            # Credentials the upstream has not accepted in the session claim nothing in it: not a request id
            # the owner is about to send, not a view, and a re-sent id is not answered from the window.
            refused: web.StreamResponse | int | None = await authorize(
                self.ctx, request, session_id, granted, message.first_id
            )
            if refused is None:
                refused = await self._claim_and_reserve(request, session_id, message, granted)
            if refused is not None:
                assert not isinstance(refused, int)  # a merge is never asked here
                return refused
            reserved = True
        elif session_id is None and message.is_initialize and not await self._has_room():
            # Refuse before forwarding, so the upstream does not start a session the proxy cannot track.
            raise TooManySessions(
                f"the proxy holds its maximum of {self.settings.max_sessions} sessions",
                max_sessions=self.settings.max_sessions,
            )
        try:
            opened = await self._forward_claimed(request, body, message, session_id, granted)
            if isinstance(opened, web.Response):
                return opened
            if isinstance(opened, _Opened):
                plan = ViewPlan(
                    (opened.stream,), opened.priming_seq - 1, opened.headers, reader=opened.reader
                )
                view = serve_view if reserved else attach_view  # a reserved view is counted already
                return await view(self.ctx, request, opened.session_id, plan)
            return await relay(self.ctx, request, opened, request_id=message.first_id)
        finally:
            if reserved and session_id is not None:
                await release_view(self.ctx, session_id)

    async def _claim_and_reserve(
        self,
        request: web.Request,
        session_id: str,
        message: ClientMessage,
        granted: SessionAccess,
        *,
        resume: tuple[int, Sequence[int]] | None = None,
    ) -> web.StreamResponse | int | None:
        """Before forwarding: claim the request ids (exactly once), then count the client view the request
        will get (a request refused for too many views must not run upstream). An answer if refused.

        ``granted``: the session's access: the claim is made in its incarnation only. The caller has
        authorized the request's credentials (``authorize``): a request id seen before is answered from the
        window.

        ``resume`` (POST + ``Last-Event-ID``: the cursor's seq and the streams it resumes): a re-sent request
        whose stream the client can take from there is not answered here; its stream number is returned for
        the caller's view (counted already) to follow."""
        if message.request_keys:
            limit = self.settings.max_streams_per_session
            claim = await self.store.claim(session_id, message.request_keys, limit, granted.epoch)
            if claim is None:  # ended (or re-issued) since it was looked up
                error = UnknownSession()
                return self.ctx.reject(request, error, message.first_id)
            if claim.outcome is not ClaimOutcome.NEW:
                stream = None
                if resume is not None and claim.outcome is ClaimOutcome.ATTACH and claim.stream is not None:
                    stream = await self._resumable_duplicate(session_id, claim.stream, *resume)
                if stream is None:
                    return await self._refuse_claim(request, session_id, message, claim)
                self.metrics.duplicate_requests.inc()
                refused = await reserve_view(self.ctx, request, session_id, message.first_id)
                return stream if refused is None else refused
        refused = await reserve_view(self.ctx, request, session_id, message.first_id)
        if refused is not None:  # the same id may come back
            await self.store.release(session_id, message.request_keys, granted.epoch)
        return refused

    async def _resumable_duplicate(
        self, session_id: str, stream: int, after: int, resumed: Sequence[int]
    ) -> int | None:
        """The stream of a request re-sent with a cursor, if the client can take it from the cursor without
        an event twice: it is one of the streams the cursor resumes (the design note's client re-sends its
        request with its last event's id), or no client was sent anything of it past the cursor (so it
        comes whole with the cursor's tail). None: answered as a re-send without a cursor."""
        if stream in resumed:
            return stream
        view = await self.store.view(session_id, stream)
        if view is None or view.stream is None:
            return None
        # Sent nothing but its priming event (when it has one): delivered at most first_seq, or below it.
        untouched = view.stream.delivered < view.stream.first_seq + view.stream.primed
        return stream if view.stream.first_seq > after and untouched else None

    async def _forward_claimed(
        self,
        request: web.Request,
        body: bytes,
        message: ClientMessage,
        session_id: str | None,
        granted: SessionAccess | None,
    ) -> _Opened | aiohttp.ClientResponse | web.Response:
        """Forward; on failure answer with the error (the forward released or settled the claim)."""
        opened = await self._forward_shielded(request, body, message, session_id, granted)
        if not isinstance(opened, ProxyError):
            return opened
        return self.ctx.reject(request, opened, message.first_id)

    async def _forward_shielded(
        self,
        request: web.Request,
        body: bytes,
        message: ClientMessage,
        session_id: str | None,
        granted: SessionAccess | None,
    ) -> _Opened | aiohttp.ClientResponse | ProxyError:
        """Forward in a task of its own: a client that disconnects now must not cancel the upstream request
        (handshake era: disconnection is not cancellation); its answer still reaches the window. A drain's
        deadline ends the wait (503 shutting_down) but not the forward."""
        forward = asyncio.ensure_future(self._forward_and_open(request, body, message, session_id, granted))
        try:
            with self.ctx.drain.upstream_wait():
                return await asyncio.shield(forward)
        except ShuttingDown as refusal:
            forward.add_done_callback(self._abandoned)
            return refusal
        except asyncio.CancelledError:
            forward.add_done_callback(self._abandoned)
            raise

    def _abandoned(self, forward: asyncio.Future[_Opened | aiohttp.ClientResponse | ProxyError]) -> None:
        """The client left while its request was forwarded: release what was kept for its view."""
        if forward.cancelled() or forward.exception() is not None:
            return
        opened = forward.result()
        if isinstance(opened, _Opened):
            self.ctx.local.remove_reader(opened.session_id, opened.reader)
        elif isinstance(opened, aiohttp.ClientResponse):
            opened.release()

    async def _has_room(self) -> bool:
        limit = self.settings.max_sessions
        if await self.store.session_count() < limit:
            return True
        await self.store.reap(self.ctx.clock())  # expired sessions make room before anyone is refused
        return await self.store.session_count() < limit

    async def _forward_and_open(
        self,
        request: web.Request,
        body: bytes,
        message: ClientMessage,
        session_id: str | None,
        granted: SessionAccess | None,
    ) -> _Opened | aiohttp.ClientResponse | ProxyError:
        """``session_id`` None: an ``initialize``, whose 2xx answer with ``Mcp-Session-Id`` begins a session;
        else a request of the tracked session, ``granted`` its access. Everything this request records is
        recorded in its own incarnation (``epoch``): if the upstream re-issued the session id meanwhile, the
        new incarnation gets nothing of it (no claim released or settled, no stream, no answer)."""
        keys = message.request_keys
        epoch = None if granted is None else granted.epoch
        if session_id is not None:
            await self._after_standalone_sent(session_id)
        try:
            upstream = await self.upstream.request(
                "POST", request.path_qs, upstream_headers(request), body, decoded=True
            )
        except ProxyError as error:
            # Here, in the shielded task, so it happens even when the client left: the request never ran,
            # unless it was answered in an encoding the proxy cannot read (then it must not run again).
            if session_id is not None and keys:
                if isinstance(error, UpstreamBadResponse):
                    await self.store.settle(session_id, keys, epoch)
                else:
                    await self.store.release(session_id, keys, epoch)
            return error
        sid = upstream.headers.get(SESSION_HEADER) if session_id is None else session_id
        if upstream.status == 404 and session_id is not None:
            # The upstream forgot the session (it restarted): the client must re-initialize, so drop ours.
            if granted is not None and trusted(self.ctx, request, granted):
                await self._drop_session(session_id, epoch)
            elif keys:
                await self.store.release(session_id, keys, epoch)
            return upstream
        if not (200 <= upstream.status < 300) or sid is None:
            if session_id is not None and keys:
                await self.store.release(session_id, keys, epoch)  # refused: the same id may be sent again
            return upstream
        if session_id is None:
            epoch = await self._begin_session(sid, begins_with(self.ctx, request))
            if epoch is None:
                upstream.release()
                return TooManySessions(  # untracked, its every request would be 404 unknown_session
                    f"the proxy holds its maximum of {self.settings.max_sessions} sessions",
                    max_sessions=self.settings.max_sessions,
                )
        elif granted is not None:
            await remember_version(self.ctx, request, sid, granted)
        if message.request_ids and upstream.status != 202 and upstream.content_type not in _REQUEST_ANSWERS:
            # Spec: a POST with a request is answered with application/json or text/event-stream.
            content_type = upstream.content_type
            upstream.release()
            if session_id is not None:
                await self.store.settle(session_id, keys, epoch)  # it ran upstream: never forward it again
            return UpstreamBadResponse(
                f"the upstream answered a request with {content_type!r}", content_type=content_type
            )
        if upstream.content_type != SSE:
            if keys:  # answered: a re-send is refused, never forwarded again
                await self.store.settle(sid, keys, epoch)
            return upstream
        now = self.ctx.clock()
        record = self._pump_record(request, sid, message.request_ids)
        stream = await self.store.open_stream(
            sid,
            StreamOrigin.POST,
            message.request_keys,
            now,
            epoch,
            priming=_primes(request, message),
            pump=record,
        )
        if stream is None:
            # The session ended while its request was forwarded (DELETE, reaped, its id re-issued): answered
            # as a request of an ended session is, never relayed raw (nor its event ids).
            upstream.release()
            return UnknownSession(SessionGone.ENDED_WHILE_FORWARDED)
        # The client's reader is registered before the pump starts: the first burst waits for it.
        reader = self.ctx.local.add_reader(sid, [stream.number], stream.priming_seq - 1)
        self._spawn_pump(PumpJob.of(sid, stream.number, record, log_id(sid)), upstream)
        return _Opened(sid, stream.number, stream.priming_seq, _client_headers(self.ctx, upstream), reader)

    async def _after_standalone_sent(self, session_id: str) -> None:
        """Wait (ORDER_WAIT at most) until the session's standalone GET being opened, if any, is sent."""
        sending = self._sending_standalone.get(session_id)
        if sending is None or sending.done():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ORDER_WAIT):
                await asyncio.shield(sending)

    async def _begin_session(self, session_id: str, credential: bytes | None) -> str | None:
        """Track a session the upstream began; its epoch, or None when it cannot be tracked."""
        try:
            # The owner is recorded where sessions are routed (several replicas); one replica owns all.
            owner = self.settings.replica if self.ctx.hop is not None else ""
            epoch = await self.store.create_session(session_id, self.ctx.clock(), credential, owner)
        except ProxyError as error:
            log.warning("session %s cannot be tracked: %s", log_id(session_id), error.message)
            return None
        log.info("session %s begins", log_id(session_id))
        return epoch

    def _pump_record(
        self, request: web.Request, session_id: str, request_ids: tuple[str | int, ...]
    ) -> PumpRecord:
        # A resume GET speaks for the client: its session, protocol revision and credentials.
        resume_headers = [(SESSION_HEADER, session_id)]
        version = request.headers.get(PROTOCOL_VERSION_HEADER)
        if version is not None:
            resume_headers.append((PROTOCOL_VERSION_HEADER, version))
        resume_headers += credential_headers_of(self.ctx, request)
        return PumpRecord(request_ids, request.path_qs, tuple(resume_headers))

    def _pump(self, job: PumpJob) -> Pump:
        ctx = self.ctx
        return Pump(job, self.store, ctx.local, self.metrics, self.upstream, ctx.clock, self._pump_settings)

    def _spawn_pump(self, job: PumpJob, upstream: UpstreamAnswer, *, standalone: bool = False) -> None:
        self.ctx.pumps.spawn(job.session_id, self._pump(job).run(upstream), standalone=standalone)

    def adopt(self, orphans: Sequence[Orphan], *, taken_from: str | None = None) -> None:
        """Pump the streams another process was pumping (this replica's before a restart, or a dead
        replica's: ``taken_from``): each resumed upstream from its last upstream id, or ended with an
        error for each pending request. Where this replica's upstream does not know the session (a dead
        replica's, in the sidecar layout), the session is then retired: its clients re-initialize."""
        for orphan in orphans:
            job = PumpJob.of(orphan.session_id, orphan.stream, orphan.pump, log_id(orphan.session_id))
            pump = self._pump(job)
            pump.restore(orphan.upstream_cursor, orphan.answered)
            standalone = orphan.origin is StreamOrigin.GET
            self.ctx.pumps.spawn(orphan.session_id, self._adopted(pump, orphan), standalone=standalone)
        if orphans:
            whose = "this replica's previous process" if taken_from is None else f"replica {taken_from}"
            log.info("took over %d stream(s) left by %s", len(orphans), whose)

    async def _adopted(self, pump: Pump, orphan: Orphan) -> None:
        await pump.run(None)
        if pump.upstream_forgot:
            await self.store.retire(orphan.session_id, orphan.epoch)
            log.info("session %s: its upstream does not know it; new requests get 404", pump.job.log_id)

    # -- owner routing (several replicas over one store) ---------------------------------------------

    async def _routed(
        self, request: web.Request, body: bytes, request_id: str | int | None = None
    ) -> web.StreamResponse | None:
        """The answer to a request of a session another replica owns (forwarded there, or refused); None:
        served here. Nothing is routed with one replica (no ``advertise_url``)."""
        hop = self.ctx.hop
        if hop is None:
            return None
        here, now = self.settings.replica, self.ctx.clock()
        decision = await plan(
            self.store, request, here, now, needs_upstream=await self._needs_upstream(request)
        )
        if isinstance(decision, TakeOver):
            await self.take_over(decision.owner)
            decision = await plan(self.store, request, here, self.ctx.clock(), takeover_tried=True)
        match decision:
            case Forward(url=url):
                with self.ctx.drain.upstream_wait(standalone=request.method == "GET"):
                    return await hop.forward(request, body, url, request_id)
            case Refuse(error=error):
                return self.ctx.reject(request, error, request_id)
            case Serve(owner_lost=True):
                owner = await self.store.owner(request.headers.get(SESSION_HEADER, ""))
                if owner:
                    self.ctx.pumps.spawn("", self.take_over(owner))
        return None

    async def _needs_upstream(self, request: web.Request) -> bool:
        """Whether serving a re-attach here would ask the upstream (a ping for credentials new to the
        session): only the owner's upstream knows the session."""
        session_id = request.headers.get(SESSION_HEADER)
        if request.method != "GET" or session_id is None or LAST_EVENT_ID_HEADER not in request.headers:
            return False
        granted = await self.store.access(session_id)
        return (
            granted is not None and access(granted.credentials, presented(self.ctx, request)) is Access.VERIFY
        )

    async def take_over(self, owner: str) -> None:
        """A replica's lease is gone: its sessions become this replica's (the store picks one winner),
        and their live streams are pumped here."""
        orphans = await self.store.take_over(owner, self.settings.replica)
        self.metrics.takeovers.labels("taken" if orphans else "nothing_left").inc()
        # Where this replica's upstream never saw a session (the sidecar layout), it is retired first: its
        # streams end with an error each (their resumes get 404), and new requests get 404.
        for orphan in {o.session_id: o for o in orphans}.values():
            record = orphan.pump
            if not await upstream_knows(self.ctx, record.path_qs, record.resume_headers):
                await self.store.retire(orphan.session_id, orphan.epoch)
                log.info(
                    "session %s: this replica's upstream does not know it; retired", log_id(orphan.session_id)
                )
        self.adopt(orphans, taken_from=owner)

    async def _refuse_claim(
        self, request: web.Request, session_id: str, message: ClientMessage, claim: Claim
    ) -> web.StreamResponse:
        """The answer to request ids that must not be forwarded (a duplicate, or too many streams)."""
        if claim.outcome is ClaimOutcome.LIMITED:
            error = claim_refusal(claim.outcome, self.settings.max_streams_per_session)
            return self.ctx.reject(request, error, message.first_id)
        return await self._duplicate(request, session_id, message, claim.outcome, claim.stream)

    async def _duplicate(
        self,
        request: web.Request,
        session_id: str,
        message: ClientMessage,
        outcome: ClaimOutcome,
        stream: int | None,
    ) -> web.StreamResponse:
        """A request id seen before in this session: never forwarded twice (invariant #8)."""
        self.metrics.duplicate_requests.inc()
        if outcome is ClaimOutcome.ATTACH and stream is not None:
            view = await self.store.view(session_id, stream)
            if view is not None and view.stream is not None:
                plan = ViewPlan((stream,), view.stream.first_seq - 1, _SSE_HEADERS)
                return await attach_view(self.ctx, request, session_id, plan)
        return self.ctx.reject(request, claim_refusal(outcome), message.first_id)

    # -- resumption --------------------------------------------------------------------------------------

    async def _decide(
        self, session_id: str, cursor_header: str, granted: SessionAccess | None
    ) -> Resumed | ProxyError:
        """The resume decision: a re-attach with its stream as the decision saw it (retained, or the last
        standalone stream gone) and the session's newest seq then; or the rejection. ``granted``: the
        incarnation the request's credentials were checked in; another one is as good as unknown."""
        cursor = parse_cursor(cursor_header)
        view = await self.store.view(session_id, cursor.stream if isinstance(cursor, Cursor) else 0)
        if view is not None and (granted is None or view.epoch != granted.epoch):
            view = None  # begun since the check: nothing of it is served to credentials not checked in it
        decision = decide(view, cursor, self.ctx.clock())
        self.metrics.resumptions.labels(outcome_label(decision)).inc()
        if isinstance(decision, ProxyError):
            return decision
        assert view is not None and view.stream is not None  # decide re-attaches only to a stream it saw
        return Resumed(decision, view.stream, view.newest_seq)

    def _resume_preface(self, request: web.Request, epoch_cursor: str, stream: int) -> bytes:
        # The retry hint only where a priming event would carry it: a client of an earlier revision may
        # surface a block without data as an empty event.
        preface = encode_retry(self.settings.retry_ms) if _primes(request) else b""
        preface += encode_comment(f"resumed {epoch_cursor}".encode())
        if self.settings.resume_notification:
            note = orjson.dumps(
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/mcpresume/resumed",
                    "params": {"cursor": epoch_cursor, "stream": stream},
                }
            )
            preface += frame_body(note)
        return preface

    async def _mcp_get(self, request: web.Request) -> web.StreamResponse:
        routed = await self._routed(request, b"")
        if routed is not None:
            return routed
        # Decided by get_plan.plan_get (its tables), carried out here: fetch what it needs, then do it.
        session_id = request.headers.get(SESSION_HEADER)
        cursor_header = request.headers.get(LAST_EVENT_ID_HEADER)
        facts = GetFacts(session_id is not None, self._is_modern(request, None), cursor_header is not None)
        granted: SessionAccess | None = None
        while isinstance(step := plan_get(facts), Need):
            assert session_id is not None  # plan_get relays a request without one
            match step:
                case Need.ACCESS:
                    granted = await self.store.access(session_id)
                    if granted is not None:  # history, live events, a 409's facts: to accepted credentials
                        refused = await authorize(self.ctx, request, session_id, granted)
                        if refused is not None:
                            return refused
                    facts = replace(facts, asked=True, known=granted is not None)
                case Need.RESUME:
                    assert cursor_header is not None
                    facts = replace(facts, resumed=await self._decide(session_id, cursor_header, granted))
                case _:  # pragma: no cover
                    assert_never(step)
        match step:
            case Relay():
                return await passthrough(self.ctx, request, None)
            case Reject(error=error):
                return self.ctx.reject(request, error, None)
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
                preface = self._resume_preface(request, cursor_header, step.streams[0])
                plan = ViewPlan(
                    step.streams,
                    step.after,
                    _SSE_HEADERS,
                    preface,
                    replay_through=step.replay_through,
                    standalone=step.standalone,
                )
                return await attach_view(self.ctx, request, session_id, plan)
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
        while True:  # join, wait or open: get_plan.plan_standalone decides, each time the store is read
            live = await self.store.standalone_stream(session_id)
            view = None if live is None else await self.store.view(session_id, live)
            opening = self._opening_standalone.get(session_id)
            planned = plan_standalone(
                live, view, granted.epoch, opening=opening is not None, primes=_primes(request)
            )
            match planned:
                case Join(stream=stream, head=head, primed=primed):
                    # One upstream GET per session: a second client view joins the live stream at its head.
                    preface = b""
                    if primed:
                        cursor = encode_cursor(granted.epoch, stream, head)
                        preface = encode_frame(cursor, priming_block(self.settings.retry_ms))
                    return ViewPlan((stream,), head, _SSE_HEADERS, preface, standalone=True)
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
        self._opening_standalone[session_id] = opened_here
        sent: asyncio.Future[None] = loop.create_future()
        self._sending_standalone[session_id] = sent

        def on_sent() -> None:  # the GET is written: the session's POSTs may go
            if not sent.done():
                sent.set_result(None)
            if self._sending_standalone.get(session_id) is sent:
                del self._sending_standalone[session_id]

        plan: ViewPlan | None = None
        upstream: UpstreamAnswer | None = None
        try:
            with self.ctx.drain.upstream_wait(standalone=True):
                upstream = answer = await self.upstream.open_get(
                    request.path_qs, upstream_headers(request), on_sent
                )
            if answer.status == 404 and trusted(self.ctx, request, granted):
                # Forgotten (the upstream says so to credentials accepted in it): the client re-initializes.
                await self._drop_session(session_id, granted.epoch)
            opened = None
            if answer.status == 200 and answer.content_type == SSE:
                await remember_version(self.ctx, request, session_id, granted)
                now = self.ctx.clock()
                record = self._pump_record(request, session_id, ())
                opened = await self.store.open_stream(
                    session_id,
                    StreamOrigin.GET,
                    (),
                    now,
                    granted.epoch,
                    priming=_primes(request),
                    pump=record,
                )
                if opened is None:  # ended meanwhile: never relayed raw (the upstream's own event ids)
                    raise UnknownSession(SessionGone.ENDED_WHILE_OPENING)
            if opened is not None:
                reader = self.ctx.local.add_reader(session_id, [opened.number], opened.priming_seq - 1)
                job = PumpJob.of(session_id, opened.number, record, log_id(session_id))
                # The head is read before the pump starts reading the body (which lets go of it).
                plan = ViewPlan(
                    (opened.number,),
                    opened.priming_seq - 1,
                    _client_headers(self.ctx, answer),
                    reader=reader,
                    standalone=True,
                )
                self._spawn_pump(job, answer, standalone=True)
                upstream = None  # the pump owns it now
        except BaseException:
            if upstream is not None:
                upstream.release()
            raise
        finally:
            on_sent()  # sent, or it never will be: nothing waits for it any more
            del self._opening_standalone[session_id]
            opened_here.set_result(None)  # waiters look again: they join this stream, or try themselves
        return answer if plan is None else plan

    async def _post_with_cursor(
        self, request: web.Request, body: bytes, message: ClientMessage, session_id: str, cursor_header: str
    ) -> web.StreamResponse:
        """The design note's client: POST + ``Last-Event-ID``. The cursor is checked before anything is
        forwarded; then this response carries the old stream's tail and the new request's events (a
        re-sent request's stream instead, when it began after the cursor). The streams one view followed
        are grouped: the client holds one cursor for them, so a re-attach with it follows them all."""
        granted = await self.store.access(session_id)
        if granted is not None:  # the cursor's facts and the stream's tail: only to accepted credentials
            refused = await authorize(self.ctx, request, session_id, granted, message.first_id)
            if refused is not None:
                return refused
        decided = await self._decide(session_id, cursor_header, granted)
        if isinstance(decided, ProxyError):
            return self.ctx.reject(request, decided, message.first_id)
        assert granted is not None  # _decide found the session, in the incarnation checked
        decision, stream, newest = decided.decision, decided.stream, decided.newest
        # A standalone stream never ends and this response must: its events stay for a GET re-attach.
        followed = [] if stream.standalone else [decision.stream, *stream.group]
        claimed = await self._claim_and_reserve(
            request, session_id, message, granted, resume=(decision.after, followed)
        )
        if isinstance(claimed, web.StreamResponse):
            return claimed
        try:
            reader = None
            if isinstance(claimed, int):  # re-sent: its stream is followed, the request not forwarded again
                streams = followed if claimed in followed else [*followed, claimed]
            else:
                opened = await self._forward_claimed(request, body, message, session_id, granted)
                if isinstance(opened, web.Response):
                    return opened
                streams = list(followed)
                if isinstance(opened, _Opened):
                    streams.append(opened.stream)
                elif opened.status == 200 and opened.content_type == "application/json":
                    retained = await self._retain_answer(request, session_id, message, opened, granted.epoch)
                    streams.append(retained)
                elif opened.status == 202:
                    opened.release()  # notifications only: the view carries the old stream's tail alone
                    if not streams:
                        return web.Response(status=202)
                else:
                    # an upstream error is the answer
                    return await relay(self.ctx, request, opened, request_id=message.first_id)
                # This view's reader covers every stream, registered before anything is written, so no
                # burst of the new stream can be evicted under it; the new stream's first reader then goes.
                reader = self.ctx.local.add_reader(session_id, streams, decision.after)
                if isinstance(opened, _Opened):
                    self.ctx.local.remove_reader(session_id, opened.reader)
            if len(streams) > 1:
                await self.store.group_streams(session_id, streams)
            preface = self._resume_preface(request, cursor_header, decision.stream) if followed else b""
            plan = ViewPlan(streams, decision.after, _SSE_HEADERS, preface, newest, reader)
            return await serve_view(self.ctx, request, session_id, plan)
        finally:
            await release_view(self.ctx, session_id)

    async def _retain_answer(
        self,
        request: web.Request,
        session_id: str,
        message: ClientMessage,
        upstream: aiohttp.ClientResponse,
        epoch: str,
    ) -> int:
        """An application/json answer on a response that is an SSE view: kept as a one-event stream, so it
        reaches this client in the view and stays resumable like any response."""
        limit = self.settings.max_event_bytes
        answer = bytearray()
        try:
            async for chunk in upstream.content.iter_any():  # the whole body, but never more than the limit
                answer += chunk
                if len(answer) > limit:
                    break
        finally:
            upstream.release()
        now = self.ctx.clock()
        opened = await self.store.open_stream(
            session_id, StreamOrigin.POST, message.request_keys, now, epoch, priming=_primes(request, message)
        )
        if opened is None:
            raise UnknownSession(SessionGone.ENDED_WHILE_FORWARDED)
        if len(answer) <= limit:
            # JSON allows raw CR/LF only as whitespace between tokens: drop them, one data line.
            body = frame_body(bytes(answer).replace(b"\r", b"").replace(b"\n", b""))
        else:  # not deliverable as one SSE event: say so rather than truncate it
            data = {"reason": "event_too_large"}
            body = frame_body(error_response(message.first_id, SERVER_ERROR, "the answer is too large", data))
        await self.store.append(session_id, opened.number, [NewEvent(body, EventKind.RESPONSE)], now)
        await self.store.end_stream(session_id, opened.number, now)
        return opened.number

    # -- session end -------------------------------------------------------------------------------------

    async def _mcp_delete(self, request: web.Request) -> web.StreamResponse:
        routed = await self._routed(request, b"")
        if routed is not None:
            return routed
        session_id = request.headers.get(SESSION_HEADER)
        with self.ctx.drain.upstream_wait():
            upstream = await self.upstream.request(
                "DELETE", request.path_qs, upstream_headers(request), None, decoded=True
            )
        if session_id is not None and 200 <= upstream.status < 300:
            await self._drop_session(session_id)
            log.info("session %s ends (DELETE)", log_id(session_id))
        elif session_id is not None and upstream.status == 404:
            granted = await self.store.access(session_id)
            # Not another user's 404 (see trusted): credentials accepted in the session.
            if granted is not None and trusted(self.ctx, request, granted):
                await self._drop_session(session_id, granted.epoch)
                log.info("session %s ends (DELETE: the upstream does not know it)", log_id(session_id))
        return await relay(self.ctx, request, upstream)

    async def _drop_session(self, session_id: str, epoch: str | None = None) -> None:
        """Forget the session (only its incarnation ``epoch``, when given) and stop its pumps."""
        if await self.store.delete_session(session_id, epoch) or epoch is None:
            self.ctx.pumps.cancel_session(session_id)


@dataclass(frozen=True, slots=True)
class _Opened:
    """A POST whose SSE answer became stream ``stream`` of ``session_id``."""

    session_id: str
    stream: int
    priming_seq: int
    headers: list[tuple[str, str]]
    reader: int


_SSE_HEADERS: list[tuple[str, str]] = list(SSE_RESPONSE_HEADERS)


def _primes(request: web.Request, message: ClientMessage | None = None) -> bool:
    """Whether this request's SSE response starts with a priming event: its client speaks 2025-11-25 or
    later (the version an initialize asks for; after it, MCP-Protocol-Version, the negotiated one)."""
    if message is not None and message.is_initialize:
        return primes(message.protocol_version)
    return primes(request.headers.get(PROTOCOL_VERSION_HEADER))


def _client_headers(ctx: ProxyContext, upstream: UpstreamAnswer) -> list[tuple[str, str]]:
    """The upstream's response headers as the client gets them, with the SSE no-buffering headers set."""
    ours = {name.lower() for name, _ in SSE_RESPONSE_HEADERS}
    kept = [(n, v) for n, v in client_headers(ctx, upstream) if n.lower() not in ours]
    return kept + _SSE_HEADERS if kept else _SSE_HEADERS  # one shared list when nothing else is kept
