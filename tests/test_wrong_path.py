"""A typo in the upstream's path: the proxy says so, at start and when a session begins on a relayed path.

Every path but the upstream URL's is passed through as is (OAuth discovery and the like), so a client whose
URL and ``--upstream`` disagree on the path gets no resumption at all, and nothing else tells it.
"""

from __future__ import annotations

import logging

import aiohttp
import pytest
from yarl import URL

from mcpresume.daemon.app import unlike_mcp_path
from tests.support.proxy import ScriptedClient, running_proxy

START_WARNING = "does not look like an MCP endpoint"
RELAYED_INITIALIZE = "is relayed as is, with no resumption"


@pytest.mark.parametrize(
    ("path", "unlike"),
    [("/", True), ("/sse", True), ("/api", True), ("/mcp", False), ("/mcp/", False), ("/v1/MCP", False)],
)
def test_which_paths_look_unlike_an_mcp_endpoint(path: str, unlike: bool) -> None:
    assert unlike_mcp_path(path) is unlike


async def test_an_mcp_path_gets_no_warning(example_upstream: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "mcpresume")
    async with running_proxy(example_upstream) as proxy, aiohttp.ClientSession() as http:
        await ScriptedClient(http, proxy.url).initialize()
    assert not [r for r in caplog.records if START_WARNING in r.message or RELAYED_INITIALIZE in r.message]


async def test_a_wrong_upstream_path_is_warned_at_start_and_at_each_session(
    example_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "mcpresume")
    root = str(URL(example_upstream).with_path("/"))  # --upstream http://host:port/ instead of .../mcp
    async with running_proxy(root) as proxy, aiohttp.ClientSession() as http:
        starts = [r for r in caplog.records if START_WARNING in r.message]
        assert len(starts) == 1 and starts[0].levelno == logging.WARNING
        assert "'/'" in starts[0].message
        client = ScriptedClient(http, str(URL(proxy.url).with_path("/mcp")))  # where the server is
        await client.initialize()  # relayed as is: the upstream's session, unknown to the proxy
        assert client.session_id and not await proxy.ctx.store.has_session(client.session_id)
        _, body = client.tool_call("add", {"a": 1, "b": 2})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            await response.read()
        await ScriptedClient(http, client.url).initialize()  # a second session
    relayed = [r for r in caplog.records if RELAYED_INITIALIZE in r.message]
    assert len(relayed) == 2  # one per session, none for its other requests
    assert all(r.levelno == logging.WARNING for r in relayed)
    assert "initialize on /mcp" in relayed[0].message and "the MCP endpoint is /" in relayed[0].message
