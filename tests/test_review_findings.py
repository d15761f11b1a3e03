"""Regressions of review findings: each test is named after a bug a review found, and fails if it returns.

The upstream here is a playbook (``tests/support/playbook.py``) whose timing the test controls with gates,
so nothing depends on fixed sleeps: waits are bounded polls with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

import mcpresume
from mcpresume.daemon.app import reap_once
from mcpresume.process.local import LocalSessions
from tests.support import playbook as pb
from tests.support.playbook import Playbook
from tests.support.poll import until
from tests.support.proxy import ManualClock, collect, memory_session, running_proxy

SESSION = "review-session-1"
HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-11-25",
}


def gated_upstream() -> Playbook:
    """The upstream of these regressions: a request streams one progress event (with the upstream's own
    event id), waits at the gate of its request id, then sends its response; ``json`` is answered
    application/json, ``fail`` with a 500 and a JSON-RPC error, ``hang`` never (``arrived``/``left`` at its
    id's gate). The standalone GET is open and quiet (a test that sends on it calls ``standalone``)."""
    upstream = Playbook(session_ids=[SESSION])
    upstream.on(
        None,
        pb.sse(
            pb.event(pb.progress(1), id=lambda seen: f"u{seen.id}-1"),
            pb.wait(pb.by_id),
            pb.event(pb.result(), id=lambda seen: f"u{seen.id}-2"),
        ),
        when=lambda seen: seen.id is not None,
    )
    upstream.on("initialize", pb.initialize())
    upstream.on("json", pb.reply(pb.result({"json": True})))
    upstream.on("fail", pb.reply(pb.error(-32603, "boom"), status=500))
    upstream.on("hang", pb.never(pb.by_id))
    standalone(upstream)
    return upstream


def standalone(upstream: Playbook, *, held_at: str | None = None) -> asyncio.Queue[bytes]:
    """The standalone GET streams what the test puts in the queue returned (``held_at``: its head waits at
    that gate first)."""
    pushes: asyncio.Queue[bytes] = asyncio.Queue()
    answer = pb.sse(pb.each(pushes))
    upstream.on(None, answer if held_at is None else pb.held(held_at, answer), http="GET")
    return pushes


def call(request_id: int, method: str) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": {}})


def in_session(**extra: str) -> dict[str, str]:
    return {**HEADERS, "Mcp-Session-Id": SESSION, **extra}


async def initialize(http: aiohttp.ClientSession, url: str) -> None:
    async with http.post(url, data=call(1, "initialize"), headers=HEADERS) as response:
        assert response.headers["Mcp-Session-Id"] == SESSION
        await response.read()


def response_ids(events: list) -> list[int]:
    out = []
    for event in events:
        if event.data:
            doc = orjson.loads(event.data)
            if "result" in doc or "error" in doc:
                out.append(doc["id"])
    return out


async def drop_after_first_progress(http: aiohttp.ClientSession, url: str, request_id: int) -> str:
    """POST ``slow``, read its priming event and first progress, drop the connection; the last cursor."""
    async with http.post(url, data=call(request_id, "slow"), headers=in_session()) as response:
        assert response.status == 200
        seen = await collect(response, limit=1)
    cursor = seen[-1].id
    assert cursor is not None
    return cursor.decode()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def gated(
    serve: Callable[[web.Application], Awaitable[str]],
) -> AsyncIterator[tuple[Playbook, str]]:
    upstream = gated_upstream()
    url = await serve(upstream.app())
    yield upstream, url
    upstream.open_all()


# -- 1. POST + Last-Event-ID drops the new request's JSON answer ---


# Regression: POST + Last-Event-ID (http/post.py) released an application/json answer to the new request
# unread: the client never got the response, and a re-send was refused as duplicate_request
async def test_post_with_cursor_keeps_a_json_answer(http, gated) -> None:
    upstream, upstream_url = gated
    async with running_proxy(upstream_url) as proxy:
        await initialize(http, proxy.url)
        cursor = await drop_after_first_progress(http, proxy.url, 2)
        upstream.open("2")  # the old request completes while the client is away
        headers = in_session(**{"Last-Event-ID": cursor})
        async with http.post(proxy.url, data=call(3, "json"), headers=headers) as response:
            assert response.status == 200
            events = await collect(response)
        assert 3 in [seen.id for seen in upstream.requests("json")]  # the upstream ran request 3 ...
        assert sorted(response_ids(events)) == [2, 3]  # ... so its answer must reach the client


# Regression: POST + Last-Event-ID (http/post.py) swallowed an upstream error status for the new request (here
# 500) and answered 200 with only the old stream's tail
async def test_post_with_cursor_relays_an_upstream_error(http, gated) -> None:
    upstream, upstream_url = gated
    async with running_proxy(upstream_url) as proxy:
        await initialize(http, proxy.url)
        cursor = await drop_after_first_progress(http, proxy.url, 2)
        upstream.open("2")
        headers = in_session(**{"Last-Event-ID": cursor})
        async with http.post(proxy.url, data=call(3, "fail"), headers=headers) as response:
            body = await response.read()
        assert response.status == 500 or b"boom" in body


# -- 2. A client that leaves while its request is forwarded leaks the claim when forwarding fails ---


# Regression: the abandoned forward (send.Sender._abandoned) ignored a ProxyError outcome: the
# request id stays claimed (ClaimState.PENDING) and in_flight stays counted forever, so the session is
# stuck at max_streams_per_session (429)
async def test_abandoned_forward_that_fails_ends_its_claim(http, gated) -> None:
    upstream, upstream_url = gated
    async with running_proxy(upstream_url, first_byte_timeout=0.5, max_streams_per_session=1) as proxy:
        await initialize(http, proxy.url)
        # The client sends a request and leaves while the proxy still waits for the upstream's headers.
        post = asyncio.ensure_future(http.post(proxy.url, data=call(2, "hang"), headers=in_session()))
        await asyncio.wait_for(upstream.arrived("2").wait(), 5)
        post.cancel()
        # The proxy gives up on the upstream (first_byte_timeout): the request ends in UpstreamTimeout, which
        # ends the claim as on the non-abandoned path (it may have run: no longer in flight, never re-sent).
        await asyncio.wait_for(upstream.left("2").wait(), 5)
        session = memory_session(proxy.ctx.store, SESSION)
        await until(lambda: session.in_flight == 0, timeout=2.0)
        async with http.post(proxy.url, data=call(3, "json"), headers=in_session()) as response:
            assert response.status == 200


# -- 3. Reader tokens are reused: a stale view removes another view's reader --------------------------------


# Regression: SessionState.add_reader reuses max(token)+1: after drop_lagging_readers, the dropped view's
# token is handed to a new view, and the stale view's remove_reader/move_reader hits the new one
async def test_dropped_reader_token_is_not_reused() -> None:
    local = LocalSessions()
    stalled = local.add_reader("s", [1], 0)  # view A, never reads
    # A burst that does not fit: the pump drops A (A's follow() still holds its token, blocked in a write).
    assert local.drop_readers("s", [stalled]) == 1
    fresh = local.add_reader("s", [1], 4)  # view B: the client re-attached
    # A's write finally fails: its finally-clause removes "its" reader, and moves it first.
    local.move_reader("s", stalled, 9)
    local.remove_reader("s", stalled)
    assert local.readers("s") == 1  # B's flow-control registration survives
    local.remove_reader("s", fresh)
    again = local.add_reader("s", [1], 0)  # the session's readers start over: tokens do not
    assert again not in (stalled, fresh)


# -- 4. A POST + Last-Event-ID view closes early when the old stream is forgotten ---


# Regression: SessionState.read reports a gap when one of a view's streams was forgotten (ended, all events
# delivered then expired/evicted), so the POST+Last-Event-ID view closes before the new request's response
async def test_post_with_cursor_view_survives_the_old_stream_leaving_the_window(http, gated) -> None:
    upstream, upstream_url = gated
    clock = ManualClock()
    async with running_proxy(upstream_url, clock=clock, window_ttl=10.0) as proxy:
        await initialize(http, proxy.url)
        cursor = await drop_after_first_progress(http, proxy.url, 2)
        upstream.open("2")
        session = memory_session(proxy.ctx.store, SESSION)
        await until(lambda: not any(s.live for s in session.streams.values()), timeout=5.0)
        headers = in_session(**{"Last-Event-ID": cursor})
        async with http.post(proxy.url, data=call(3, "slow"), headers=headers) as response:
            assert response.status == 200
            events = []
            from tests.support.proxy import sse_events

            async for event in sse_events(response):
                events.append(event)
                if event.data and b"progress" in event.data:
                    # The old tail (response 2) and the new stream's progress were delivered. Time passes:
                    # every event so far leaves the window by TTL (all of them were delivered).
                    clock.advance(11.0)
                    await reap_once(proxy.ctx)
                    upstream.open("3")
        assert response_ids(events) == [2, 3]


# -- 5. Upstream traffic on the standalone stream keeps a client-less session alive forever ---


# Regression: SessionState.append refreshes last_active, which the reaper and decide() use as 'idle since':
# a session whose client left is never reaped while its standalone GET stream carries server messages
async def test_session_without_client_expires_despite_standalone_traffic(http, gated) -> None:
    upstream, upstream_url = gated
    pushes = standalone(upstream)
    clock = ManualClock()
    async with running_proxy(upstream_url, clock=clock, session_ttl=10.0, drain_timeout=0.5) as proxy:
        await initialize(http, proxy.url)
        session = memory_session(proxy.ctx.store, SESSION)
        async with http.get(proxy.url, headers=in_session()) as response:
            assert response.status == 200
            await collect(response, limit=0)  # the priming event; then the client goes away for good
        await until(lambda: proxy.ctx.local.attached(SESSION) == 0, timeout=5.0)
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {}})
        for _ in range(3):  # a server that logs something every 6 s, to nobody
            clock.advance(6.0)
            if not await proxy.ctx.store.has_session(SESSION):
                break  # reaped: its pump was cancelled, nothing more reaches it
            before = session.version
            pushes.put_nowait(note)
            await until(lambda before=before: session.version != before, timeout=5.0)
            await reap_once(proxy.ctx)
        # 18 s with no client and no POST stream, session_ttl = 10 s: the session must be gone.
        assert not await proxy.ctx.store.has_session(SESSION)


