"""Per-event cost of the proxy's hot path, in process: upstream bytes -> pump -> window -> a client's read.

    python -m bench.micro

No sockets, no event loop: the SSE parser, the pump's event conversion, the window append and one
attachment's read and join, on 256-byte events arriving in 64 KiB chunks, as the throughput scenario
delivers them. It isolates the Python work per event that bounds throughput (see bench/results/profile.md).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from mcpresume.pump import Pump, PumpJob, PumpSettings
from mcpresume.session import SessionState, StreamOrigin
from mcpresume.window import WindowLimits

EVENTS = 200_000
CHUNK = 64 * 1024


def upstream_bytes(size: int = 256, ids: bool = True) -> bytes:
    frames = []
    for k in range(EVENTS):
        # The official SDK writes the id line first (sse_starlette), then event and data.
        head = f"id: 7-{k}\nevent: message\ndata: ".encode() if ids else b"event: message\ndata: "
        body = {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 7, "progress": k},
        }
        data = orjson.dumps(body)
        pad = size - len(head) - len(data) - 2
        if pad > 0:
            body["params"]["pad"] = "x" * max(0, pad - 9)
            data = orjson.dumps(body)
        frames.append(head + data + b"\n\n")
    return b"".join(frames)


class _Null:
    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


def run(ids: bool) -> float:
    payload = upstream_bytes(ids=ids)
    chunks = [payload[i : i + CHUNK] for i in range(0, len(payload), CHUNK)]
    session = SessionState("s", "aaaaaaaaaaaa", WindowLimits(256, 4 << 20, 300.0), 1000, 0.0)
    priming = session.open_stream(StreamOrigin.POST, ["n:7"], 0.0)
    job = PumpJob("s", priming.stream, (7,), "x")
    settings = PumpSettings(4 << 20, 30.0, 256, 1000, 5)
    pump = Pump(job, _Null(), _Null(), _Null(), lambda: 0.0, settings)  # store/metrics unused below
    from mcpresume.sse import SSEParser, SSERun

    parser = SSEParser(4 << 20)
    position = priming.seq
    sent = 0
    start = time.perf_counter()
    for chunk in chunks:
        for batch in pump._events(parser.feed_batched(chunk)):
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


if __name__ == "__main__":
    for ids in (False, True):
        best = min(run(ids) for _ in range(3))
        print(
            f"{best:.2f} us per event ({1e6 / best:,.0f} events/s on one core), 256 B events, 64 KiB chunks, "
            + ("upstream ids on every event" if ids else "no upstream ids")
        )
