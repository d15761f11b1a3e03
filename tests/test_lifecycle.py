"""Start-up and graceful drain: the daemon as an operator runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from mcpresume.daemon.app import RunningProxy
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.proxy import ScriptedClient, collect, running_proxy


@contextlib.asynccontextmanager
async def initialized(
    upstream: str, **settings: Any
) -> AsyncIterator[tuple[RunningProxy, aiohttp.ClientSession, ScriptedClient]]:
    """A proxy in front of ``upstream``, and a client with a session through it."""
    async with running_proxy(upstream, **settings) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        yield proxy, http, client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_drain_lets_open_streams_finish_and_refuses_new_work(example_upstream: str) -> None:
    admin = free_port()
    async with initialized(example_upstream, metrics_port=admin, drain_timeout=10) as (proxy, http, client):
        request_id, body = client.tool_call("count_slowly", {"n": 5, "delay": 0.1})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            first = await response.content.readany()  # the call is running
            assert first
            stopping = asyncio.ensure_future(proxy.stop())
            await asyncio.sleep(0)  # let the drain begin
            async with http.get(f"{proxy.admin_url}/readyz") as ready:
                assert ready.status == 503  # the load balancer stops sending new work
            async with http.get(f"{proxy.admin_url}/healthz") as health:
                assert health.status == 200  # but the process is alive
            rest = await collect(response)
        await stopping
    messages = [orjson.loads(e.data) for e in rest if e.data]
    assert [m["id"] for m in messages if "result" in m] == [request_id]  # the open call finished


async def test_sigterm_drains_and_exits_zero(example_upstream: str) -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mcpresume",
        "serve",
        "--upstream",
        example_upstream,
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        stderr=asyncio.subprocess.PIPE,
        # A typo of MCPRESUME_WINDOW_EVENTS: warned about at start, with the name it was meant to be.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "MCPRESUME_WINDOW_EVENT": "3"},
    )
    assert process.stderr is not None
    async with asyncio.timeout(30):
        line = await process.stderr.readline()
        before = [line]
        while b"mcpresume 0" not in line:  # the start-up line
            line = await process.stderr.readline()
            before.append(line)
        assert orjson.loads(line)["level"] == "info"
        async with aiohttp.ClientSession() as http:
            client = ScriptedClient(http, f"http://127.0.0.1:{port}/mcp")
            await client.initialize()
        process.send_signal(signal.SIGTERM)
        _, err = await process.communicate()
    assert process.returncode == 0
    assert b"draining" in err
    warned = [orjson.loads(line) for line in before if b"MCPRESUME_WINDOW_EVENT" in line]
    assert [(w["level"], w["msg"]) for w in warned] == [
        (
            "warning",
            "environment: MCPRESUME_WINDOW_EVENT matches no setting and is ignored; did you mean "
            "MCPRESUME_WINDOW_EVENTS?",
        )
    ]
    lines = [orjson.loads(line) for line in err.splitlines()]
    assert lines[-1]["msg"] == "stopped"  # the last line says the process is done
    # The access lines of the two requests, their fields as fields of the JSON objects.
    access = [line for line in lines if line["logger"] == "mcpresume.access"]
    assert [(a["method"], a["status"], a["rpc"], a["action"]) for a in access] == [
        ("POST", 200, "initialize", "forwarded"),
        ("POST", 202, "notifications/initialized", "forwarded"),
    ]
    assert access[0]["session"] == access[1]["session"] and len(access[0]["session"]) == 10


async def test_drain_ends_standalone_views_at_once_and_cleanly_while_calls_finish(
    example_upstream: str,
) -> None:
    """A standalone view never completes: the drain ends it at its start (the response ends cleanly, the
    client re-attaches elsewhere), instead of holding the drain to its deadline and past it (aiohttp then
    cancelled it, twice drain_timeout after the SIGTERM, with a truncated body)."""
    async with initialized(example_upstream, drain_timeout=30) as (proxy, http, client):
        request_id, body = client.tool_call("count_slowly", {"n": 4, "delay": 1.0})
        async with (
            http.get(client.url, headers=client.headers()) as standalone,
            http.post(client.url, data=body, headers=client.headers()) as call,
        ):
            assert standalone.status == 200 and call.status == 200
            assert await call.content.readany()  # the call is running
            async with asyncio.timeout(20):
                stopping = asyncio.ensure_future(proxy.stop())
                events = await collect(standalone)  # ends, and cleanly: collect raises on a cut body
                assert not call.content.at_eof()  # while the call still runs
                assert events[0].id is not None  # the priming event: a cursor to re-attach with
                rest = await collect(call)
                await stopping
    messages = [orjson.loads(e.data) for e in rest if e.data]
    assert [m["id"] for m in messages if "result" in m] == [request_id]  # the open call finished


async def test_drain_ends_a_view_still_open_at_drain_timeout_cleanly(example_upstream: str) -> None:
    async with initialized(example_upstream, drain_timeout=0.5) as (proxy, http, client):
        _, body = client.tool_call("count_slowly", {"n": 20, "delay": 0.5})
        async with http.post(client.url, data=body, headers=client.headers()) as call:
            assert await call.content.readany()
            async with asyncio.timeout(20):
                stopping = asyncio.ensure_future(proxy.stop())
                events = await collect(call)  # ended at the deadline, cleanly, before the call's response
                await stopping
    messages = [orjson.loads(e.data) for e in events if e.data]
    assert messages and not [m for m in messages if "result" in m]
    assert all(
        e.id is not None for e in events
    )  # each with its cursor: the client re-attaches after the last


async def test_drain_ends_a_relayed_sse_stream_at_its_deadline_cleanly(serve: ServeApp) -> None:
    """An SSE stream the proxy relays as is (any path but the MCP endpoint; every request of a newer
    protocol era) is a view too: the drain ends it at its deadline, cleanly. It was cut when aiohttp gave
    up on it, twice the grace later."""
    upstream = pb.Playbook()
    # open until the proxy goes: the gate is never opened
    upstream.on(None, pb.sse(pb.event(b"first"), pb.wait("never")), http=None)
    url = await serve(upstream.app())
    async with running_proxy(url, drain_timeout=0.5) as proxy, aiohttp.ClientSession() as http:
        other = proxy.url.rsplit("/", 1)[0] + "/events"  # not the MCP endpoint: relayed as is
        async with http.get(other) as relayed:
            assert relayed.status == 200
            async with asyncio.timeout(20):
                stopping = asyncio.ensure_future(proxy.stop())
                events = await collect(relayed)  # ends cleanly: collect raises on a cut body
                await stopping
    assert [e.data for e in events] == [b"first"]


def slow_upstream() -> pb.Playbook:
    """An upstream that starts a session and takes notifications at its MCP endpoint, and never answers
    anything else (gate ``asked``: a request is waiting for headers)."""

    def at_mcp(seen: pb.Seen) -> bool:
        return seen.path == "/mcp"

    def notification(seen: pb.Seen) -> bool:
        return at_mcp(seen) and isinstance(seen.message, dict) and "id" not in seen.message

    upstream = pb.Playbook()
    upstream.on(None, pb.never("asked"), http=None)  # no headers, ever
    upstream.on("initialize", pb.initialize(name="slow"), when=at_mcp)
    upstream.on(None, pb.status(202), when=notification)
    return upstream


@pytest.mark.parametrize(
    ("method", "path", "at_once"),
    [
        ("POST", "/mcp", False),  # a tools/call, forwarded: the upstream may still run it
        ("GET", "/mcp", True),  # the upstream GET that would open the standalone stream: ended at the start
        ("DELETE", "/mcp", False),
        ("POST", "/other", False),  # relayed as is
    ],
    ids=["call", "standalone-get", "delete", "passthrough"],
)
async def test_every_wait_for_the_upstream_ends_with_the_drain(
    serve: ServeApp, method: str, path: str, at_once: bool
) -> None:
    """A request waiting for the upstream's headers is ended by the drain like a view (503 shutting_down):
    a standalone GET when the drain begins, the others at its deadline. They held the drain to twice its
    limit and were cut without an answer."""
    upstream = slow_upstream()
    url = await serve(upstream.app())
    drain_timeout = 30.0 if at_once else 0.5
    async with initialized(url, drain_timeout=drain_timeout) as (proxy, http, client):
        target = proxy.url.rsplit("/", 1)[0] + path
        request_id, body = client.tool_call("slow", {})
        async with asyncio.timeout(10):
            asking = asyncio.ensure_future(http.request(method, target, headers=client.headers(), data=body))
            await upstream.arrived("asked").wait()
            stopping = asyncio.ensure_future(proxy.stop())
            async with await asking as response:
                assert response.status == 503
                answer = orjson.loads(await response.read())
            await stopping
    assert answer["error"]["data"]["reason"] == "shutting_down"
    if (method, path) == ("POST", "/mcp"):
        assert answer["id"] == request_id  # the answer to that request
