"""Streams nobody reads any more do not pin their upstream connection, their session's stream count or
the session itself (issue 30, item 2).

A client cancels a call with ``notifications/cancelled``; the spec says the receiver SHOULD NOT answer it,
and the TypeScript SDK's server does not: it keeps the call's POST stream open until its client leaves.
Through the proxy nobody "leaves" the upstream connection, so before this fix every cancelled call pinned a
stream forever: after ``max_streams_per_session`` of them the next call got 429 ``too_many_streams``, the
upstream held every one open, and the session was never reaped. Now a stream whose requests were all
cancelled is closed once no client view reads it for ``cancel_grace`` (no answer: none is expected; a
re-sent id gets 409 ``request_cancelled``), and any POST stream that no view read and no upstream event fed
for ``session_ttl`` is given up, so its session expires as idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.session import StreamPhase
from mcpresume.daemon.app import RunningProxy, reap_once
from tests.support import playbook as pb
from tests.support.conformance import Unavailable
from tests.support.metrics import sample
from tests.support.poll import until
from tests.support.proxy import ManualClock, ScriptedClient, collect, error_of, memory_session, running_proxy
from tests.support.ts_sdk import TsServer, ts_sdk_server

GRACE = 0.1  # cancel_grace in these tests: a moot stream is closed this long after its last view left
TTL = 60.0


@pytest.fixture
async def ts_server() -> AsyncIterator[TsServer]:
    try:
        async with ts_sdk_server() as server:
            yield server
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        raise


def cancellation(request_id: int) -> bytes:
    return orjson.dumps(
        {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": "Request timed out"},
        }
    )


async def call_and_leave(
    http: aiohttp.ClientSession, client: ScriptedClient, name: str, arguments: dict[str, Any] | None = None
) -> int:
    """A tools/call whose stream the client reads until its first event, then leaves; its request id."""
    request_id, body = client.tool_call(name, arguments or {})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        assert await response.content.readany()  # the stream began (its priming event)
    return request_id


async def cancel(http: aiohttp.ClientSession, client: ScriptedClient, request_id: int) -> None:
    async with http.post(client.url, data=cancellation(request_id), headers=client.headers()) as response:
        assert response.status == 202


async def views_closed(proxy: RunningProxy, session_id: str, *, left: int = 0) -> None:
    """Until the proxy saw the client leave: its views of the session ended (``left`` still open)."""
    await until(lambda: proxy.ctx.local.attached(session_id) == left, what="the client's views ended")


def phase(proxy: RunningProxy, session_id: str, stream: int) -> StreamPhase:
    return memory_session(proxy.ctx.store, session_id).phase(stream)


def streams_of(proxy: RunningProxy, session_id: str) -> list[int]:
    return sorted(memory_session(proxy.ctx.store, session_id).streams)


async def test_calls_the_typescript_sdk_server_never_answers_after_a_cancel_free_their_streams(
    ts_server: TsServer,
) -> None:
    """The TS SDK server as the issue met it: with three streams allowed, four cancelled calls in a row all
    run, the upstream holds none of them open, a re-sent id is refused, and the session expires."""
    clock = ManualClock()
    settings = {"max_streams_per_session": 3, "cancel_grace": GRACE, "session_ttl": TTL, "clock": clock}
    async with running_proxy(ts_server.url, **settings) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        cancelled = []
        for _ in range(4):  # one more than max_streams_per_session
            request_id = await call_and_leave(http, client, "slow")
            await cancel(http, client, request_id)
            cancelled.append(request_id)

            async def upstream_closed() -> bool:
                return (await ts_server.stats())["open"] == 0

            await until(upstream_closed, what="the proxy closed the cancelled call's upstream connection")
        stats = await ts_server.stats()
        assert stats["cancelled"] == 4 and stats["finished"] == 0  # the upstream did cancel each call
        await until(lambda: not proxy.ctx.pumps.pumping(client.session_id), what="every pump ended")
        session = memory_session(proxy.ctx.store, client.session_id)
        assert session.live_post_streams() == 0 and session.in_flight == 0
        assert sample(proxy.ctx.metrics, "mcpresume_abandoned_streams_total", reason="cancelled") == 4
        # No answer was made up for the cancelled calls (the client expects none).
        assert (
            sample(proxy.ctx.metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost")
            == 0
        )

        # A re-sent id of a cancelled call is never forwarded again.
        _, body = client.tool_call("slow", {})
        resent = orjson.loads(body) | {"id": cancelled[0]}  # the same request: its id, method and params
        resent["params"]["_meta"]["progressToken"] = f"p{cancelled[0]}"
        async with http.post(client.url, data=orjson.dumps(resent), headers=client.headers()) as response:
            assert response.status == 409
            assert (await error_of(response))["data"]["reason"] == "request_cancelled"
        assert (await ts_server.stats())["cancelled"] == 4

        # Nothing keeps the idle session: it expires a session_ttl after the client's last activity.
        clock.advance(TTL + 1)
        await reap_once(proxy.ctx)
        assert not await proxy.ctx.store.has_session(client.session_id)


async def test_a_cancelled_stream_a_client_still_reads_stays_open(serve) -> None:
    """As without the proxy: the stream of a cancelled call stays open while a client reads it. The
    order makes it deterministic: the read stream was cancelled first, so its grace passed before the
    unread one's did."""
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.sse(pb.event(pb.progress(0)), pb.wait(pb.by_text)))
    url = await serve(upstream.app())
    async with running_proxy(url, cancel_grace=GRACE) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        read_id, body = client.tool_call("echo", {"text": "read"})
        async with http.post(client.url, data=body, headers=client.headers()) as read:
            assert read.status == 200
            assert await read.content.readany()
            await cancel(http, client, read_id)
            unread_id = await call_and_leave(http, client, "echo", {"text": "unread"})
            await cancel(http, client, unread_id)
            read_stream, unread_stream = streams_of(proxy, client.session_id)
            await until(
                lambda: phase(proxy, client.session_id, unread_stream) is not StreamPhase.LIVE,
                what="the unread cancelled stream ended",
            )
            await until(lambda: upstream.left("unread").is_set(), what="its upstream connection closed")
            assert phase(proxy, client.session_id, read_stream) is StreamPhase.LIVE
            assert not upstream.left("read").is_set()
        # The client left: now that stream goes too, and its upstream connection.
        await until(lambda: upstream.left("read").is_set(), what="the read stream's upstream closed")
        assert phase(proxy, client.session_id, read_stream) is not StreamPhase.LIVE
        assert sample(proxy.ctx.metrics, "mcpresume_abandoned_streams_total", reason="cancelled") == 2


