"""The load side of the benchmarks, run in its own process: ``python -m bench.client '<json spec>'``.

It prints one ``RESULT <json>`` line at the end. A spec that needs the benchmark to measure something
between phases (the memory scenarios) prints ``PHASE <name> <json>`` and waits for a ``continue`` line on
standard input before going on (bounded by ``phase_timeout``).

Counting is cheap: throughput clients count occurrences of ``data: {`` in the raw (de-chunked) bytes,
carrying 6 bytes across reads, and never parse JSON. Only the latency workload looks inside events, for
the ``"ts"`` stamp, and only the resume workload reads ``id:`` lines (to pick a cursor).

Every workload is bounded: a fixed number of events per stream, and an overall ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from bench.stats import percentiles, quantile_curve

# 2025-11-25: the proxy primes its streams (an id before any message) for this revision and later only,
# and the idle-stream phase waits for that first id.
PROTOCOL = "2025-11-25"
MARK = b"data: {"
_TS = re.compile(rb'"ts":(\d{19})')
_ID = re.compile(rb"^id: (\S+)$", re.M)

BASE_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
}


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


INITIALIZE = _dumps(
    {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": PROTOCOL,
            "capabilities": {},
            "clientInfo": {"name": "mcpresume-bench", "version": "1"},
        },
    }
)
INITIALIZED = _dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})


def tool_call(request_id: int, **arguments: Any) -> bytes:
    return _dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": "bench", "arguments": arguments},
        }
    )


def session_headers(session_id: str) -> dict[str, str]:
    return {**BASE_HEADERS, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": PROTOCOL}


async def pool(count: int, concurrency: int, job: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """Run ``job(i)`` for i in range(count), at most ``concurrency`` at a time; results in order."""
    results: list[Any] = [None] * count
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            results[i] = await job(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return results


def http_session(read_bufsize: int = 1 << 18) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
        read_bufsize=read_bufsize,
        auto_decompress=False,
    )


async def open_session(http: aiohttp.ClientSession, url: str, *, initialized: bool = True) -> str:
    async with http.post(url, data=INITIALIZE, headers=BASE_HEADERS) as response:
        await response.read()
        if response.status != 200 or "Mcp-Session-Id" not in response.headers:
            raise RuntimeError(f"initialize: {response.status}")
        session_id = response.headers["Mcp-Session-Id"]
    if initialized:
        async with http.post(url, data=INITIALIZED, headers=session_headers(session_id)) as response:
            await response.read()
            if response.status != 202:
                raise RuntimeError(f"notifications/initialized: {response.status}")
    return session_id


async def delete_session(http: aiohttp.ClientSession, url: str, session_id: str) -> None:
    with contextlib.suppress(aiohttp.ClientError):
        async with http.delete(url, headers=session_headers(session_id)) as response:
            await response.read()


async def count_stream(
    http: aiohttp.ClientSession, url: str, session_id: str, body: bytes
) -> tuple[int, float, bool]:
    """POST ``body`` and count ``data: {`` to the end: (events, end time, ended normally)."""
    count = 0
    tail = b""
    try:
        async with http.post(url, data=body, headers=session_headers(session_id)) as response:
            if response.status != 200:
                await response.read()
                return 0, time.perf_counter(), False
            async for chunk in response.content.iter_any():
                count += chunk.count(MARK)
                if tail:
                    count += (tail + chunk[:6]).count(MARK)
                tail = chunk[-6:]
    except (aiohttp.ClientError, OSError):
        return count, time.perf_counter(), False
    return count, time.perf_counter(), True


# -- workloads -------------------------------------------------------------------------------------------


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    """``streams`` sessions, each one tools/call streaming as fast as possible. Probe runs (doubling) size
    the measured run to about ``duration`` seconds (events per stream clamped to [min_events, max_events]).
    Every run uses fresh sessions and deletes them afterwards, so a proxy's windows do not pile up."""
    url, streams, size = spec["url"], spec["streams"], spec["size"]
    async with http_session() as http:

        async def run(per_stream: int) -> dict[str, Any]:
            sessions = await pool(streams, 50, lambda _i: open_session(http, url))
            body = tool_call(1, count=per_stream, size=size, rate=0, framing=spec.get("framing", {}))
            start = time.perf_counter()
            results = await asyncio.gather(*(count_stream(http, url, sid, body) for sid in sessions))
            elapsed = max(end for _, end, _ in results) - start
            await pool(len(sessions), 50, lambda i: delete_session(http, url, sessions[i]))
            events = sum(n for n, _, _ in results)
            # each stream ends with the JSON-RPC response, also a "data: {" event
            complete = sum(1 for n, _, ok in results if ok and n == per_stream + 1)
            return {
                "per_stream": per_stream,
                "events": events,
                "elapsed": elapsed,
                "rate": events / elapsed if elapsed > 0 else 0.0,
                "mib_per_s": events * size / elapsed / (1 << 20) if elapsed > 0 else 0.0,
                "complete_streams": complete,
            }

        per_stream = max(20, spec["probe_events"] // streams)
        probes = []
        for _ in range(6):
            probe = await run(per_stream)
            probes.append(probe)
            if probe["elapsed"] >= spec.get("probe_seconds", 0.25) or probe["complete_streams"] < streams:
                break
            per_stream = min(spec["max_events"], per_stream * 4)
        rate = probes[-1]["rate"]
        per_stream = int(rate * spec["duration"] / streams)
        per_stream = max(spec["min_events"], min(spec["max_events"], per_stream))
        main = await run(per_stream)
    return {"probes": probes, **main, "streams": streams, "size": size}


async def latency(spec: dict[str, Any]) -> dict[str, Any]:
    """``streams`` sessions, each a tools/call paced at ``rate / streams`` events/s for ``duration`` s;
    one-way latency = receive time - the upstream's stamp, for events received after ``warmup`` s."""
    url, streams, rate, size = spec["url"], spec["streams"], spec["rate"], spec["size"]
    per_stream_rate = rate / streams
    per_stream = int(per_stream_rate * spec["duration"])
    samples: list[float] = []
    async with http_session() as http:
        sessions = await pool(streams, 50, lambda _i: open_session(http, url))
        cutoff = time.time_ns() + int(spec["warmup"] * 1e9)

        async def one(i: int) -> tuple[int, bool]:
            # streams are staggered so the aggregate is evenly spaced, not bursts of `streams` events
            body = tool_call(1, count=per_stream, size=size, rate=per_stream_rate, delay=i / rate)
            buffer = b""
            received = 0
            try:
                async with http.post(url, data=body, headers=session_headers(sessions[i])) as response:
                    async for chunk in response.content.iter_any():
                        now = time.time_ns()
                        buffer += chunk
                        end = buffer.rfind(b"\n\n")
                        if end < 0:
                            continue
                        done, buffer = buffer[: end + 2], buffer[end + 2 :]
                        received += done.count(MARK)
                        if now >= cutoff:
                            samples.extend((now - int(ts)) / 1e6 for ts in _TS.findall(done))
            except (aiohttp.ClientError, OSError):
                return received, False
            return received, True

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(streams)))
        elapsed = time.perf_counter() - start
        await pool(len(sessions), 50, lambda i: delete_session(http, url, sessions[i]))
    received = sum(n for n, _ in results)
    return {
        "rate": rate,
        "streams": streams,
        "size": size,
        "elapsed": elapsed,
        "expected": streams * (per_stream + 1),
        "received": received,
        "achieved_rate": received / elapsed if elapsed else 0.0,
        "latency_ms": percentiles(samples),
        # microseconds, so the benchmark can pool interleaved segments
        "samples_us": [round(x * 1000) for x in samples],
    }


