"""Durable long calls through the real proxy, in front of the official SDK's server (modern path) as the
upstream, with raw HTTP: a 2026-07-28 client that declares the tasks extension gets a task handle for a call
longer than task_after, and polls it to its result from another connection (and, with Redis, another
replica); cancel; another token's 404; what stays as today."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import InputRequiredResult

from mcpresume.core.sse import SSEParser
from mcpresume.daemon.app import PROXY, RunningProxy
from mcpresume.examples.upstream import RunningUpstream, build_example_app, local_transport_security
from mcpresume.http.tasks import ACCEPTED_FOR
from tests.support.playbook import is_era_probe
from tests.support.poll import until
from tests.support.proxy import ManualClock, running_proxy
from tests.test_redis_proxy import on_redis

TASKS_EXT = "io.modelcontextprotocol/tasks"
CAPS = "io.modelcontextprotocol/clientCapabilities"
FAST = {"tasks": True, "task_after": 0.5, "task_ttl": 60.0}


def messages_of(content_type: str, raw: bytes) -> list[Any]:
    """The JSON-RPC messages of an answer: a JSON body's, or an event stream's, in order."""
    if content_type != "text/event-stream":
        return [orjson.loads(raw)]
    parser = SSEParser(1 << 24)
    events = parser.feed(raw)
    parser.close()
    return [orjson.loads(e.data) for e in events if e.data]


async def answer_of(r: aiohttp.ClientResponse) -> Any:
    """The JSON-RPC response in an answer (JSON, or the event stream's response)."""
    docs = messages_of(r.content_type, await r.read())
    return next(d for d in docs if "id" in d and ("result" in d or "error" in d))


def meta(tasks: bool = True) -> dict[str, Any]:
    caps: dict[str, Any] = {"extensions": {TASKS_EXT: {}}} if tasks else {}
    return {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": caps,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
    }


def headers(method: str, name: str, token: str = "alice") -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
        "Mcp-Name": name,
        "Authorization": f"Bearer {token}",
    }


async def post(
    url: str, rid: int, method: str, name: str, params: dict[str, Any], token: str = "alice"
) -> Any:
    """One request on a fresh connection (every poll is another connection)."""
    body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**params, "_meta": meta()}}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=orjson.dumps(body), headers=headers(method, name, token)) as r,
    ):
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw else None


async def call(url: str, n: int, delay: float, *, tasks: bool = True, rid: int = 1) -> Any:
    params = {"name": "count_slowly", "arguments": {"n": n, "delay": delay}, "_meta": meta(tasks)}
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=orjson.dumps(body), headers=headers("tools/call", "count_slowly")) as r,
    ):
        return r.status, await answer_of(r)


async def get(url: str, task_id: str, token: str = "alice") -> Any:
    return await post(url, 9, "tasks/get", task_id, {"taskId": task_id}, token)


