"""Faults of the scale-out layout that must cost a client a retry, never its session or an event: a store
outage longer than the lease (every lease lapses while every replica lives), an owner paused past its lease
(taken over, then wakes up and writes late), two processes with one ``replica_id``, a replica killed for
good (its registration pruned). Real ``mcpresume serve`` processes over a real ``redis-server`` of the
test's own, paused and resumed with real signals (issue 29)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from mcpresume.core.window import WindowLimits
from mcpresume.store.memory import MemoryStore
from mcpresume.store.redis import REPLICA_URLS
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.pods import pods
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, sse_events
from tests.support.redis import RedisProcess
from tests.test_redis_scale import LEASE_TTL, Sidecar, call, sidecars

# The reaper looks for lost owners every min(5, session_ttl / 10, window_ttl / 10) seconds: 3 s with the
# sidecars' session_ttl of 30.
REAP_INTERVAL = 3.0


async def _call_retrying_outage(
    http: aiohttp.ClientSession, client: ScriptedClient, url: str, tool: str, deadline: float
) -> Any:
    """``call``, retried while the answer is a truthful 503 of an outage being recovered from (the store
    not answering yet, an owner's takeover not yet decided); any other refusal fails the test."""
    loop = asyncio.get_running_loop()
    while True:
        _, body = client.tool_call(tool, {})
        async with http.post(url, data=body, headers=client.headers()) as response:
            if response.status == 200:
                messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                (answer,) = [m for m in messages if "result" in m or "error" in m]
                assert "result" in answer, answer
                return answer["result"]["structuredContent"]["result"]
            reason = (await error_of(response))["data"]["reason"]
            assert response.status == 503 and reason in ("store_unavailable", "owner_lost"), reason
        assert loop.time() < deadline, "the outage's 503s outlasted it"
        await asyncio.sleep(0.2)


@pytest.mark.processes
async def test_a_store_outage_longer_than_the_lease_retires_no_session(own_redis: RedisProcess) -> None:
    """Sidecar layout (each pod its own upstream). Redis pauses for twice the lease, so every lease lapses
    while both pods live; a call is in flight on a. When Redis is back: the call completes with its result
    (its pump held what it read), each pod's session keeps working from either pod, its calls running once
    on its own upstream, during the first lease after the outage (when the leases are still lapsed) and
    after a reaper's round. Before fencing and the takeover's evidence rule, the first pod to see the other's
    lapsed lease took its sessions over and retired them: 404 ``unknown_session`` for every one."""
    async with sidecars(own_redis.url, 2) as (a, b), aiohttp.ClientSession() as http:
        first, second = ScriptedClient(http, a.url), ScriptedClient(http, b.url)
        await first.initialize()
        await second.initialize()
        assert await call(http, first, b.url, "tally") == 1  # a's session, forwarded by b to a
        assert await call(http, second, a.url, "tally") == 1
        _, body = first.tool_call("count_slowly", {"n": 30, "delay": 0.1})
        async with http.post(a.url, data=body, headers=first.headers()) as response:
            head = await collect(response, limit=3)
            own_redis.pause()
            try:
                await asyncio.sleep(2.5 * LEASE_TTL)
            finally:
                own_redis.resume()
            async with asyncio.timeout(60):
                head += await collect(response)
        messages = [orjson.loads(e.data) for e in head if e.data]
        if not any("result" in m for m in messages):  # the view ended in the outage: re-attach for the rest
            cursor = [e.id for e in head if e.id][-1]
            assert cursor is not None
            headers = first.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
            async with asyncio.timeout(60), http.get(b.url, headers=headers) as response:
                assert response.status == 200, await response.text()
                messages += [orjson.loads(e.data) for e in await collect(response) if e.data]
        progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
        assert progress == list(range(1, 31))
        assert [m["result"]["structuredContent"]["result"] for m in messages if "result" in m] == [
            "counted to 30"
        ]
        deadline = asyncio.get_running_loop().time() + 30
        tallies = [
            await _call_retrying_outage(http, first, b.url, "tally", deadline),
            await _call_retrying_outage(http, second, a.url, "tally", deadline),
        ]
        await asyncio.sleep(REAP_INTERVAL + LEASE_TTL)  # a reaper's round with every lease live again
        tallies += [
            await _call_retrying_outage(http, first, b.url, "tally", deadline),
            await _call_retrying_outage(http, second, a.url, "tally", deadline),
        ]
        assert tallies == [2, 2, 3, 3]  # each on its own pod's upstream, once each


@pytest.mark.processes
async def test_an_owner_paused_past_its_lease_is_taken_over_and_its_late_writes_are_fenced_off(
    own_redis: RedisProcess, example_upstream_with_event_store: str
) -> None:
    """Shared-upstream layout (one upstream with an event store). The owner is stopped (SIGSTOP) mid-call
    for longer than its lease: b takes the session over (a does not answer its liveness check) and resumes
    the call upstream from the last upstream id in Redis. Then a wakes (SIGCONT) with what it read before
    the stop still to append: its writes are refused (the fence moved on), it steps down, and the client,
    re-attached on b, gets every progress event once, in order, and the result once. Before fencing, a's
    late appends were dropped as "stale" while its pump carried on: a silent gap."""
    upstream = example_upstream_with_event_store
    async with (
        sidecars(own_redis.url, 2, shared_upstream=upstream) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        await asyncio.sleep(LEASE_TTL)  # b has seen the store answer for a whole lease: it may take over
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 40, "delay": 0.3})  # still running when a wakes
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            a.signal(signal.SIGSTOP)
        resumed = False
        try:
            cursor = head[-1].id
            assert cursor is not None
            headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
            messages: list[Any] = []
            async with asyncio.timeout(60), http.get(b.url, headers=headers) as tail:
                assert tail.status == 200, await tail.text()
                async for event in sse_events(tail):  # one parser for the whole stream
                    if not event.data:
                        continue
                    messages.append(orjson.loads(event.data))
                    progress = [m["params"]["progress"] for m in messages if m.get("method")]
                    if not resumed and progress and progress[-1] >= 15:  # b pumps the call now
                        a.signal(signal.SIGCONT)
                        resumed = True
        finally:
            if not resumed:
                a.signal(signal.SIGCONT)
        progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
        logs = "\n".join(["-- a:", *a.log, "-- b:", *b.log])
        assert progress == list(range(4, 41)), logs  # no gap, no duplicate
        assert [m["result"]["structuredContent"]["result"] for m in messages if "result" in m] == [
            "counted to 40"
        ]
        assert a.process is not None and a.process.returncode is None  # a lives on, stepped down


