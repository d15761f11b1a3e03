"""Bounded under slow clients and abandoned sessions (ARCHITECTURE.md, invariant #7)."""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.sse import SSEParser
from mcpresume.daemon.app import reap_once
from mcpresume.http.view import ClientWriter, Stalled
from tests.conftest import ServeApp
from tests.support.metrics import sample
from tests.support.poll import until
from tests.support.proxy import ManualClock, ScriptedClient, collect, error_of, running_proxy
from tests.support.scripted import ScriptedUpstream
from tests.support.transport import BufferedTransport


async def raw_post(
    port: int, body: bytes, headers: dict[str, str], rcvbuf: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client with a tiny receive buffer that sends a request and then does not read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body
    )
    await writer.drain()
    return reader, writer


async def test_a_client_that_stops_reading_is_detached_and_resumes_without_loss(serve: ServeApp) -> None:
    # 120 events of ~64 KiB: far more than the kernel buffers of a client that does not read.
    upstream = ScriptedUpstream(total=120, pad=64 * 1024)
    url = await serve(upstream.app())
    settings = {"stall_timeout": 0.5, "window_bytes": 32 << 20, "window_events": 1024}
    async with running_proxy(url, **settings) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("work", {})
        reader, writer = await raw_post(proxy.port, body, client.headers(), rcvbuf=4096)
        metrics = proxy.ctx.metrics
        await until(lambda: sample(metrics, "mcpresume_backpressure_detaches_total") > 0)
        # The slow client never slowed the pump: the whole stream reached the window anyway.
        await until(lambda: len(proxy.ctx.pumps) == 0)
        # Another session is unaffected meanwhile.
        other = ScriptedClient(http, proxy.url)
        await other.initialize()
        # The detached client reads what it had received, then re-attaches from its last complete event.
        received = await reader.read()  # the proxy aborted the connection: read to EOF
        writer.close()
        before = SSEParser(1 << 20).feed(dechunk(received.split(b"\r\n\r\n", 1)[1]))
        assert before and before[0].data == b""  # at least the priming event arrived
        cursor = [e.id for e in before if e.id][-1].decode()
        async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": cursor})) as response:
            assert response.status == 200
            after = await collect(response)
    messages = [orjson.loads(e.data) for e in before + after if e.data]
    assert [m["params"]["progress"] for m in messages if m.get("method")] == list(range(1, 121))
    assert [m["id"] for m in messages if "result" in m] == [request_id]
    assert sample(metrics, "mcpresume_backpressure_detaches_total") == 1


def dechunk(body: bytes) -> bytes:
    """The data of the complete chunks of an HTTP/1.1 chunked body (a cut one is dropped)."""
    out, rest = bytearray(), body
    while b"\r\n" in rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if size == 0 or len(rest) < size + 2:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


