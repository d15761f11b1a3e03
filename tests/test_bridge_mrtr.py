"""The era bridge's server-to-client requests (MRTR, issue 34) when the upstream answers with an event stream.

The official SDK's 2026-07-28 path in SSE mode (its default) commits a call's answer to ``text/event-stream``
at the call's first notification: ``ask_later`` and ``sample_later`` report progress, then answer with an
input-required result as the stream's response event, and report progress again on the retry. The proxy
holds that result back, sends the client ``elicitation/create`` (``sampling/createMessage``) on the call's
stream, and retries the call with the client's answer; the stream goes on with the retry's events. (The
Python SDK's ``ClientSession`` answering ``ask_later``: ``tests/test_bridge.py``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import mcp_types as types
import orjson
import pytest
from mcp.client.client import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from mcpresume.daemon.app import PROXY, RunningProxy
from mcpresume.daemon.demo import ScriptedClient, sse_events
from tests.support.modern_upstream import ModernOnly, serve_modern_upstream
from tests.support.proxy import running_proxy
from tests.support.sdk import result_text
from tests.test_bridge import _run_ts, store  # noqa: F401 (store: the memory and Redis fixture)

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def _bridged_session(
    **settings: Any,
) -> AsyncIterator[tuple[ModernOnly, RunningProxy, aiohttp.ClientSession, ScriptedClient]]:
    """A modern-only upstream, the proxy in front of it, and a raw client's bridged session begun."""
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url, **settings) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        yield guard, proxy, http, client


async def test_a_sampling_in_an_event_stream_reaches_the_sdk_client_in_legacy_mode() -> None:
    prompts: list[str] = []

    async def sample(context: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        content = params.messages[0].content
        prompts.append(content.text if isinstance(content, types.TextContent) else "")
        return types.CreateMessageResult(
            role="assistant", content=types.TextContent(type="text", text="plum"), model="test-model"
        )

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        pass

    async with serve_modern_upstream() as (url, guard), running_proxy(url) as proxy:
        async with Client(
            proxy.url, mode="legacy", sampling_callback=sample, read_timeout_seconds=30
        ) as client:
            answered = await client.call_tool(
                "sample_later", {"prompt": "A fruit"}, progress_callback=on_progress
            )
            assert result_text(answered) == "the model said plum (sampled)"
        assert prompts == ["A fruit"]
        assert guard.methods.count("tools/call") == 2


async def test_input_required_again_and_two_input_requests_at_once_in_event_streams() -> None:
    """The retry's answer asks again (a second round); each round asks for a word and the client's roots at
    once (``elicitation/create`` and ``roots/list``): each round's two answers retry the call once."""
    asked: list[str] = []
    listed = 0
    progress: list[float] = []

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"word": f"fig{len(asked)}"})

    async def roots(context: Any) -> types.ListRootsResult:
        nonlocal listed
        listed += 1
        return types.ListRootsResult(roots=[types.Root(uri="file:///tmp/a"), types.Root(uri="file:///tmp/b")])

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        streamable_http_client(proxy.url) as (read, write),
        ClientSession(
            read, write, elicitation_callback=elicit, list_roots_callback=roots, read_timeout_seconds=30
        ) as session,
    ):
        await session.initialize()
        answered = await session.call_tool(
            "ask_later", {"question": "A fig?", "rounds": 2, "roots": True}, progress_callback=on_progress
        )
        assert result_text(answered) == "you said fig2 (asked-later, 1, 2 root(s))"
        assert asked == ["A fig?", "A fig?"] and listed == 2
        assert progress == [0, 1, 2]
        assert guard.methods.count("tools/call") == 3  # the call, then a retry per round
        assert not proxy.app[PROXY].bridge.awaiting  # nothing left awaiting a client's answer


async def test_the_typescript_sdk_client_answers_an_elicitation_in_an_event_stream() -> None:
    async with serve_modern_upstream() as (url, guard), running_proxy(url) as proxy:
        got = await _run_ts("ts_bridge_client.mjs", proxy.url)
        assert got["answeredLater"] == "you said kumquat (asked-later, 1)"
        assert got["progressLater"] == [0, 1]
        assert got["asked"] == [
            "A fruit?",
            "A fruit?",
        ]  # ask (a JSON answer), then ask_later (an event stream)
        assert guard.slow_tallies["asked"] == 1  # type: ignore[attr-defined]


def _answer(request: dict[str, Any], word: str) -> bytes:
    return orjson.dumps(
        {"jsonrpc": "2.0", "id": request["id"], "result": {"action": "accept", "content": {"word": word}}}
    )


async def _messages_until(
    response: aiohttp.ClientResponse, method: str | None, request_id: int | None
) -> tuple[list[dict[str, Any]], bytes | None]:
    """The messages of a stream until one of ``method`` (or the response to ``request_id``), and the cursor
    of the last event read."""
    messages: list[dict[str, Any]] = []
    cursor: bytes | None = None
    async for event in sse_events(response):
        cursor = event.id or cursor
        if not event.data:
            continue
        message = orjson.loads(event.data)
        messages.append(message)
        if (method is not None and message.get("method") == method) or (
            request_id is not None and message.get("id") == request_id and "method" not in message
        ):
            break
    return messages, cursor


