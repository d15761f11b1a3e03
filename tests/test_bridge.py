"""The era bridge: handshake-era clients in front of a 2026-07-28-only upstream (issue 34)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.support.modern_upstream import MODERN_VERSION, serve_modern_upstream
from tests.support.proxy import running_proxy
from tests.support.sdk import result_text, sdk_session

pytestmark = pytest.mark.asyncio

META = {
    "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
}
MODERN_HEADERS = {
    "accept": "application/json, text/event-stream",
    "content-type": "application/json",
    "mcp-protocol-version": MODERN_VERSION,
}


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps(body), headers={**MODERN_HEADERS, **headers}) as response:
        text = await response.text()
        return response.status, json.loads(text) if response.content_type == "application/json" else text


async def test_modern_upstream_refuses_the_handshake_era() -> None:
    async with serve_modern_upstream() as (url, guard), aiohttp.ClientSession() as session:
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        status, body = await _post(session, url, initialize, **{"mcp-protocol-version": "2025-06-18"})
        assert status == 400 and body["error"]["code"] == -32022
        async with session.get(url, headers=MODERN_HEADERS) as response:
            assert response.status == 405
        async with session.delete(url, headers=MODERN_HEADERS) as response:
            assert response.status == 405
        discover = {"jsonrpc": "2.0", "id": 2, "method": "server/discover", "params": {"_meta": META}}
        status, body = await _post(session, url, discover, **{"mcp-method": "server/discover"})
        assert status == 200 and body["result"]["supportedVersions"] == [MODERN_VERSION]
        assert guard.refused == ["initialize", "GET", "DELETE"]
        assert guard.methods == ["server/discover"]


async def test_a_handshake_era_sdk_client_gets_a_bridged_session() -> None:
    async with serve_modern_upstream() as (url, guard), running_proxy(url) as proxy:
        async with sdk_session(proxy.url, read_timeout_seconds=30) as session:
            assert session.initialize_result is not None
            assert session.initialize_result.server_info.name == "mcpresume-modern"
            assert session.initialize_result.protocol_version == "2025-11-25"
            assert result_text(await session.call_tool("echo", {"text": "hi"})) == "hi"
            seen: list[float] = []

            async def progress(value: float, total: float | None, message: str | None) -> None:
                seen.append(value)

            counted = await session.call_tool("count_slowly", {"n": 3}, progress_callback=progress)
            assert result_text(counted) == "counted to 3" and seen == [1.0, 2.0, 3.0]
            await session.send_ping()  # answered by the proxy: 2026-07-28 has no ping
            tools = await session.list_tools()
            assert "ask" in [tool.name for tool in tools.tools]
        # The upstream saw only 2026-07-28 requests (the proxy's probes, then the session's), each with
        # the routing headers and the envelope.
        assert guard.refused[:1] == ["initialize"]  # the proxy's probe; the client's never reached it
        assert "ping" not in guard.methods and guard.methods[0] == "server/discover"
        calls = [h for h in guard.headers if h.get("mcp-method") == "tools/call"]
        assert {h.get("mcp-name") for h in calls} == {"echo", "count_slowly"}
        assert all("mcp-session-id" not in h for h in guard.headers)
        assert proxy.ctx.metrics.era_requests.labels("handshake", "bridged")._value.get() >= 5
