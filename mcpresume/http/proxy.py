"""The aiohttp handler: what the proxy does with each client request, and which executor does it.

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
  - GET + ``Last-Event-ID`` (and POST + ``Last-Event-ID``): ``core.resume.decide`` re-attaches or rejects.
  - GET without it: the standalone stream, with no history.
  - DELETE: forwarded, then the session's state dropped.
  - Any of them while the store has not answered since start-up (a replica started before its Redis):
    503 ``store_unavailable`` (``ProxyContext.awaiting_store``).

Each handler decides, then acts: a pure plan module of the core decides what the request gets
(``core/post.py``, ``core/get.py``, ``core/delete.py``, and ``core/route.py`` first when several replicas
share the store), and the executor of the same name in ``http/`` carries the plan out. ``Proxy`` only admits
a request and dispatches it.

Every answer the proxy makes itself (4xx/5xx) carries a JSON-RPC error body whose ``error.data.reason`` is
stable, and is logged in one line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Final

from aiohttp import web

from mcpresume.core.errors import (
    BadSessionId,
    HeadersTooLarge,
    HostNotAllowed,
    OriginNotAllowed,
    ProxyError,
    ShuttingDown,
    StoreUnavailable,
)
from mcpresume.core.headers import (
    MAX_SESSION_ID_LEN,
    PROBE_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    effective_allowed_hosts,
    header_bytes,
    host_allowed,
    is_loopback,
    valid_session_id,
)
from mcpresume.core.jsonrpc import parse_client_body
from mcpresume.http.access import AccessLog, span_attributes
from mcpresume.http.bridge import Bridge
from mcpresume.http.context import ANSWERED, ARRIVED, PREPARED, ProxyContext
from mcpresume.http.delete import serve_delete
from mcpresume.http.forward import SSE, body_stream, passthrough, read_body
from mcpresume.http.get import Gets, Openings
from mcpresume.http.incoming import Post
from mcpresume.http.post import Posts
from mcpresume.http.route import Routing
from mcpresume.http.send import Sender
from mcpresume.http.tasks import Tasks
from mcpresume.process.tracing import Span
from mcpresume.streams.starter import PumpStarter

log = logging.getLogger("mcpresume.proxy")


# The status a request is counted with when its client left (its handler cancelled) before any answer: the
# one nginx logs for a client that closed its request.
CLIENT_CLOSED: Final = 499
# The (method, status) pairs whose counter is kept (``Proxy._ended``).
MAX_COUNTED: Final = 256


def unreturned_status(request: web.Request, exc: BaseException) -> int:
    """The status of a request whose handler did not return: the answer it was sent when its head went out
    (an SSE view its client dropped: 200); else 499 when it was cancelled (handler_cancellation: its client
    left; or the shutdown's last step), or the status aiohttp answers the exception with."""
    answered: int | None = request.get(ANSWERED)
    if answered is not None:
        return answered
    if isinstance(exc, asyncio.CancelledError):
        return CLIENT_CLOSED
    return int(exc.status) if isinstance(exc, web.HTTPException) else 500


class Proxy:
    """The client listener's one handler: admits a request, then dispatches it by path and method."""

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self._allowed_hosts = effective_allowed_hosts(ctx.settings.allowed_hosts, ctx.settings.host)
        self._hosts_hint = (
            ""
            if ctx.settings.allowed_hosts or is_loopback(ctx.settings.host)
            else " (allowed_hosts is unset: on a non-loopback address, IP addresses and localhost only; "
            "list the names clients use in allowed_hosts)"
        )
        openings = Openings()  # the standalone GETs being opened: a session's POSTs wait for them
        self.pumps = PumpStarter(
            ctx.settings, ctx.pumps, ctx.store, ctx.local, ctx.metrics, ctx.upstream, ctx.clock
        )  # every pump starts there, and the adoption of orphaned streams
        self.routing = Routing(ctx, self.pumps)  # several replicas: forward, refuse, or take over
        self.gets = Gets(ctx, self.pumps, openings)
        self.posts = Posts(ctx, Sender(ctx, self.pumps, openings))
        self.bridge = Bridge(ctx, self.pumps)  # handshake-era sessions in front of a modern-only upstream
        self.tasks = Tasks(ctx) if ctx.settings.tasks else None  # durable long calls (2026-07-28)
        self.access = AccessLog(ctx.settings.access_log, ctx.upstream.mcp_path)
        # mcpresume_requests_total's child per (method, status) seen: a labels() lookup per request costs
        # more than the increment. Bounded (a client chooses its method): emptied when full.
        self._counted: dict[tuple[str, int], Any] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Admit, route (several replicas), dispatch by method. Inline, not in helpers: a held view's task
        keeps every frame above its follow loop (tests/test_review_findings.py counts them)."""
        ctx, settings = self.ctx, self.settings
        if PROBE_HEADER in request.headers and ctx.hop is not None and request.path == ctx.upstream.mcp_path:
            # Another replica asks whether this one is alive (``Hop.probe``): a draining one is not.
            return web.Response(
                status=503 if ctx.drain.started else 204, headers={REPLICA_HEADER: settings.replica}
            )
        request[ARRIVED] = asyncio.get_running_loop().time()
        methods: tuple[str, ...] = ()  # a POST's JSON-RPC methods, for its access line
        span = self._span(request) if ctx.tracing.enabled else None
        try:
            if ctx.drain.started:
                raise ShuttingDown("the proxy is shutting down; retry on another replica")
            session_id = self._admit(request)
            method = request.method
            if request.path != ctx.upstream.mcp_path:
                response = await self._other_path(request)
            elif ctx.awaiting_store:
                raise StoreUnavailable("the session store has not answered since this replica started")
            elif method == "POST":
                body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
                message = parse_client_body(body)
                methods = message.methods
                post = Post.admit(request, body, message, session_id)
                tasked = await self.tasks.serve(post) if self.tasks is not None else None
                if tasked is not None:
                    response = tasked
                    self.bridge.tasked()  # counted by era as every POST
                else:
                    routed = await self.routing.route(request, session_id, body, post.request_id)
                    if routed.answer is not None:
                        response = routed.answer
                    else:
                        if routed.asked:  # the session's access record: the executor needs it
                            post = replace(post, asked=True, access=routed.access)
                        response = await self._post(post)
            elif method == "GET":
                # Before anything is awaited: the session's POSTs that come after it wait for it (#12).
                ahead = self.gets.openings.arrive(request)
                try:
                    routed = await self.routing.route(request, session_id, b"")
                    response = (
                        routed.answer
                        if routed.answer is not None
                        else await self.bridge.standalone(request)
                        or await self.gets.serve(request, routed, ahead)
                    )
                finally:
                    ahead.settle()  # refused, or answered (a stream is placed sooner: Gets.serve)
            elif method == "DELETE":
                routed = await self.routing.route(request, session_id, b"")
                if routed.answer is not None:
                    response = routed.answer
                else:
                    response = await self.bridge.delete(request) or await serve_delete(ctx, request)
            else:
                response = await passthrough(ctx, request, body_stream(request, settings.body_timeout))
        except ProxyError as error:
            response = ctx.reject(request, error, None)
        except BaseException as exc:  # counted when it ends, as every request: once (the client left, say)
            self._ended(request, unreturned_status(request, exc), None, methods, span)
            raise
        self._ended(request, response.status, response, methods, span)
        return response

    async def _post(self, post: Post) -> web.StreamResponse:
        """A POST in this replica: bridged (http/bridge.py) or served as any."""
        response = await self.bridge.serve(post, self.posts.serve)
        if response is None:
            response = await self.posts.serve(post)
            self.bridge.served(post, response)
        return response

    def _ended(
        self,
        request: web.Request,
        status: int,
        response: web.StreamResponse | None,
        methods: tuple[str, ...],
        span: Span | None,
    ) -> None:
        """A request ended (``response``: the answer its handler returned; None: it did not return): the one
        place it is counted, its access line written and its span ended."""
        key = (request.method, status)
        counter = self._counted.get(key)
        if counter is None:
            if len(self._counted) >= MAX_COUNTED:
                self._counted.clear()
            counter = self._counted[key] = self.ctx.metrics.requests.labels(request.method, str(status))
        counter.inc()
        now = asyncio.get_running_loop().time()
        fields = self.access.ended(request, status, response, methods, now, want=span is not None)
        if span is not None and fields is not None:
            span.end(span_attributes(request, fields), fields["reason"])

    def _span(self, request: web.Request) -> Span | None:
        """The request's span: named by its method, and the MCP endpoint's path (any other path is the
        client's to choose: not in a name, which must stay few)."""
        path = request.path
        name = f"{request.method} {path}" if path == self.ctx.upstream.mcp_path else request.method
        attributes: dict[str, str | int] = {
            "http.request.method": request.method,
            "url.path": path[:200],
            "mcpresume.replica": self.settings.replica,
        }
        if request.remote:
            attributes["client.address"] = request.remote
        return self.ctx.tracing.start(name, request.headers, attributes)

    async def prepared(self, request: web.Request, response: web.StreamResponse) -> None:
        """The application's ``on_response_prepare``: the status a request was answered is known from here
        (its handler may yet be cancelled)."""
        request[ANSWERED] = response.status
        if self.access.on():  # its head's size, should the handler not return it (its client left)
            request[PREPARED] = response

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
                self.ctx.upstream.mcp_path,
            )
        return await passthrough(self.ctx, request, body)

    def _admit(self, request: web.Request) -> str | None:
        """Checks every request passes before anything is read or forwarded; its ``Mcp-Session-Id`` (None
        off the MCP endpoint)."""
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
            raise HostNotAllowed(f"Host {(host or '')[:200]!r} is not allowed{self._hosts_hint}")
        if request.path != self.ctx.upstream.mcp_path:
            return None
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is not None and not valid_session_id(session_id):
            raise BadSessionId(f"Mcp-Session-Id must be 1-{MAX_SESSION_ID_LEN} visible ASCII characters")
        return session_id
