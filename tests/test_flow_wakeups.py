"""Flow control across a store round trip: a reader that moves while a guarded append is on its way wakes
nobody, so the pump must not then park as if nothing had moved (it did, with a shared store: the view had
sent everything and waited for news, the pump waited for the view, until stall_timeout)."""

from __future__ import annotations

import asyncio
from typing import Any

from mcpresume.core.flow import Appended, Guard
from mcpresume.core.session import NewEvent, StreamOrigin
from mcpresume.core.sse import SSERun, frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.store.memory import MemoryStore
from mcpresume.streams.pump import Pump, PumpJob, PumpSettings


class SlowStore(MemoryStore):
    """The memory store, with an append that takes a round trip: ``during`` runs while it is on its way,
    after the guard was checked (as a shared store's reply is on the wire)."""

    during: Any = None

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
        appended = await super().append_run(session_id, stream, run, now, guard, upstream_cursor, fence)
        during, self.during = self.during, None
        if during is not None:
            during()
        await asyncio.sleep(0)
        return appended


async def test_a_reader_that_moved_during_a_blocked_append_is_not_waited_for() -> None:
    store = SlowStore(WindowLimits(4, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None)
    local = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    body = frame_body(b'{"jsonrpc":"2.0","method":"m"}')
    await store.append("s", opened.number, [NewEvent(body, EventKind.MESSAGE)] * 3, now=0.0)  # full: 4 events
    reader = local.add_reader("s", [opened.number], 0)  # has sent nothing yet
    # While the guarded append (blocked: it would evict seq 1) is on its way, the reader sends it all.
    store.during = lambda: local.move_reader("s", reader, 4)
    settings = PumpSettings(1 << 20, 30.0, 4, 1000, 0)  # stall_timeout 30 s: a park would outlast the test
    unused: Any = None
    pump = Pump(
        PumpJob("s", opened.number, (), "log"), store, local, Metrics(), unused, lambda: 0.0, settings
    )
    run = SSERun([body], None, len(body))
    async with asyncio.timeout(5):
        await pump._store(run)
    read = await store.read("s", [opened.number], 4)
    assert read is not None and read.count == 1  # appended, once the pump saw the reader had moved


async def test_a_pump_waiting_for_a_reader_is_woken_when_the_session_is_dropped() -> None:
    store = MemoryStore(WindowLimits(4, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None)
    local = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    waiting = asyncio.ensure_future(local.readers_moved("s", 30.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    await store.delete_session("s")  # no reader will move again: the pump stops waiting at once
    async with asyncio.timeout(5):
        assert await waiting is True