async def completed(url: str, task_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def done() -> bool:
        status, doc = await get(url, task_id)
        assert status == 200, doc
        seen.update(doc["result"])
        return bool(doc["result"]["status"] != "working")

    await until(done, timeout=30, what="the task ended", every=0.1)
    return seen


def tasks_of(proxy: RunningProxy) -> Any:
    return proxy.app[PROXY].tasks


async def test_a_long_call_becomes_a_task_polled_to_its_result_from_another_connection(
    example_upstream: str,
) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        status, doc = await call(proxy.url, n=8, delay=0.25)  # 2 s, task_after 0.5 s
        assert status == 200
        handle = doc["result"]
        assert handle["resultType"] == "task" and handle["status"] == "working"
        assert handle["taskId"].startswith("mcpr-") and len(handle["taskId"]) > 40
        assert handle["ttlMs"] == 60_000 and handle["pollIntervalMs"] >= 100
        assert not {"result", "error"} & handle.keys()
        final = await completed(proxy.url, handle["taskId"])
        assert final["status"] == "completed"
        assert final["result"]["structuredContent"] == {"result": "counted to 8"}
        metrics = proxy.app[PROXY].ctx.metrics
        assert metrics.tasks.labels("created")._value.get() == 1
        assert metrics.tasks.labels("completed")._value.get() == 1
        assert metrics.task_polls._value.get() >= 1


async def test_another_token_gets_404_and_an_unknown_id_too(example_upstream: str) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        _, doc = await call(proxy.url, n=6, delay=0.25)
        task_id = doc["result"]["taskId"]
        status, other = await get(proxy.url, task_id, token="mallory")
        assert status == 404 and other["error"]["data"]["reason"] == "unknown_task"
        status, unknown = await get(proxy.url, "mcpr-" + "x" * 43)
        assert status == 404 and unknown["error"]["data"]["reason"] == "unknown_task"
        status, _ = await post(proxy.url, 3, "tasks/cancel", task_id, {"taskId": task_id}, "mallory")
        assert status == 404
        assert (await completed(proxy.url, task_id))["status"] == "completed"  # untouched by mallory


async def test_cancel_closes_the_upstream_call_and_the_task_stays_cancelled(example_upstream: str) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        _, doc = await call(proxy.url, n=100, delay=0.2)  # 20 s unless cancelled
        task_id = doc["result"]["taskId"]
        assert task_id in tasks_of(proxy)._running
        status, cancelled = await post(proxy.url, 4, "tasks/cancel", task_id, {"taskId": task_id})
        assert status == 200 and cancelled["result"]["status"] == "cancelled"
        await until(lambda: task_id not in tasks_of(proxy)._running, what="the upstream call closed")
        _, polled = await get(proxy.url, task_id)
        assert polled["result"]["status"] == "cancelled"
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("cancelled")._value.get() == 1


@pytest.mark.parametrize("tasks", [True, False])
async def test_a_call_within_task_after_or_without_the_extension_is_answered_as_today(
    example_upstream: str, tasks: bool
) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        status, doc = await call(proxy.url, n=1, delay=0.01, tasks=tasks)
        assert status == 200
        assert doc["result"]["resultType"] == "complete"
        assert doc["result"]["structuredContent"] == {"result": "counted to 1"}
        if not tasks:
            status, doc = await call(proxy.url, n=4, delay=0.25, tasks=False)  # long, but not declared
            assert doc["result"]["structuredContent"] == {"result": "counted to 4"}
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


async def test_tasks_off_leaves_every_call_as_today(example_upstream: str) -> None:
    async with running_proxy(example_upstream, **{**FAST, "tasks": False}) as proxy:
        status, doc = await call(proxy.url, n=4, delay=0.25)
        assert status == 200 and doc["result"]["structuredContent"] == {"result": "counted to 4"}


async def test_with_redis_a_task_made_on_one_replica_is_polled_and_cancelled_on_the_other(
    example_upstream: str, redis_db: str
) -> None:
    async with (
        running_proxy(example_upstream, **on_redis(redis_db, replica_id="one", **FAST)) as one,
        running_proxy(example_upstream, **on_redis(redis_db, replica_id="two", **FAST)) as two,
    ):
        _, doc = await call(one.url, n=8, delay=0.25)
        task_id = doc["result"]["taskId"]
        final = await completed(two.url, task_id)
        assert final["status"] == "completed"
        assert final["result"]["structuredContent"] == {"result": "counted to 8"}
        status, _ = await get(two.url, task_id, token="mallory")
        assert status == 404
        # A cancel on the other replica closes the call on the one that reads it (within a poll interval).
        _, doc = await call(one.url, n=100, delay=0.2, rid=2)
        long_id = doc["result"]["taskId"]
        status, cancelled = await post(two.url, 5, "tasks/cancel", long_id, {"taskId": long_id})
        assert status == 200 and cancelled["result"]["status"] == "cancelled"
        await until(lambda: long_id not in tasks_of(one)._running, timeout=20, what="closed on replica one")


# -- a real client: FastMCP 4 with fastmcp-tasks (pinned to matching versions) -------------------------

FASTMCP_VERSION = "4.1.4"  # fastmcp-tasks' newest; its fastmcp must be the same release
FASTMCP_VENV = Path.home() / ".cache" / "mcpresume" / f"fastmcp-tasks-{FASTMCP_VERSION}"
CLIENT_SCRIPT = Path(__file__).parent / "support" / "fastmcp_tasks_client.py"


@pytest.fixture(scope="session")
def fastmcp_python() -> Path:
    """The venv's interpreter, the venv built on first use (PyPI needed once; skipped without it)."""
    python = FASTMCP_VENV / "bin" / "python"
    marker = FASTMCP_VENV / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(FASTMCP_VENV)], check=True)
        pins = [f"fastmcp=={FASTMCP_VERSION}", f"fastmcp-tasks=={FASTMCP_VERSION}"]
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *pins], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            pytest.skip(f"PyPI unreachable or the pins unavailable: {done.stderr.strip()[-300:]}")
        marker.touch()
    return python


