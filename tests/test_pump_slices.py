"""How a pump cuts an upstream read into appends: slices of a window's events (one store call where a
reader takes a window per write), and of about half the window's bytes at most when events are large."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcpresume.core.flow import Appended, Guard
from mcpresume.core.session import NewEvent, StreamOrigin
from mcpresume.core.sse import SSERun, frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.store.memory import MemoryStore
from mcpresume.streams.pump import Pump, PumpJob, PumpSettings


class RecordingStore(MemoryStore):
    """The memory store, recording (events, bytes) of every append."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.appends: list[tuple[int, int]] = []

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
        self.appends.append((len(run), run.size))
        return await super().append_run(session_id, stream, run, now, guard, upstream_cursor, fence)

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
        self.appends.append((len(events), sum(len(event.body) for event in events)))
        return await super().append(session_id, stream, events, now, guard, upstream_cursor, fence)


async def _pump(window_events: int, window_bytes: int) -> tuple[Pump, RecordingStore]:
    limits = WindowLimits(window_events, window_bytes, 300.0)
    store = RecordingStore(limits, session_ttl=300.0, max_sessions=10, retry_ms=None)
    local = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    settings = PumpSettings(1 << 20, 30.0, window_events, 1000, 0, window_bytes=window_bytes)
    unused: Any = None
    pump = Pump(
        PumpJob("s", opened.number, (), "log"), store, local, Metrics(), unused, lambda: 0.0, settings
    )
    return pump, store


def _body(size: int) -> bytes:
    body = frame_body(b'{"jsonrpc":"2.0","method":"m","params":{"pad":"' + b"x" * size + b'"}}')
    return body


async def test_small_events_are_appended_a_window_at_a_time() -> None:
    pump, store = await _pump(8, 1 << 20)
    body = _body(10)
    await pump._append([SSERun([body] * 20, None, 20 * len(body))])
    assert store.appends == [(8, 8 * len(body)), (8, 8 * len(body)), (4, 4 * len(body))]


async def test_large_events_are_appended_half_the_windows_bytes_at_a_time() -> None:
    body = _body(100)
    pump, store = await _pump(8, 4 * len(body))  # the window holds 4 of these by its bytes
    await pump._append([SSERun([body] * 10, None, 10 * len(body))])
    assert [count for count, _ in store.appends] == [2, 2, 2, 2, 2]
    assert all(2 * size <= 4 * len(body) for _, size in store.appends)
    events = [NewEvent(body, EventKind.MESSAGE)] * 5  # single events (the line parser's) alike
    store.appends.clear()
    await pump._append([events])
    assert [count for count, _ in store.appends] == [2, 2, 1]
