"""The host side of deploy/image-smoke.sh: the example upstream the container proxies, and the checks.

    python deploy/image_smoke.py upstream URL_FILE     # serve the example upstream until SIGTERM
    python deploy/image_smoke.py check MCP_URL ADMIN_URL
    python deploy/image_smoke.py hold MCP_URL READY_FILE

``check``: /healthz, /readyz and /metrics answer; the official MCP SDK client initializes and calls a tool
through the proxy; the session shows in the metrics. ``hold``: opens a session and a long tool call,
writes READY_FILE once its first event arrived, then reads the stream to its end: it must end cleanly
(the proxy's drain ends it at drain_timeout when the container is stopped), with a cursor to resume from.
Needs the project's test or demo extra (the MCP SDK). Every step has a timeout: a hang fails, it never
waits for ever.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp

TIMEOUT = 30.0


def fail(message: str) -> int:
    print(f"image-smoke: FAIL: {message}", file=sys.stderr, flush=True)
    return 1


async def upstream(url_file: Path) -> int:
    from mcpresume.examples.upstream import serve_example_upstream

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_example_upstream() as url:
        url_file.write_text(url)
        await stop.wait()
    return 0


async def check(mcp_url: str, admin_url: str) -> int:
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for path, expected in (("/healthz", {"status": "ok"}), ("/readyz", {"status": "ready"})):
            async with http.get(admin_url + path) as response:
                body = await response.json()
                if response.status != 200 or body != expected:
                    return fail(f"{path}: {response.status} {body}")
            print(f"image-smoke: {path}: 200 {body}", flush=True)
        async with asyncio.timeout(TIMEOUT):
            async with streamable_http_client(mcp_url) as (read, write), ClientSession(read, write) as sdk:
                info = await sdk.initialize()
                result = await sdk.call_tool("add", {"a": 2, "b": 3})
        text = "".join(getattr(content, "text", "") for content in result.content)
        if result.is_error or text != "5":
            return fail(f"tools/call add(2, 3) through the proxy: {result}")
        print(f"image-smoke: SDK client: initialize -> {info.server_info.name}, add(2, 3) -> {text}")
        async with http.get(admin_url + "/metrics") as response:
            metrics = await response.text()
        wanted = ('mcpresume_requests_total{method="POST",status="200"}', "mcpresume_sessions ")
        missing = [name for name in wanted if name not in metrics]
        if response.status != 200 or missing:
            return fail(f"/metrics: {response.status}, missing {missing}")
        print("image-smoke: /metrics: 200, with the SDK client's requests", flush=True)
    return 0


async def hold(mcp_url: str, ready_file: Path) -> int:
    from mcpresume.daemon.demo import ScriptedClient, sse_events

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        client = ScriptedClient(http, mcp_url)
        async with asyncio.timeout(TIMEOUT):
            await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 10_000, "delay": 0.2})
        cursor, progress = "", 0
        # A hang guard only: the drain ends the stream within drain_timeout + 2 s of `docker stop`.
        async with asyncio.timeout(120):
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                if response.status != 200:
                    return fail(f"hold: tools/call answered {response.status}")
                async for event in sse_events(response):
                    cursor = event.id.decode() if event.id else cursor
                    if event.data:
                        progress += 1
                        if progress == 1:
                            ready_file.write_text(cursor)
    if not progress or not cursor:
        return fail(f"hold: the stream ended after {progress} events, cursor {cursor!r}")
    print(f"image-smoke: the held stream ended cleanly after {progress} events, last cursor {cursor}")
    return 0


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "upstream":
        return asyncio.run(upstream(Path(args[0])))
    if command == "check":
        return asyncio.run(check(args[0], args[1]))
    if command == "hold":
        try:
            return asyncio.run(hold(args[0], Path(args[1])))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return fail(f"hold: the stream did not end cleanly: {type(exc).__name__}: {exc}")
    return fail(f"unknown command {command!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