async def test_fastmcp_call_tool_task_through_the_proxy_gets_a_handle_and_its_result(
    example_upstream: str, fastmcp_python: Path
) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        # -P: the script's folder (tests/support, which has a redis.py) is not put first on the path.
        client = await asyncio.create_subprocess_exec(
            str(fastmcp_python), "-P", str(CLIENT_SCRIPT), proxy.url, "8", "0.25",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(client.communicate(), timeout=120)
        assert client.returncode == 0, err.decode()[-2000:]
        seen = orjson.loads(out.splitlines()[-1])
        assert seen["task_id"].startswith("mcpr-") and seen["status"] == "working"
        assert seen["result"] == {"result": "counted to 8"}
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("completed")._value.get() == 1


# -- an input-required round trip (MRTR) -------------------------------------------------------------


def mrtr_app() -> Any:
    """An SDK server whose one tool takes a while, then asks the client a question (an InputRequiredResult),
    and with the answer and its request state takes a while again and returns."""
    server: MCPServer[Any] = MCPServer("mrtr", log_level="WARNING")

    @server.tool(description="Ask for an approval, then answer.")
    async def approve(ctx: Context[Any, Any]) -> Any:
        await asyncio.sleep(1.0)
        responses = ctx.input_responses
        if not responses:
            question = {
                "method": "elicitation/create",
                "params": {
                    "mode": "form",
                    "message": "approve?",
                    "requestedSchema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
                },
            }
            return InputRequiredResult.model_validate(
                {"resultType": "input_required", "inputRequests": {"q1": question}, "requestState": "round-1"}
            )
        answer = responses["q1"]
        content = answer.content if hasattr(answer, "content") else None
        return f"approved={content} state={ctx.request_state}"

    return server.streamable_http_app(
        streamable_http_path="/mcp", transport_security=local_transport_security()
    )


async def test_an_input_required_answer_waits_for_tasks_update_and_the_call_is_retried_with_it() -> None:
    async with (
        RunningUpstream(mrtr_app()) as upstream,
        running_proxy(upstream.url, **FAST) as proxy,
    ):
        params = {"name": "approve", "arguments": {}, "_meta": meta()}
        body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=body, headers=headers("tools/call", "approve")) as r,
        ):
            task_id = (await answer_of(r))["result"]["taskId"]
        waiting = await completed(proxy.url, task_id)
        assert waiting["status"] == "input_required", waiting
        assert waiting["inputRequests"]["q1"]["method"] == "elicitation/create"
        reply = {"taskId": task_id, "inputResponses": {"q1": {"action": "accept", "content": {"ok": True}}}}
        status, doc = await post(proxy.url, 5, "tasks/update", task_id, reply)
        assert status == 200, doc
        status, again = await post(proxy.url, 6, "tasks/update", task_id, reply)
        assert status == 400 and again["error"]["data"]["reason"] == "task_not_waiting"
        final = await completed(proxy.url, task_id)
        assert final["status"] == "completed", final
        assert final["result"]["content"][0]["text"] == "approved={'ok': True} state=round-1"


