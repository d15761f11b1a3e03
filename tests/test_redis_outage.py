"""A Redis outage in the middle of a call: the pump never drops an event it has read. It stops reading the
upstream while the store is down (TCP backpressure holds the upstream), for up to ``store_outage_grace``,
then lets go of the upstream connection and resumes it upstream from its last id once Redis is back. Views
end cleanly (``store_unavailable``), and their clients re-attach with their cursors: no gap, no duplicate.

A real ``redis-server`` paused with SIGSTOP (it then accepts connections and answers nothing, the worst
case for a client library), the official SDK's server upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from tests.support.proxy import ScriptedClient, collect, running_proxy
from tests.support.redis import RedisProcess
from tests.test_redis_proxy import on_redis


async def _call_through_an_outage(
    upstream: str, redis: RedisProcess, outage: float, **settings: Any
) -> tuple[list[Any], list[Any]]:
    """A count_slowly call whose client reads three events; Redis is paused for ``outage`` seconds
    meanwhile; then the client re-attaches with its last cursor. The client's messages before the outage
    and after it."""
    async with (
        running_proxy(upstream, **on_redis(redis.url, metrics_port=0, **settings)) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 30, "delay": 0.05})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            redis.pause()
            try:
                await asyncio.sleep(outage)
            finally:
                redis.resume()
            async with asyncio.timeout(30):
                head += await collect(response)  # to its end: complete, or ended cleanly by the outage
        tail: list[Any] = []
        if not any(e.data and b'"result"' in e.data for e in head):  # the view ended early: re-attach
            cursor = [e.id for e in head if e.id][-1]
            assert cursor is not None
            headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
            async with asyncio.timeout(30), http.get(client.url, headers=headers) as response:
                assert response.status == 200
                tail = await collect(response)
    before = [orjson.loads(e.data) for e in head if e.data]
    after = [orjson.loads(e.data) for e in tail if e.data]
    return before, after


def _progress(messages: list[Any]) -> list[int]:
    return [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]


async def test_a_short_outage_loses_nothing_the_pump_read(
    example_upstream: str, own_redis: RedisProcess
) -> None:
    before, after = await _call_through_an_outage(example_upstream, own_redis, outage=1.0)
    assert _progress(before) + _progress(after) == list(range(1, 31))  # no gap, no duplicate
    results = [m["result"]["structuredContent"]["result"] for m in before + after if "result" in m]
    assert results == ["counted to 30"]


async def test_past_the_grace_the_pump_lets_go_and_resumes_upstream_when_redis_is_back(
    example_upstream_with_event_store: str, own_redis: RedisProcess
) -> None:
    before, after = await _call_through_an_outage(
        example_upstream_with_event_store, own_redis, outage=2.0, store_outage_grace=0.5
    )
    assert _progress(before) + _progress(after) == list(range(1, 31))
    results = [m["result"]["structuredContent"]["result"] for m in before + after if "result" in m]
    assert results == ["counted to 30"]