@pytest.mark.parametrize("dropped", ["before the elicitation", "after the elicitation"])
async def test_a_client_that_drops_while_the_elicitation_is_pending_reattaches_with_its_cursor(
    store: dict[str, Any],  # noqa: F811
    dropped: str,
) -> None:
    """Cut before the elicitation reached the client: the re-attach brings it, then the result once. Cut after
    it: the client answers, re-attaches, and gets the result once (and not the elicitation again)."""
    async with _bridged_session(**store) as (guard, proxy, http, client):
        request_id, body = client.tool_call("ask_later", {"question": "A colour?"})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            until = "notifications/progress" if dropped == "before the elicitation" else "elicitation/create"
            first, cursor = await _messages_until(response, until, None)
        assert cursor is not None and first[-1]["method"] == until
        elicitation: dict[str, Any] | None = first[-1] if until == "elicitation/create" else None
        reattach = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
        if elicitation is None:  # not delivered yet: the re-attach brings it
            async with http.get(proxy.url, headers=reattach) as again:
                assert again.status == 200
                before, cursor = await _messages_until(again, "elicitation/create", None)
            assert [m.get("method") for m in before] == ["elicitation/create"]
            elicitation = before[0]
            assert cursor is not None
            reattach = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
        assert elicitation["params"]["message"] == "A colour?"
        async with http.post(
            proxy.url, data=_answer(elicitation, "teal"), headers=client.headers()
        ) as answered:
            assert answered.status == 202
        async with http.get(proxy.url, headers=reattach) as again:
            assert again.status == 200
            rest, _ = await _messages_until(again, None, request_id)
        assert all(m.get("method") != "elicitation/create" for m in rest)  # never twice
        assert [m.get("method") for m in rest] == ["notifications/progress", None]  # the retry's progress
        results = [m for m in rest if m.get("id") == request_id]
        assert len(results) == 1
        assert results[0]["result"]["content"][0]["text"] == "you said teal (asked-later, 1)"
        assert guard.slow_tallies["asked"] == 1  # type: ignore[attr-defined]
        # The whole stream again from its start: the input-required result was never a response of it.
        async with http.post(proxy.url, data=body, headers=client.headers()) as replayed:
            whole = [orjson.loads(e.data) for e in [e async for e in sse_events(replayed)] if e.data]
        assert [m.get("method") for m in whole] == [
            "notifications/progress",
            "elicitation/create",
            "notifications/progress",
            None,
        ]
        assert all("inputRequests" not in m.get("result", {}) for m in whole)


async def test_an_elicitation_refused_by_the_client_is_the_calls_answer() -> None:
    async with _bridged_session() as (guard, proxy, http, client):
        request_id, body = client.tool_call("ask_later", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            messages: list[dict[str, Any]] = []
            async for event in sse_events(response):
                if not event.data:
                    continue
                message = orjson.loads(event.data)
                messages.append(message)
                if message.get("method") == "elicitation/create":
                    refusal = {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -1, "message": "no"}}
                    async with http.post(
                        proxy.url, data=orjson.dumps(refusal), headers=client.headers()
                    ) as answered:
                        assert answered.status == 202
        assert messages[-1] == {"jsonrpc": "2.0", "id": request_id, "error": {"code": -1, "message": "no"}}
        assert guard.methods.count("tools/call") == 1  # refused: not retried


async def test_a_call_cancelled_while_its_elicitation_is_pending_ends_unanswered_and_is_not_retried() -> None:
    async with _bridged_session() as (guard, proxy, http, client):
        request_id, body = client.tool_call("ask_later", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            seen, _ = await _messages_until(response, "elicitation/create", None)
            cancel = {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": request_id},
            }
            async with http.post(proxy.url, data=orjson.dumps(cancel), headers=client.headers()) as cancelled:
                assert cancelled.status == 202
            rest, _ = await _messages_until(response, None, request_id)  # to the stream's end
        assert [m.get("method") for m in seen] == ["notifications/progress", "elicitation/create"]
        assert rest == []  # a cancelled request SHOULD NOT be answered
        assert guard.methods.count("tools/call") == 1
        assert not proxy.app[PROXY].bridge.awaiting
        # The elicitation's answer after the cancel: not the proxy's to collect any more, nothing retried.
        late = _answer(seen[-1], "late")
        async with http.post(proxy.url, data=late, headers=client.headers()) as answered:
            assert answered.status == 202
        assert guard.methods.count("tools/call") == 1


async def test_a_json_input_required_answer_is_pumped_the_same_way_and_resumable() -> None:
    """``ask`` answers with JSON (no progress before it): the same stream, cursors and retry."""
    async with _bridged_session() as (guard, proxy, http, client):
        request_id, body = client.tool_call("ask", {"question": "A tree?"})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            first, cursor = await _messages_until(response, "elicitation/create", None)
        assert [m.get("method") for m in first] == ["elicitation/create"] and cursor is not None
        async with http.post(proxy.url, data=_answer(first[0], "oak"), headers=client.headers()) as answered:
            assert answered.status == 202
        reattach = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
        async with http.get(proxy.url, headers=reattach) as again:
            rest, _ = await _messages_until(again, None, request_id)
        assert [m["result"]["content"][0]["text"] for m in rest] == ["you said oak (asked)"]
        assert guard.methods.count("tools/call") == 2
        assert not proxy.app[PROXY].bridge.awaiting


async def test_a_retry_the_upstream_does_not_answer_is_the_calls_error_once() -> None:
    async with _bridged_session() as (guard, proxy, http, client):
        request_id, body = client.tool_call("ask_later", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            first, _ = await _messages_until(response, "elicitation/create", None)
            guard.down = True
            async with http.post(
                proxy.url, data=_answer(first[-1], "x"), headers=client.headers()
            ) as answered:
                assert answered.status == 202
            rest, _ = await _messages_until(response, None, request_id)
        assert len(rest) == 1 and rest[0]["id"] == request_id
        assert rest[0]["error"]["message"] == "the upstream answered the retry with HTTP 503"
        assert guard.methods.count("tools/call") == 1  # the retry never reached the server