async def test_an_upstream_that_makes_tasks_itself_gets_the_call_as_today(serve: Any) -> None:
    """Its server/discover declares the extension: the call goes with the extension, its task is its own."""
    seen: list[dict[str, Any]] = []

    async def mcp(request: web.Request) -> web.Response:
        doc = await request.json()
        seen.append(doc)
        if doc["method"] == "server/discover":
            caps = {"tools": {}, "extensions": {TASKS_EXT: {}}}
            result: dict[str, Any] = {"resultType": "complete", "capabilities": caps}
        else:
            await asyncio.sleep(1.0)  # longer than task_after: still the upstream's answer
            result = {"resultType": "task", "taskId": "upstream-1", "status": "working"}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    app = web.Application()
    app.router.add_post("/mcp", mcp)
    url = await serve(app)
    async with running_proxy(url, **FAST) as proxy:
        for rid in (1, 2):
            status, doc = await call(proxy.url, n=1, delay=0.0, rid=rid)
            assert status == 200 and doc["result"]["taskId"] == "upstream-1"
        status, _ = await get(proxy.url, "upstream-1")  # not the proxy's: passed through
        calls = [d for d in seen if d["method"] == "tools/call"]
        assert len(calls) == 2
        assert all(TASKS_EXT in d["params"]["_meta"][CAPS]["extensions"] for d in calls)
        asked = [d for d in seen if d["method"] == "server/discover" and not is_era_probe(d)]
        assert len(asked) == 1  # asked once, kept (the proxy's era probe at start aside)
        assert seen[-1]["method"] == "tasks/get"
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


async def test_an_upstream_without_tasks_gets_the_call_without_the_extension(serve: Any) -> None:
    seen: list[dict[str, Any]] = []

    async def mcp(request: web.Request) -> web.Response:
        doc = await request.json()
        seen.append(doc)
        result = {"resultType": "complete", "capabilities": {"tools": {}}, "content": []}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    app = web.Application()
    app.router.add_post("/mcp", mcp)
    url = await serve(app)
    async with running_proxy(url, **FAST) as proxy:
        status, doc = await call(proxy.url, n=1, delay=0.0)
        assert status == 200 and doc["result"]["content"] == []
    (tool_call,) = [d for d in seen if d["method"] == "tools/call"]
    assert "extensions" not in tool_call["params"]["_meta"][CAPS]


async def test_a_task_whose_replica_stops_fails_with_proxy_shutdown(
    example_upstream: str, redis_db: str
) -> None:
    async with running_proxy(example_upstream, **on_redis(redis_db, replica_id="one", **FAST)) as one:
        _, doc = await call(one.url, n=100, delay=0.2)
        task_id = doc["result"]["taskId"]
    async with running_proxy(example_upstream, **on_redis(redis_db, replica_id="two", **FAST)) as two:
        status, polled = await get(two.url, task_id)
        assert status == 200 and polled["result"]["status"] == "failed"
        assert polled["result"]["error"]["data"]["reason"] == "proxy_shutdown"


async def test_a_working_task_carries_the_calls_newest_progress(example_upstream: str) -> None:
    async with running_proxy(example_upstream, **FAST) as proxy:
        params = {
            "name": "count_slowly",
            "arguments": {"n": 12, "delay": 0.25},
            "_meta": {**meta(), "progressToken": "p"},
        }
        body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=body, headers=headers("tools/call", "count_slowly")) as r,
        ):
            task_id = (await answer_of(r))["result"]["taskId"]
        messages: list[str] = []

        async def progressed() -> bool:
            _, doc = await get(proxy.url, task_id)
            if doc["result"]["status"] == "working" and "statusMessage" in doc["result"]:
                messages.append(doc["result"]["statusMessage"])
            return len(messages) > 0

        await until(progressed, timeout=20, what="a progress message on the task", every=0.1)
        assert messages[0].startswith("step ") and messages[0].endswith(" of 12")
        assert (await completed(proxy.url, task_id))["status"] == "completed"


