"""Exactly once per request, over real HTTP (invariant #8): a request id the session used before is a re-send
only when it carries the same request (its method and params); another request under it reaches the
upstream once the first is over, and is refused with 409 ``request_id_in_use`` while it is not. A request
that may have run upstream (sent, and no answer head came: 504, or the connection broke: 502) is never sent
again: its re-send is 409 ``outcome_unknown``; only one the proxy never sent (no connection) may be.

The upstream is the official SDK's example server where it does what a test needs (a client reconnecting
to its session), else a playbook whose timing the test controls with gates.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import orjson
import pytest
from aiohttp import web
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.support import playbook as pb
from tests.support.conformance import Unavailable
from tests.support.metrics import sample
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy
from tests.support.sdk import HANDSHAKE_VERSION, result_text, sdk_session
from tests.support.ts_sdk import with_script

STORES = ["memory", "redis"]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The proxy's store settings: the memory store, or a real Redis (emptied)."""
    if request.param == "memory":
        return {}
    port = free_port()  # the Redis store needs the URL other replicas would reach this one at
    return {
        "store": request.getfixturevalue("redis_db"),
        "port": port,
        "advertise_url": f"http://127.0.0.1:{port}/mcp",
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def results(events: list[Any]) -> list[Any]:
    """The JSON-RPC responses among a stream's events: (id, result or error)."""
    messages = [orjson.loads(e.data) for e in events if e.data]
    return [(m["id"], m.get("result", m.get("error"))) for m in messages if "result" in m or "error" in m]


def text_of(result: Any) -> str:
    return "".join(block["text"] for block in result["content"])


# -- 1. a client that numbers its requests anew in its session gets its own answers ------------------------


async def test_an_sdk_client_reconnecting_to_its_session_gets_its_own_answers(
    example_upstream: str, store: dict[str, Any]
) -> None:
    """The official SDK client, run twice on one session: the second run adopts the session (its id and
    initialize result, no initialize) and numbers its requests from 1 again, the first run's initialize's
    id included. Each of its calls reaches the upstream and gets its own answer, as it does directly.
    (Before: the echo under the initialize's id got the initialize result, ``add(40, 2)`` run 1's answer
    under that id; neither reached the upstream.)"""
    session_ids: list[str] = []

    async def remember(response: httpx2.Response) -> None:
        if "mcp-session-id" in response.headers:
            session_ids.append(response.headers["mcp-session-id"])

    async with running_proxy(example_upstream, **store) as proxy:
        async with (
            httpx2.AsyncClient(event_hooks={"response": [remember]}) as first,
            sdk_session(proxy.url, http_client=first, terminate_on_close=False) as run1,
        ):
            initialized = run1.initialize_result
            assert initialized is not None
            assert (
                result_text(await run1.call_tool("echo", {"text": "hello from run 1"})) == "hello from run 1"
            )
            assert result_text(await run1.call_tool("add", {"a": 1, "b": 2})) == "3"
        headers = {"mcp-session-id": session_ids[0], "mcp-protocol-version": HANDSHAKE_VERSION}
        async with (
            httpx2.AsyncClient(headers=headers) as second,
            streamable_http_client(proxy.url, http_client=second) as (read, write),
            ClientSession(read, write, read_timeout_seconds=30) as run2,
        ):
            run2.adopt(initialized)
            # id 1: the initialize's (then tools/list, id 2: run 1's echo)
            echoed = await run2.call_tool("echo", {"text": "hello from run 2"})
            assert not echoed.is_error and result_text(echoed) == "hello from run 2"
            added = await run2.call_tool("add", {"a": 40, "b": 2})  # id 3: run 1's tools/list
            assert not added.is_error and result_text(added) == "42"
        assert sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total") == 0


TS_CLIENT = Path(__file__).parent / "support" / "ts_sdk_client.mjs"


async def test_the_typescript_sdk_client_reconnecting_with_its_session_id_gets_its_own_answers(
    example_upstream: str, store: dict[str, Any]
) -> None:
    """The finding's own client: ``new StreamableHTTPClientTransport(url, { sessionId })`` sends no
    initialize and numbers its requests from 0 again, so its echo takes the id of the first run's initialize
    and its ``add(40, 2)`` the id of the first run's echo. Through the proxy each must reach the upstream, as
    directly. (Before: the echo got the initialize result, the add run 1's echo.)"""
    try:
        node, script = with_script(TS_CLIENT)  # beside its node_modules, where node resolves the SDK from
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        raise
    async with running_proxy(example_upstream, **store) as proxy:
        client = await asyncio.create_subprocess_exec(
            node, str(script), proxy.url, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await asyncio.wait_for(client.communicate(), 120)
        assert client.returncode == 0, err.decode()
        runs = json.loads(out)
        assert runs["run1"] == ["hello from run 1", "3"]
        assert runs["run2"] == ["hello from run 2", "42"]
        assert sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total") == 0


async def test_another_request_under_a_used_id_reaches_the_upstream_and_a_resend_does_not(
    example_upstream: str, store: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    """Raw HTTP, the SDK upstream: a client that numbers its requests anew sends other requests under the
    ids of its initialize and of an answered call; each runs (``tally`` counts the runs), while a re-send of
    one of them (the same id, the same request) gets that request's answer and runs nothing."""
    async with running_proxy(example_upstream, **store) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()  # id 1
        tally_id, tally = client.tool_call("tally", {})  # id 2
        async with http.post(client.url, data=tally, headers=client.headers()) as response:
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (tally_id, "1")
        client.next_id = 1  # the client numbers its requests from 1 again
        echo_id, echo = client.tool_call("echo", {"text": "hello from run 2"})
        assert echo_id == 1  # the initialize's id
        async with http.post(client.url, data=echo, headers=client.headers()) as response:
            assert response.status == 200
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (1, "hello from run 2")
        add_id, add = client.tool_call("add", {"a": 40, "b": 2})
        assert add_id == tally_id  # the answered tally's id
        async with http.post(client.url, data=add, headers=client.headers()) as response:
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (add_id, "42")
        # The same request again under that id: a re-send, attached to its answer, run once.
        async with http.post(client.url, data=add, headers=client.headers()) as response:
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (add_id, "42")
        assert sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total") == 1
        client.next_id = add_id  # and the tally again, under the add's id: it runs (a second time in all)
        _, tally = client.tool_call("tally", {})
        async with http.post(client.url, data=tally, headers=client.headers()) as response:
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (add_id, "2")


def reused_id_upstream() -> pb.Playbook:
    """``tools/call`` with text ``held`` waits at its gate before any answer (in flight); any other is
    echoed, as an SSE stream."""
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.sse(pb.event(pb.result(pb.echo))))
    upstream.on(
        "tools/call",
        pb.held("held", pb.sse(pb.event(pb.result(pb.echo)))),
        when=lambda seen: seen.text == "held",
    )
    return upstream


async def test_another_request_under_an_id_in_flight_is_409_request_id_in_use(
    serve: Any, store: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    upstream = reused_id_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, **store) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        held_id, held = client.tool_call("echo", {"text": "held"})
        first = asyncio.ensure_future(http.post(client.url, data=held, headers=client.headers()))
        await asyncio.wait_for(upstream.arrived("held").wait(), 10)
        client.next_id = held_id
        _, other = client.tool_call("echo", {"text": "other"})
        async with http.post(client.url, data=other, headers=client.headers()) as response:
            assert response.status == 409
            error = await error_of(response)
        assert error["data"]["reason"] == "request_id_in_use"
        assert [seen.text for seen in upstream.requests("tools/call")] == ["held"]  # never forwarded
        upstream.open("held")
        async with await first as response:
            assert results(await collect(response))[0][0] == held_id
        # The first request is over: its id may carry another request now.
        async with http.post(client.url, data=other, headers=client.headers()) as response:
            ((answered, result),) = results(await collect(response))
        assert (answered, text_of(result)) == (held_id, "other")
        assert [seen.text for seen in upstream.requests("tools/call")] == ["held", "other"]


# -- 3. a request that may have run upstream is never sent again ----------------------------------------


async def test_a_request_whose_answer_head_did_not_come_in_time_is_never_sent_again(
    serve: Any, store: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    """504: the upstream got the request and sent no head within ``first_byte_timeout``. It may run (it
    did here: the upstream holds it): its re-send is 409 ``outcome_unknown``, never forwarded; another
    request under its id 409 ``request_id_in_use``. (Before: the claim was released, and the re-send ran
    the call a second time.)"""
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.never("call"))
    url = await serve(upstream.app())
    async with running_proxy(url, first_byte_timeout=1.0, **store) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        call_id, call = client.tool_call("echo", {"text": "once"})
        async with http.post(client.url, data=call, headers=client.headers()) as response:
            assert response.status == 504
            assert (await error_of(response))["data"]["reason"] == "upstream_timeout"
        await asyncio.wait_for(upstream.left("call").wait(), 10)  # the proxy gave up on it
        async with http.post(client.url, data=call, headers=client.headers()) as response:
            assert response.status == 409
            error = await error_of(response)
        assert error["data"]["reason"] == "outcome_unknown"
        client.next_id = call_id
        _, other = client.tool_call("echo", {"text": "other"})
        async with http.post(client.url, data=other, headers=client.headers()) as response:
            assert response.status == 409
            assert (await error_of(response))["data"]["reason"] == "request_id_in_use"
        assert [seen.text for seen in upstream.requests("tools/call")] == ["once"]


async def _cut(playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
    """Read the request whole, then cut the connection before any answer: the request reached the upstream,
    what it did is unknown."""
    assert request.transport is not None
    request.transport.abort()
    return web.Response()


async def test_a_request_whose_connection_broke_after_it_was_sent_is_never_sent_again(
    serve: Any, store: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    upstream = pb.Playbook()
    upstream.on("tools/call", _cut)
    url = await serve(upstream.app())
    async with running_proxy(url, **store) as proxy:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, call = client.tool_call("echo", {"text": "once"})
        async with http.post(client.url, data=call, headers=client.headers()) as response:
            assert response.status == 502
            assert (await error_of(response))["data"]["reason"] == "upstream_unreachable"
        async with http.post(client.url, data=call, headers=client.headers()) as response:
            assert response.status == 409
            assert (await error_of(response))["data"]["reason"] == "outcome_unknown"
        assert [seen.text for seen in upstream.requests("tools/call")] == ["once"]


async def _initialize_and_close(
    playbook: pb.Playbook, request: web.Request, seen: pb.Seen
) -> web.StreamResponse:
    """The session begins; the connection is not kept (no pooled connection outlives the upstream)."""
    response = await pb.initialize()(playbook, request, seen)
    response.force_close()
    return response


async def test_a_request_the_upstream_never_got_may_be_sent_again(
    store: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    """502 with no connection to send it on (the upstream is down, connect refused): the request is known
    never to have been sent, so its claim is released and the same request re-sent is forwarded (a 502
    again while the upstream is down; answered once it is back)."""
    upstream = pb.Playbook()
    upstream.on("initialize", _initialize_and_close)
    upstream.on("tools/call", pb.reply(pb.result(pb.echo)))
    runner = web.AppRunner(upstream.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        async with running_proxy(url, **store) as proxy:
            client = ScriptedClient(http, proxy.url)
            await client.initialize()
            await runner.cleanup()  # the upstream is down: connections are refused
            call_id, call = client.tool_call("echo", {"text": "once"})
            for _ in range(2):  # the same request, forwarded each time
                async with http.post(client.url, data=call, headers=client.headers()) as response:
                    assert response.status == 502
                    assert (await error_of(response))["data"]["reason"] == "upstream_unreachable"
            unreachable = sample(
                proxy.ctx.metrics, "mcpresume_upstream_errors_total", reason="upstream_unreachable"
            )
            assert unreachable == 2
            runner = web.AppRunner(upstream.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()  # back, on the same port
            async with http.post(client.url, data=call, headers=client.headers()) as response:
                assert response.status == 200
                answer = orjson.loads(await response.read())
            assert (answer["id"], text_of(answer["result"])) == (call_id, "once")
            assert [seen.text for seen in upstream.requests("tools/call")] == ["once"]
    finally:
        await runner.cleanup()
