"""The bundled example MCP upstream: an unmodified official-SDK server speaking Streamable HTTP.

Used by the demo and by the test-suite as the "real upstream" behind the proxy. Everything here runs in the
*current* event loop (uvicorn is driven as a task, not as a subprocess), so a test can start an upstream,
talk to it through the proxy, and shut it down without leaking tasks or sockets.

Requires the optional ``demo`` extra (``mcp`` and ``uvicorn``); the proxy core never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import weakref
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventStore
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.types import ASGIApp

from mcpresume.examples.event_store import InMemoryEventStore

__all__ = [
    "LOCAL_ALLOWED_HOSTS",
    "LOCAL_ALLOWED_ORIGINS",
    "InMemoryEventStore",
    "RunningUpstream",
    "build_example_app",
    "build_example_server",
    "local_transport_security",
    "serve_example_upstream",
]

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"

# The SDK's DNS-rebinding protection matches a ``host:*`` entry against any ``host:<port>`` (see
# `mcp.server.transport_security.TransportSecurityMiddleware._validate_host`), but an entry with a port
# wildcard does not match a Host header *without* a port, hence the bare names too.
LOCAL_ALLOWED_HOSTS: tuple[str, ...] = (
    "127.0.0.1",
    "127.0.0.1:*",
    "localhost",
    "localhost:*",
    "[::1]",
    "[::1]:*",
)
LOCAL_ALLOWED_ORIGINS: tuple[str, ...] = (
    "http://127.0.0.1",
    "http://127.0.0.1:*",
    "http://localhost",
    "http://localhost:*",
    "http://[::1]",
    "http://[::1]:*",
)


def local_transport_security() -> TransportSecuritySettings:
    """DNS-rebinding protection that accepts any loopback Host/Origin on any port.

    A proxy in front of the upstream forwards the *client's* Host header (``127.0.0.1:<proxy port>``), which
    the SDK would otherwise check against the upstream's own address.
    """
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=list(LOCAL_ALLOWED_HOSTS),
        allowed_origins=list(LOCAL_ALLOWED_ORIGINS),
    )


def build_example_server(*, name: str = "mcpresume-example") -> MCPServer[Any]:
    """An `MCPServer` with a handful of deterministic tools.

    Tools:
        ``echo(text)`` -> ``text``.
        ``add(a, b)`` -> ``a + b``.
        ``count_slowly(n=5, delay=0.05)``: n progress notifications ``(i, n, "step i of n")``, sleeping
            ``delay`` seconds after each, then ``"counted to n"``.
        ``poll_me(n=3, delay=0.01)``: like ``count_slowly`` but closes the request's SSE stream after every
            progress notification (``ctx.close_sse_stream()``), so a client must reconnect with
            ``Last-Event-ID`` to see the rest; returns ``"polled n times"``. Closing is a no-op unless the app
            has an event store and the client negotiated 2025-11-25 or later.
    """
    # log_level only matters when nothing configured the root logger yet (MCPServer calls basicConfig).
    server: MCPServer[Any] = MCPServer(name, log_level="WARNING")

    @server.tool(description="Return the given text unchanged.")
    async def echo(text: str) -> str:
        return text

    @server.tool(description="Add two integers.")
    async def add(a: int, b: int) -> int:
        return a + b

    calls = {"tally": 0}

    @server.tool(description="Count this call (a side effect) and return how many this server has run.")
    async def tally() -> int:
        calls["tally"] += 1
        return calls["tally"]

    @server.tool(description="Send n progress notifications, `delay` seconds apart, then return.")
    async def count_slowly(ctx: Context[Any, Any], n: int = 5, delay: float = 0.05) -> str:
        for i in range(1, n + 1):
            await ctx.report_progress(i, n, f"step {i} of {n}")
            await asyncio.sleep(delay)
        return f"counted to {n}"

    @server.tool(description="Progress notifications with the SSE stream closed after each (server polling).")
    async def poll_me(ctx: Context[Any, Any], n: int = 3, delay: float = 0.01) -> str:
        for i in range(1, n + 1):
            await ctx.report_progress(i, n, f"poll {i} of {n}")
            await ctx.close_sse_stream()
            await asyncio.sleep(delay)
        return f"polled {n} times"

    return server


def build_example_app(
    *,
    event_store: EventStore | None = None,
    retry_interval: int | None = None,
    json_response: bool = False,
    stateless: bool = False,
    name: str = "mcpresume-example",
    transport_security: TransportSecuritySettings | None = None,
    session_idle_timeout: float | None = None,
) -> Starlette:
    """The example server's Streamable HTTP ASGI app, mounted at ``/mcp``.

    A fresh `MCPServer` is built per call: the SDK's session manager can run only once, so one app serves
    one uvicorn lifetime. ``retry_interval`` (ms) is only sent to clients when ``event_store`` is set. The
    default ``transport_security`` is `local_transport_security()`. ``session_idle_timeout`` defaults to
    ``None`` (sessions never expire on their own) so long, idle tests are not reaped by the upstream.
    """
    server = build_example_server(name=name)
    return server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        stateless_http=stateless,
        event_store=event_store,
        retry_interval=retry_interval,
        session_idle_timeout=session_idle_timeout,
        transport_security=transport_security or local_transport_security(),
    )


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling alone.

    `uvicorn.Server.serve` swaps the process's SIGINT/SIGTERM handlers for its own and restores them when it
    returns; with several in-loop servers that stop in a non-LIFO order this leaves a dead server's handler
    installed (Ctrl+C stops working). The owner of the event loop owns signals.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# Upstreams running per event loop; see `_stop_sse_starlette_watcher`.
_running_in_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


async def _stop_sse_starlette_watcher() -> None:
    """Cancel the shutdown-watcher task sse-starlette leaves running in the loop.

    The SDK answers with sse-starlette's ``EventSourceResponse``, whose first use starts a per-thread
    ``_shutdown_watcher`` task that polls every 0.5 s until a process-wide "uvicorn is exiting" flag is set
    (set only from uvicorn's signal handler, which `_InLoopServer` does not install). Left alone it outlives
    the upstream and shows up as a leaked task. Its ``finally`` re-arms sse-starlette, so the next SSE
    response starts a fresh one.
    """
    current = asyncio.current_task()
    watchers = [
        task
        for task in asyncio.all_tasks()
        if task is not current
        and getattr(task.get_coro(), "__qualname__", None) == "_shutdown_watcher"
        and "sse_starlette" in getattr(getattr(task.get_coro(), "cr_code", None), "co_filename", "")
    ]
    for task in watchers:
        task.cancel()
    for task in watchers:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class RunningUpstream:
    """Serve an ASGI app with uvicorn as a task in the current event loop.

    Binds ``host:port`` itself (``port=0`` picks a free port; the chosen one is `port` after start), so the
    port is known before uvicorn runs and an upstream can be restarted on the same port. Use as an async
    context manager::

        async with RunningUpstream(build_example_app()) as upstream:
            ...  # upstream.url == "http://127.0.0.1:<port>/mcp"

    On exit uvicorn is asked to stop; HTTP responses still streaming after ``shutdown_grace`` seconds (e.g.
    SSE streams a client left open) have their connections aborted, then the task is awaited.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        path: str = MCP_PATH,
        shutdown_grace: float = 0.5,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.path = path
        self.shutdown_grace = shutdown_grace
        self._server: _InLoopServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The MCP endpoint, e.g. ``http://127.0.0.1:54321/mcp``."""
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            raise RuntimeError("upstream is not running")
        return self._server

    async def start(self) -> str:
        """Bind, start uvicorn, wait until it accepts connections; return `url`."""
        if self._task is not None:
            raise RuntimeError("upstream already started")
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            http="h11",
            ws="none",
            lifespan="on",
            log_level="warning",
            log_config=None,
            access_log=False,
        )
        server = _InLoopServer(config)
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{self.port}")
        task = self._task
        loop = asyncio.get_running_loop()
        _running_in_loop[loop] = _running_in_loop.get(loop, 0) + 1
        try:
            while not server.started:
                if task.done():
                    task.result()  # re-raise whatever stopped uvicorn
                    raise RuntimeError("uvicorn exited before it started")
                await asyncio.sleep(0.005)
        except BaseException:
            self._task = None
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            sock.close()
            await self._release_loop()
            raise
        return self.url

    async def stop(self) -> None:
        """Stop uvicorn and wait for it; idempotent."""
        task, server = self._task, self._server
        if task is None or server is None:
            return
        self._task = None
        server.should_exit = True
        done, _ = await asyncio.wait({task}, timeout=self.shutdown_grace)
        if not done:
            # Graceful shutdown waits for in-flight responses to complete; an SSE stream nobody closes never
            # does. Dropping the connection delivers http.disconnect to the app, which ends the response.
            for connection in list(server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
        try:
            await task
        finally:
            await self._release_loop()

    @staticmethod
    async def _release_loop() -> None:
        loop = asyncio.get_running_loop()
        remaining = _running_in_loop.get(loop, 1) - 1
        if remaining > 0:
            _running_in_loop[loop] = remaining
            return
        _running_in_loop.pop(loop, None)
        await _stop_sse_starlette_watcher()

    async def __aenter__(self) -> RunningUpstream:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def serve_example_upstream(
    host: str = "127.0.0.1",
    port: int = 0,
    **app_kwargs: Any,
) -> AsyncIterator[str]:
    """Run `build_example_app(**app_kwargs)` in the current loop; yield its endpoint URL (``.../mcp``)."""
    async with RunningUpstream(build_example_app(**app_kwargs), host=host, port=port) as upstream:
        yield upstream.url


def main(argv: list[str] | None = None) -> int:
    """``python -m mcpresume.examples.upstream``: the example upstream on its own (deploy/compose/)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        prog="python -m mcpresume.examples.upstream",
        description="The bundled example MCP server (official SDK, no event store), for trying the proxy.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [default: 127.0.0.1]")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on [default: 8000]")
    parser.add_argument(
        "--any-host",
        action="store_true",
        help="accept any Host and Origin header (the SDK's DNS-rebinding check only accepts loopback ones):"
        " for a container only the proxy reaches",
    )
    args = parser.parse_args(argv)
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False) if args.any_host else None

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        app = build_example_app(transport_security=security)
        async with RunningUpstream(app, host=args.host, port=args.port) as upstream:
            print(f"example MCP upstream: {upstream.url}", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
