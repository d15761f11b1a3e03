"""A session id's incarnations stay apart: what the proxy no longer tracks is gone for its clients, and
nothing of an ended incarnation (a request still in flight, its answer) reaches another (ARCHITECTURE.md,
invariant #4).

Handshake-era requests (docs/how-it-works.md, "Eras") carrying a session id the proxy does not track get 404
``unknown_session`` and are not forwarded: the client re-initializes, as the spec says of an unknown
session. Upstream event ids never reach a client, whatever ended the session meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.daemon.app import reap_once
from tests.conftest import ServeApp
from tests.support.proxy import ManualClock, ScriptedClient, collect, error_of, running_proxy
from tests.support.scripted import ScriptedUpstream, catch_all, initialize_answer


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_request_resent_after_the_session_was_reaped_is_404_and_not_run_again(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = ScriptedUpstream(total=2)
    clock = ManualClock()
    async with running_proxy(await serve(upstream.app()), session_ttl=60, clock=clock) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("count", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert orjson.loads((await collect(response))[-1].data)["id"] == request_id
        posts = upstream.posts
        clock.advance(61)
        await reap_once(proxy.ctx)
        assert not await proxy.ctx.store.has_session(client.session_id)
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.status == 404
            error = await error_of(response)
        assert error["data"]["reason"] == "unknown_session"
        # A new request of the reaped session, and its standalone GET: gone as well, nothing forwarded.
        _, other = client.tool_call("count", {})
        async with http.post(proxy.url, data=other, headers=client.headers()) as response:
            assert response.status == 404
        async with http.get(proxy.url, headers=client.headers()) as response:
            assert response.status == 404
            assert (await error_of(response))["data"]["reason"] == "unknown_session"
        assert upstream.posts == posts and upstream.gets == []


@dataclass
class GatedUpstream:
    """Holds each tools/call's answer until the test opens its gate; then streams it with the upstream's own
    event ids. Session ids come from ``session_ids`` in turn (the same one twice: a re-issued id)."""

    session_ids: list[str] = field(default_factory=lambda: ["gated-session"])
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # by the call's "text" argument
    arrived: dict[str, asyncio.Event] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    standalone_gate: asyncio.Event = field(default_factory=asyncio.Event)
    standalone_arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        return catch_all(self.handle)

    def gate(self, text: str) -> asyncio.Event:
        return self.gates.setdefault(text, asyncio.Event())

    def arrival(self, text: str) -> asyncio.Event:
        return self.arrived.setdefault(text, asyncio.Event())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "DELETE":
            return web.Response(status=200)
        if request.method == "GET":
            self.standalone_arrived.set()
            await self.standalone_gate.wait()
            return await self.sse(request, [b'{"jsonrpc":"2.0","method":"notifications/x"}'])
        message = orjson.loads(await request.read())
        if message.get("method") == "initialize":
            return initialize_answer(message, self.session_ids.pop(0), "gated")
        if "id" not in message:
            return web.Response(status=202)
        text = message["params"]["arguments"]["text"]
        self.calls.append(text)
        self.arrival(text).set()
        await self.gate(text).wait()
        result = {
            "jsonrpc": "2.0",
            "id": message["id"],
            "result": {"content": [{"type": "text", "text": text}]},
        }
        return await self.sse(request, [orjson.dumps(result)])

    async def sse(self, request: web.Request, messages: list[bytes]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k, data in enumerate(messages, 1):
            await response.write(f"id: UPSTREAM-INTERNAL-ID-{k}\ndata: ".encode() + data + b"\n\n")
        return response


def call(client: ScriptedClient, text: str, request_id: int | None = None) -> tuple[int, bytes]:
    request_id = client.next_id if request_id is None else request_id
    body = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "t", "arguments": {"text": text}},
    }
    return request_id, orjson.dumps(body)


async def test_a_post_answered_after_the_sessions_delete_is_404_not_relayed_raw(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = GatedUpstream()
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = call(client, "late")
        pending = asyncio.ensure_future(http.post(proxy.url, data=body, headers=client.headers()))
        await upstream.arrival("late").wait()  # forwarded; its answer is held upstream
        async with http.delete(proxy.url, headers=client.headers()) as response:
            assert response.status == 200
        upstream.gate("late").set()
        async with await pending as response:
            assert response.status == 404
            raw = await response.read()
        assert orjson.loads(raw)["error"]["data"]["reason"] == "unknown_session"
        assert b"UPSTREAM-INTERNAL-ID" not in raw


async def test_a_standalone_get_opened_after_the_sessions_delete_is_404_not_relayed_raw(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = GatedUpstream()
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        pending = asyncio.ensure_future(http.get(proxy.url, headers=client.headers()))
        await upstream.standalone_arrived.wait()
        async with http.delete(proxy.url, headers=client.headers()) as response:
            assert response.status == 200
        upstream.standalone_gate.set()
        async with await pending as response:
            assert response.status == 404
            raw = await response.read()
        assert b"UPSTREAM-INTERNAL-ID" not in raw


async def test_a_request_in_flight_when_the_session_id_is_reissued_never_reaches_the_new_incarnation(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = GatedUpstream(session_ids=["reissued", "reissued"])
    async with running_proxy(await serve(upstream.app())) as proxy:
        first = ScriptedClient(http, proxy.url)
        await first.initialize()
        _, body = call(first, "the first client's answer", request_id=7)
        pending = asyncio.ensure_future(http.post(proxy.url, data=body, headers=first.headers()))
        await upstream.arrival("the first client's answer").wait()  # waiting for its headers
        second = ScriptedClient(http, proxy.url)
        await second.initialize()  # the upstream hands out the same session id: a new incarnation
        assert second.session_id == first.session_id
        upstream.gate("the first client's answer").set()
        async with await pending as response:  # its incarnation ended: answered as a gone session's request
            assert response.status == 404
            assert b"UPSTREAM-INTERNAL-ID" not in await response.read()
        # The new incarnation starts with no claims: its request 7 is forwarded, and answered with its own.
        upstream.gate("the second client's answer").set()
        _, body = call(second, "the second client's answer", request_id=7)
        async with http.post(proxy.url, data=body, headers=second.headers()) as response:
            assert response.status == 200
            events = await collect(response)
        result = orjson.loads(events[-1].data)["result"]
        assert result["content"][0]["text"] == "the second client's answer"
        assert upstream.calls == ["the first client's answer", "the second client's answer"]
