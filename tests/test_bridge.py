"""The era bridge: handshake-era clients in front of a 2026-07-28-only upstream (issue 34)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.support.modern_upstream import MODERN_VERSION, serve_modern_upstream

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
