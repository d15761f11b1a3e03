"""Per-event cost of the proxy's hot path, in process: upstream bytes -> pump -> window -> a client's read.

    python -m bench.micro

Two measures, no sockets:

* batched: no event loop; the SSE parser, the pump's event conversion, the window append and one
  attachment's read and join, on 256-byte events arriving in 64 KiB chunks, as the throughput scenario
  delivers them. The Python work per event that bounds throughput (see bench/results/profile.md).
* one event per chunk: the real pump task, memory store (with metrics) and view task (``follow`` with a
  ``ClientWriter``) on uvloop, fed one event per loop iteration, as a paced stream arrives (the latency
  scenario): the per-event overhead of tasks, store calls and wake-ups, without the sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from typing import Any

import orjson
import uvloop

from bench.upstream import FRAMINGS, Framing, burst_pieces
from mcpresume.core.session import SessionState, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import WindowLimits
from mcpresume.http.view import ClientWriter, follow
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.store.memory import MemoryStore
from mcpresume.streams.pump import Pump, PumpJob, PumpSettings

EVENTS = 200_000  # per measure (--events to change)
CHUNK = 64 * 1024


def upstream_events(framing: Framing, size: int = 256, events: int | None = None) -> list[bytes]:
    """``events`` progress events of ``size`` bytes each, as the benchmark's upstream writes them in
    ``framing`` (with ids, each event's own)."""
    events = EVENTS if events is None else events
    per_write = 256
    out: list[bytes] = []
    for write in range(0, events, per_write):
        count = min(per_write, events - write)
        joined = (b"%08x" % write).join(burst_pieces(size, framing, count, 1_700_000_000_000_000_000))
        end = b"\r\n\r\n" if framing.crlf else b"\n\n"
        blocks = [block + end for block in joined.split(end) if block]
        if framing.comments:  # each event is its comment block and its own block
            blocks = [blocks[i] + blocks[i + 1] for i in range(0, len(blocks), 2)]
        out += blocks
    return out


def upstream_bytes(framing: Framing, size: int = 256) -> bytes:
    return b"".join(upstream_events(framing, size))


class _Null:
    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


def run(framing: Framing, payload: bytes | None = None) -> float:
    payload = upstream_bytes(framing) if payload is None else payload
    chunks = [payload[i : i + CHUNK] for i in range(0, len(payload), CHUNK)]
    session = SessionState("s", "aaaaaaaaaaaa", WindowLimits(256, 4 << 20, 300.0), 1000, 0.0)
    priming = session.open_stream(StreamOrigin.POST, ["n:7"], 0.0)
    job = PumpJob("s", priming.stream, (7,), "x")
    settings = PumpSettings(4 << 20, 30.0, 256, 1000, 5)
    pump = Pump(job, _Null(), _Null(), _Null(), _Null(), lambda: 0.0, settings)  # only its core is used
    from mcpresume.core.sse import SSEParser, SSERun

    parser = SSEParser(4 << 20)
    position = priming.seq
    sent = 0
    start = time.perf_counter()
    for chunk in chunks:
        for batch in pump.events.feed(parser.feed_batched(chunk)):
            for begin in range(0, len(batch), pump.step):
                if isinstance(batch, SSERun):
                    session.append_run(priming.stream, batch.split(begin, begin + pump.step), 0.0)
                else:
                    session.append(priming.stream, batch[begin : begin + pump.step], 0.0)
                result = session.read([priming.stream], position)
                if result.segments:
                    sent += len(result.body())
                    position = result.last_seq
    elapsed = time.perf_counter() - start
    assert sent > len(payload)  # every event reached the reader, with its cursor
    return elapsed / EVENTS * 1e6


class _Feed:
    """An upstream response delivering one chunk per loop iteration, as data_received would."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = iter(chunks)
        self.content = self

    async def readany(self) -> bytes:
        future = asyncio.get_running_loop().create_future()
        future.get_loop().call_soon(future.set_result, next(self.chunks, b""))
        return await future

    def release(self) -> None:
        return None


class _Sink:
    """A client response that takes every write (and a transport with an empty buffer)."""

    def __init__(self) -> None:
        self.size = 0

    async def write(self, data: bytes) -> None:
        self.size += len(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 * 1024, 64 * 1024


async def _one_event_per_chunk(events: int, framing: Framing) -> float:
    store = MemoryStore(WindowLimits(256, 4 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=1000)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.POST, ["n:7"], now=0.0)
    assert opened is not None
    local = LocalSessions()
    store.set_news(local.changed)
    after = opened.priming_seq - 1
    reader = local.add_reader("s", [opened.number], after)
    done = frame_body(orjson.dumps({"jsonrpc": "2.0", "id": 7, "result": {}}))
    chunks = [*upstream_events(framing, events=events), done]
    pump = Pump(
        PumpJob("s", opened.number, (7,), "x"),
        store,
        local,
        Metrics(),
        _Null(),  # type: ignore[arg-type]  # the upstream: not called unless the stream must be resumed
        time.monotonic,
        PumpSettings(4 << 20, 30.0, 256, 1000, 5),
    )
    sink = _Sink()
    writer = ClientWriter(sink, sink, 30.0)  # type: ignore[arg-type]
    start = time.perf_counter()
    view = asyncio.ensure_future(
        follow(writer, store, local, "s", [opened.number], after, replay_through=0, reader=reader)
    )
    await pump.run(_Feed(chunks))  # type: ignore[arg-type]
    outcome = await view
    elapsed = time.perf_counter() - start
    assert outcome.complete and outcome.sent == events + 2, outcome  # the priming event, events, response
    return elapsed / events * 1e6


def one_event_per_chunk(framing: Framing, events: int = 50_000) -> float:
    return uvloop.run(_one_event_per_chunk(events, framing))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__)
    parser.add_argument("--framing", nargs="+", choices=list(FRAMINGS), default=list(FRAMINGS))
    parser.add_argument("--batched-only", action="store_true", help="skip the one-event-per-chunk measure")
    parser.add_argument("--profile", action="store_true", help="cProfile the batched measure per framing")
    args = parser.parse_args(argv)
    for name in args.framing:
        framing = FRAMINGS[name]
        if args.profile:
            payload = upstream_bytes(framing)  # made outside the profile: only the proxy's work is in it
            profiler = cProfile.Profile()
            profiler.runcall(run, framing, payload)
            print(f"== {name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
            continue
        payload = upstream_bytes(framing)
        best = min(run(framing, payload) for _ in range(3))
        print(
            f"{name:18} {best:.2f} us per event ({1e6 / best:,.0f} events/s on one core), "
            "256 B events, 64 KiB chunks"
        )
    if not args.batched_only and not args.profile:
        for name in args.framing:
            best = min(one_event_per_chunk(FRAMINGS[name]) for _ in range(3))
            print(
                f"{name:18} {best:.2f} us per event, one 256 B event per chunk through pump, store and view"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