# -- 6. overflow = pause waits session_ttl again for every slice, not once ----------------------------------


# Regression: Pump._make_room pauses up to session_ttl before EVERY append slice once the window is full of
# undelivered events: a stream whose client left is read one slice per session_ttl, holding the upstream
# request and keeping the session from expiring for (events / slice) x session_ttl. Counted, not timed: a
# pause ends with a wait for readers that times out (``LocalSessions.readers_moved`` resolves False, never
# before its deadline), so the fixed pump's stream ends after one such wait, the bug's after ~19.
async def test_pause_gives_up_after_session_ttl_once(http, serve) -> None:
    from tests.support.scripted import SESSION as SCRIPTED
    from tests.support.scripted import ScriptedUpstream

    upstream = ScriptedUpstream(total=20)
    url = await serve(upstream.app())
    # window_events=2: append slices of one event; session_ttl=0.5 s: the pause a client-less stream gets.
    async with running_proxy(
        url, overflow="pause", window_events=2, session_ttl=0.5, drain_timeout=0.5
    ) as proxy:
        local = proxy.ctx.local
        waits_timed_out: list[float] = []
        readers_moved = local.readers_moved

        async def counted(session_id: str, timeout: float) -> bool:
            moved = await readers_moved(session_id, timeout)
            if not moved:
                waits_timed_out.append(timeout)
            return moved

        local.readers_moved = counted  # type: ignore[method-assign]
        async with http.post(proxy.url, data=call(1, "initialize"), headers=HEADERS) as r:
            await r.read()
        headers = {**HEADERS, "Mcp-Session-Id": SCRIPTED}
        async with http.post(proxy.url, data=call(2, "tools/call"), headers=headers) as response:
            await collect(response, limit=0)  # the priming event; the client leaves
        session = memory_session(proxy.ctx.store, SCRIPTED)
        await until(lambda: not any(s.live for s in session.streams.values()), timeout=30.0)  # a hang guard
        assert len(waits_timed_out) == 1  # one pause of session_ttl, then read on (evicting): 21 events
        assert upstream.posts == 2  # the call was read once, to its end


