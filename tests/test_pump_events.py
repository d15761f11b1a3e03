"""The pump's conversion of parsed upstream events into appends (Pump._events), without a network: the run
fast path, the split at a response, and replays dropped after an upstream resume."""

from __future__ import annotations

import asyncio
from typing import Any

from mcpresume.metrics import Metrics
from mcpresume.pump import Pump, PumpJob, Pumps, PumpSettings
from mcpresume.session import NewEvent
from mcpresume.sse import SSEParser, SSERun
from mcpresume.window import EventKind, Evicted
from tests.support.metrics import sample

NOTE = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":%d}}'


def note(k: int, id: bytes | None = None) -> bytes:
    head = b"" if id is None else b"id: " + id + b"\n"
    return head + b"event: message\ndata: " + NOTE % k + b"\n\n"


def answer(request_id: int, id: bytes | None = None) -> bytes:
    head = b"" if id is None else b"id: " + id + b"\n"
    return head + b'event: message\ndata: {"jsonrpc":"2.0","id":%d,"result":{}}\n\n' % request_id


def make_pump(request_ids: tuple[int, ...] = (7,)) -> Pump:
    job = PumpJob("s", 1, request_ids, "log")
    settings = PumpSettings(1 << 20, 5.0, 256, 1000, 5)
    unused: Any = None  # store and upstream: _events touches neither
    return Pump(job, unused, Metrics(), unused, lambda: 0.0, settings)


def flatten(batches: list[list[NewEvent] | SSERun]) -> list[tuple[str, int]]:
    """(kind of batch, events) per batch: "run" for the fast path, else each event's kind."""
    out: list[tuple[str, int]] = []
    for batch in batches:
        if isinstance(batch, SSERun):
            out.append(("run", len(batch)))
        else:
            out.extend((item.kind.name, 1) for item in batch)
    return out


def test_a_chunk_ending_with_the_response_is_a_run_then_the_response() -> None:
    pump = make_pump()
    chunk = b"".join(note(k) for k in range(50)) + answer(7) + note(99)
    batches = pump._events(SSEParser(1 << 20).feed_batched(chunk))
    assert flatten(batches) == [("run", 50), ("RESPONSE", 1), ("MESSAGE", 1)]
    assert pump.pending == {}  # answered: the stream is complete
    # Once nothing is pending, a chunk is a run whatever it holds.
    assert flatten(pump._events(SSEParser(1 << 20).feed_batched(answer(8) + note(1)))) == [("run", 2)]


def test_an_answer_to_another_request_stays_a_message() -> None:
    pump = make_pump((7,))
    batches = pump._events(SSEParser(1 << 20).feed_batched(note(1) + answer(3) + note(2)))
    assert flatten(batches) == [("run", 1), ("MESSAGE", 1), ("MESSAGE", 1)]
    assert set(pump.pending) == {"n:7"}


def test_after_a_resume_replayed_ids_are_dropped_in_runs_and_single_events() -> None:
    pump = make_pump()
    odd = b"id: u5\ndata: two\ndata: lines\n\n"  # not canonical: a single event, the slow path
    first = b"".join(note(k, b"u%d" % k) for k in range(5)) + odd
    assert flatten(pump._events(SSEParser(1 << 20).feed_batched(first))) == [("run", 5), ("MESSAGE", 1)]
    assert pump.last_id == b"u5"
    pump._seen = set(pump._recent or ())  # what _resume does before reading the resumed stream
    # The upstream replays u3, u4 and u5, then goes on to u6 and its answer.
    replay = note(3, b"u3") + note(4, b"u4") + odd + note(6, b"u6") + answer(7, b"u7")
    batches = pump._events(SSEParser(1 << 20).feed_batched(replay))
    assert flatten(batches) == [("run", 1), ("RESPONSE", 1)]
    assert sample(pump.metrics, "mcpresume_upstream_duplicates_total") == 3
    assert pump.last_id == b"u7"
    (run, [response]) = batches
    assert isinstance(run, SSERun) and [e.id for e in run.events()] == [b"u6"]
    assert response.kind is EventKind.RESPONSE and response.response_key == "n:7"


async def test_pumps_keep_each_sessions_tasks_until_they_end() -> None:
    pumps = Pumps()
    release = asyncio.Event()
    a1 = pumps.spawn("a", release.wait())
    a2 = pumps.spawn("a", release.wait())
    b = pumps.spawn("b", asyncio.sleep(30))
    assert len(pumps) == 3
    pumps.cancel_session("b")
    await asyncio.gather(b, return_exceptions=True)
    assert b.cancelled() and len(pumps) == 2 and not a1.done()
    release.set()
    await asyncio.gather(a1, a2)
    await asyncio.sleep(0)  # done callbacks run one loop step after the tasks end
    assert len(pumps) == 0 and not pumps._tasks


async def test_room_is_asked_for_the_bytes_the_window_will_hold() -> None:
    """Flow control asks the store for room for what the window will keep of a run: its blocks, without
    the upstream id lines the chunk carried (asking for more pauses or detaches a reader too early)."""
    asked: list[tuple[int, int]] = []
    appended: list[SSERun] = []

    class Store:
        async def wait_for_room(self, _sid: str, count: int, size: int, _timeout: float) -> bool:
            asked.append((count, size))
            return True

        async def append_run(self, _sid: str, _stream: int, run: SSERun, _now: float) -> Evicted:
            appended.append(run)
            return Evicted()

    pump = make_pump(request_ids=())
    pump.store = Store()  # type: ignore[assignment]
    chunk = note(1, b"u-1") + note(2, b"u-2")
    await pump._append(pump._events(SSEParser(1 << 20).feed_batched(chunk)))
    (run,) = appended
    assert asked == [(2, sum(map(len, run.blocks)))]
    assert sum(map(len, run.blocks)) == len(chunk) - len(b"id: u-1\n") - len(b"id: u-2\n")
