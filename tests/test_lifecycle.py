"""Start-up and graceful drain: the daemon as an operator runs it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import aiohttp
import orjson

from tests.support.proxy import ScriptedClient, collect, running_proxy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_drain_lets_open_streams_finish_and_refuses_new_work(example_upstream: str) -> None:
    admin = free_port()
    async with (
        running_proxy(example_upstream, metrics_port=admin, drain_timeout=10) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
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
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    async with asyncio.timeout(30):
        line = await process.stderr.readline()
        while b"mcpresume 0" not in line:  # the start-up line
            line = await process.stderr.readline()
        assert orjson.loads(line)["level"] == "info"
        async with aiohttp.ClientSession() as http:
            client = ScriptedClient(http, f"http://127.0.0.1:{port}/mcp")
            await client.initialize()
        process.send_signal(signal.SIGTERM)
        _, err = await process.communicate()
    assert process.returncode == 0
    assert b"draining" in err
