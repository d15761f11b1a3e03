"""The era bridge over several replicas: a bridged session's client facts (its initialize's capabilities and
info, its log level, its subscribed resources) are kept with the session in the store, so a replica that
serves it after its owner is gone sends every request (and its listen) with them (issue 34, deliver 2).
Real ``mcpresume serve`` processes over a real ``redis-server`` of the test's own, the owner killed with
SIGKILL."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.modern_upstream import serve_modern_upstream
from tests.support.proxy import ScriptedClient, collect, error_of
from tests.support.redis import RedisProcess
from tests.test_redis_scale import sidecars

CAPABILITIES = {"elicitation": {"form": {}}, "roots": {"listChanged": True}, "sampling": {}}
INFO = {"name": "a-handshake-era-editor", "version": "1.132.0"}


async def _initialize(http: aiohttp.ClientSession, client: ScriptedClient) -> dict[str, Any]:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": CAPABILITIES, "clientInfo": INFO},
    }
    async with http.post(client.url, data=orjson.dumps(body), headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        client.session_id = response.headers["Mcp-Session-Id"]
        answer: dict[str, Any] = await response.json()
    client.next_id = 2
    return answer


async def _whoami(http: aiohttp.ClientSession, client: ScriptedClient, url: str, deadline: float) -> Any:
    """The ``whoami`` tool called on ``url``; retried while the answer is a truthful refusal of an owner gone
    whose lease has not lapsed yet (502 ``owner_unreachable``) or whose takeover is being decided (503
    ``owner_lost``); any other refusal fails the test."""
    loop = asyncio.get_running_loop()
    while True:
        _, body = client.tool_call("whoami", {})
        async with http.post(url, data=body, headers=client.headers()) as response:
            if response.status == 200:
                messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                (answer,) = [m for m in messages if "result" in m or "error" in m]
                assert "result" in answer, answer
                return answer["result"]["structuredContent"]
            reason = (await error_of(response))["data"]["reason"]
            assert (response.status, reason) in ((502, "owner_unreachable"), (503, "owner_lost")), reason
        assert loop.time() < deadline, "the takeover's 503s went on"
        await asyncio.sleep(0.2)


@pytest.mark.processes
async def test_a_bridged_sessions_client_facts_reach_the_upstream_from_a_replica_that_took_it_over(
    own_redis: RedisProcess,
) -> None:
    """Initialize on a (bridged: the upstream is 2026-07-28 only), a ``logging/setLevel`` and a call on b
    (forwarded to a, the owner); a is killed; a call on b, which takes the session over: the upstream gets
    the client's capabilities, info and log level in that request's ``_meta``, as from a. Before the facts
    were kept in the store, b sent empty capabilities and no client info."""
    async with (
        serve_modern_upstream() as (upstream, guard),
        sidecars(own_redis.url, 2, shared_upstream=upstream) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        answer = await _initialize(http, client)
        assert answer["result"]["protocolVersion"] == "2025-06-18"
        assert answer["result"]["serverInfo"]["name"] == "mcpresume-modern"  # the bridge's answer
        loop = asyncio.get_running_loop()
        told = {"capabilities": CAPABILITIES, "info": INFO}
        assert await _whoami(http, client, b.url, loop.time() + 30) == told
        level = {"jsonrpc": "2.0", "id": 90, "method": "logging/setLevel", "params": {"level": "debug"}}
        async with http.post(b.url, data=orjson.dumps(level), headers=client.headers()) as response:
            assert response.status == 200 and (await response.json())["result"] == {}
        a.signal(signal.SIGKILL)
        await a.wait()
        assert await _whoami(http, client, b.url, loop.time() + 60) == told
        calls = [m for h, m in zip(guard.headers, guard.metas, strict=True) if h.get("mcp-name") == "whoami"]
        assert len(calls) == 2  # each call ran once upstream: a's, then b's
        for meta in calls:
            assert meta["io.modelcontextprotocol/clientCapabilities"] == CAPABILITIES
            assert meta["io.modelcontextprotocol/clientInfo"] == INFO
        assert calls[1]["io.modelcontextprotocol/logLevel"] == "debug"  # set on a, sent by b


@pytest.mark.processes
async def test_a_bridged_sessions_subscriptions_reach_the_listen_of_a_replica_that_took_it_over(
    own_redis: RedisProcess,
) -> None:
    """A ``resources/subscribe`` on b (forwarded to a, the owner) is kept with the session in Redis; a is
    killed; the client's standalone GET on b, which takes the session over, listens upstream with it."""
    async with (
        serve_modern_upstream() as (upstream, guard),
        sidecars(own_redis.url, 2, shared_upstream=upstream) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        await _initialize(http, client)
        subscribe = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "resources/subscribe",
            "params": {"uri": "note://x"},
        }
        async with http.post(b.url, data=orjson.dumps(subscribe), headers=client.headers()) as response:
            assert response.status == 200 and (await response.json())["result"] == {}
        a.signal(signal.SIGKILL)
        await a.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not guard.listens:
            async with http.get(b.url, headers=client.headers()) as response:
                if response.status == 200:
                    while not guard.listens and loop.time() < deadline:
                        await asyncio.sleep(0.1)
                    break
                reason = (await error_of(response))["data"]["reason"]
                assert (response.status, reason) in ((502, "owner_unreachable"), (503, "owner_lost")), reason
            assert loop.time() < deadline, "the takeover's refusals went on"
            await asyncio.sleep(0.2)
        (listened,) = guard.listens
        assert listened["resourceSubscriptions"] == ["note://x"]
        assert "resources/subscribe" not in guard.methods