async def test_an_upstream_that_answers_a_cancelled_call_ends_its_stream_as_any_answer_does(serve) -> None:
    """The Python SDK's server answers a cancelled request (-32800): the answer is kept as any answer."""
    upstream = pb.Playbook()
    upstream.on(
        "tools/call", pb.sse(pb.event(pb.progress(0)), pb.wait("cancel"), pb.event(pb.error(-32800, "x")))
    )

    async def cancelled(playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        playbook.open("cancel")
        return web.Response(status=202)

    upstream.on("notifications/cancelled", cancelled)
    url = await serve(upstream.app())
    async with running_proxy(url, cancel_grace=GRACE) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id = await call_and_leave(http, client, "work")
        await cancel(http, client, request_id)
        (stream,) = streams_of(proxy, client.session_id)
        await until(lambda: phase(proxy, client.session_id, stream) is not StreamPhase.LIVE, what="its end")
        resent = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "work"}}
        async with http.post(client.url, data=orjson.dumps(resent), headers=client.headers()) as response:
            assert response.status == 200  # its retained stream, the answer in it
            messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
        assert messages[-1]["error"]["code"] == -32800
        assert sample(proxy.ctx.metrics, "mcpresume_abandoned_streams_total", reason="cancelled") == 0


def held_call(upstream: pb.Playbook) -> Callable[[], bool]:
    """Calls held upstream until the proxy closes them; whether the first one was closed."""
    upstream.on("tools/call", pb.sse(pb.event(pb.progress(0), id="u-0"), pb.wait("held")))
    return upstream.left("held").is_set