# -- 9. Two cursor-less GETs at once open two upstream GETs -----------------------------------------------


# Regression: the standalone GET's opening (get.Gets._standalone_plan) looks for the session's standalone
# stream, and opens an upstream GET when there is none; a second GET arriving while the first upstream GET
# is still on its way found none too, and opened a second one (which the SDK server answers 409, relayed
# to that client)
async def test_concurrent_cursorless_gets_share_one_upstream_get(http, gated) -> None:
    upstream, upstream_url = gated
    pushes = standalone(upstream, held_at="get")
    async with running_proxy(upstream_url, drain_timeout=0.5) as proxy:
        await initialize(http, proxy.url)

        async def view() -> list:
            async with http.get(proxy.url, headers=in_session()) as response:
                assert response.status == 200
                return await collect(response, limit=1)

        first = asyncio.ensure_future(view())
        await until(lambda: len(pb.gets(upstream)) == 1, timeout=5.0)  # its upstream GET is held at the gate
        second = asyncio.ensure_future(view())
        # the second view is in, while the first is still opening
        await until(lambda: proxy.ctx.local.attached(SESSION) == 2, timeout=5.0)
        for _ in range(20):
            await asyncio.sleep(0)
        upstream.open("get")
        await until(
            lambda: proxy.ctx.local.readers(SESSION) == 2, timeout=5.0
        )  # both views follow the one stream
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"n": 1}})
        pushes.put_nowait(note)
        async with asyncio.timeout(5):
            got = [await first, await second]
        assert [[e.data for e in events if e.data] for events in got] == [[note], [note]]
        assert len(pb.gets(upstream)) == 1