async def test_a_long_calls_notifications_do_not_add_up_against_max_event_bytes(
    example_upstream: str,
) -> None:
    async with running_proxy(example_upstream, **FAST, max_event_bytes=1024) as proxy:
        meta_ = {**meta(), "progressToken": "p"}
        params = {"name": "count_slowly", "arguments": {"n": 40, "delay": 0.05}, "_meta": meta_}
        body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=body, headers=headers("tools/call", "count_slowly")) as r,
        ):
            task_id = (await answer_of(r))["result"]["taskId"]
        final = await completed(proxy.url, task_id)  # ~6 KB of events, each < 1 KiB: a task early
        assert final["status"] == "completed", final
        assert final["result"]["structuredContent"] == {"result": "counted to 40"}


# -- the answer before task_after: relayed as it comes ------------------------------------------------


def gated_app(gate: asyncio.Event, cancelled: asyncio.Event | None = None) -> Any:
    """An SDK server (modern path: an event stream per call) whose one tool reports progress at once, then
    waits for the test to open ``gate``: a proxy that held the progress back until the answer ended would
    never let the test see it, and the test would wait in vain. ``cancelled``: set if the call is."""
    server: MCPServer[Any] = MCPServer("gated", log_level="WARNING")

    @server.tool(description="Report progress, wait for the gate, answer.")
    async def gated(ctx: Context[Any, Any]) -> str:
        await ctx.report_progress(1, 2, "halfway")
        try:
            await gate.wait()
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.set()
            raise
        return "released"

    return server.streamable_http_app(
        streamable_http_path="/mcp", transport_security=local_transport_security()
    )


@contextlib.asynccontextmanager
async def gated_proxy(
    cancelled: asyncio.Event | None = None, **settings: Any
) -> AsyncIterator[tuple[asyncio.Event, RunningProxy]]:
    """The proxy (``FAST``, and ``settings``) in front of ``gated_app``, and its gate."""
    gate = asyncio.Event()
    async with (
        RunningUpstream(gated_app(gate, cancelled)) as upstream,
        running_proxy(upstream.url, **{**FAST, **settings}) as proxy,
    ):
        yield gate, proxy


@contextlib.asynccontextmanager
async def gated_call(url: str) -> AsyncIterator[aiohttp.ClientResponse]:
    params = {"name": "gated", "arguments": {}, "_meta": {**meta(), "progressToken": "p"}}
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=body, headers=headers("tools/call", "gated")) as r,
    ):
        yield r


async def next_message(r: aiohttp.ClientResponse, parser: SSEParser) -> Any:
    """The stream's next JSON-RPC message, read as it comes (None at its end)."""
    while True:
        chunk = await r.content.readany()
        if not chunk:
            return None
        events = [e for e in parser.feed(chunk) if e.data]
        if events:
            assert len(events) == 1, "one message at a time: the upstream waits between them"
            return orjson.loads(events[0].data)


async def test_a_call_that_ends_before_task_after_streams_its_progress_as_it_comes() -> None:
    async with gated_proxy(task_after=60.0) as (gate, proxy):
        async with gated_call(proxy.url) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            parser = SSEParser(1 << 20)
            progress = await asyncio.wait_for(next_message(r, parser), timeout=30)
            assert progress["method"] == "notifications/progress"  # while the call still runs
            assert progress["params"]["message"] == "halfway"
            gate.set()
            done = await asyncio.wait_for(next_message(r, parser), timeout=30)
            assert done["id"] == 1 and done["result"]["content"][0]["text"] == "released"
            assert await next_message(r, parser) is None
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


async def test_a_client_that_leaves_before_its_handle_cancels_the_call_upstream_as_today() -> None:
    cancelled = asyncio.Event()
    async with gated_proxy(cancelled, task_after=60.0) as (_, proxy):
        async with gated_call(proxy.url) as r:
            progress = await asyncio.wait_for(next_message(r, SSEParser(1 << 20)), timeout=30)
            assert progress["method"] == "notifications/progress"
            r.close()  # the client leaves: its connection closed mid-answer
        await asyncio.wait_for(cancelled.wait(), timeout=30)  # the upstream's answer was closed: cancelled
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


