"""A replica's previous process died mid-stream (kill -9, OOM): the streams it was pumping are in the shared
store, and the process that starts with the same ``replica_id`` takes them over (``SessionStore.orphans``,
``streams.starter.PumpStarter.adopt``): each is resumed upstream from the last upstream event id that reached
the store, or its pending requests are answered with ``upstream_stream_lost``. A client re-attaching with its
cursor gets exactly the events after it, the response once.

The dead process is played by writing to the store what its pump had written (a memory store outlives no
process; the same over Redis with real processes is in test_redis_restart.py).
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from mcpresume.core.cursor import encode_cursor
from mcpresume.core.session import NewEvent, PumpRecord, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.store.memory import MemoryStore
from tests.support.proxy import collect, running_proxy
from tests.support.scripted import SESSION, ScriptedUpstream

REQUEST = 7


def _progress(k: int, total: int) -> NewEvent:
    """Event ``k`` of the scripted upstream's call, as the dead process's pump kept it."""
    params = {"progressToken": REQUEST, "progress": k + 1, "total": total}
    body = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
    return NewEvent(frame_body(orjson.dumps(body)), EventKind.MESSAGE)


async def _left_by_a_dead_process(store: MemoryStore, total: int, sent: int, owner: str) -> bytes:
    """A session owned by ``owner`` with a POST stream whose pump appended ``sent`` events, then died; the
    cursor of the last one (what the client holds)."""
    epoch = await store.create_session(SESSION, now=0.0, owner=owner)
    record = PumpRecord((REQUEST,), "/mcp", (("Mcp-Session-Id", SESSION),))
    opened = await store.open_stream(SESSION, StreamOrigin.POST, [f"n:{REQUEST}"], 0.0, pump=record)
    assert opened is not None
    events = [_progress(k, total) for k in range(sent)]
    await store.append(SESSION, opened.number, events, 0.0, upstream_cursor=f"{REQUEST}-{sent - 1}")
    return encode_cursor(epoch, opened.number, opened.priming_seq + sent)


def _store() -> MemoryStore:
    return MemoryStore(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=10)


async def _reattach(url: str, cursor: bytes) -> list[dict[str, object]]:
    headers = {"Mcp-Session-Id": SESSION, "Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as response:
        assert response.status == 200
        async with asyncio.timeout(10):
            return [orjson.loads(e.data) for e in await collect(response) if e.data]


async def test_a_stream_left_by_the_previous_process_is_resumed_upstream_and_read_from_the_cursor(
    serve,
) -> None:
    upstream = ScriptedUpstream(total=10)
    url = await serve(upstream.app())
    store = _store()
    cursor = await _left_by_a_dead_process(store, total=10, sent=3, owner="pod-a")
    async with running_proxy(url, store_instance=store, replica_id="pod-a") as proxy:
        messages = await _reattach(proxy.url, cursor)
    assert upstream.gets == [f"{REQUEST}-2"]  # resumed from the last upstream id in the store, once
    assert upstream.posts == 0  # the call was never sent again
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    assert progress == list(range(4, 11))  # exactly the events after the client's cursor
    responses = [m for m in messages if "result" in m]
    assert len(responses) == 1 and responses[0]["id"] == REQUEST


async def test_a_stream_the_upstream_cannot_resume_ends_with_an_error_for_its_request(serve) -> None:
    upstream = ScriptedUpstream(total=10, resumable=False)  # it answers the resume GET with 404
    url = await serve(upstream.app())
    store = _store()
    cursor = await _left_by_a_dead_process(store, total=10, sent=3, owner="pod-a")
    async with running_proxy(url, store_instance=store, replica_id="pod-a") as proxy:
        messages = await _reattach(proxy.url, cursor)
    (error,) = [m for m in messages if "error" in m]
    assert error["id"] == REQUEST
    assert error["error"]["data"]["reason"] == "upstream_stream_lost"  # type: ignore[index]


async def test_streams_of_another_replica_are_left_to_it(serve) -> None:
    upstream = ScriptedUpstream(total=10)
    url = await serve(upstream.app())
    store = _store()
    await _left_by_a_dead_process(store, total=10, sent=3, owner="pod-b")
    async with running_proxy(url, store_instance=store, replica_id="pod-a") as proxy:
        assert len(proxy.ctx.pumps) == 0
        assert [o.session_id for o in await store.orphans("pod-b")] == [SESSION]
    assert upstream.gets == []
