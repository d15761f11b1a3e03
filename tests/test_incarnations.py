"""A session id's incarnations stay apart: what the proxy no longer tracks is gone for its clients, and
nothing of an ended incarnation (a request still in flight, its answer) reaches another.

Handshake-era requests (see README, "Eras") carrying a session id the proxy does not track get 404
``unknown_session`` and are not forwarded: the client re-initializes, as the spec says of an unknown
session. Upstream event ids never reach a client, whatever ended the session meanwhile.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from mcpresume.app import reap_once
from tests.conftest import ServeApp
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
