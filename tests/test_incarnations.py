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

import aiohttp
import orjson
import pytest

from mcpresume.daemon.app import reap_once
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.playbook import Playbook
from tests.support.proxy import ManualClock, ScriptedClient, collect, error_of, running_proxy
from tests.support.scripted import ScriptedUpstream


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


def gated_upstream(*session_ids: str) -> Playbook:
    """Holds each tools/call's answer (before its head) at the gate of its ``text`` argument until the test
    opens it; then streams it with the upstream's own event ids. The standalone GET is held at the gate
    ``standalone`` likewise. Session ids come from ``session_ids`` in turn (the same one twice: a re-issued
    id)."""
    upstream = Playbook(session_ids=list(session_ids) or ["gated-session"])
    answer = pb.sse(pb.event(pb.result(pb.echo), id="UPSTREAM-INTERNAL-ID-1"))
    upstream.on("tools/call", pb.held(pb.by_text, answer))
    note = pb.sse(pb.event(pb.notification("notifications/x"), id="UPSTREAM-INTERNAL-ID-1"))
    upstream.on(None, pb.held("standalone", note), http="GET")
    return upstream


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
    upstream = gated_upstream()
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = call(client, "late")
        pending = asyncio.ensure_future(http.post(proxy.url, data=body, headers=client.headers()))
        await upstream.arrived("late").wait()  # forwarded; its answer is held upstream
        async with http.delete(proxy.url, headers=client.headers()) as response:
            assert response.status == 200
        upstream.open("late")
        async with await pending as response:
            assert response.status == 404
            raw = await response.read()
        assert orjson.loads(raw)["error"]["data"]["reason"] == "unknown_session"
        assert b"UPSTREAM-INTERNAL-ID" not in raw


async def test_a_standalone_get_opened_after_the_sessions_delete_is_404_not_relayed_raw(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = gated_upstream()
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        pending = asyncio.ensure_future(http.get(proxy.url, headers=client.headers()))
        await upstream.arrived("standalone").wait()
        async with http.delete(proxy.url, headers=client.headers()) as response:
            assert response.status == 200
        upstream.open("standalone")
        async with await pending as response:
            assert response.status == 404
            raw = await response.read()
        assert b"UPSTREAM-INTERNAL-ID" not in raw


async def test_a_request_in_flight_when_the_session_id_is_reissued_never_reaches_the_new_incarnation(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    upstream = gated_upstream("reissued", "reissued")
    async with running_proxy(await serve(upstream.app())) as proxy:
        first = ScriptedClient(http, proxy.url)
        await first.initialize()
        _, body = call(first, "the first client's answer", request_id=7)
        pending = asyncio.ensure_future(http.post(proxy.url, data=body, headers=first.headers()))
        await upstream.arrived("the first client's answer").wait()  # waiting for its headers
        second = ScriptedClient(http, proxy.url)
        await second.initialize()  # the upstream hands out the same session id: a new incarnation
        assert second.session_id == first.session_id
        upstream.open("the first client's answer")
        async with await pending as response:  # its incarnation ended: answered as a gone session's request
            assert response.status == 404
            assert b"UPSTREAM-INTERNAL-ID" not in await response.read()
        # The new incarnation starts with no claims: its request 7 is forwarded, and answered with its own.
        upstream.open("the second client's answer")
        _, body = call(second, "the second client's answer", request_id=7)
        async with http.post(proxy.url, data=body, headers=second.headers()) as response:
            assert response.status == 200
            events = await collect(response)
        result = orjson.loads(events[-1].data)["result"]
        assert result["content"][0]["text"] == "the second client's answer"
        assert [seen.text for seen in upstream.requests("tools/call")] == [
            "the first client's answer",
            "the second client's answer",
        ]
