"""HTTP at the edges of the proxy, over real sockets: what crosses it (Expect, Content-Encoding, Location,
Host), which requests its DNS-rebinding checks cover, and how it holds up against connections that never
send a request (header timeout, connection cap).

Scripted aiohttp upstreams record what reached them, so "not forwarded" is checked, not assumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.proxy import collect, error_of, running_proxy
from tests.support.scripted import initialize_answer

TIMEOUT = 30.0  # hang guard only (a loaded 2-core box)

INIT = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
)
MCP = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Recorder:
    """A scripted upstream that records each request's headers; ``answer`` makes the response."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers

    def app(self, *, expect_handler: Any = None) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=expect_handler)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path, dict(request.headers)))
        return await self.answer(request, body)

    async def answer(self, request: web.Request, body: bytes) -> web.StreamResponse:
        if request.path == "/mcp" and body and orjson.loads(body).get("method") == "initialize":
            return initialize_answer(orjson.loads(body), "edge-session", "edges")
        return web.json_response({"path": request.path})


# -- 11. Expect: 100-continue -----------------------------------------------------------------------------


async def _no_continue(request: web.Request) -> None:
    """An upstream that never sends 100 Continue (allowed: it may wait for the body instead)."""


async def test_expect_100_continue_is_answered_by_the_proxy_and_not_forwarded(serve, http) -> None:
    upstream = Recorder()
    url = await serve(upstream.app(expect_handler=_no_continue))
    # Without the fix the upstream hop waits for a 100 that never comes: 504 after first_byte_timeout.
    async with running_proxy(url, first_byte_timeout=5.0) as proxy, asyncio.timeout(TIMEOUT):
        async with http.post(proxy.url, data=INIT, headers=MCP, expect100=True) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Mcp-Session-Id"] == "edge-session"
        other = proxy.url.replace("/mcp", "/oauth/token")
        async with http.post(other, data=b"grant_type=x", expect100=True) as response:
            assert response.status == 200
            assert await response.json() == {"path": "/oauth/token"}
    assert [path for _, path, _ in upstream.seen] == ["/mcp", "/oauth/token"]
    assert all("Expect" not in headers for _, _, headers in upstream.seen)
