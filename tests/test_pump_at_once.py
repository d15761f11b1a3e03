"""A POST stream whose whole answer came with its head is appended and ended by ``Pump.at_once`` in the
forwarding task, with no pump task; whatever would make that wait (the session's guard, a store outage, an
event too large, an answer that does not complete the stream) is left to ``Pump.run``, in a task, from what
was read: each event appended once, the stream ended as a pump ends it. Real aiohttp upstream answers read
through the proxy's client, the memory store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from mcpresume.core.errors import StoreUnavailable
from mcpresume.core.flow import Appended, Guard
from mcpresume.core.session import NewEvent, StreamOrigin
from mcpresume.core.sse import SSERun
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.store.memory import MemoryStore
from mcpresume.streams.pump import Pump, PumpJob, Pumps, PumpSettings
from mcpresume.streams.upstream import Upstream
from tests.conftest import ServeApp
from tests.support.poll import until

TIMEOUT = 30
RESPONSE = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":false}}'


class FlakyStore(MemoryStore):
    """The memory store, its first ``outages`` appends refused as unavailable; every append counted."""

    def __init__(self, *args: Any, outages: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outages = outages
        self.appends = 0

    def _flaky(self) -> None:
        self.appends += 1
        if self.outages:
            self.outages -= 1
            raise StoreUnavailable("the store is down (test)")

    async def append(
        self,
        session_id: str,
        stream: int,
        events: Sequence[NewEvent],
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        self._flaky()
        return await super().append(session_id, stream, events, now, guard, upstream_cursor, fence)

    async def append_run(
        self,
        session_id: str,
        stream: int,
        run: SSERun,
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        self._flaky()
        return await super().append_run(session_id, stream, run, now, guard, upstream_cursor, fence)


def upstream_app(body: bytes) -> web.Application:
    """Answers every POST with ``body`` as one SSE write (head, body and end in one piece)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/mcp", answer)
    return app


async def setup(
    serve: ServeApp,
    body: bytes,
    *,
    window_events: int = 64,
    outages: int = 0,
    max_event_bytes: int = 1 << 20,
    priming: bool = True,
) -> tuple[Pump, FlakyStore, LocalSessions, Upstream, int]:
    url = await serve(upstream_app(body))
    upstream = Upstream(url, connect_timeout=5, first_byte_timeout=10)
    await upstream.start()
    store = FlakyStore(
        WindowLimits(window_events, 1 << 20, 300.0),
        session_ttl=300.0,
        max_sessions=10,
        retry_ms=None,
        outages=outages,
    )
    local = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.POST, ["1"], now=0.0, priming=priming)
    assert opened is not None
    settings = PumpSettings(max_event_bytes, 0.5, window_events, 1000, 0, store_outage_grace=30.0)
    pump = Pump(
        PumpJob("s", opened.number, (1,), "log"), store, local, Metrics(), upstream, lambda: 1.0, settings
    )
    return pump, store, local, upstream, opened.number


async def answered(upstream: Upstream) -> Any:
    response = await upstream.request(
        "POST", "/mcp", [("Content-Type", "application/json")], b"{}", decoded=True
    )
    await until(lambda: response.arrived, timeout=TIMEOUT, what="the whole answer")
    return response


async def stream_events(store: MemoryStore, stream: int) -> tuple[list[bytes], bool]:
    """The stream's events but its priming one (the store's own), and whether it ended."""
    read = await store.read("s", [stream], 0)
    assert read is not None
    blocks = [block for segment in read.segments for block in segment.blocks]
    return [block for block in blocks if block != b"data: \n\n"], read.complete


def event(data: bytes, event_id: bytes | None = None) -> bytes:
    return (b"id: " + event_id + b"\n" if event_id else b"") + b"data: " + data + b"\n\n"