async def _raw_get(
    host: str, port: int, headers: dict[str, str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    lines = ["GET /mcp HTTP/1.1", f"Host: {host}:{port}"] + [f"{k}: {v}" for k, v in headers.items()]
    return reader, writer, ("\r\n".join(lines) + "\r\n\r\n").encode()


async def resume(spec: dict[str, Any]) -> dict[str, Any]:
    """Sessions whose window is full of one finished tools/call stream; then GET + Last-Event-ID with a
    cursor near the start of the window, timed from the request's write to the first replayed event."""
    url, count, size, back = spec["url"], spec["count"], spec["size"], spec["cursor_back"]
    host, port = spec["host"], spec["port"]
    prepared: list[tuple[str, str, int]] = []  # session, cursor, events expected after it
    async with http_session() as http:

        async def prepare(_i: int) -> tuple[str, str, int]:
            sid = await open_session(http, url)
            async with http.post(
                url,
                data=tool_call(1, count=count, size=size, rate=spec.get("rate", 0)),
                headers=session_headers(sid),
            ) as response:
                body = await response.read()
            ids = _ID.findall(body)
            if len(ids) < back + 1:
                raise RuntimeError(f"only {len(ids)} ids in the stream")
            return sid, ids[-back].decode(), back - 1

        prepared = await pool(spec["sessions"], spec.get("concurrency", 2), prepare)

    first_ms: list[float] = []
    all_ms: list[float] = []
    failures: list[str] = []
    for trial in range(spec["trials"]):
        sid, cursor, expected = prepared[trial % len(prepared)]
        headers = {
            "Accept": "text/event-stream",
            "Mcp-Session-Id": sid,
            "Last-Event-ID": cursor,
            "MCP-Protocol-Version": PROTOCOL,
        }
        reader, writer, request = await _raw_get(host, port, headers)
        try:
            buffer = bytearray()
            first = None
            start = time.perf_counter()
            writer.write(request)
            while True:
                data = await asyncio.wait_for(reader.read(1 << 20), 10)
                if not data:
                    break
                buffer += data
                if first is None:
                    mark = buffer.find(MARK)
                    if mark >= 0 and buffer.find(b"\n\n", mark) >= 0:
                        first = time.perf_counter()
                if buffer.endswith(b"\r\n0\r\n\r\n"):
                    break
            end = time.perf_counter()
            if not buffer.startswith(b"HTTP/1.1 200"):
                failures.append(bytes(buffer[:200]).decode(errors="replace"))
                continue
            got = buffer.count(MARK)
            if first is None or got != expected:
                failures.append(f"replayed {got} events, expected {expected}")
                continue
            first_ms.append((first - start) * 1e3)
            all_ms.append((end - start) * 1e3)
        finally:
            writer.close()
    return {
        "trials": spec["trials"],
        "sessions": len(prepared),
        "replayed_per_trial": back - 1,
        "size": size,
        "first_event_ms": percentiles(first_ms),
        "full_replay_ms": percentiles(all_ms),
        "curve_ms": quantile_curve(first_ms),
        "failures": len(failures),
        "failure_examples": failures[:3],
    }


async def _phase(name: str, info: dict[str, Any], timeout: float) -> None:
    print(f"PHASE {name} {json.dumps(info)}", flush=True)
    loop = asyncio.get_running_loop()
    line = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), timeout)
    if line.strip() != "continue":
        raise RuntimeError(f"expected 'continue', got {line!r}")


