"""Shared fixtures: real example upstreams (official SDK + uvicorn, in the test's loop) and a real Redis."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web

from mcpresume.core.window import WindowLimits
from mcpresume.examples.event_store import InMemoryEventStore
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.store.redis import RedisStore
from tests.support import EVENT_STORE_RETRY_MS
from tests.support.redis import MakeRedisStore, RedisClusterProcesses, RedisProcess

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


@pytest.fixture(scope="session")
def redis_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A throwaway ``redis-server`` (no persistence) for the whole session (tests/support/redis.py).

    Skipped when ``redis-server`` is not installed, except under CI (env ``CI`` set), where it fails.
    """
    process = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def redis_server(redis_process: RedisProcess) -> str:
    """``redis://127.0.0.1:<port>/0`` of the session's throwaway ``redis-server``."""
    return redis_process.url


@pytest.fixture
def redis_db(redis_server: str) -> str:
    """The session's Redis, emptied (``FLUSHALL``) for this test: a test counting sessions sees its own."""
    port = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
        assert sock.recv(64) == b"+OK\r\n"
    return redis_server


@pytest.fixture
def redis_cluster_db(redis_cluster: RedisClusterProcesses) -> str:
    """The session's Redis Cluster, every node emptied (``FLUSHALL``) for this test."""
    for node in redis_cluster.nodes:
        with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
            sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
            assert sock.recv(64) == b"+OK\r\n"
    return redis_cluster.url


@pytest.fixture
async def redis_stores() -> AsyncIterator[MakeRedisStore]:
    """``make(url, limits, **options)``: a started ``RedisStore`` (60 s sessions, 1,000 at most, the priming
    event's retry 1000 ms, unless ``options`` say otherwise), closed after the test."""
    stores: list[RedisStore] = []

    async def make(url: str, limits: WindowLimits, **options: Any) -> RedisStore:
        store = RedisStore(
            url, limits, **{"session_ttl": 60.0, "max_sessions": 1000, "retry_ms": 1000, **options}
        )
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A ``redis-server`` of this test alone, to stop, pause or restart."""
    process = RedisProcess(tmp_path).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A real 3-node Redis Cluster (no replicas) for the whole session."""
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """Every async test runs twice: on uvloop, the loop the daemon runs on (Linux, macOS), and on asyncio's
    own, its fallback elsewhere. uvloop differs where it matters here (its transports are not
    asyncio.Transport subclasses; its create_connection has no happy_eyeballs_delay). A test marked
    ``processes`` runs once, on uvloop: the proxies it tests are processes of their own (on the daemon's
    loop), and the test's own loop only drives clients."""
    if item.get_closest_marker("processes") is not None:
        return {"uvloop": uvloop.new_event_loop}
    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl, installed by .ci/run), and its key."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    command = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2"
    command += " -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1"
    argv = [*command.split(), "-keyout", str(key), "-out", str(cert)]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key
