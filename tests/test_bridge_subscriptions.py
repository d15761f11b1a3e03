"""The era bridge's resource subscriptions: a handshake-era ``resources/subscribe`` in front of a
2026-07-28-only upstream, which has no such method, becomes the ``resourceSubscriptions`` of the session's
``subscriptions/listen`` stream (issue 34)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import mcp_types as types
import orjson
import pytest
from mcp.client.client import Client

from mcpresume.core.bridge import ClientFacts, Local, listen_event, listen_filter, treat
from mcpresume.core.reinit import Recipe
from mcpresume.daemon.app import PROXY, RunningProxy
from mcpresume.daemon.demo import sse_events
from mcpresume.http.bridge import Bridge
from tests.support.modern_upstream import serve_modern_upstream
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, running_proxy
from tests.support.sdk import result_text
from tests.test_bridge import store  # noqa: F401 (the fixture: the memory store, or a real Redis)

NOTE = "note://greeting"
FACTS = ClientFacts("2025-11-25")


def _bridge(proxy: RunningProxy) -> Bridge:
    return proxy.app[PROXY].bridge


def test_subscribe_is_answered_by_the_proxy_only_when_the_upstream_offers_subscriptions() -> None:
    subscribe = {"jsonrpc": "2.0", "id": 3, "method": "resources/subscribe", "params": {"uri": NOTE}}
    assert treat(subscribe, FACTS, True) == Local(result={}, subscription=("resources/subscribe", NOTE))
    refused = treat(subscribe, FACTS, False)
    assert isinstance(refused, Local) and refused.error is not None and refused.error["code"] == -32601
    assert refused.error["data"] == {"reason": "subscriptions_not_offered"}
    no_uri = treat({**subscribe, "params": {}}, FACTS, True)
    assert isinstance(no_uri, Local) and no_uri.error is not None and no_uri.error["code"] == -32602
    assert no_uri.error["data"] == {"reason": "bad_subscription"}
    offered = {"resources": {"subscribe": True, "listChanged": True}, "tools": {"listChanged": True}}
    assert listen_filter(offered, frozenset({"b://2", "a://1"})) == {
        "toolsListChanged": True,
        "resourcesListChanged": True,
        "resourceSubscriptions": ["a://1", "b://2"],
    }
    assert listen_filter({"tools": {"listChanged": True}}, frozenset({"a://1"})) == {"toolsListChanged": True}
    ack = b'{"jsonrpc":"2.0","method":"notifications/subscriptions/acknowledged","params":{}}'
    assert listen_event(ack) == (False, True)
    assert listen_event(b'{"jsonrpc":"2.0","id":"l","result":{}}') == (False, False)
    updated = b'{"jsonrpc":"2.0","method":"notifications/resources/updated","params":{"uri":"a://1"}}'
    assert listen_event(updated) == (True, False)


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:resources/(un)?subscribe is removed")
async def test_the_python_sdk_client_subscribes_through_the_bridge_and_gets_the_updates(
    store: dict[str, Any],  # noqa: F811
) -> None:
    """``Client(mode="legacy")`` subscribes to a resource of a 2026-07-28-only upstream: the proxy answers,
    keeps the URI with the session (memory or Redis store), and re-opens the session's listen stream
    upstream with it, the client's standalone GET going on; the upstream's update reaches that GET once;
    unsubscribed, no more come."""
    updates: list[str] = []
    tools_changed = asyncio.Event()
    updated = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            updates.append(str(message.params.uri))
            updated.set()
        elif isinstance(message, types.ToolListChangedNotification):
            tools_changed.set()

    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url, **store) as proxy,
        Client(proxy.url, mode="legacy", message_handler=on_message, read_timeout_seconds=30) as client,
    ):
        await until(lambda: len(guard.listens) == 1, timeout=30, what="the listen stream open")
        assert "resourceSubscriptions" not in guard.listens[0]
        bridge = _bridge(proxy)
        (session_id,) = bridge.sessions
        await until(lambda: session_id in bridge.listens, timeout=30, what="the GET served")
        (listening,) = bridge.listens[session_id]  # the client's GET, as the proxy serves it
        await client.subscribe_resource(NOTE)
        # Answered once the upstream listens with it: the second listen, the first closed.
        assert guard.listens[-1]["resourceSubscriptions"] == [NOTE]
        assert len(guard.listens) == 2 and bridge.listens[session_id] == {listening}  # the same GET goes on
        session = bridge.sessions[session_id]
        assert session is not None and session.recipe.subscriptions == {NOTE}
        kept = await proxy.ctx.store.recipe(session_id, session.epoch)
        assert kept is not None and Recipe.decode(kept).subscriptions == {NOTE}
        assert "resources/subscribe" not in guard.methods  # never sent upstream

        assert result_text(await client.call_tool("update_note", {"text": "bye"})) == "updated"
        async with asyncio.timeout(30):
            await updated.wait()
        assert updates == [NOTE]

        await client.unsubscribe_resource(NOTE)
        assert guard.listens[-1].get("resourceSubscriptions") is None and len(guard.listens) == 3
        assert result_text(await client.call_tool("update_note", {"text": "again"})) == "updated"
        # The tool-list change comes after the update would have, on the same stream: once it is here,
        # no update came.
        assert result_text(await client.call_tool("change_tools", {})) == "changed"
        async with asyncio.timeout(30):
            await tools_changed.wait()
        assert updates == [NOTE]
        assert bridge.listens[session_id] == {listening} and len(guard.listens) == 3
        assert "GET" not in guard.refused
        kept = await proxy.ctx.store.recipe(session_id, session.epoch)
        assert kept is not None and Recipe.decode(kept).subscriptions == frozenset()


@pytest.mark.asyncio
async def test_a_get_opened_after_subscribing_listens_with_them_and_ends_with_the_session() -> None:
    """Subscribed before any GET: the GET's listen carries the URI; the update comes on it, without the
    listen's acknowledgement (the proxy's own request's); a DELETE of the session ends the GET."""
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        subscribe = {"jsonrpc": "2.0", "id": 50, "method": "resources/subscribe", "params": {"uri": NOTE}}
        async with http.post(proxy.url, data=orjson.dumps(subscribe), headers=client.headers()) as response:
            assert response.status == 200 and await response.json() == {
                "jsonrpc": "2.0",
                "id": 50,
                "result": {},
            }
        assert guard.listens == []  # no GET yet: nothing upstream
        async with http.get(proxy.url, headers=client.headers()) as get:
            assert get.status == 200 and get.content_type == "text/event-stream"
            await until(lambda: len(guard.listens) == 1, timeout=30, what="the listen stream open")
            assert guard.listens[0]["resourceSubscriptions"] == [NOTE]
            await until(
                lambda: client.session_id in _bridge(proxy).listens, timeout=30, what="the GET served"
            )
            _, call = client.tool_call("update_note", {"text": "later"})
            async with http.post(proxy.url, data=call, headers=client.headers()) as response:
                assert response.status == 200
                await response.read()
            seen: list[dict[str, Any]] = []
            async with asyncio.timeout(30):
                async for event in sse_events(get):
                    if event.data:
                        seen.append(orjson.loads(event.data))
                        break
            assert seen == [
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/resources/updated",
                    "params": {"uri": NOTE, "_meta": seen[0]["params"]["_meta"]},
                }
            ]
            async with http.delete(proxy.url, headers=client.headers()) as response:
                assert response.status == 200
            async with asyncio.timeout(30):
                rest = [event async for event in sse_events(get)]  # the GET ends with the session
            assert [e for e in rest if e.data] == []
            assert client.session_id not in _bridge(proxy).listens
