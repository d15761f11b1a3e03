"""The proxy on the Redis store, over real HTTP with the official-SDK example upstream and a real
``redis-server``: it serves, a stopped Redis is 503 ``store_unavailable`` (``/readyz`` too), and it serves
again once Redis is back; a session outlives the proxy process that began it."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from mcpresume.core.errors import StoreUnavailable
from mcpresume.core.window import WindowLimits
from tests.support import INITIALIZE_BODY, MCP_HEADERS, new_session_id
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy
from tests.support.redis import MakeRedisStore, RedisProcess

HANG_GUARD = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def on_redis(url: str, **settings: Any) -> dict[str, Any]:
    """The settings of a proxy on the Redis store: a free port, and the URL the other replicas reach it at."""
    port = free_port()
    return {"store": url, "port": port, "advertise_url": f"http://127.0.0.1:{port}/mcp", **settings}


def _results(events: list) -> list[object]:  # type: ignore[type-arg]
    return [orjson.loads(e.data).get("result") for e in events if e.data]


async def test_a_stopped_redis_is_503_store_unavailable_and_the_proxy_recovers(
    example_upstream: str, own_redis: RedisProcess
) -> None:
    async with (
        running_proxy(example_upstream, **on_redis(own_redis.url, metrics_port=0)) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = client.tool_call("add", {"a": 1, "b": 2})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            assert any(r is not None for r in _results(await collect(response)))
        own_redis.pause()
        try:
            started = time.monotonic()
            _, body = client.tool_call("add", {"a": 2, "b": 3})
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                elapsed = time.monotonic() - started
                assert response.status == 503
                error = await error_of(response)
            assert error["data"]["reason"] == "store_unavailable"
            assert elapsed < HANG_GUARD
        finally:
            own_redis.resume()
        _, body = client.tool_call("add", {"a": 3, "b": 4})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            assert any(r is not None for r in _results(await collect(response)))


async def test_readyz_is_503_while_redis_is_stopped(example_upstream: str, own_redis: RedisProcess) -> None:
    async with (
        running_proxy(example_upstream, **on_redis(own_redis.url, metrics_port=free_port())) as proxy,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{proxy.admin_url}/readyz") as ready:
            assert ready.status == 200
        own_redis.pause()
        try:
            async with http.get(f"{proxy.admin_url}/readyz") as ready:
                assert ready.status == 503
        finally:
            own_redis.resume()
        async with http.get(f"{proxy.admin_url}/readyz") as ready:
            assert ready.status == 200


async def test_a_session_outlives_the_proxy_process_that_began_it(
    example_upstream: str, own_redis: RedisProcess
) -> None:
    """A re-attach on another proxy process (a restart, or another replica) on the same Redis: exactly the
    events after the cursor, from the window in Redis."""
    async with aiohttp.ClientSession() as http:
        async with running_proxy(example_upstream, **on_redis(own_redis.url)) as first:
            client = ScriptedClient(http, first.url)
            await client.initialize()
            _, body = client.tool_call("count_slowly", {"n": 3, "delay": 0.01})
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                sent = await collect(response)
        cursors = [e.id.decode() for e in sent if e.id]
        assert len(cursors) >= 4  # priming, three progress notifications, the result
        async with running_proxy(example_upstream, **on_redis(own_redis.url)) as second:
            client.url = second.url
            headers = client.headers(**{"Last-Event-ID": cursors[1]})
            async with http.get(client.url, headers=headers) as response:
                assert response.status == 200
                replayed = await collect(response)
    assert [e.id.decode() for e in replayed if e.id] == cursors[2:]
    assert [e.data for e in replayed if e.id] == [e.data for e in sent if e.id][2:]


async def test_redis_at_maxmemory_is_an_outage_503_and_not_ready_then_nothing_lost(
    example_upstream: str, own_redis: RedisProcess
) -> None:
    """Redis full (``maxmemory`` with ``noeviction``, as the README recommends) refuses every write with
    "OOM command not allowed" while PING still answers: a request that needs a write is 503
    ``store_unavailable``, ``/readyz`` is 503 (it was 200: it only pinged), and once Redis has room again the
    session serves on, its calls running once each."""
    async with (
        running_proxy(example_upstream, **on_redis(own_redis.url, metrics_port=free_port())) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        admin = aioredis.Redis.from_url(own_redis.url)
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")  # below what Redis already holds: every write refused
            try:
                async with http.get(f"{proxy.admin_url}/readyz") as ready:
                    assert ready.status == 503
                _, body = client.tool_call("tally", {})
                async with http.post(client.url, data=body, headers=client.headers()) as response:
                    assert response.status == 503
                    assert (await error_of(response))["data"]["reason"] == "store_unavailable"
                # A session begun upstream that the store cannot take: the store's failure, never
                # too_many_sessions (which it was); the re-attach's touch fails the same (it was a 500).
                newcomer = ScriptedClient(http, proxy.url)
                with pytest.raises(KeyError):  # no Mcp-Session-Id: not begun
                    await newcomer.initialize()
                async with http.post(proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS) as response:
                    assert response.status == 503
                    assert (await error_of(response))["data"]["reason"] == "store_unavailable"
                with pytest.raises(StoreUnavailable):
                    await proxy.ctx.store.touch([client.session_id], 1e12)
            finally:
                await admin.config_set("maxmemory", "0")
        finally:
            await admin.aclose()
        async with http.get(f"{proxy.admin_url}/readyz") as ready:
            assert ready.status == 200
        _, body = client.tool_call("tally", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            (result,) = [r for r in _results(await collect(response)) if r is not None]
        assert result["structuredContent"]["result"] == 1  # the refused call never ran upstream


async def test_after_redis_restarts_no_call_fails_on_a_connection_to_the_redis_that_went_away(
    own_redis: RedisProcess, redis_stores: MakeRedisStore
) -> None:
    """Redis restarts (a failover, a restart with its data): every idle pooled connection is to the Redis
    that went away. Once the store's subscription is back, calls that come however much later all succeed:
    the connections were dropped when the subscription was lost. Before, each stale connection failed its
    next call with 503 ``store_unavailable``, 18 of 20 in a burst 15 s after the restart."""
    store = await redis_stores(own_redis.url, WindowLimits(64, 1 << 20, 60.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)

    async def burst() -> None:  # 20 calls at once: 20 pooled connections, and the link
        await asyncio.gather(*(store.has_session(sid) for _ in range(20)), store.owner(sid))

    await burst()
    own_redis.stop()
    own_redis.restart()  # empty: the test is about the connections, not the data
    admin = aioredis.Redis.from_url(own_redis.url)
    try:

        async def subscribed() -> bool:
            return bool((await admin.pubsub_numsub("mcpresume:news"))[0][1])

        await until(subscribed, what="the store's subscription is back")
    finally:
        await admin.aclose()
    await burst()  # raises StoreUnavailable on a stale connection
