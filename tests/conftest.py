"""Shared fixtures: real example upstreams (official SDK + uvicorn, in the test's loop) and a real Redis."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web

from mcpresume.examples.event_store import InMemoryEventStore
from mcpresume.examples.upstream import serve_example_upstream
from tests.support import EVENT_STORE_RETRY_MS, redis_ping

ServeApp = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[ServeApp]:
    """Start scripted aiohttp upstreams on free loopback ports; yields ``start(app) -> MCP endpoint URL``."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        # handler_cancellation: a proxy that drops the connection ends the handler, as with a real server;
        # a short shutdown_timeout: a handler still holding a stream at teardown must not hold the test;
        # header limits over the proxy's (an upstream that takes a 9 KB bearer token, as the proxy does).
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=1.0,
            max_line_size=1 << 16,
            max_field_size=1 << 16,
            max_headers=1 << 13,
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}/mcp"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def example_upstream() -> AsyncIterator[str]:
    """URL (``http://127.0.0.1:<port>/mcp``) of a running example upstream with default options."""
    async with serve_example_upstream() as url:
        yield url


@pytest.fixture
def event_store() -> InMemoryEventStore:
    """The event store behind `example_upstream_with_event_store` (inspect it to see what was stored)."""
    return InMemoryEventStore()


@pytest.fixture
async def example_upstream_with_event_store(event_store: InMemoryEventStore) -> AsyncIterator[str]:
    """URL of an example upstream that supports resumption itself.

    It has an event store and ``retry_interval=200`` ms, so every SSE response to a 2025-11-25 client starts
    with a priming event (``id`` + empty ``data`` + ``retry: 200``), a client that loses a stream reconnects
    with ``GET`` + ``Last-Event-ID`` after 200 ms, and the ``poll_me`` tool can close its stream on purpose
    (``ctx.close_sse_stream()``) to make the client poll.
    """
    async with serve_example_upstream(event_store=event_store, retry_interval=EVENT_STORE_RETRY_MS) as url:
        yield url


# ------------------------------------------------------------------------------------------------------------
# Redis


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_redis(binary: str, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    log = workdir / f"redis-{port}.log"
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir), "--logfile", str(log), "--daemonize", "no"]
    return subprocess.Popen(
        [binary, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0`` of a throwaway ``redis-server`` (no persistence) for the whole session.

    Skipped when ``redis-server`` is not installed, except under CI (env ``CI`` set), where it fails.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server not found on PATH (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the Redis tests", pytrace=False)
        pytest.skip(message)
    workdir = tmp_path_factory.mktemp("redis")
    last_error = "not started"
    for _attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        proc = _start_redis(binary, workdir, port)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and proc.poll() is None and not redis_ping(port):
            time.sleep(0.02)  # a subprocess's readiness can only be polled
        if proc.poll() is None and redis_ping(port):
            try:
                yield f"redis://127.0.0.1:{port}/0"
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            return
        log = workdir / f"redis-{port}.log"
        last_error = log.read_text(errors="replace")[-2000:] if log.exists() else f"exit status {proc.poll()}"
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    pytest.fail(f"redis-server did not start:\n{last_error}", pytrace=False)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """Every async test runs twice: on uvloop, the loop the daemon runs on (Linux, macOS), and on asyncio's
    own, its fallback elsewhere. uvloop differs where it matters here (its transports are not
    asyncio.Transport subclasses; its create_connection has no happy_eyeballs_delay)."""
    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