async def test_a_call_outlasting_task_after_gets_its_handle_as_the_last_event_of_the_same_stream() -> None:
    async with gated_proxy() as (gate, proxy):
        async with gated_call(proxy.url) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            parser = SSEParser(1 << 20)
            progress = await asyncio.wait_for(next_message(r, parser), timeout=30)
            assert progress["method"] == "notifications/progress"
            handle = await asyncio.wait_for(next_message(r, parser), timeout=30)  # at task_after
            assert handle["id"] == 1 and handle["result"]["resultType"] == "task"
            assert await next_message(r, parser) is None  # the stream ends with the handle
        task_id = handle["result"]["taskId"]
        _, polled = await get(proxy.url, task_id)
        assert polled["result"]["status"] == "working"  # the call goes on: the gate is shut
        gate.set()
        final = await completed(proxy.url, task_id)
        assert final["status"] == "completed" and final["result"]["content"][0]["text"] == "released"


async def test_a_json_answer_within_task_after_stays_json_whatever_its_size(serve: Any) -> None:
    """A JSON answer is relayed as it comes, not held: max_event_bytes does not limit it (it does not
    without tasks either)."""
    big = "x" * 200_000

    async def mcp(request: web.Request) -> web.Response:
        doc = await request.json()
        result: dict[str, Any] = {"resultType": "complete", "capabilities": {"tools": {}}}
        if doc["method"] == "tools/call":
            result = {"content": [{"type": "text", "text": big}]}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    app = web.Application()
    app.router.add_post("/mcp", mcp)
    url = await serve(app)
    async with running_proxy(url, **FAST, max_event_bytes=1024) as proxy:
        params = {"name": "big", "arguments": {}, "_meta": meta()}
        body = orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params})
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=body, headers=headers("tools/call", "big")) as r,
        ):
            assert r.status == 200 and r.content_type == "application/json"
            doc = await r.json()
        assert doc["id"] == 7 and doc["result"]["content"][0]["text"] == big
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


# -- expiry -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
async def test_an_expired_task_is_404_and_counted_expired_once(
    example_upstream: str, redis_db: str, shared: bool
) -> None:
    """Counted by the housekeeping round (``Tasks.sweep``), on either store; with Redis by one replica of
    the two, though Redis drops the task's key on its own."""
    clock = ManualClock(time.time())  # Redis expires the key by the real clock: start from it
    settings = {**FAST, "clock": clock}
    store = {"replica_id": "one"} if shared else {}
    async with contextlib.AsyncExitStack() as stack:
        if shared:
            one = await stack.enter_async_context(
                running_proxy(example_upstream, **on_redis(redis_db, **store, **settings))
            )
            two = await stack.enter_async_context(
                running_proxy(example_upstream, **on_redis(redis_db, replica_id="two", **settings))
            )
            proxies = [one, two]
        else:
            proxies = [await stack.enter_async_context(running_proxy(example_upstream, **settings))]
        _, doc = await call(proxies[0].url, n=4, delay=0.25)
        task_id = doc["result"]["taskId"]
        assert (await completed(proxies[-1].url, task_id))["status"] == "completed"
        clock.advance(FAST["task_ttl"])
        status, gone = await get(proxies[-1].url, task_id)
        assert status == 404 and gone["error"]["data"]["reason"] == "unknown_task"
        for _ in range(2):  # two rounds on every replica: counted once in all
            for proxy in proxies:
                await tasks_of(proxy).sweep()
        counted = [p.app[PROXY].ctx.metrics.tasks.labels("expired")._value.get() for p in proxies]
        assert sum(counted) == 1, counted


# -- the upstream's check applies to polls ---------------------------------------------------------------


