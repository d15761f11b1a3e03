"""Assembly: build the proxy and admin applications from settings, a store and a metrics registry.

Nothing here is global: ``build_app`` receives what it needs, and everything it creates lives in the app
(typed ``web.AppKey`` state, ``cleanup_ctx`` for resources), so tests and the demo can run several proxies in
one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from mcpresume import __version__
from mcpresume.core.errors import StoreUnavailable
from mcpresume.core.window import WindowLimits
from mcpresume.daemon.inspector import add_inspector
from mcpresume.http.context import ProxyContext
from mcpresume.http.listener import CappedSite, ConnectionCap, connection_budget
from mcpresume.http.proxy import Proxy
from mcpresume.http.route import probe_timeout
from mcpresume.process.config import Settings, check_advertise_url
from mcpresume.process.drain import DRAIN_GRACE
from mcpresume.process.logs import log_id
from mcpresume.process.metrics import CONTENT_TYPE_LATEST, Metrics
from mcpresume.process.tracing import Tracing
from mcpresume.replicas.hop import Hop, owner_head_timeout
from mcpresume.replicas.lease import DuplicateReplica, Lease
from mcpresume.store import SessionStore
from mcpresume.store.memory import MemoryStore
from mcpresume.streams.upstream import Upstream

log = logging.getLogger("mcpresume")

CONTEXT = web.AppKey("context", ProxyContext)
PROXY = web.AppKey("proxy", Proxy)

# How often idle sessions and expired events are reaped, at most. A tenth of the TTL keeps the overshoot
# small; the cap keeps gauges fresh for scrapes.
REAP_INTERVAL_MAX = 5.0
# How often a replica whose store did not answer at start asks it again (one log line each time): a sidecar's
# Redis that comes up a few seconds late costs a few lines and seconds, not a crash loop's restarts.
STORE_RETRY_INTERVAL = 1.0


class _OneLineForUnparsableRequests(logging.Filter):
    """A request aiohttp cannot parse as HTTP (a bad chunk size, a folded header line) is answered by
    aiohttp itself (400, text/plain, before any handler) and logged by it at ERROR with a traceback: any
    client could fill the log with them. Made one WARNING line each, with the client and the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage):
            # The error's name, not its message: that quotes the offending line, which may hold a token.
            record.msg = "unparsable request from %s: %s"
            record.args = (
                record.args[0] if isinstance(record.args, tuple) and record.args else None,
                type(error).__name__,
            )
            record.exc_info = None
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_UNPARSABLE = _OneLineForUnparsableRequests()


def build_store(settings: Settings, metrics: Metrics | None = None) -> SessionStore:
    limits = WindowLimits(settings.window_events, settings.window_bytes, settings.window_ttl)
    if settings.store != "memory":
        try:
            from mcpresume.store.redis import RedisStore  # the redis extra: imported only when configured
        except ImportError as exc:  # reported as one line at start-up, as a store the install lacks
            raise NotImplementedError(f"store: {exc}; install mcpresume[redis]") from exc
        return RedisStore(
            settings.store,
            limits,
            session_ttl=settings.session_ttl,
            max_sessions=settings.max_sessions,
            retry_ms=settings.retry_ms,
            metrics=metrics,
        )
    return MemoryStore(
        limits,
        session_ttl=settings.session_ttl,
        max_sessions=settings.max_sessions,
        retry_ms=settings.retry_ms,
        max_total_bytes=settings.max_total_window_bytes,
    )


