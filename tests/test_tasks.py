"""Durable long calls through the real proxy, in front of the official SDK's server (modern path) as the
upstream, with raw HTTP: a 2026-07-28 client that declares the tasks extension gets a task handle for a call
longer than task_after, and polls it to its result from another connection (and, with Redis, another
replica); cancel; another token's 404; what stays as today."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import InputRequiredResult

from mcpresume.daemon.app import PROXY, RunningProxy
from mcpresume.examples.upstream import RunningUpstream, local_transport_security
from tests.support.playbook import is_era_probe
from tests.support.poll import until
from tests.support.proxy import running_proxy
from tests.test_redis_proxy import on_redis

TASKS_EXT = "io.modelcontextprotocol/tasks"
CAPS = "io.modelcontextprotocol/clientCapabilities"
FAST = {"tasks": True, "task_after": 0.5, "task_ttl": 60.0}


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
        return r.status, orjson.loads(await r.read())


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
            task_id = (await r.json())["result"]["taskId"]
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
            task_id = (await r.json())["result"]["taskId"]
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
            task_id = (await r.json())["result"]["taskId"]
        final = await completed(proxy.url, task_id)  # ~6 KB of events, each < 1 KiB: a task early
        assert final["status"] == "completed", final
        assert final["result"]["structuredContent"] == {"result": "counted to 40"}