@pytest.mark.parametrize("overflow", ["evict", "pause"])
async def test_overflow_policy_while_no_client_reads(serve: ServeApp, overflow: str) -> None:
    """evict: the ring drops the oldest and a resume behind it gets 409; pause: the pump stops reading the
    upstream until the client re-attaches, and the client gets everything."""
    # The tool thinks a moment before its first event: the client has its priming cursor and is gone by then,
    # so no event of the call was ever sent to it.
    upstream = ScriptedUpstream(total=40, start_delay=0.3)
    url = await serve(upstream.app())
    async with (
        running_proxy(url, window_events=8, overflow=overflow) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            first = SSEParser(1 << 20).feed(await response.content.readany())
        assert [e.data for e in first] == [b""]  # the priming event only
        cursor = first[0].id
        assert cursor is not None
        store = proxy.ctx.store
        if overflow == "evict":
            await until(lambda: len(proxy.ctx.pumps) == 0)  # read to the end, evicting as it went
        else:
            await until(lambda: _paused(store, client.session_id))  # window full of undelivered: it waits
            assert len(proxy.ctx.pumps) == 1
        headers = client.headers(**{"Last-Event-ID": cursor.decode()})
        async with http.get(client.url, headers=headers) as response:
            if overflow == "evict":
                assert response.status == 409
                assert (await error_of(response))["data"]["reason"] == "cursor_out_of_window"
                undelivered = sample(
                    proxy.ctx.metrics, "mcpresume_evicted_events_total", reason="undelivered"
                )
                assert undelivered > 0
                return
            assert response.status == 200
            events = await collect(response)
    messages = [orjson.loads(e.data) for e in events if e.data]
    assert [m["params"]["progress"] for m in messages if m.get("method")] == list(range(1, 41))
    assert [m["id"] for m in messages if "result" in m] == [request_id]


async def _paused(store: object, session_id: str) -> bool:
    stats = await store.stats()  # type: ignore[attr-defined]
    return bool(stats.window_events >= 8)


async def test_abandoned_sessions_stay_bounded_and_are_reaped(serve: ServeApp) -> None:
    """The abandoned sessions (docs/how-it-works.md): 200 sessions whose clients vanish mid-stream and never
    return. What the proxy holds (traced allocations in mcpresume's own code) stays under sessions x window
    bound + a small per-session overhead, and falls back near the baseline after session_ttl."""
    sessions, window_bytes = 200, 16 << 10
    upstream = ScriptedUpstream(total=60, pad=1024)  # ~60 KiB per call, four windows' worth
    url = await serve(upstream.app())
    clock = ManualClock()
    settings = {"window_events": 64, "window_bytes": window_bytes, "session_ttl": 60.0, "clock": clock}
    tracemalloc.start()
    try:
        async with running_proxy(url, **settings) as proxy, aiohttp.ClientSession() as http:
            baseline = _held()
            for _ in range(sessions):
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                _, body = client.tool_call("work", {})
                async with http.post(client.url, data=body, headers=client.headers()) as response:
                    await response.content.readany()  # a first chunk, then the client vanishes
            await until(lambda: len(proxy.ctx.pumps) == 0, timeout=60)
            stats = await proxy.ctx.store.stats()
            held = _held() - baseline
            assert stats.sessions == sessions
            assert stats.window_bytes <= sessions * window_bytes
            assert held <= sessions * (window_bytes + 8 * 1024), f"{held} bytes held for {sessions} sessions"
            clock.advance(61)
            await reap_once(proxy.ctx)
            assert (await proxy.ctx.store.stats()).sessions == 0
            assert sample(proxy.ctx.metrics, "mcpresume_sessions") == 0
            after = _held() - baseline
            assert after <= 256 * 1024, f"{after} bytes still held after every session expired"
    finally:
        tracemalloc.stop()


def _held() -> int:
    """Bytes currently allocated by mcpresume's own code (and still reachable)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/mcpresume/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


# -- the write bound's fast path ----------------------------------------------------------------------


class _SlowResponse:
    """A response whose write takes ``delay`` s: stands for a write that waits on a paused protocol."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        await asyncio.sleep(self.delay)
        self.written.append(data)


@pytest.mark.parametrize(
    ("buffered", "size", "timed"),
    [
        (0, 100, False),  # an empty buffer: the write cannot wait, no time-out armed
        (16 * 1024, 100, False),  # at the low-water mark the protocol is not paused
        (16 * 1024 + 1, 100, True),  # over it, the protocol may still be paused from before
        (0, 64 * 1024, True),  # a write that would cross the high-water mark pauses the protocol
    ],
)
async def test_a_write_is_timed_only_when_it_can_wait(buffered: int, size: int, timed: bool) -> None:
    response = _SlowResponse(delay=0.05)
    writer = ClientWriter(response, BufferedTransport(buffered), stall_timeout=0.01)  # type: ignore[arg-type]
    if timed:
        with pytest.raises(Stalled):
            await writer.write(b"x" * size)
        assert response.written == []
    else:
        await writer.write(b"x" * size)  # no time-out armed: the (fake) slow write completes
        assert response.written == [b"x" * size]


# -- the write bound on a real response (the chunk written straight to the transport) --------------------


def _view_app(writes: list[bytes], outcome: dict[str, object]) -> web.Application:
    """An aiohttp server whose one handler writes ``writes`` through a ``ClientWriter`` as a view does,
    recording after each write how many bytes its transport held, and how the writes ended."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        transport = request.transport
        assert transport is not None
        writer = ClientWriter(response, transport, 0.3, request.writer)
        held: list[int] = []
        outcome["held"], outcome["limits"] = held, transport.get_write_buffer_limits()
        try:
            for data in writes:
                await writer.write(data)
                held.append(transport.get_write_buffer_size())
        except Stalled:
            outcome["end"] = "stalled"
            transport.abort()
            return response
        outcome["end"] = "written"
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/mcp", handler)
    return app


async def test_a_view_write_reaches_the_client_as_written(serve: ServeApp) -> None:
    writes = [b"", *(b"data: %d\n\n" % k * (1 + 97 * k) for k in range(40)), b"x" * (200 * 1024)]
    outcome: dict[str, object] = {}
    url = await serve(_view_app(writes, outcome))
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["Transfer-Encoding"] == "chunked"
        body = await response.read()
    assert body == b"".join(writes)
    assert outcome["end"] == "written"


async def test_a_client_that_does_not_read_stalls_the_view_and_the_proxy_holds_one_write_over_high_water(
    serve: ServeApp,
) -> None:
    """The write goes straight to the transport and waits only when the transport's buffer is over its
    high-water mark: a client that takes nothing makes the view hold at most that mark plus one write
    (not every write it was handed), and ends it as stalled within the stall time-out."""
    size = 64 * 1024
    writes = [b"x" * size] * 400  # 25 MiB: far more than the kernel buffers of a client that does not read
    outcome: dict[str, object] = {}
    url = await serve(_view_app(writes, outcome))
    port = int(url.split(":")[2].split("/")[0])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await until(lambda: "end" in outcome, timeout=20)
    writer.close()
    assert outcome["end"] == "stalled"
    held = outcome["held"]
    assert isinstance(held, list) and len(held) < len(writes)
    _, high = outcome["limits"]  # type: ignore[misc]
    assert max(held) <= high + size + 32, f"{max(held)} bytes held over a high-water mark of {high}"


def _one_write_app(body: bytes) -> web.Application:
    """A handler that writes ``body`` through a ``ClientWriter`` as its only and last write, before any
    other (aiohttp still holds the head), as a view of a complete one-event answer does."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        assert request.transport is not None
        writer = ClientWriter(response, request.transport, 30.0, request.writer)
        await writer.write(body, last=True)
        await response.write_eof()  # nothing left to send: the end went with the write
        return response

    app = web.Application()
    app.router.add_get("/mcp", handler)
    return app


async def test_a_last_write_carries_the_head_and_the_body_end_and_the_connection_stays_usable(
    serve: ServeApp,
) -> None:
    body = b"id: c\ndata: {}\n\n"
    url = await serve(_one_write_app(body))
    port = int(url.split(":")[2].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):  # the same keep-alive connection: the body's end was framed once, as it must be
            writer.write(b"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
            chunked = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
            assert chunked == b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    finally:
        writer.close()