async def test_a_stream_nobody_reads_or_feeds_for_the_session_ttl_does_not_keep_its_session(serve) -> None:
    upstream = pb.Playbook()
    closed = held_call(upstream)
    url = await serve(upstream.app())
    clock = ManualClock()
    async with (
        running_proxy(url, session_ttl=TTL, clock=clock) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        await call_and_leave(http, client, "work")
        (stream,) = streams_of(proxy, client.session_id)
        await views_closed(proxy, client.session_id)  # left as of now: the clock moves only then
        clock.advance(TTL - 1)
        await reap_once(proxy.ctx)
        assert proxy.ctx.pumps.stop_unattended(clock(), TTL) == 0  # not yet
        clock.advance(2)
        await reap_once(proxy.ctx)
        await until(lambda: phase(proxy, client.session_id, stream) is not StreamPhase.LIVE, what="its end")
        await until(closed, what="its upstream connection closed")
        assert sample(proxy.ctx.metrics, "mcpresume_abandoned_streams_total", reason="unattended") == 1
        # Its request was answered with an error (a client re-attaching would read it) ...
        events = memory_session(proxy.ctx.store, client.session_id).read([stream], 0).events
        last = orjson.loads(events[-1].body.split(b"data: ", 1)[1])
        assert last["id"] == 2 and last["error"]["data"]["reason"] == "upstream_stream_lost"
        # ... and the session expires as of its last activity, at the next round: not a session_ttl later.
        await reap_once(proxy.ctx)
        assert not await proxy.ctx.store.has_session(client.session_id)


async def test_a_stream_with_a_reader_or_upstream_events_is_attended(serve) -> None:
    upstream = pb.Playbook()
    events: asyncio.Queue[bytes] = asyncio.Queue()
    upstream.on(
        "tools/call", pb.sse(pb.event(pb.progress(0)), pb.each(events)), when=lambda s: s.text == "fed"
    )
    upstream.on(
        "tools/call", pb.sse(pb.event(pb.progress(0)), pb.wait("held")), when=lambda s: s.text == "read"
    )
    url = await serve(upstream.app())
    clock = ManualClock()
    async with (
        running_proxy(url, session_ttl=TTL, clock=clock) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = client.tool_call("echo", {"text": "read"})
        async with http.post(client.url, data=body, headers=client.headers()) as read:
            assert await read.content.readany()
            _, body = client.tool_call("echo", {"text": "fed"})
            async with http.post(client.url, data=body, headers=client.headers()) as fed:
                assert await fed.content.readany()
            read_stream, fed_stream = streams_of(proxy, client.session_id)
            await views_closed(proxy, client.session_id, left=1)
            clock.advance(TTL - 1)
            events.put_nowait(orjson.dumps(pb.progress(1)))  # the upstream works on it: traffic
            await until(
                lambda: memory_session(proxy.ctx.store, client.session_id).read([fed_stream], 0).count == 3
            )
            clock.advance(2)
            assert proxy.ctx.pumps.stop_unattended(clock(), TTL) == 0  # one read, one fed
            clock.advance(TTL)
            assert proxy.ctx.pumps.stop_unattended(clock(), TTL) == 1  # the fed one, fed no more
            await until(lambda: phase(proxy, client.session_id, fed_stream) is not StreamPhase.LIVE)
            assert phase(proxy, client.session_id, read_stream) is StreamPhase.LIVE  # still read
            upstream.open("held")  # (its call ends: nothing for the proxy's drain to wait for)
