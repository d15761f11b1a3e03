"""Held GETs (``mcpresume.streams.heldget``): the long-lived upstream GET streams, read through h11.

Over real loopback sockets against a raw server that sends exactly the bytes a test scripts (framing a real
HTTP server would never get wrong on demand: a cut chunk, a broken head, a 1xx before the answer), on both
loops as every async test (uvloop's transports are not ``asyncio.Transport`` subclasses: a first version
failed there only); and, for arbitrary framing and arbitrary TCP splits, the protocol object fed directly
(hypothesis).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.errors import BadRequest, UpstreamTimeout, UpstreamUnreachable
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.streams.answer import HIGH_WATER, NotHTTP11
from mcpresume.streams.heldget import HeldGet
from mcpresume.streams.upstream import Upstream
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, running_proxy, sse_events

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class RawServer:
    """Answers every connection with ``script``; keeps each request head it read, and sees the proxy side
    close a connection the script holds (``closed``)."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.heads: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.closed = asyncio.Event()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        self.heads.append(await reader.readuntil(b"\r\n\r\n"))
        with contextlib.suppress(ConnectionError):
            await self.script(reader, writer)
            if not writer.is_closing() and await reader.read() == b"":
                self.closed.set()

    async def proxy_side_closes(self) -> None:
        async with asyncio.timeout(10):
            await self.closed.wait()

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        scheme = "https" if self.tls else "http"
        return Upstream(f"{scheme}://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.writers:
            writer.transport.abort()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def sends(*parts: bytes, close: bool = True) -> Script:
    """A script writing ``parts`` one write each (so they arrive split), then closing, or holding the
    connection until the proxy side closes it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0)
        if close:
            writer.close()

    return script


async def read_all(held: HeldGet) -> bytes:
    return b"".join([chunk async for chunk in held.iter_any()])


async def test_chunked_stream_arrives_whole_in_order_and_the_request_is_what_the_upstream_should_see() -> (
    None
):
    events = [b": hi\n\n", b"data: 1\n\n", b"data: " + b"x" * 5000 + b"\n\n", b"data: caf\xc3\xa9\n\n"]
    wire = SSE_HEAD + chunked(*events)
    server = RawServer(sends(wire[:10], wire[10:70], wire[70:75], wire[75:], close=False))
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
        await server.proxy_side_closes()
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
    ("answer", "status", "length", "body"),
    [
        (b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 7\r\n\r\nno GETs", 405, 7, b"no GETs"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2\n\n",
            200,
            None,
            b"data: 1\n\ndata: 2\n\n",
        ),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", 204, None, b""),
    ],
    ids=["content-length", "until-close", "1xx-then-204"],
)
async def test_every_framing_of_an_answer_ends_where_http_says(
    answer: bytes, status: int, length: int | None, body: bytes
) -> None:
    async with RawServer(sends(answer)) as upstream:
        held = await upstream.open_get("/mcp", [])
        assert (held.status, held.content_length) == (status, length)
        if status == 405:
            assert held.content_type == "application/octet-stream"  # none sent: as aiohttp says
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
        # as aiohttp's client maps a response it cannot parse: upstream_unreachable, "request failed"
        (sends(b"HTTP/1.1 abc\r\n\r\n"), UpstreamUnreachable, r"failed: .*not valid HTTP/1\.1"),
        (sends(b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000), UpstreamUnreachable, r"not valid HTTP/1\.1"),
        (sends(b"HTTP/1.1 200 OK\r\nContent-Ty"), UpstreamUnreachable, "closed the connection before"),
    ],
    ids=["bad-status-line", "head-over-64k", "closed-in-head"],
)
async def test_an_answer_without_a_usable_head_is_a_proxy_error(
    script: Script, error: type[Exception], message: str
) -> None:
    async with RawServer(script) as upstream:
        with pytest.raises(error, match=message):
            await upstream.open_get("/mcp", [])


async def test_no_head_in_time_is_a_timeout_and_the_connection_is_closed() -> None:
    server = RawServer(sends(close=False))
    async with server as upstream:
        upstream.first_byte_timeout = 0.2
        with pytest.raises(UpstreamTimeout, match=r"no response headers within 0\.2 s"):
            await upstream.open_get("/mcp", [])
        await server.proxy_side_closes()


async def test_a_get_cancelled_while_it_waits_for_the_head_closes_its_connection() -> None:
    server = RawServer(sends(close=False))
    async with server as upstream:
        opening = asyncio.ensure_future(upstream.open_get("/mcp", []))
        await until(lambda: bool(server.heads))  # the request is in, the head never comes
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        await server.proxy_side_closes()


async def test_a_parked_read_cancelled_leaves_the_data_for_the_next_read_and_logs_nothing() -> None:
    go = asyncio.Event()

    async def later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        await go.wait()
        writer.write(b"9\r\ndata: 1\n\n\r\n")

    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: errors.append(context))
    server = RawServer(later)
    async with server as upstream:
        held = await upstream.open_get("/mcp", [])
        parked = held.readany()
        with pytest.raises(RuntimeError, match="another read"):
            held.readany()  # one reader at a time
        reading = asyncio.ensure_future(parked)
        await asyncio.sleep(0)
        reading.cancel()  # a pump cancelled while it waits (session end, shutdown)
        with pytest.raises(asyncio.CancelledError):
            await reading
        go.set()
        assert await held.readany() == b"data: 1\n\n"
        held.release()
    assert errors == []


async def test_nothing_listening_is_unreachable_and_a_header_with_a_line_break_is_not_forwarded() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, with nothing listening on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    upstream = Upstream(f"http://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)
    with pytest.raises(UpstreamUnreachable, match="cannot connect to the upstream"):
        await upstream.open_get("/mcp", [])
    with pytest.raises(BadRequest, match="cannot be forwarded") as refused:
        await upstream.open_get("/mcp", [("Authorization", "Bearer x\r\nInjected: yes")])
    assert "Bearer" not in refused.value.message  # the value may be a credential: never in a message


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
        await until(lambda: held._paused)  # the upstream floods; nobody reads
        assert HIGH_WATER < held._buffered < HIGH_WATER + 512 * 1024
        await asyncio.sleep(0.05)
        backlog = held._buffered
        assert held._paused and held._buffered == backlog  # paused: nothing more is taken in
        body = await read_all(held)
        assert body == piece * total
        held.release()


async def test_an_https_upstream_is_verified_and_held(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with RawServer(sends(SSE_HEAD, chunked(b"data: 1\n\n")), tls) as upstream:
        with pytest.raises(UpstreamUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await upstream.open_get("/mcp", [])  # not trusted by the system's store
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted, as an operator would add a private CA
    server = RawServer(sends(SSE_HEAD, chunked(b"data: 1\n\n")), tls)
    async with server as upstream:
        held = await upstream.open_get("/mcp", [])
        assert await read_all(held) == b"data: 1\n\n"
        held.release()
    assert server.heads[-1].split(b"\r\n")[1] == b"Host: 127.0.0.1:%d" % int(upstream.url.port or 0)


async def test_the_proxy_holds_a_standalone_stream_of_the_sdk_server() -> None:
    """End to end: the official SDK server behind the proxy, a standalone GET answered with the proxy's
    priming event once the upstream's GET is held, then released on DELETE."""
    async with (
        serve_example_upstream() as url,
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        get = await http.get(proxy.url, headers=client.headers(Accept="text/event-stream"))
        priming = await anext(sse_events(get))
        assert len(proxy.ctx.pumps) == 1  # the upstream GET, held by its pump
        async with http.delete(proxy.url, headers=client.headers()) as deleted:
            assert deleted.status == 200
        get.close()
    assert get.status == 200
    assert priming.data == b"" and priming.id is not None and priming.id.count(b"-") == 2  # epoch-stream-seq


async def test_an_upstream_without_a_standalone_stream_answers_through_the_proxy(serve: ServeApp) -> None:
    """A server that offers no standalone stream answers the GET 405 (the spec's way): the client gets that
    answer as the upstream gave it, and the session lives on."""
    upstream = pb.Playbook()
    upstream.on(None, pb.status(202))  # every other POST
    upstream.on("initialize", pb.initialize(name="no-get"))
    no_get = pb.status(405, "no standalone stream", headers={"Allow": "POST, DELETE"})
    upstream.on(None, no_get, http="GET")
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        async with http.get(proxy.url, headers=client.headers(Accept="text/event-stream")) as answer:
            assert (answer.status, answer.headers["Allow"], await answer.text()) == (
                405,
                "POST, DELETE",
                "no standalone stream",
            )
        assert await proxy.ctx.store.has_session(pb.SESSION)
        assert len(proxy.ctx.pumps) == 0


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


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    framing=st.sampled_from(["chunked", "length", "close"]),
    hints=st.booleans(),
    splits=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    cut=st.none() | st.integers(min_value=0, max_value=4000),
    read_between=st.booleans(),
)
def test_any_framing_split_anywhere_reads_back_the_body_or_says_it_was_cut(
    pieces: list[bytes], framing: str, hints: bool, splits: list[int], cut: int | None, read_between: bool
) -> None:
    """The body read back is the body sent, for any framing and any TCP split; a connection that ends early
    gives what arrived, then ``ConnectionResetError`` (except read-until-close, where the end IS the close);
    one that ends in the head fails the head."""
    body = b"".join(pieces)
    head = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" if hints else b""
    if framing == "chunked":
        head += SSE_HEAD
        wire = head + chunked(*pieces)
    elif framing == "length":
        head += b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        wire = head + body
    else:
        head += b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        wire = head + body
    sent = wire if cut is None else wire[: cut % (len(wire) + 1)]
    complete = len(sent) == len(wire)

    async def feed() -> tuple[bytes, BaseException | None, BaseException | None]:
        held = HeldGet("upstream:80", "/mcp", [])
        transport = _Transport()
        held.connection_made(transport)  # type: ignore[arg-type]
        assert transport.written.startswith(b"GET /mcp HTTP/1.1\r\nHost: upstream:80\r\n")
        opening = asyncio.ensure_future(held.head())
        received = b""
        for segment in _split(sent, splits):
            held.data_received(segment)
            await asyncio.sleep(0)
            if read_between and opening.done() and held._chunks:
                received += await held.readany()
        held.connection_lost(None)  # the upstream closes (after the whole answer, or early)
        await asyncio.wait([opening])
        if opening.exception() is not None:
            return received, opening.exception(), None
        try:
            while chunk := await held.readany():
                received += chunk
        except ConnectionResetError as error:
            return received, None, error
        return received, None, None

    received, head_error, body_error = asyncio.run(feed())
    if len(sent) < len(head):
        assert isinstance(head_error, ConnectionResetError) and received == b""
        return
    assert head_error is None
    assert body.startswith(received)
    if complete or framing == "close":
        assert received == body[: len(sent) - len(head)] and body_error is None
    else:
        assert isinstance(body_error, ConnectionResetError)