# -- 10. What a held view keeps ------------------------------------------------------------------------


def _await_chain(task: asyncio.Task[Any]) -> tuple[list[str], object]:
    """The files of the coroutines ``task`` is suspended in, outermost first, and what the innermost one
    awaits."""
    files: list[str] = []
    awaited: Any = task.get_coro()
    while hasattr(awaited, "cr_code"):
        files.append(awaited.cr_code.co_filename)
        awaited = awaited.cr_await
    return files, awaited


# An idle view is the proxy's most numerous object: each coroutine frame it holds costs ~300 bytes. Held,
# the view's task holds at most five frames of the proxy's own code (the handler down to the view's follow
# loop), parked on a bare future of the store's (no store coroutine, no timer of its own); the opening of the
# stream is not held. Counted by where the frames' code lives, not by their names, so a rename keeps the
# test and a deeper chain fails it.
async def test_a_held_standalone_view_parks_at_most_five_frames_deep_on_a_bare_future(http, gated) -> None:
    _, upstream_url = gated
    package = str(Path(mcpresume.__file__).parent)
    server = str(Path(aiohttp.__file__).parent)
    async with running_proxy(upstream_url, drain_timeout=0.5) as proxy:
        await initialize(http, proxy.url)
        before = asyncio.all_tasks()
        async with http.get(proxy.url, headers=in_session()) as response:
            assert response.status == 200
            await until(lambda: proxy.ctx.local.readers(SESSION) == 1, timeout=5.0)
            for _ in range(5):
                await asyncio.sleep(0)  # let the view reach its wait
            # The request's task is the one aiohttp's server runs (a pump's task, new too, is the proxy's).
            chains = [_await_chain(task) for task in asyncio.all_tasks() - before]
            served = [(files, awaited) for files, awaited in chains if files[0].startswith(server)]
            [(frames, awaited)] = [
                ([f for f in files if f.startswith(package)], awaited)
                for files, awaited in served
                if any(f.startswith(package) for f in files)
            ]
            assert 1 <= len(frames) <= 5, (frames, chains)
            assert isinstance(awaited, asyncio.Future) or type(awaited).__name__ == "FutureIter"  # C future
