"""Owner routing: several pods (an upstream of the official SDK each, knowing only its own sessions, with a
proxy as its sidecar) over one shared store, and requests of one session landing on any pod.

The store is one memory store shared by the pods' proxies in this process: what is routed, and how, is the
same as over Redis (test_redis_scale.py runs the pods as real processes over a real redis-server)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest

from mcpresume.core.session import SessionAccess, StreamOrigin
from mcpresume.core.window import WindowLimits
from mcpresume.store.memory import MemoryStore
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.pods import QUICK_TAKEOVER, Pod, kill, pods
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, reattach, sse_events


def shared_store() -> MemoryStore:
    return MemoryStore(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=100, retry_ms=100)


async def call(
    client: ScriptedClient, url: str, tool: str, arguments: dict[str, Any]
) -> list[dict[str, Any]]:
    """One tools/call sent to ``url``; the JSON-RPC messages of its stream."""
    _, body = client.tool_call(tool, arguments)
    async with client.http.post(url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Mcp-Session-Id"] == client.session_id  # the same session, whoever served
        return [orjson.loads(e.data) for e in await collect(response) if e.data]


def result_of(messages: list[dict[str, Any]]) -> Any:
    (answer,) = [m for m in messages if "result" in m or "error" in m]
    assert "result" in answer, answer
    return answer["result"]["structuredContent"]["result"]


def forwarded(pod: Pod) -> float:
    return sample(pod.proxy.ctx.metrics, "mcpresume_forwarded_requests_total", outcome="relayed")


async def test_a_session_begun_on_a_is_served_on_b_and_c_and_each_call_runs_once_on_as_upstream(
    http: aiohttp.ClientSession,
) -> None:
    async with pods(shared_store(), 3) as (a, b, c):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        counts = [result_of(await call(client, [b, c][i % 2].url, "tally", {})) for i in range(6)]
        assert counts == [1, 2, 3, 4, 5, 6]  # every call reached a's upstream (b's, c's never knew it), once
        assert forwarded(b) == 3 and forwarded(c) == 3 and forwarded(a) == 0
        # A re-send of an answered request id, on another pod: attached to its stream, never run again.
        request_id, body = client.tool_call("tally", {})
        async with http.post(b.url, data=body, headers=client.headers()) as response:
            first = [orjson.loads(e.data) for e in await collect(response) if e.data]
        async with http.post(c.url, data=body, headers=client.headers()) as response:
            again = [orjson.loads(e.data) for e in await collect(response) if e.data]
        assert result_of(first) == result_of(again) == 7
        assert result_of(await call(client, c.url, "tally", {})) == 8  # 7 was not run twice
        assert request_id


async def test_a_call_on_a_dropped_and_re_attached_on_b_gets_exactly_the_tail(
    http: aiohttp.ClientSession,
) -> None:
    async with pods(shared_store(), 2) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 8, "delay": 0.05})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)  # three progress notifications, then the client drops
        cursor = head[-1].id
        assert cursor is not None
        headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
        async with http.get(b.url, headers=headers) as response:  # served by b, from the store
            assert response.status == 200
            async with asyncio.timeout(20):
                tail = [orjson.loads(e.data) for e in await collect(response) if e.data]
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == [4, 5, 6, 7, 8]  # no gap, no duplicate, in order
        assert result_of(tail) == "counted to 8"  # once
        assert forwarded(b) == 0  # a re-attach is never forwarded


async def test_delete_on_b_ends_the_session_everywhere(http: aiohttp.ClientSession) -> None:
    async with pods(shared_store(), 3) as (a, b, c):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        async with http.delete(b.url, headers=client.headers()) as response:
            assert response.status == 200
        for pod in (a, b, c):
            _, body = client.tool_call("tally", {})
            async with http.post(pod.url, data=body, headers=client.headers()) as response:
                assert response.status == 404
                assert (await error_of(response))["data"]["reason"] == "unknown_session"


async def test_a_hop_header_from_a_client_is_never_followed_again(http: aiohttp.ClientSession) -> None:
    """A request that already carries the hop header is not forwarded: a client forging it gets a refusal,
    never a loop or another target."""
    async with pods(shared_store(), 2) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("tally", {})
        headers = client.headers(**{"Mcp-Resume-Hop": "pod-x"})
        async with http.post(b.url, data=body, headers=headers) as response:
            assert response.status == 503
            assert (await error_of(response))["data"]["reason"] == "misrouted_hop"
        assert forwarded(b) == 0


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_the_owner_killed_mid_call_a_client_on_b_gets_the_tail_then_the_error_then_404(
    http: aiohttp.ClientSession,
) -> None:
    """Sidecar layout: b's upstream never saw the session, so the call cannot go on. The client re-attached
    on b gets what the window kept, then ``upstream_stream_lost``, within owner_lease_ttl plus a little;
    the session is then unknown everywhere (the client re-initializes)."""
    async with pods(shared_store(), 2, **QUICK_TAKEOVER) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 50, "delay": 0.05})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            await kill(a.proxy)  # kill -9, mid-call
        cursor = head[-1].id
        assert cursor is not None
        loop = asyncio.get_running_loop()
        killed = loop.time()
        async with asyncio.timeout(1.0 + 10):  # owner_lease_ttl + 10 s: nothing hangs
            tail = await reattach(http, client, b.url, cursor)
        assert loop.time() - killed < 11
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == list(range(4, 4 + len(progress)))  # the retained tail, in order, no gap
        (error,) = [m for m in tail if "error" in m]
        assert error["error"]["data"]["reason"] == "upstream_stream_lost"
        assert sample(b.proxy.ctx.metrics, "mcpresume_takeovers_total", outcome="taken") == 1
        _, body = client.tool_call("tally", {})
        async with http.post(b.url, data=body, headers=client.headers()) as response:
            assert response.status == 404
            assert (await error_of(response))["data"]["reason"] == "unknown_session"


async def test_a_drained_owner_hands_its_call_over_to_b_which_completes_it(
    http: aiohttp.ClientSession, example_upstream_with_event_store: str
) -> None:
    """SIGTERM on a mid-call, both pods in front of one upstream with an event store: a releases its lease
    as it exits, b takes the stream over at once, resumes it upstream, and the call completes with its
    result, once."""
    async with pods(shared_store(), 2, shared_upstream=example_upstream_with_event_store) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 12, "delay": 0.1})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            head = await collect(response, limit=3)
        cursor = head[-1].id
        assert cursor is not None
        await a.proxy.stop()  # graceful: drains, hands its pumps over, releases its lease
        async with asyncio.timeout(20):
            tail = await reattach(http, client, b.url, cursor)
        progress = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert progress == list(range(4, 13))
        assert result_of(tail) == "counted to 12"
        assert sample(b.proxy.ctx.metrics, "mcpresume_takeovers_total", outcome="taken") == 1
        assert result_of(await call(client, b.url, "tally", {})) == 1  # b owns the session now


async def test_the_owner_killed_before_the_calls_first_event_b_resumes_it_from_the_priming_id(
    http: aiohttp.ClientSession, serve: ServeApp
) -> None:
    """Both pods in front of one upstream that keeps its streams' events: the upstream's priming event (its
    first resumption point, sent before it runs the call) is kept in the store as it arrives, not with the
    call's first event. The owner killed between the two, b takes the stream over and resumes it upstream
    from the priming id: the client's re-attach gets the result, not ``upstream_stream_lost``."""
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.sse(pb.raw(b"id: p-1\ndata:\n\n"), pb.wait("run")))
    url = await serve(upstream.app())
    store = shared_store()
    async with pods(store, 2, shared_upstream=url, **QUICK_TAKEOVER) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        call_id, body = client.tool_call("slow", {})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            priming = await anext(aiter(sse_events(response)))  # the proxy's own, with its cursor
            await upstream.arrived("run").wait()

            def upstream_cursor() -> str | None:
                streams = store._sessions[client.session_id].streams.values()
                (post,) = [s for s in streams if s.origin is StreamOrigin.POST]
                return post.upstream_cursor

            await until(lambda: upstream_cursor() == "p-1", what="the priming id in the store")
            await kill(a.proxy)
        assert priming.id is not None and not priming.data
        answer = orjson.dumps({"jsonrpc": "2.0", "id": call_id, "result": {"done": True}})
        resumed = lambda seen: seen.last_event_id == "p-1"  # noqa: E731
        upstream.on(None, pb.sse(pb.event(answer, id="p-2")), http="GET", when=resumed)
        async with asyncio.timeout(20):
            tail = await reattach(http, client, b.url, priming.id)
        assert tail == [orjson.loads(answer)]
        assert len([seen for seen in upstream.seen if resumed(seen)]) == 1
        assert sample(b.proxy.ctx.metrics, "mcpresume_takeovers_total", outcome="taken") == 1