def build_app(
    settings: Settings,
    store: SessionStore,
    metrics: Metrics,
    *,
    clock: Callable[[], float] = time.time,
    owns_store: bool = True,
) -> web.Application:
    """The proxy's application. ``owns_store``: the store is this app's, closed when it stops (else it is
    shared with other proxies of this process, as in tests, and closed by whoever made it)."""
    if settings.upstream is None:
        raise ValueError("upstream: required to serve")
    upstream = Upstream(
        settings.upstream,
        connect_timeout=settings.connect_timeout,
        first_byte_timeout=settings.first_byte_timeout,
    )
    ctx = ProxyContext(settings, store, metrics, upstream, clock, owns_store=owns_store)
    ctx.tracing = upstream.tracing = Tracing(settings.replica, __version__)
    store.set_news(ctx.local.changed)
    check_advertise_url(settings.store, settings.advertise_url)
    if settings.advertise_url is not None:  # several replicas over one store: owner routing
        ctx.hop = Hop(
            settings.replica,
            metrics,
            connect_timeout=settings.connect_timeout,
            first_byte_timeout=owner_head_timeout(settings.connect_timeout, settings.first_byte_timeout),
            stall_timeout=settings.stall_timeout,
            keepalive_timeout=settings.header_timeout / 2,
            reject=ctx.reject,
            drain=ctx.drain,
        )
        hop = ctx.hop
        hop.tracing = ctx.tracing
        probe_wait = probe_timeout(settings)
        ctx.lease = Lease(
            store,
            settings.replica,
            settings.advertise_url,
            settings.owner_lease_ttl,
            metrics,
            clock,
            probe=lambda url: hop.probe(url, probe_wait),
        )
    # client_max_size is enforced by the MCP handler itself (413 with a JSON-RPC body); aiohttp's own check
    # would answer in plain text, so it is set just above ours.
    app = web.Application(client_max_size=settings.max_body_bytes + 1)
    app[CONTEXT] = ctx
    proxy = app[PROXY] = Proxy(ctx)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    app.on_response_prepare.append(proxy.prepared)  # the status a request was answered: for the metric
    app.cleanup_ctx.append(_lifecycle)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    ctx, proxy = app[CONTEXT], app[PROXY]
    await ctx.store.start()
    await ctx.upstream.start()
    if ctx.hop is not None:
        await ctx.hop.start()
    begin = _Begin(ctx, proxy)
    loop = asyncio.get_running_loop()
    try:
        ready = await begin.attempt()
    except DuplicateReplica:  # nothing may run beside the other process: all closed, then the error
        if ctx.hop is not None:
            await ctx.hop.close()
        await ctx.upstream.close()
        await ctx.store.close()
        raise
    proxy.bridge.start()  # the upstream's era probed in the background (bridge = "auto")
    if ready:
        housekeeping = loop.create_task(_reap_forever(ctx, proxy))
    else:  # serve meanwhile, not ready: a sidecar whose Redis comes up late must not crash-loop
        ctx.awaiting_store = True
        housekeeping = loop.create_task(begin.when_the_store_answers())
    yield
    # The handlers are done (step 3 of Drain.run, which goes on with the pumps, the lease, the closes).
    housekeeping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await housekeeping
    if proxy.tasks is not None:
        await proxy.tasks.close()
    await proxy.bridge.close()


class _Begin:
    """What a replica does with its store before it is ready: register its lease (several replicas), then
    adopt the streams its previous process was pumping when it died (a shared store kept them). A store that
    does not answer at start (a sidecar's Redis not up yet) is asked again every ``STORE_RETRY_INTERVAL``, one
    log line each time, while the replica serves: ``/readyz`` 503, requests on the MCP endpoint 503
    ``store_unavailable`` (``ProxyContext.awaiting_store``). Then it is ready, and the housekeeping starts."""

    def __init__(self, ctx: ProxyContext, proxy: Proxy) -> None:
        self.ctx = ctx
        self.proxy = proxy
        self.leased = False

    async def attempt(self) -> bool:
        """One attempt; whether the replica is ready (else one line says why)."""
        ctx = self.ctx
        try:
            # Asked first: the lease is registered, and the orphans adopted, only once the store answers
            # (a lease that fails to register says it lapsed, a failed adoption would stop the start).
            if not await ctx.store.ready():
                raise StoreUnavailable("the session store did not answer (ping)")
            if ctx.lease is not None and not self.leased:
                await ctx.lease.start()  # DuplicateReplica: another live process holds this replica id
                self.leased = True  # its own renewals retry it from now on
            self.proxy.pumps.adopt(await ctx.store.orphans(ctx.settings.replica))
        except (StoreUnavailable, TimeoutError) as error:
            log.warning(
                "not ready: %s; asking again in %.0f s (meanwhile /readyz and the MCP endpoint answer 503)",
                str(error) or "the session store did not answer in time",
                STORE_RETRY_INTERVAL,
            )
            return False
        return True

    async def when_the_store_answers(self) -> None:
        while True:
            await asyncio.sleep(STORE_RETRY_INTERVAL)
            try:
                if await self.attempt():
                    break
            except DuplicateReplica as error:  # found only now the store answers: never ready, and says why
                log.error("not serving: %s", error)
                return
        self.ctx.awaiting_store = False
        log.info("the session store answers: ready")
        await _reap_forever(self.ctx, self.proxy)


