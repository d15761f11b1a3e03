"""Held GETs (``mcpresume.heldget``): the long-lived upstream GET streams, read through h11.

Over real loopback sockets against a raw server that sends exactly the bytes a test scripts (framing a real
HTTP server would never get wrong on demand: a cut chunk, a broken head, a 1xx before the answer), under
asyncio's loop and under uvloop (whose transports are not ``asyncio.Transport`` subclasses); and, for
arbitrary framing and arbitrary TCP splits, the protocol object fed directly (hypothesis).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.errors import BadRequest, UpstreamBadResponse, UpstreamTimeout, UpstreamUnreachable
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.heldget import HIGH_WATER, HeldGet, NotHTTP11
from mcpresume.sse import SSEEvent
from mcpresume.upstream import Upstream
from tests.support.proxy import ScriptedClient, running_proxy, sse_events

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class RawServer:
    """Answers every connection with ``script``; keeps each request head it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        self.heads.append(await reader.readuntil(b"\r\n\r\n"))
        with contextlib.suppress(ConnectionError):
            await self.script(reader, writer)

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Upstream(f"http://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.writers:
            writer.transport.abort()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def sends(*parts: bytes, close: bool = True) -> Script:
    """A script writing ``parts`` one write each (so they arrive split), then closing or holding."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0)
        if close:
            writer.close()
        else:
            await reader.read()  # until the proxy side closes

    return script


async def read_all(held: HeldGet) -> bytes:
    return b"".join([chunk async for chunk in held.iter_any()])


async def test_chunked_stream_arrives_whole_in_order_and_the_request_is_what_the_upstream_should_see() -> (
    None
):
    events = [b": hi\n\n", b"data: 1\n\n", b"data: " + b"x" * 5000 + b"\n\n", b"data: caf\xc3\xa9\n\n"]
    wire = SSE_HEAD + chunked(*events)
    server = RawServer(sends(wire[:10], wire[10:70], wire[70:75], wire[75:]))
    async with server as upstream:
        headers = [
            ("Accept", "text/event-stream"),
            ("Mcp-Session-Id", "s-1"),
            ("Accept-Encoding", "gzip"),  # not asked of the upstream: the proxy re-frames what it reads
            ("Connection", "keep-alive"),
            ("X-Note", "caf\xe9 \udce9"),  # as aiohttp decodes a header: UTF-8, undecodable bytes kept
        ]
        held = await upstream.open_get("/mcp?x=1", headers)
        assert (held.status, held.reason, held.content_type, held.content_length) == (
            200,
            "OK",
            "text/event-stream",
            None,
        )
        assert held.headers["Transfer-Encoding"] == "chunked"
        assert await read_all(held) == b"".join(events)
        assert held.headers == {}  # reading the body let go of the head
        held.release()
    head = server.heads[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"GET /mcp?x=1 HTTP/1.1"
    fields = [tuple(line.split(b": ", 1)) for line in lines[1:] if line]
    assert fields == [
        (b"Host", b"127.0.0.1:%d" % int(upstream.url.port or 0)),
        (b"Accept", b"text/event-stream"),
        (b"Mcp-Session-Id", b"s-1"),
        (b"X-Note", "café ".encode() + b"\xe9"),
        (b"Accept-Encoding", b"identity"),
        (b"Connection", b"close"),
    ]


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 7\r\n\r\nno GETs", b"no GETs"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2\n\n",
            b"data: 1\n\ndata: 2\n\n",
        ),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
    ids=["content-length", "until-close", "1xx-then-204"],
)
async def test_every_framing_of_an_answer_ends_where_http_says(answer: bytes, body: bytes) -> None:
    async with RawServer(sends(answer)) as upstream:
        held = await upstream.open_get("/mcp", [])
        assert held.status in (405, 200, 204)
        if held.status == 405:
            assert (held.content_length, held.content_type) == (7, "application/octet-stream")
        assert await read_all(held) == body
        assert await held.readany() == b""  # the end stays the end
        held.release()


async def test_a_cut_in_the_middle_of_a_chunk_delivers_what_arrived_then_fails() -> None:
    async with RawServer(sends(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n20\r\ndata: tr")) as upstream:
        held = await upstream.open_get("/mcp", [])
        received = b""
        with pytest.raises(ConnectionResetError, match="before the end"):
            while chunk := await held.readany():
                received += chunk
        assert received == b"data: 1\n\ndata: tr"
        held.release()


async def test_broken_framing_after_the_head_is_not_http11() -> None:
    async with RawServer(sends(SSE_HEAD + b"zz\r\nnot a chunk size\r\n", close=False)) as upstream:
        held = await upstream.open_get("/mcp", [])
        with pytest.raises(NotHTTP11, match=r"not valid HTTP/1\.1"):
            await held.readany()
        held.release()


@pytest.mark.parametrize(
    ("script", "error", "message"),
    [
        (sends(b"HTTP/1.1 abc\r\n\r\n"), UpstreamBadResponse, r"not valid HTTP/1\.1"),
        (sends(b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000), UpstreamBadResponse, r"not valid HTTP/1\.1"),
        (sends(b"HTTP/1.1 200 OK\r\nContent-Ty"), UpstreamUnreachable, "closed the connection before"),
        (sends(close=False), UpstreamTimeout, r"no response headers within 0\.2 s"),
    ],
    ids=["bad-status-line", "head-over-64k", "closed-in-head", "no-head"],
)
async def test_an_answer_without_a_usable_head_is_a_proxy_error(
    script: Script, error: type[Exception], message: str
) -> None:
    async with RawServer(script) as upstream:
        upstream.first_byte_timeout = 0.2
        with pytest.raises(error, match=message):
            await upstream.open_get("/mcp", [])


async def test_nothing_listening_is_unreachable_and_a_header_with_a_line_break_is_not_forwarded() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, with nothing listening on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    upstream = Upstream(f"http://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)
    with pytest.raises(UpstreamUnreachable, match="cannot connect to the upstream"):
        await upstream.open_get("/mcp", [])
    with pytest.raises(BadRequest, match="cannot be forwarded"):
        await upstream.open_get("/mcp", [("X-Bad", "a\r\nInjected: yes")])


async def test_reading_pauses_at_high_water_and_resumes_when_the_reader_takes_the_backlog() -> None:
    piece = b"data: " + b"z" * 4090 + b"\n\n"
    total = 1024 * 1024 // len(piece)

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for _ in range(total):
            writer.write(chunked(piece)[:-5])  # one chunk each, the terminator at the end
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with RawServer(flood) as upstream:
        held = await upstream.open_get("/mcp", [])
        while not held._paused:  # the upstream floods; nobody reads
            await asyncio.sleep(0.01)
        assert HIGH_WATER < held._buffered < HIGH_WATER + 512 * 1024
        await asyncio.sleep(0.05)
        backlog = held._buffered
        assert held._paused and held._buffered == backlog  # paused: nothing more is taken in
        body = await read_all(held)
        assert body == piece * total
        held.release()


def test_a_held_get_under_uvloop() -> None:
    """The proxy runs on uvloop, whose transports are not asyncio.Transport subclasses."""

    async def main() -> bytes:
        async with RawServer(sends(SSE_HEAD, chunked(b"data: 1\n\n"))) as upstream:
            held = await upstream.open_get("/mcp", [])
            body = await read_all(held)
            held.release()
            return body

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == b"data: 1\n\n"


def test_the_proxy_holds_a_standalone_stream_of_the_sdk_server_under_uvloop() -> None:
    """End to end as the daemon runs (uvloop): the official SDK server behind the proxy, a standalone GET
    answered with the proxy's priming event once the upstream's GET is held, then released on DELETE."""

    async def main() -> tuple[int, SSEEvent, int]:
        async with (
            serve_example_upstream() as url,
            running_proxy(url) as proxy,
            aiohttp.ClientSession() as http,
        ):
            client = ScriptedClient(http, proxy.url)
            await client.initialize()
            get = await http.get(proxy.url, headers=client.headers(Accept="text/event-stream"))
            priming = await anext(sse_events(get))
            pumps = len(proxy.ctx.pumps)
            async with http.delete(proxy.url, headers=client.headers()) as deleted:
                assert deleted.status == 200
            get.close()
            return get.status, priming, pumps

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        status, priming, pumps = runner.run(main())
    assert status == 200
    assert priming.data == b"" and priming.id is not None and priming.id.count(b"-") == 2  # epoch-stream-seq
    assert pumps == 1  # the upstream GET, held by its pump


# -- the protocol fed directly: any framing, any TCP split ---------------------------------------------------


class _Transport:
    """Records what the protocol asks of its transport."""

    def __init__(self) -> None:
        self.written = b""
        self.paused = False
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    chunked_framing=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    read_between=st.booleans(),
)
def test_any_framing_split_anywhere_reads_back_the_body(
    pieces: list[bytes], chunked_framing: bool, cuts: list[int], read_between: bool
) -> None:
    body = b"".join(pieces)
    if chunked_framing:
        wire = SSE_HEAD + chunked(*pieces)
    else:
        wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def feed() -> tuple[bytes, Any]:
        held = HeldGet("upstream:80", "/mcp", [])
        transport = _Transport()
        held.connection_made(transport)  # type: ignore[arg-type]
        assert transport.written.startswith(b"GET /mcp HTTP/1.1\r\nHost: upstream:80\r\n")
        received = b""
        head = asyncio.ensure_future(held.head())
        for segment in _split(wire, cuts):
            held.data_received(segment)
            await asyncio.sleep(0)
            if read_between and head.done() and held._chunks:
                received += await held.readany()
        await head
        received += await _drain(held)
        held.connection_lost(None)
        return received, await held.readany()

    received, end = asyncio.run(feed())
    assert received == body
    assert end == b""


async def _drain(held: HeldGet) -> bytes:
    out = b""
    while held._chunks or not held._ended:
        out += await held.readany()
    return out