class CountingStore(MemoryStore):
    """The shared memory store, counting what routing and the handlers ask it of a session."""

    def __init__(self) -> None:
        super().__init__(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=100, retry_ms=100)
        self.asked: Counter[str] = Counter()

    async def owner(self, session_id: str) -> str | None:
        self.asked["owner"] += 1
        return await super().owner(session_id)

    async def access(self, session_id: str) -> SessionAccess | None:
        self.asked["access"] += 1
        return await super().access(session_id)

    async def owner_and_access(self, session_id: str) -> tuple[str | None, SessionAccess | None]:
        self.asked["owner_and_access"] += 1
        return await super().owner_and_access(session_id)


async def test_a_post_on_its_owner_reads_the_owner_and_the_access_record_in_one_call(
    http: aiohttp.ClientSession,
) -> None:
    """A tools/call on the session's owner: routing reads the owner and the access record in one store
    call, and the POST handler is handed the record (no read of its own); on another replica, routing's
    read alone, and the owner's handler its own (the hop's request is routed there too)."""
    store = CountingStore()
    async with pods(store, 2) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        store.asked.clear()
        assert result_of(await call(client, a.url, "tally", {})) == 1
        assert store.asked == {"owner_and_access": 1}
        store.asked.clear()
        assert result_of(await call(client, b.url, "tally", {})) == 2  # forwarded to a, served there
        assert store.asked == {"owner_and_access": 2}  # b's routing, a's routing (its handler: none)


async def test_a_re_attach_to_a_lost_owners_session_reads_its_owner_and_access_once(
    http: aiohttp.ClientSession,
) -> None:
    """A re-attach on b after a released its lease: routing reads the session's owner and its access record
    once, in one call (``Serve`` carries the owner to the takeover it starts; the GET handler is handed the
    record)."""
    store = CountingStore()
    async with pods(store, 2, **QUICK_TAKEOVER) as (a, b):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 3, "delay": 0.01})
        async with http.post(a.url, data=body, headers=client.headers()) as response:
            events = await collect(response)
        cursor = events[-1].id
        assert cursor is not None
        await a.proxy.stop()  # releases its lease: the owner is lost
        store.asked.clear()
        assert await reattach(http, client, b.url, cursor) == []  # the call had ended: nothing after it
        assert store.asked == {"owner_and_access": 1}
        taken = lambda: sample(b.proxy.ctx.metrics, "mcpresume_takeovers_total", outcome="nothing_left")  # noqa: E731
        await until(lambda: taken() >= 1, what="the takeover started beside the re-attach")