async def windows(spec: dict[str, Any]) -> dict[str, Any]:
    """``sessions`` sessions, each filled with one tools/call of ``count`` events (more than the window)."""
    url = spec["url"]
    async with http_session() as http:

        async def fill(i: int) -> bool:
            sid = await open_session(http, url)
            n, _, ok = await count_stream(
                http, url, sid, tool_call(1, count=spec["count"], size=spec["size"], rate=spec.get("rate", 0))
            )
            return ok and n == spec["count"] + 1

        start = time.perf_counter()
        ok = await pool(spec["sessions"], spec["concurrency"], fill)
        elapsed = time.perf_counter() - start
        await _phase("filled", {"ok": sum(ok)}, spec["phase_timeout"])
    return {"sessions": spec["sessions"], "ok": sum(ok), "elapsed": elapsed}


async def idle(spec: dict[str, Any]) -> dict[str, Any]:
    """``sessions`` sessions (initialize only); then ``streams`` of them open the standalone GET stream
    and hold it, idle, while the benchmark measures; then everything is closed."""
    url, host, port = spec["url"], spec["host"], spec["port"]
    held: list[asyncio.StreamWriter] = []
    async with http_session() as http:
        start = time.perf_counter()
        sessions = await pool(
            spec["sessions"], spec["concurrency"], lambda _i: open_session(http, url, initialized=False)
        )
        await _phase(
            "sessions",
            {"sessions": len(sessions), "elapsed": time.perf_counter() - start},
            spec["phase_timeout"],
        )

    async def hold(i: int) -> bool:
        headers = {
            "Accept": "text/event-stream",
            "Mcp-Session-Id": sessions[i],
            "MCP-Protocol-Version": PROTOCOL,
        }
        reader, writer, request = await _raw_get(host, port, headers)
        writer.write(request)
        buffer = b""
        try:
            async with asyncio.timeout(20):
                # the proxy's priming event ("id: ...") shows the stream is attached
                while b"\nid: " not in buffer:
                    data = await reader.read(4096)
                    if not data:
                        break
                    buffer += data
        except TimeoutError:
            pass
        held.append(writer)
        return buffer.startswith(b"HTTP/1.1 200") and b"id: " in buffer

    start = time.perf_counter()
    try:
        ok = await pool(spec["streams"], spec["concurrency"], hold)
        await _phase(
            "streams", {"open": sum(ok), "elapsed": time.perf_counter() - start}, spec["phase_timeout"]
        )
    finally:
        for writer in held:
            writer.close()
    return {"sessions": len(sessions), "streams": spec["streams"], "streams_ok": sum(ok)}


async def sessions(spec: dict[str, Any]) -> dict[str, Any]:
    """``sessions`` sessions (initialize only), left open: the proxy holds them, idle, after this ends."""
    async with http_session() as http:
        start = time.perf_counter()
        opened = await pool(
            spec["sessions"],
            spec["concurrency"],
            lambda _i: open_session(http, spec["url"], initialized=False),
        )
    return {"sessions": len(opened), "elapsed": time.perf_counter() - start}


WORKLOADS: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "sessions": sessions,
    "throughput": throughput,
    "latency": latency,
    "resume": resume,
    "windows": windows,
    "idle": idle,
}


async def _main(spec: dict[str, Any]) -> dict[str, Any]:
    async with asyncio.timeout(spec.get("timeout", 120)):
        return await WORKLOADS[spec["kind"]](spec)


def main() -> int:
    spec = json.loads(sys.argv[1])
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = asyncio.run(_main(spec))
    # The event loop may leave stdout non-blocking (a shared pipe): a result line longer than the pipe's
    # buffer (a latency run's samples, ~240 KB) was then cut at 128 KiB and the benchmark could not read it.
    os.set_blocking(sys.stdout.fileno(), True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