async def test_a_whole_one_event_answer_is_appended_and_ended_without_a_task(serve: ServeApp) -> None:
    pump, store, _, upstream, stream = await setup(serve, event(b"", b"1") + event(RESPONSE, b"2"))
    try:
        response = await answered(upstream)
        assert await pump.at_once(response) is None
        events, complete = await stream_events(store, stream)
        assert complete and len(events) == 1 and RESPONSE in events[0]
        assert store.appends == 1
        assert not pump.pending
        # released, its connection kept for the next request: a second answer reads back the same way
        again = await answered(upstream)
        assert await again.read() == event(b"", b"1") + event(RESPONSE, b"2")
        again.release()
    finally:
        await upstream.close()


async def test_a_store_outage_leaves_the_answer_to_a_task_that_appends_it_once(serve: ServeApp) -> None:
    pump, store, _, upstream, stream = await setup(serve, event(RESPONSE), outages=2)
    try:
        response = await answered(upstream)
        first = await pump.at_once(response)
        assert first is not None and first.batches  # read, not appended
        assert await stream_events(store, stream) == ([], False)
        pumps = Pumps()
        task = pumps.spawn("s", pump.run(response, first), pump=pump)
        await asyncio.wait_for(task, TIMEOUT)
        events, complete = await stream_events(store, stream)
        assert complete and len(events) == 1 and RESPONSE in events[0]
        assert store.appends == 3  # at once (down), the task's first try (down), its retry (up): once in
    finally:
        await upstream.close()


async def test_an_append_the_guard_refuses_waits_in_a_task_for_the_reader(serve: ServeApp) -> None:
    """The window holds 2 events, both undelivered to a reader of another stream: appending evicts one under
    it, so the guard refuses at once; the task waits, the reader falls behind by stall_timeout and is
    detached, and the answer goes in."""
    pump, store, local, upstream, stream = await setup(serve, event(RESPONSE), window_events=2, priming=False)
    try:
        other = await store.open_stream("s", StreamOrigin.POST, ["9"], now=0.0, priming=False)
        assert other is not None
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {}})
        await store.append("s", other.number, [NewEvent(event(note), EventKind.MESSAGE)] * 2, now=0.0)
        local.add_reader("s", [other.number], 0)
        response = await answered(upstream)
        first = await pump.at_once(response)
        assert first is not None
        assert (await stream_events(store, stream))[0] == []
        pumps = Pumps()
        await asyncio.wait_for(pumps.spawn("s", pump.run(response, first), pump=pump), TIMEOUT)
        events, complete = await stream_events(store, stream)
        assert complete and len(events) == 1 and RESPONSE in events[0]
        assert not local.reads("s", other.number)  # detached (stall_timeout), as any pump detaches it
    finally:
        await upstream.close()


async def test_an_event_too_large_or_an_answer_without_the_response_ends_as_a_pump_ends_it(
    serve: ServeApp,
) -> None:
    big = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"pad":"' + b"x" * 400 + b'"}}'
    pump, store, _, upstream, stream = await setup(serve, event(big) + event(RESPONSE), max_event_bytes=256)
    try:
        response = await answered(upstream)
        first = await pump.at_once(response)
        assert first is not None and first.unparsed  # not parsed here: the pump's read says it is too large
        await asyncio.wait_for(Pumps().spawn("s", pump.run(response, first), pump=pump), TIMEOUT)
        events, complete = await stream_events(store, stream)
        assert complete and len(events) == 1  # the error for the request, as a pump's read of it says
        error = orjson.loads(events[0].split(b"data: ", 1)[1])["error"]
        assert error["data"]["reason"] == "upstream_stream_lost" and "exceeds 256 bytes" in error["message"]
    finally:
        await upstream.close()
    pump, store, _, upstream, stream = await setup(serve, event(b"", b"7"))  # priming only, then the end
    try:
        response = await answered(upstream)
        first = await pump.at_once(response)
        assert first is not None and not first.batches
        await asyncio.wait_for(Pumps().spawn("s", pump.run(response, first), pump=pump), TIMEOUT)
        events, complete = await stream_events(store, stream)
        assert complete and len(events) == 1
        error = orjson.loads(events[0].split(b"data: ", 1)[1])["error"]
        assert error["data"]["reason"] == "upstream_stream_lost"
    finally:
        await upstream.close()
