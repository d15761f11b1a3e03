"""The sidecar layout over Redis, every part a real process, a whole pod killed -9 (issue #33, Deliver 6).

Each pod is the official SDK server (``python -m mcpresume.examples.upstream``, knowing only its own
sessions) and a ``mcpresume serve`` process as its sidecar; both pods share a real ``redis-server``. The
session's pod is killed with SIGKILL, proxy and upstream both (a node lost, an eviction), while a call of
the session streams. The client goes on with its next request at the other pod, as a balancer would send
it there: once the dead pod's lease lapses, that pod takes the session over.

``reinitialize``: the takeover keeps the session, whose next call begins it again on the other pod's
upstream from the recipe in Redis and is answered, in the same session id; the call in flight at the kill
ends with ``upstream_stream_lost``, once; a re-attach with a cursor from before the kill gets what
followed it; the official Python SDK client behind a round-robin balancer goes on as well, and the
standalone stream re-attached on the other pod goes on in the session begun again. ``end`` (the
default): the other pod's upstream never saw the session, so it ends, and the client's next request gets
the proxy's own 404 with a ``data.reason`` (today's behaviour).

Replicas in front of one upstream: the session's mapping to its new upstream session lives in the store,
and every upstream-bound request of the session, on any replica, goes to the upstream session it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from mcp.shared.exceptions import MCPError

from faults.balancer import Balancer
from mcpresume.core.errors import SessionGone
from mcpresume.core.window import WindowLimits
from tests.support.metrics import sample
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, reattach, running_proxy, sse_events
from tests.support.redis import MakeRedisStore
from tests.support.sdk import result_text, sdk_session
from tests.test_redis_scale import Sidecar
from tests.test_reinitialize import (
    REINITS,
    TOOLS_CHANGED,
    UPDATED,
    UpstreamProcess,
    call,
    client_on,
    free_port,
    restarted,
    touch,
    until_received,
    upstream_process,
    view_messages,
)

TIMEOUT = 120  # generous: four Python processes start on a loaded two-core machine
# What another pod answers while the dead owner's lease has not lapsed yet (its requests forwarded to a
# pod that does not answer), or before the takeover is decided: a truthful retry, never the session's end.
RETRY_REASONS = frozenset({"owner_unreachable", "owner_lost"})
BEGUN = "begun again upstream (its upstream lost it)"  # the proxy's log line for a re-initialization


@dataclass
class PodProcesses:
    """One pod: the SDK server and its sidecar proxy, each a process of its own."""

    upstream: UpstreamProcess
    proxy: Sidecar

    @property
    def url(self) -> str:
        return self.proxy.url

    async def kill(self) -> None:
        """kill -9 of the whole pod: the proxy first (it writes nothing after), then its upstream."""
        self.proxy.signal(9)
        await self.proxy.wait()
        await asyncio.to_thread(self.upstream.kill)


@contextlib.asynccontextmanager
async def pod_processes(
    store: str, count: int, *, shaped: bool = False, **settings: Any
) -> AsyncIterator[list[PodProcesses]]:
    tag = uuid.uuid4().hex[:6]  # replica names of their own: the registry outlives a test in one Redis
    async with contextlib.AsyncExitStack() as stack:
        running: list[PodProcesses] = []
        for index in range(count):
            upstream = UpstreamProcess(free_port(), shaped)
            await asyncio.to_thread(upstream.start)  # off the loop: it reads a pipe
            stack.callback(upstream.stop)
            proxy = Sidecar(f"pod-{'ab'[index]}-{tag}", upstream.url, store, **settings)
            await proxy.start()
            stack.push_async_callback(proxy.stop)
            running.append(PodProcesses(upstream, proxy))
        yield running


async def call_after_takeover(
    http: aiohttp.ClientSession, client: ScriptedClient, url: str
) -> tuple[int, dict[str, Any]]:
    """``add(1, 2)`` in the session at ``url``, sent again while the answer is a retry (the dead owner's
    lease not lapsed yet); the final status and its JSON-RPC answer (the result's, or the refusal's)."""
    while True:
        _, body = client.tool_call("add", {"a": 1, "b": 2})
        async with http.post(url, data=body, headers=client.headers()) as response:
            if response.status == 200:
                assert response.headers.get("Mcp-Session-Id", client.session_id) == client.session_id
                messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                (answer,) = [m for m in messages if "result" in m or "error" in m]
                return 200, answer
            error = await error_of(response)
            if response.status in (502, 503) and error["data"]["reason"] in RETRY_REASONS:
                await asyncio.sleep(0.2)
                continue
            return response.status, error


async def request(http: aiohttp.ClientSession, client: ScriptedClient, method: str, params: Any) -> int:
    body = orjson.dumps({"jsonrpc": "2.0", "id": client._id(), "method": method, "params": params})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        await response.read()
        return response.status


@pytest.mark.processes
@pytest.mark.parametrize("setting", ["reinitialize", "end"])
async def test_a_whole_pod_killed_9_the_client_goes_on_with_its_session_on_the_other_pod(
    redis_server: str, setting: str
) -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        pod_processes(redis_server, 2, upstream_session_lost=setting) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        assert await request(http, client, "logging/setLevel", {"level": "debug"}) == 200
        slow_id, slow = client.tool_call("count_slowly", {"n": 1000, "delay": 0.05})
        async with http.post(a.url, data=slow, headers=client.headers()) as response:
            assert response.status == 200
            head = await collect(response, limit=4)  # progress 1..4 at least: the call is running
            await a.kill()
            with contextlib.suppress(aiohttp.ClientError):  # the connection ends with the pod
                head += await collect(response)
        seen = [(e.id, orjson.loads(e.data)) for e in head if e.data and e.id]
        progress = [m["params"]["progress"] for _, m in seen if m.get("method") == "notifications/progress"]
        assert progress[:4] == [1, 2, 3, 4] and progress == list(range(1, len(progress) + 1))
        assert not any(m.get("id") == slow_id for _, m in seen)  # it was in flight at the kill
        early = seen[1][0]  # a cursor from before the kill: after progress 1 (or its priming)
        assert early is not None

        status, answer = await call_after_takeover(http, client, b.url)
        if setting == "end":
            # b's upstream never saw the session: it ends, and the client is told so by the proxy's 404.
            assert status == 404, answer
            assert answer["data"]["reason"] == "unknown_session"
            assert answer["message"] == SessionGone.UNTRACKED.value
            return

        # The next call, in the same session id, is answered on b (begun again on b's upstream).
        assert status == 200, (answer, b.proxy.log[-20:])
        assert answer["result"]["content"][0]["text"] == "3"
        await until(
            lambda: any(BEGUN in line for line in b.proxy.log),
            timeout=30,
            what="b's log line for the re-initialization",
        )
        assert sum(BEGUN in line for line in b.proxy.log) == 1
        # The call in flight at the kill: ended with upstream_stream_lost, once; a re-attach with a cursor
        # from before the kill gets what followed it (the progress the client had, then the rest kept).
        tail = await reattach(http, client, b.url, early)
        after = [m for _, m in seen[2:]]
        assert tail[: len(after)] == after
        more = [m["params"]["progress"] for m in tail if m.get("method") == "notifications/progress"]
        assert more == list(range(more[0], more[0] + len(more))) and more[0] <= 3
        ends = [m for m in tail if m.get("id") == slow_id]
        assert len(ends) == 1, ends
        assert ends[0]["error"]["data"]["reason"] == "upstream_stream_lost"
        assert tail[-1] == ends[0]  # nothing after its end
        # Once, whichever cursor it is re-attached from.
        assert [m for m in await reattach(http, client, b.url, seen[-1][0]) if m.get("id") == slow_id] == ends
        # The session goes on: another call, no second re-initialization.
        status, answer = await call_after_takeover(http, client, b.url)
        assert status == 200 and answer["result"]["content"][0]["text"] == "3"
        assert sum(BEGUN in line for line in b.proxy.log) == 1


@pytest.mark.processes
async def test_the_official_sdk_client_behind_a_balancer_goes_on_after_its_pod_is_killed_9(
    redis_server: str,
) -> None:
    """The official Python SDK client behind a round-robin balancer with no affinity (``faults.balancer``:
    a refused connection goes to the next pod), one ``ClientSession``: its initialize lands on a (the
    balancer's first turn). A call in flight when pod a is killed -9 (proxy and upstream) ends with the
    synthesized ``upstream_stream_lost`` (the SDK re-attaches its stream on b, which took the session over);
    its next call, retried while b answers that the owner is not reachable yet, succeeds in the same
    session, begun again on b's upstream."""
    async with (
        asyncio.timeout(TIMEOUT),
        pod_processes(redis_server, 2, upstream_session_lost="reinitialize") as (a, b),
    ):
        balancer = Balancer([a.proxy.port, b.proxy.port])
        await balancer.start()
        try:
            async with sdk_session(balancer.url, read_timeout_seconds=60) as session:
                assert result_text(await session.call_tool("add", {"a": 1, "b": 2})) == "3"
                progressed = asyncio.Event()

                async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                    if progress >= 3:
                        progressed.set()

                slow = asyncio.ensure_future(
                    session.call_tool(
                        "count_slowly", {"n": 1000, "delay": 0.05}, progress_callback=on_progress
                    )
                )
                await progressed.wait()
                await a.kill()
                with pytest.raises(MCPError) as lost:
                    await slow
                assert lost.value.error.data["reason"] == "upstream_stream_lost", lost.value.error
                while True:
                    try:
                        result = await session.call_tool("add", {"a": 2, "b": 2})
                        break
                    except MCPError as refused:  # b cannot reach a, or has not taken its sessions over yet
                        data = refused.error.data
                        assert isinstance(data, dict) and data.get("reason") in RETRY_REASONS, refused.error
                        await asyncio.sleep(0.2)
                assert result_text(result) == "4"
        finally:
            await balancer.close()
        assert sum(BEGUN in line for line in b.proxy.log) == 1, "\n".join(b.proxy.log)


@pytest.mark.processes
async def test_the_standalone_stream_re_attached_on_the_other_pod_goes_on_in_the_session_begun_again(
    redis_server: str,
) -> None:
    """``reinitialize``, the shaped SDK server in each pod: the client subscribed to a resource and holds its
    standalone stream on a. Pod a killed -9. The client re-attaches the standalone stream on b with its
    cursor, and its next call on b begins the session again on b's upstream (the subscription replayed):
    b, which took the stream over, opens it again in its upstream's new session, and the re-attached view
    gets ``notifications/tools/list_changed`` and then the ``resources/updated`` b's upstream sends."""
    async with (
        asyncio.timeout(TIMEOUT),
        pod_processes(redis_server, 2, shaped=True, upstream_session_lost="reinitialize") as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        assert await request(http, client, "resources/subscribe", {"uri": "test://a"}) == 200
        async with http.get(a.url, headers=client.headers(Accept="text/event-stream")) as get:
            assert get.status == 200
            events = aiter(sse_events(get))
            assert await touch(http, client) == "1"
            cursor = None
            while cursor is None:  # the notification, with its cursor
                event = await anext(events)
                if event.data:
                    assert orjson.loads(event.data) == UPDATED
                    cursor = event.id
            await a.kill()
        assert cursor is not None
        headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
        async with http.get(b.url, headers=headers) as view:
            assert view.status == 200, await view.text()
            async with view_messages(view) as received:
                at_b = client_on(client, b.url)
                status, answer = await call_after_takeover(http, at_b, b.url)
                assert status == 200, (answer, b.proxy.log[-20:])
                assert await received.get() == TOOLS_CHANGED
                await until_received(http, at_b, received, UPDATED)


async def test_a_get_and_a_delete_on_another_replica_go_to_the_upstream_session_the_store_maps(
    redis_db: str, redis_stores: MakeRedisStore
) -> None:
    """Two replicas over Redis in front of one SDK server (no owner routing: either serves any request).
    The server killed -9 and restarted; x begins the session again on a call. y never served the session:
    its standalone GET opens in the new upstream session (read from the store with the session's access,
    not learnt by y), with no second re-initialization; its DELETE ends the new upstream session."""
    limits = WindowLimits(256, 1 << 20, 300.0)
    store_x, store_y = await redis_stores(redis_db, limits), await redis_stores(redis_db, limits)
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(
                    upstream.url, upstream_session_lost="reinitialize", store_instance=store_x
                ) as x,
                running_proxy(
                    upstream.url, upstream_session_lost="reinitialize", store_instance=store_y
                ) as y,
                aiohttp.ClientSession() as http,
            ):
                client = ScriptedClient(http, x.url)
                await client.initialize()
                async with restarted(upstream):
                    pass
                async with await call(http, client) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                assert sample(x.ctx.metrics, REINITS, outcome="reinitialized") == 1
                granted = await store_x.access(client.session_id)
                assert granted is not None and granted.upstream_id not in (None, client.session_id)
                mapped = granted.upstream_id
                assert client.session_id not in y.ctx.upstream.aliases  # y never learnt it on a POST

                at_y = ScriptedClient(http, y.url)
                at_y.session_id, at_y.next_id = client.session_id, client.next_id
                async with http.get(y.url, headers=at_y.headers(Accept="text/event-stream")) as get:
                    assert get.status == 200, await get.text()
                assert sample(y.ctx.metrics, REINITS, outcome="reinitialized") == 0
                again = await store_y.access(client.session_id)
                assert again is not None and again.upstream_id == mapped  # not begun a second time

                async with http.delete(y.url, headers=at_y.headers()) as response:
                    assert response.status == 200, await response.text()
                assert not await store_y.has_session(client.session_id)
                direct = ScriptedClient(http, upstream.url)  # the upstream session the DELETE ended
                direct.session_id = mapped
                async with await call(http, direct) as response:
                    assert response.status == 404
