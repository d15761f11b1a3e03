"""Several replicas as real processes over a real redis-server: the layout of issue 16, with no affinity.

Each pod is an upstream of the official SDK (in this process: it knows only its own sessions) and a
``mcpresume serve --store redis://...`` process as its sidecar. Requests of one session land on any pod;
pods are killed with real signals (SIGKILL, SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from mcpresume.examples.upstream import serve_example_upstream
from tests.support.pods import free_port
from tests.support.proxy import ScriptedClient, collect, error_of, reattach
from tests.support.sdk import count_slowly, sdk_session
from tests.test_deploy_scale import _running_nginx

LEASE_TTL = 2.0


class Sidecar:
    """A ``mcpresume serve`` process over Redis, advertising its own loopback URL."""

    def __init__(self, name: str, upstream: str, store: str, **settings: Any) -> None:
        self.name, self.upstream, self.store, self.settings = name, upstream, store, settings
        self.port = free_port()
        self.process: asyncio.subprocess.Process | None = None
        self._log: asyncio.Future[None] | None = None
        self.log: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "mcpresume", "serve", "--upstream", self.upstream]
        argv += ["--port", str(self.port), "--metrics-port", "0", "--store", self.store]
        argv += ["--replica-id", self.name, "--advertise-url", self.url]
        argv += ["--owner-lease-ttl", str(LEASE_TTL), "--session-ttl", "30", "--drain-timeout", "1"]
        for key, value in self.settings.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        return argv

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv(), stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        assert self.process.stderr is not None
        async with asyncio.timeout(30):
            while True:
                line = await self.process.stderr.readline()
                assert line, "the proxy exited before it served"
                if b"mcpresume 0" in line and b"->" in line:  # the start-up line: it listens
                    break
        self._log = asyncio.ensure_future(self._drain_log())  # its log read on, so it never blocks

    async def _drain_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        while line := await self.process.stderr.readline():
            self.log.append(line.decode(errors="replace").rstrip())  # read on, so it never blocks; kept for
            del self.log[:-200]  # a failing test's message (the last 200 lines)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self) -> int:
        assert self.process is not None
        async with asyncio.timeout(30):
            return await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@contextlib.asynccontextmanager
async def sidecars(
    store: str, count: int, shared_upstream: str | None = None, **settings: Any
) -> AsyncIterator[list[Sidecar]]:
    tag = uuid.uuid4().hex[:6]  # replica names of their own: the registry outlives a test in one Redis
    async with contextlib.AsyncExitStack() as stack:
        running: list[Sidecar] = []
        for index in range(count):
            name = f"pod-{'abc'[index]}-{tag}"
            upstream = shared_upstream or await stack.enter_async_context(serve_example_upstream(name=name))
            sidecar = Sidecar(name, upstream, store, **settings)
            await sidecar.start()
            stack.push_async_callback(sidecar.stop)
            running.append(sidecar)
        yield running


async def call(http: aiohttp.ClientSession, client: ScriptedClient, url: str, tool: str) -> Any:
    _, body = client.tool_call(tool, {})
    async with http.post(url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
    (answer,) = [m for m in messages if "result" in m]
    return answer["result"]["structuredContent"]["result"]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_initialize_on_a_every_later_request_on_b_or_c_runs_once_on_as_upstream(
    redis_server: str, http: aiohttp.ClientSession
) -> None:
    async with sidecars(redis_server, 3) as (a, b, c):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        counts = [await call(http, client, [b, c][i % 2].url, "tally") for i in range(6)]
        assert counts == [1, 2, 3, 4, 5, 6]  # each reached a's upstream, once; b's and c's never knew it
        async with http.delete(c.url, headers=client.headers()) as response:
            assert response.status == 200
        for pod in (a, b):
            _, body = client.tool_call("tally", {})
            async with http.post(pod.url, data=body, headers=client.headers()) as response:
                assert response.status == 404
                assert (await error_of(response))["data"]["reason"] == "unknown_session"


async def test_a_call_on_a_re_attached_on_b_gets_exactly_the_tail(
    redis_server: str, http: aiohttp.ClientSession
) -> None:
    async with sidecars(redis_server, 2) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 8, "delay": 0.05})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
        assert head[-1].id is not None
        async with asyncio.timeout(20):
            tail = await reattach(http, client, b.url, head[-1].id)
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == [4, 5, 6, 7, 8]
        assert [m["result"]["structuredContent"]["result"] for m in tail if "result" in m] == ["counted to 8"]


async def test_kill_9_of_the_owner_mid_call_ends_the_call_with_an_error_on_b_then_404(
    redis_server: str, http: aiohttp.ClientSession
) -> None:
    async with sidecars(redis_server, 2) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 100, "delay": 0.05})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            a.signal(signal.SIGKILL)
        await a.wait()
        assert head[-1].id is not None
        loop = asyncio.get_running_loop()
        killed = loop.time()
        async with asyncio.timeout(LEASE_TTL + 10):  # owner_lease_ttl + 10 s: nothing hangs
            tail = await reattach(http, client, b.url, head[-1].id)
        assert loop.time() - killed < LEASE_TTL + 10
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == list(range(4, 4 + len(progress)))  # the retained tail: in order, no gap
        (error,) = [m for m in tail if "error" in m]
        assert error["error"]["data"]["reason"] == "upstream_stream_lost"
        _, body = client.tool_call("tally", {})
        async with http.post(b.url, data=body, headers=client.headers()) as response:
            assert response.status == 404
            assert (await error_of(response))["data"]["reason"] == "unknown_session"


async def test_sigterm_of_the_owner_mid_call_hands_it_to_b_which_completes_it(
    redis_server: str, http: aiohttp.ClientSession, example_upstream_with_event_store: str
) -> None:
    """Both pods in front of one upstream with an event store (a proxy tier before one logical server):
    the drained owner releases its lease as it exits, b takes the stream over at once, and the call
    completes with its result."""
    async with sidecars(redis_server, 2, shared_upstream=example_upstream_with_event_store) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 12, "delay": 0.1})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
        a.signal(signal.SIGTERM)
        assert await a.wait() == 0
        assert head[-1].id is not None
        async with asyncio.timeout(20):
            tail = await reattach(http, client, b.url, head[-1].id)
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == list(range(4, 13))
        assert [m["result"]["structuredContent"]["result"] for m in tail if "result" in m] == [
            "counted to 12"
        ]


async def test_the_official_sdk_client_through_round_robin_nginx_over_two_pods_succeeds_every_time(
    redis_server: str, tmp_path: Path
) -> None:
    """The layout end to end: the shipped deploy/nginx/scale.conf (round-robin, no affinity) in front of two
    pods, and the official SDK client following the spec: every request succeeds, and each call runs once on
    the owner's upstream (the tally counts 1, 2, 3, ... whichever pod each request landed on)."""
    async with sidecars(redis_server, 2) as (a, b), _running_nginx(tmp_path, [a.port, b.port]) as port:
        url = f"http://127.0.0.1:{port}/mcp"
        async with sdk_session(url, read_timeout_seconds=30) as session:
            tallies = [(await session.call_tool("tally", {})).structured_content for _ in range(6)]
            assert tallies == [{"result": n} for n in range(1, 7)]
            counted = await count_slowly(session, n=5, delay=0.02)
            assert counted.text == "counted to 5"
            assert [p for p, _, _ in counted.progress] == [1, 2, 3, 4, 5]


async def test_kill_9_of_the_proxy_and_a_restart_with_its_replica_id_lose_nothing(
    redis_server: str, http: aiohttp.ClientSession, example_upstream_with_event_store: str
) -> None:
    """Issue 15's restart: the proxy is killed mid-call and started again with the same replica_id (its
    upstream, with an event store, alive): the session is known, the stream its previous process pumped is
    resumed upstream from the last upstream id in Redis, and the client's re-attach gets exactly the events
    after its cursor, the result once."""
    async with sidecars(redis_server, 1, shared_upstream=example_upstream_with_event_store) as (a,):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 20, "delay": 0.05})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            a.signal(signal.SIGKILL)
        await a.wait()
        await a.start()  # same port, same replica_id
        assert head[-1].id is not None
        async with asyncio.timeout(30):
            tail = await reattach(http, client, a.url, head[-1].id)
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == list(range(4, 21))  # no gap, no duplicate
        results = [m["result"]["structuredContent"]["result"] for m in tail if "result" in m]
        assert results == ["counted to 20"]
