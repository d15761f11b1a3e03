"""Durable long calls: what a task costs. ``python -m bench.tasks`` (about 30 s; Redis needs redis-server).

* Poll cost: ``tasks/get`` of a completed task through the proxy, one client on one keep-alive connection,
  on the memory store and on a Redis store (a throwaway ``redis-server``): p50 and p99 of the round trip,
  and a plain ``tools/call`` (``add``) through the proxy beside them for scale; then on the memory store
  with a bearer token, so every poll's credentials are checked with the upstream (a ``server/discover``,
  its acceptance kept ``ACCEPTED_FOR`` seconds).
* Memory per task: the memory store's bytes per task record (tracemalloc, records with a result of
  ``--result-bytes``), and Redis's ``MEMORY USAGE`` of one task's key, and of the expiry index per task.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from mcpresume.core import tasks as plan
from mcpresume.core.sse import SSEParser
from mcpresume.daemon.app import start_proxy
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.http.tasks import ACCEPTED_FOR
from mcpresume.process.config import load_settings
from mcpresume.store.tasks import EXPIRY_KEY, MemoryTasks, RedisTasks, task_key

META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {plan.TASKS_EXTENSION: {}}},
    "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
}


def headers(method: str, name: str, token: str | None = None) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
        "Mcp-Name": name,
        **({"Authorization": f"Bearer {token}"} if token else {}),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def redis_server() -> Any:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", folder],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@contextlib.asynccontextmanager
async def proxy(upstream: str, store: str) -> AsyncIterator[str]:
    port = free_port()
    values: dict[str, Any] = {
        "upstream": upstream,
        "port": port,
        "metrics_port": 0,
        "store": store,
        "task_after": 0.2,
        "access_log": False,
        "log_level": "warning",
    }
    if store != "memory":
        values["advertise_url"] = f"http://127.0.0.1:{port}/mcp"
    settings = load_settings(values)
    running = await start_proxy(settings)
    try:
        yield running.url
    finally:
        await running.stop()


async def rpc(
    http: aiohttp.ClientSession,
    url: str,
    method: str,
    name: str,
    params: dict[str, Any],
    token: str | None = None,
) -> Any:
    """The JSON-RPC response (a call's answer is an event stream: its last message)."""
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": META}})
    async with http.post(url, data=body, headers=headers(method, name, token)) as r:
        raw = await r.read()
        if r.content_type != "text/event-stream":
            return orjson.loads(raw)
        parser = SSEParser(1 << 24)
        return [orjson.loads(e.data) for e in parser.feed(raw) if e.data][-1]


async def timed(
    http: aiohttp.ClientSession,
    url: str,
    n: int,
    method: str,
    name: str,
    params: Any,
    token: str | None = None,
) -> list[float]:
    took = []
    for _ in range(n):
        start = time.perf_counter()
        await rpc(http, url, method, name, params, token)
        took.append((time.perf_counter() - start) * 1000)
    return took


def quantiles(ms: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(ms, n=100)
    return statistics.median(ms), cuts[98]


async def poll_cost(store: str, n: int, token: str | None = None) -> dict[str, float]:
    async with (
        serve_example_upstream() as upstream,
        proxy(upstream, store) as url,
        aiohttp.ClientSession() as http,
    ):
        made = await rpc(
            http,
            url,
            "tools/call",
            "count_slowly",
            {"name": "count_slowly", "arguments": {"n": 3, "delay": 0.15}},
            token,
        )
        task_id = made["result"]["taskId"]
        get = {"taskId": task_id}
        while (await rpc(http, url, "tasks/get", task_id, get, token))["result"]["status"] == "working":
            await asyncio.sleep(0.1)
        await timed(http, url, 50, "tasks/get", task_id, get, token)  # warm-up
        polls = await timed(http, url, n, "tasks/get", task_id, get, token)
        add = {"name": "add", "arguments": {"a": 1, "b": 2}}
        calls = await timed(http, url, n, "tools/call", "add", add, token)
    p50, p99 = quantiles(polls)
    c50, c99 = quantiles(calls)
    return {"get_p50": p50, "get_p99": p99, "call_p50": c50, "call_p99": c99}


def result_of(size: int) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": "x" * size}], "resultType": "complete"}


async def memory_per_task(count: int, size: int) -> float:
    store = MemoryTasks(max_tasks=count + 1)
    call = orjson.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": META}}
    )
    now = time.time()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        task = plan.new_task(f"mcpr-{i:043d}", "o" * 64, call, now, 3600)
        done = plan.advance(task, plan.Event.ANSWERED, now, result=result_of(size))
        assert isinstance(done, plan.Task)
        await store.create(done, now)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / count


async def redis_per_task(url: str, size: int) -> int:
    store = RedisTasks.from_url(url)
    now = time.time()
    call = orjson.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": META}}
    )
    task = plan.advance(
        plan.new_task("mcpr-" + "a" * 43, "o" * 64, call, now, 3600),
        plan.Event.ANSWERED,
        now,
        result=result_of(size),
    )
    assert isinstance(task, plan.Task)
    await store.create(task, now)
    used = int(await store._client.memory_usage(task_key(task.task_id)))
    await store.close()
    return used


async def redis_index_per_task(url: str, count: int) -> float:
    """The expiry index's bytes per live task (``EXPIRY_KEY``: one member each), over ``count`` tasks."""
    store = RedisTasks.from_url(url)
    now = time.time()
    await store._client.delete(EXPIRY_KEY)
    for i in range(count):
        await store.create(plan.new_task(f"mcpr-{i:043d}", "o" * 64, b"{}", now, 3600), now)
    used = int(await store._client.memory_usage(EXPIRY_KEY, samples=0))
    await store.close()
    return used / count


async def main(n: int, size: int) -> None:
    print(
        f"tasks/get of a completed task, one client, one connection, {n} requests; tools/call add beside it"
    )
    with redis_server() as redis_url:
        for store in ["memory", *([redis_url] if redis_url else [])]:
            got = await poll_cost(store, n)
            label = "memory" if store == "memory" else "redis"
            print(
                f"  {label:7} tasks/get p50 {got['get_p50']:.2f} ms p99 {got['get_p99']:.2f} ms | "
                f"tools/call p50 {got['call_p50']:.2f} ms p99 {got['call_p99']:.2f} ms"
            )
        got = await poll_cost("memory", n, token="bench")
        print(
            f"  memory, a bearer token (checked with the upstream every {ACCEPTED_FOR:.0f} s): tasks/get "
            f"p50 {got['get_p50']:.2f} ms p99 {got['get_p99']:.2f} ms"
        )
        per = await memory_per_task(10_000, size)
        print(f"memory store: {per:.0f} bytes per completed task (result text {size} B, 10000 tasks)")
        if redis_url:
            print(
                f"redis: MEMORY USAGE {await redis_per_task(redis_url, size)} bytes for one such task's key"
            )
            index = await redis_index_per_task(redis_url, 10_000)
            print(f"redis: the expiry index, {index:.0f} bytes per live task (10000 tasks)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=1000, help="requests per measurement")
    parser.add_argument("--result-bytes", type=int, default=1024, help="text in each task's result")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.result_bytes))