async def _reap_forever(ctx: ProxyContext, proxy: Proxy) -> None:
    interval = min(REAP_INTERVAL_MAX, ctx.settings.session_ttl / 10, ctx.settings.window_ttl / 10)
    while True:
        await asyncio.sleep(interval)
        try:
            await reap_once(ctx)
            if proxy.tasks is not None:
                await proxy.tasks.sweep()  # counts the tasks that expired
            if ctx.lease is not None:
                await take_over_lost(ctx, proxy)
        except (StoreUnavailable, TimeoutError) as error:  # the store is down: the next round retries
            log.warning("housekeeping skipped: the store is unavailable (%s)", error)
        except Exception:  # the reaper must outlive a store hiccup
            log.exception("reaping failed")


async def reap_once(ctx: ProxyContext) -> None:
    now = ctx.clock()
    # A POST stream no client read and the upstream fed nothing for session_ttl keeps its session no longer:
    # its pump closes it (and its session then expires as idle, as of the stream's last activity).
    ctx.pumps.stop_unattended(now, ctx.settings.session_ttl)
    # Sessions with a view open here are active: touched first, so they never expire under it.
    await ctx.store.touch(ctx.local.attached_sessions(), now)
    ctx.local.news.forget_gone()
    dropped, evicted = await ctx.store.reap(now)
    for session_id in dropped:
        ctx.pumps.cancel_session(session_id)
        ctx.upstream.aliases.pop(session_id, None)  # begun again upstream (reinitialize): no more
        ctx.list_changes.pop(session_id, None)
        log.info("session %s expired after %.0f s idle", log_id(session_id), ctx.settings.session_ttl)
    ctx.metrics.expired_sessions.inc(len(dropped))
    ctx.metrics.evicted(evicted)
    ctx.metrics.store_stats(await ctx.store.stats())


async def take_over_lost(ctx: ProxyContext, proxy: Proxy) -> None:
    """Take over the sessions of replicas whose lease is gone (one winner each, by the store, and only on
    evidence that they are: ``http/route.py``), and forget the registrations of replicas long dead."""
    for owner in await ctx.store.lost_owners(ctx.clock()):
        if owner != ctx.settings.replica:
            await proxy.routing.take_over(owner)
    lease = ctx.lease
    now = ctx.clock()
    if lease is not None and lease.answered_for(now) >= lease.ttl:  # not on the leases an outage lapsed
        pruned = await ctx.store.prune_replicas(now - prune_after(lease.ttl))
        if pruned:
            ctx.metrics.pruned_replicas.inc(len(pruned))
            log.info("forgot the registration of replica(s) %s: no lease for a long time", ", ".join(pruned))


def prune_after(ttl: float) -> float:
    """How long after its lease ended a replica's registration is forgotten: 30 leases, 5 minutes at the
    default lease, and never under a minute: long past any takeover of its sessions."""
    return max(60.0, 30 * ttl)