@pytest.mark.processes
async def test_a_second_process_with_a_live_replica_id_refuses_to_start(own_redis: RedisProcess) -> None:
    """Two processes configured alike (the default replica id is the host name): the second says so in one
    line and exits 2, and the first keeps its registration."""
    async with sidecars(own_redis.url, 1) as (a,):
        twin = Sidecar(a.name, a.upstream, own_redis.url)
        twin_argv_port = twin.port
        process = await asyncio.create_subprocess_exec(
            *twin.argv(), stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL
        )
        async with asyncio.timeout(60):
            _, err = await process.communicate()
        assert process.returncode == 2
        lines = [line for line in err.decode().splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert a.name in lines[0] and "replica_id" in lines[0]
        client = aioredis.Redis.from_url(own_redis.url)
        try:
            url = await client.hget(REPLICA_URLS, a.name)
        finally:
            await client.aclose()
        assert url is not None and url.decode() == a.url and str(twin_argv_port) not in url.decode()


async def test_a_pump_whose_session_changed_hands_steps_down_and_writes_nothing(serve: Any) -> None:
    """In one process, deterministically: a's pump holds a call's stream; the session is taken over (the
    store's atomic takeover, as b would); then the upstream sends the next event and the response. a's
    append is refused (the fence moved on): a counts it, its pump ends, and it writes nothing more: not
    the event, not a synthesized error, not the stream's end. The stream stays live for its new owner
    to resume, with the upstream id of the last event that reached the store."""
    upstream = pb.Playbook(session_ids=["up-1"])
    upstream.on(
        "tools/call",
        pb.sse(
            pb.event(pb.progress(1), id="u-1"),
            pb.wait("late"),
            pb.event(pb.progress(2), id="u-2"),
            pb.event(pb.result(), id="u-3"),
        ),
    )
    store = MemoryStore(WindowLimits(64, 1 << 20, 60.0), session_ttl=60.0, max_sessions=8, retry_ms=10)
    url = await serve(upstream.app())
    async with pods(store, 1, shared_upstream=url) as (a,), aiohttp.ClientSession() as http:
        client = ScriptedClient(http, a.proxy.url)
        await client.initialize()
        session_id = client.session_id
        assert session_id is not None
        _, body = client.tool_call("slow", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=1)
            (taken,) = await store.take_over("pod-a", by="pod-b")
            upstream.open("late")
            metrics = a.proxy.ctx.metrics
            await until(lambda: sample(metrics, "mcpresume_fenced_writes_total") == 1, what="a stepped down")
            await until(lambda: len(a.proxy.ctx.pumps) == 0, what="a's pump ended")
        assert sample(metrics, "mcpresume_fenced_writes_total") == 1
        assert sample(metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost") == 0
        (orphan,) = await store.orphans("pod-b")  # still live, for the new owner: nothing more was written
        assert (orphan.stream, orphan.upstream_cursor) == (taken.stream, "u-1")
        read = await store.read(session_id, [orphan.stream], 0)
        assert read is not None and not read.complete
        assert [orjson.loads(e.data) for e in head if e.data][-1]["params"]["progress"] == 1
        assert len(read.events) == 2  # the priming event and progress 1: nothing of a's after the takeover