def token_checked(app: Any, valid: set[str]) -> Any:
    """The SDK's app behind a bearer check on every request, as an authenticating server does: a token not
    in ``valid`` (revoked) gets 401 with a challenge."""

    async def checked(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            if auth.removeprefix("Bearer ") not in valid:
                challenge = b'Bearer error="invalid_token"'
                head = [(b"www-authenticate", challenge), (b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 401, "headers": head})
                await send({"type": "http.response.body", "body": b'{"error":"invalid_token"}'})
                return
        await app(scope, receive, send)

    return checked


async def test_a_poll_with_a_token_the_upstream_revoked_is_refused_as_a_reattach_would_be() -> None:
    valid = {"alice"}
    clock = ManualClock(time.time())
    async with (
        RunningUpstream(token_checked(build_example_app(), valid)) as upstream,
        running_proxy(upstream.url, **FAST, clock=clock) as proxy,
    ):
        _, doc = await call(proxy.url, n=100, delay=0.2)  # 20 s: still working throughout
        task_id = doc["result"]["taskId"]
        status, polled = await get(proxy.url, task_id)
        assert status == 200 and polled["result"]["status"] == "working"
        valid.discard("alice")  # the upstream revokes the token
        status, _ = await get(proxy.url, task_id)
        assert status == 200  # its acceptance is kept ACCEPTED_FOR seconds (the cost of a check per poll)
        clock.advance(ACCEPTED_FOR)
        for method in ("tasks/get", "tasks/cancel"):
            body = {
                "jsonrpc": "2.0",
                "id": 3,
                "method": method,
                "params": {"taskId": task_id, "_meta": meta()},
            }
            async with (
                aiohttp.ClientSession() as http,
                http.post(proxy.url, data=orjson.dumps(body), headers=headers(method, task_id)) as r,
            ):
                assert r.status == 401, await r.text()
                assert r.headers.getall("WWW-Authenticate") == ['Bearer error="invalid_token"']
                refusal = await r.json()
            assert refusal["id"] == 3 and refusal["error"]["data"]["reason"] == "credentials_refused"
        valid.add("alice")  # nothing was cancelled by the refused cancel
        status, polled = await get(proxy.url, task_id)
        assert status == 200 and polled["result"]["status"] == "working"


# -- tasks/* the proxy refuses: each a JSON-RPC error with its reason, nothing else touched -------------


async def test_malformed_unknown_and_out_of_turn_task_requests_are_refused_with_their_reasons() -> None:
    async with gated_proxy() as (gate, proxy):
        async with gated_call(proxy.url) as r:
            task_id = (await answer_of(r))["result"]["taskId"]  # working until the gate opens
        cases: list[tuple[str, str, dict[str, Any], int, str, dict[str, Any]]] = [
            ("tasks/get", task_id, {}, 400, "invalid_task_params", {"problem": "taskId is missing"}),
            ("tasks/get", "42", {"taskId": 42}, 400, "invalid_task_params", {}),
            ("tasks/get", "other", {"taskId": task_id}, 400, "invalid_task_params", {}),  # Mcp-Name differs
            ("tasks/cancel", task_id, {"taskId": None}, 400, "invalid_task_params", {}),
            ("tasks/get", "mcpr-unknown", {"taskId": "mcpr-unknown"}, 404, "unknown_task", {}),
            ("tasks/update", task_id, {"taskId": task_id, "inputResponses": {}}, 400, "task_not_waiting",
             {"status": "working"}),
            ("tasks/update", task_id, {"taskId": task_id, "inputResponses": []}, 400, "invalid_task_params",
             {"problem": "inputResponses is not an object"}),
        ]  # fmt: skip
        for rid, (method, name, params, status, reason, facts) in enumerate(cases, start=10):
            got, refusal = await post(proxy.url, rid, method, name, params)
            assert (got, refusal["id"]) == (status, rid), (method, params, refusal)
            error = refusal["error"]
            assert error["code"] == -32602 and error["data"]["reason"] == reason, error
            assert facts.items() <= error["data"].items(), error
        gate.set()
        final = await completed(proxy.url, task_id)  # untouched by all of it
        assert final["status"] == "completed"
        assert final["result"]["content"][0]["text"] == "released"
        status, refusal = await post(proxy.url, 20, "tasks/cancel", task_id, {"taskId": task_id})
        assert status == 400 and refusal["error"]["code"] == -32602
        assert refusal["error"]["data"] == {"reason": "task_finished", "status": "completed"}
        _, polled = await get(proxy.url, task_id)
        assert polled["result"]["status"] == "completed" and "result" in polled["result"]
        metrics = proxy.app[PROXY].ctx.metrics
        assert metrics.tasks.labels("cancelled")._value.get() == 0
        assert metrics.tasks.labels("completed")._value.get() == 1


class _StoreWith:
    """The proxy's task store with a ``create`` of the test's (a store down, one that takes its time)."""

    def __init__(self, store: Any, create: Any) -> None:
        self.store = store
        self.create = create

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_a_task_the_store_cannot_keep_leaves_the_answer_relayed_to_its_end() -> None:
    async with gated_proxy() as (gate, proxy):
        tasks = tasks_of(proxy)
        refused: list[str] = []

        async def down(task: Any, now: float) -> None:
            refused.append(task.task_id)
            raise ConnectionError("the store is down")

        tasks.store = _StoreWith(tasks.store, down)
        async with gated_call(proxy.url) as r:
            parser = SSEParser(1 << 20)
            progress = await asyncio.wait_for(next_message(r, parser), timeout=30)
            assert progress["method"] == "notifications/progress"
            await until(lambda: len(refused) == 1, what="task_after passed, the task refused")
            gate.set()
            done = await asyncio.wait_for(next_message(r, parser), timeout=30)
            assert done["id"] == 1 and done["result"]["content"][0]["text"] == "released"
            assert await next_message(r, parser) is None
        assert proxy.app[PROXY].ctx.metrics.tasks.labels("created")._value.get() == 0


async def test_a_json_answer_that_begins_while_its_task_is_stored_goes_to_the_task(serve: Any) -> None:
    """The race the handle and a JSON answer run: the answer's head reaches the proxy while the task is
    being stored. The client gets the handle (no answer had begun for it), the task the answer."""
    answer_now, creating, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def mcp(request: web.Request) -> web.Response:
        doc = await request.json()
        if doc["method"] == "server/discover":
            result: dict[str, Any] = {"resultType": "complete", "capabilities": {"tools": {}}}
        else:
            await answer_now.wait()
            result = {"content": [{"type": "text", "text": "late"}]}
        return web.json_response({"jsonrpc": "2.0", "id": doc["id"], "result": result})

    app = web.Application()
    app.router.add_post("/mcp", mcp)
    url = await serve(app)
    async with running_proxy(url, **FAST) as proxy:
        tasks, upstream = tasks_of(proxy), proxy.app[PROXY].ctx.upstream
        store, send = tasks.store, upstream.request
        head_in = asyncio.Event()

        async def held_create(task: Any, now: float) -> None:
            creating.set()
            await release.wait()
            await store.create(task, now)

        async def watched(method: str, path: str, headers: Any, body: Any, **kw: Any) -> Any:
            answer = await send(method, path, headers, body, **kw)
            if b'"tools/call"' in body:
                head_in.set()
            return answer

        tasks.store = _StoreWith(store, held_create)
        upstream.request = watched
        call_task = asyncio.create_task(call(proxy.url, n=1, delay=0.0))
        await asyncio.wait_for(creating.wait(), timeout=30)  # task_after passed, no head yet
        answer_now.set()
        await asyncio.wait_for(head_in.wait(), timeout=30)  # the JSON answer began meanwhile
        release.set()
        status, doc = await asyncio.wait_for(call_task, timeout=30)
        assert status == 200 and doc["result"]["resultType"] == "task"
        final = await completed(proxy.url, doc["result"]["taskId"])
        assert final["status"] == "completed" and final["result"]["content"][0]["text"] == "late"