def build_admin_app(ctx: ProxyContext, ready: Callable[[], bool]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        # A store that does not answer must not fail the scrape: Prometheus would mark the instance down just
        # when mcpresume_store_errors_total (which counts this failure, op "stats") matters. The gauges read
        # from the store keep their last values meanwhile (docs/reference.md).
        with contextlib.suppress(StoreUnavailable):
            ctx.metrics.store_stats(await ctx.store.stats())
        return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ok = ready() and not ctx.drain.started and not ctx.awaiting_store and await ctx.store.ready()
        if ok and ctx.settings.ready_on_upstream:  # a sidecar's: its pod leaves the balancer with it
            ok = await ctx.upstream.answers(ctx.settings.connect_timeout)
        return web.json_response({"status": "ready" if ok else "not ready"}, status=200 if ok else 503)

    admin = web.Application()
    admin.router.add_get("/metrics", metrics)
    admin.router.add_get("/healthz", healthz)
    admin.router.add_get("/readyz", readyz)
    if ctx is not None:  # (the tests build it without one to list its paths)
        add_inspector(admin, ctx)
    return admin


@dataclass
class RunningProxy:
    """A proxy serving on real sockets (the daemon, the demo and the tests all start it this way)."""

    url: str  # the proxy's MCP endpoint, as a client should use it
    port: int
    admin_url: str | None
    app: web.Application
    runners: list[web.AppRunner]
    connections: ConnectionCap  # the client listener's open connections and its cap

    @property
    def ctx(self) -> ProxyContext:
        return self.app[CONTEXT]

    async def stop(self) -> None:
        """The graceful drain, ``Drain.run`` (its steps are the module docstring of ``process/drain.py``). The
        admin listener goes last, so metrics and health stay scrapeable while draining."""
        runners, self.runners = self.runners, []  # idempotent: a second stop has nothing left to do
        if not runners:
            return
        serving, *admin = runners
        try:
            await self.ctx.drain.run(self.ctx, serving.cleanup)
        finally:
            for runner in admin:
                await runner.cleanup()


async def start_proxy(
    settings: Settings,
    *,
    store: SessionStore | None = None,
    metrics: Metrics | None = None,
    clock: Callable[[], float] = time.time,
) -> RunningProxy:
    metrics = metrics or Metrics()
    app = build_app(
        settings, store or build_store(settings, metrics), metrics, clock=clock, owns_store=store is None
    )
    metrics.max_sessions.set(settings.max_sessions)
    # handler_cancellation: a client that goes away cancels its handler, so its attachment ends at once
    # (pumps are separate tasks and are not affected).
    # aiohttp's HTTP parser refuses a header line over 8190 bytes before the proxy sees the request (400,
    # text/plain): a line may be as long as max_header_bytes allows in all (an OAuth bearer token can pass
    # 8 KiB). Its 128 headers at most stay: the parser has no limit on the total, so the count bounds what
    # one request head can hold before the proxy's own check (431) runs: 128 x max_header_bytes.
    header_limit = settings.max_header_bytes
    limit, descriptors = connection_budget(settings.max_connections)
    if limit < settings.max_connections:
        log.warning(
            "max_connections lowered from %d to %d: the process may open %s files",
            settings.max_connections,
            limit,
            descriptors,
        )
    cap = ConnectionCap(
        limit, metrics.client_connections.set, lambda how: metrics.refused_connections.labels(how).inc()
    )
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        # aiohttp's keep-alive timer runs from a connection's opening, and from each answer's end, until a
        # complete request head arrives: a connection silent or trickling its head for header_timeout is
        # closed (slowloris). It is the keep-alive idle timeout as well.
        keepalive_timeout=settings.header_timeout,
        # aiohttp waits this long for handlers before it cancels them: the drain ends views cleanly at
        # drain_timeout (Drain.run), so this comes after, for a write that cannot finish
        shutdown_timeout=settings.drain_timeout + DRAIN_GRACE,
        max_line_size=max(8190, header_limit),  # the request line too: never below aiohttp's own
        max_field_size=max(8190, header_limit),
        max_headers=128,
    )
    server_log = logging.getLogger("aiohttp.server")
    if _UNPARSABLE not in server_log.filters:
        server_log.addFilter(_UNPARSABLE)
    # Both listeners are bound before anything starts (the upstream client, the store), so a port in use
    # fails with one ListenError and nothing to clean up.
    sock = _listen(settings.host, settings.port, "port")
    admin_sock = None
    admin_host = settings.metrics_host or settings.host
    if settings.metrics_port:
        try:
            admin_sock = _listen(admin_host, settings.metrics_port, "metrics_port")
        except ListenError:
            sock.close()
            raise
    try:
        await runner.setup()
    except DuplicateReplica:
        sock.close()
        if admin_sock is not None:
            admin_sock.close()
        raise
    site = CappedSite(runner, sock, cap)
    await site.start()
    port = sock.getsockname()[1]
    runners = [runner]
    admin_url = None
    if admin_sock is not None:
        admin = web.AppRunner(
            build_admin_app(app[CONTEXT], lambda: sock.fileno() != -1),
            access_log=None,
            keepalive_timeout=settings.header_timeout,
        )
        await admin.setup()
        await web.SockSite(admin, admin_sock).start()
        runners.append(admin)
        admin_url = f"http://{_url_host(admin_host)}:{admin_sock.getsockname()[1]}"
    assert settings.upstream is not None
    path = app[CONTEXT].upstream.mcp_path
    if unlike_mcp_path(path):
        log.warning(
            "upstream path %r does not look like an MCP endpoint (usually /mcp): only requests to exactly "
            "this path are resumable, every other path is relayed as is; check --upstream",
            path,
        )
    url = f"http://{_url_host(settings.host)}:{port}{path}"
    return RunningProxy(url, port, admin_url, app, runners, cap)


def unlike_mcp_path(path: str) -> bool:
    """Whether an upstream URL's path is probably not an MCP endpoint: its last segment does not name
    MCP (``/``, ``/sse`` of the older HTTP+SSE transport, ``/api``; ``/mcp``, ``/v1/mcp/`` pass)."""
    return "mcp" not in path.rstrip("/").rsplit("/", 1)[-1].lower()


class ListenError(OSError):
    """A listener could not be bound: the message names the address, the port and the setting."""


def _listen(host: str, port: int, setting: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {_url_host(host)}:{port} ({setting}): {reason}") from None
    sock.setblocking(False)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
