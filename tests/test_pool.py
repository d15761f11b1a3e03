"""The pooled client (``mcpresume.streams.pool``) behind ``Upstream.request(decoded=True)``: the requests
whose answers the proxy reads.

Over real loopback sockets against a raw keep-alive server that answers each request with the bytes a test
scripts (framing, closes and silences a real server never produces on demand), on both loops as every async
test; and, for any framing and any TCP split, the connection fed directly (hypothesis).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import ssl
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.errors import BadRequest, UpstreamBadResponse, UpstreamTimeout, UpstreamUnreachable
from mcpresume.streams import pool as pool_module
from mcpresume.streams.answer import HIGH_WATER
from mcpresume.streams.pool import Connection, Pool, PooledAnswer
from mcpresume.streams.upstream import Upstream
from tests.support.poll import until

# What a script does with one request: the answer's bytes to write (one write each), or None to stay silent
# until the client side closes the connection.
Script = Callable[[int, bytes, bytes], Awaitable[list[bytes] | None]]
CALL = b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}'
HEADERS = [("content-type", "application/json"), ("accept", "application/json, text/event-stream")]


def length(body: bytes, *fields: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"".join(f + b"\r\n" for f in fields)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class KeptServer:
    """Reads requests one after another on each connection (head, then a Content-Length body) and answers
    each as ``script`` says; records the requests and counts the connections."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.closed_by_client = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        size = int(line.split(b":", 1)[1])
                body = await reader.readexactly(size)
                self.requests.append((head, body))
                parts = await self.script(len(self.requests) - 1, head, body)
                if parts is None:
                    with contextlib.suppress(ConnectionError):
                        await reader.read()
                    self.closed_by_client += 1
                    return
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0)
                if parts and parts[-1] == b"":
                    break
        writer.close()

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        scheme = "https" if self.tls else "http"
        upstream = Upstream(f"{scheme}://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)
        await upstream.start()
        self.upstream = upstream
        return upstream

    async def __aexit__(self, *exc: object) -> None:
        await self.upstream.close()
        for writer in self.writers:
            writer.transport.abort()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def answers(*parts: bytes) -> Script:
    """Every request answered with ``parts`` (one write each; a last ``b""`` closes the connection)."""

    async def script(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return list(parts)

    return script


async def call(
    upstream: Upstream, headers: list[tuple[str, str]] | None = None
) -> tuple[PooledAnswer, bytes]:
    answer = await upstream.request("POST", "/mcp?x=1", headers or HEADERS, CALL, decoded=True)
    body = await answer.read()
    answer.release()
    return answer, body


async def test_calls_go_one_after_another_on_one_kept_connection_as_the_upstream_should_see_them() -> None:
    async def script(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return [length(b'{"a":%d}' % (index + 1))]

    server = KeptServer(script)
    async with server as upstream:
        headers = [
            *HEADERS,
            ("host", "client.example"),  # the pool's own: Host is the upstream's authority
            ("content-length", "999"),  # ... and the framing is the pool's
            ("connection", "keep-alive"),
            ("accept-encoding", "gzip"),  # a read answer is asked for as is
            ("x-note", "caf\xe9 \udce9"),  # as aiohttp decodes a header: UTF-8, undecodable bytes kept
        ]
        first, body1 = await call(upstream, headers)
        _, body2 = await call(upstream, headers)
    assert (first.status, first.reason, first.content_type, first.content_length) == (
        200,
        "OK",
        "application/json",
        7,
    )
    assert (body1, body2, server.connections) == (b'{"a":1}', b'{"a":2}', 1)
    head, body = server.requests[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /mcp?x=1 HTTP/1.1"
    fields = [tuple(line.split(b": ", 1)) for line in lines[1:] if line]
    assert fields == [
        (b"Host", b"127.0.0.1:%d" % int(upstream.url.port or 0)),
        (b"content-type", b"application/json"),
        (b"accept", b"application/json, text/event-stream"),
        (b"x-note", "café ".encode() + b"\xe9"),
        (b"Accept-Encoding", b"identity"),
        (b"Content-Length", b"%d" % len(CALL)),
    ]
    assert body == CALL


@pytest.mark.parametrize(
    ("wire", "body", "kept"),
    [
        (length(b"{}"), b"{}", True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(b"data: 1\n\n", b"data: 2\n\n"),
            b"data: 1\n\ndata: 2\n\n",
            True,
        ),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + length(b"{}"),
            b"{}",
            True,
        ),
        (b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n", b"", True),
        (length(b"{}", b"Connection: close"), b"{}", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", b"{}", False),
    ],
    ids=["content-length", "chunked", "1xx-then-answer", "202-empty", "connection-close", "http-1.0"],
)
async def test_every_framing_ends_where_http_says_and_the_connection_is_kept_only_when_it_may_be(
    wire: bytes, body: bytes, kept: bool
) -> None:
    server = KeptServer(answers(wire))
    async with server as upstream:
        _, first = await call(upstream)
        _, second = await call(upstream)
    assert (first, second) == (body, body)
    assert server.connections == (1 if kept else 2)


async def test_a_body_framed_by_the_close_is_read_to_it_and_its_connection_not_kept() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
    server = KeptServer(answers(wire, b'{"a":', b"1}", b""))
    async with server as upstream:
        _, body = await call(upstream)
        _, again = await call(upstream)
    assert (body, again, server.connections) == (b'{"a":1}', b'{"a":1}', 2)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_body_compressed_anyway_is_read_inflated(coding: str) -> None:
    body = b'{"result":"' + b"x" * 5000 + b'"}'
    packed = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
    server = KeptServer(answers(length(packed, b"Content-Encoding: " + coding.encode())))
    async with server as upstream:
        answer, read = await call(upstream)
        _, again = await call(upstream)
    assert (read, again) == (body, body)
    assert "Content-Encoding" not in answer.headers and answer.content_length is None
    assert server.connections == 1


async def test_an_encoding_not_asked_for_nor_readable_is_a_bad_response_and_the_connection_closed() -> None:
    server = KeptServer(answers(length(b"\x1b\x00", b"Content-Encoding: br")))
    async with server as upstream:
        with pytest.raises(UpstreamBadResponse) as raised:
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        assert raised.value.data()["content_encoding"] == "br"
        with pytest.raises(UpstreamBadResponse):
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
    assert server.connections == 2


async def test_a_corrupt_compressed_body_fails_its_read_and_is_not_reused() -> None:
    server = KeptServer(answers(length(b"not gzip at all", b"Content-Encoding: gzip")))
    async with server as upstream:
        answer = await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        with pytest.raises(ConnectionError, match="cannot be decoded"):
            await answer.read()
        answer.release()
        answer = await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        answer.release()
    assert server.connections == 2


async def test_no_head_in_time_is_a_timeout_that_may_have_run_and_closes_the_connection() -> None:
    async def silent(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return None

    server = KeptServer(silent)
    async with server as upstream:
        upstream.first_byte_timeout = 0.2
        with pytest.raises(UpstreamTimeout):
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        await until(lambda: server.closed_by_client == 1, what="the connection closed")


async def test_a_slow_body_after_the_head_is_not_timed_out() -> None:
    async def slow(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        await asyncio.sleep(0)
        return [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", *await later()]

    async def later() -> list[bytes]:
        return [b"3\r\nabc\r\n", b"0\r\n\r\n"]

    server = KeptServer(slow)
    async with server as upstream:
        upstream.first_byte_timeout = 0.2
        answer = await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        await asyncio.sleep(0.4)  # past the first-byte timeout: the head came in time
        assert await answer.read() == b"abc"
        answer.release()


async def test_failures_say_whether_the_request_may_have_run() -> None:
    async def closes(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return [b""] if index == 0 else [b"SSH-2.0-OpenSSH\r\n\r\n"]

    server = KeptServer(closes)
    async with server as upstream:
        with pytest.raises(UpstreamUnreachable) as closed:
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        with pytest.raises(UpstreamUnreachable, match=r"not valid HTTP/1\.1") as garbled:
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        port = upstream.url.port
    assert not closed.value.unsent and not garbled.value.unsent
    nowhere = Upstream(f"http://127.0.0.1:{port}/mcp", connect_timeout=5, first_byte_timeout=5)
    await nowhere.start()
    try:
        with pytest.raises(UpstreamUnreachable, match="cannot connect") as refused:
            await nowhere.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        assert refused.value.unsent
    finally:
        await nowhere.close()


async def test_a_line_break_in_a_header_is_not_forwarded_and_nothing_is_sent() -> None:
    server = KeptServer(answers(length(b"{}")))
    async with server as upstream:
        for bad in ("a\r\nX-Injected: 1", "a\nb", "a\0b"):
            with pytest.raises(BadRequest):
                await upstream.request("POST", "/mcp", [("x-note", bad)], CALL, decoded=True)
        with pytest.raises(BadRequest):
            await upstream.request("POST", "/mcp HTTP/1.1\r\nX: y", HEADERS, CALL, decoded=True)
    assert server.connections == 0


async def test_a_call_cancelled_while_waiting_closes_its_connection_the_next_gets_its_own_answer() -> None:
    release = asyncio.Event()

    async def script(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        if index == 0:
            await release.wait()
            return [length(b'{"late":1}')]
        return [length(b'{"own":2}')]

    server = KeptServer(script)
    async with server as upstream:
        waiting = asyncio.ensure_future(upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True))
        await until(lambda: len(server.requests) == 1)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        release.set()
        _, body = await call(upstream)
    assert body == b'{"own":2}' and server.connections == 2


async def test_an_answer_released_before_its_end_closes_its_connection_and_wakes_its_reader() -> None:
    async def script(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n"]
            if index == 0
            else [length(b"{}")]
        )

    server = KeptServer(script)
    async with server as upstream:
        answer = await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        assert await answer.readany() == b"first"
        reading = answer.readany()
        answer.release()
        with pytest.raises(ConnectionResetError):
            await reading
        _, body = await call(upstream)
    assert body == b"{}" and server.connections == 2


async def test_a_kept_connection_the_upstream_closed_or_kept_too_long_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = KeptServer(answers(length(b"{}")))
    async with server as upstream:
        await call(upstream)
        server.writers[0].close()  # the upstream's idle timeout
        await until(lambda: upstream._pool is not None and upstream._pool.idle[0].closed)
        await call(upstream)
        assert server.connections == 2
        monkeypatch.setattr(pool_module, "KEEPALIVE", 0.0)
        await asyncio.sleep(0.01)
        await call(upstream)  # the idle one is older than KEEPALIVE: closed, a new one opened
    assert server.connections == 3


async def test_bytes_after_the_answer_end_drop_the_connection() -> None:
    server = KeptServer(answers(length(b"{}") + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    async with server as upstream:
        await call(upstream)
        await until(lambda: not upstream._pool or not upstream._pool.idle or upstream._pool.idle[0].closed)
        await call(upstream)
    assert server.connections == 2


async def test_an_oversized_head_is_not_http11() -> None:
    huge = b"X-Big: " + b"a" * 70_000
    server = KeptServer(answers(length(b"{}", huge)))
    async with server as upstream:
        with pytest.raises(UpstreamUnreachable, match="head larger"):
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)


async def test_reading_pauses_at_high_water_for_a_long_answer() -> None:
    piece = b"data: " + b"x" * 16_000 + b"\n\n"
    total = 40

    async def script(index: int, head: bytes, body: bytes) -> list[bytes] | None:
        return [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(*[piece] * total)]

    server = KeptServer(script)
    async with server as upstream:
        answer = await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        await until(lambda: answer._paused, what="reading paused")
        assert answer._buffered > HIGH_WATER
        assert await answer.read() == piece * total
        answer.release()
        _, again = await call(upstream)  # resumed and kept
    assert again == piece * total and server.connections == 1


async def test_an_https_upstream_is_verified_and_its_connections_kept(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with KeptServer(answers(length(b"{}")), tls) as upstream:
        with pytest.raises(UpstreamUnreachable, match="CERTIFICATE_VERIFY_FAILED") as untrusted:
            await upstream.request("POST", "/mcp", HEADERS, CALL, decoded=True)
        assert untrusted.value.unsent
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server = KeptServer(answers(length(b"{}")), tls)
    async with server as upstream:
        assert (await call(upstream))[1] == b"{}"
        assert (await call(upstream))[1] == b"{}"
    assert server.connections == 1


# -- the connection fed directly: any framing, any TCP split -------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.aborted

    def close(self) -> None:
        self.aborted = True

    def abort(self) -> None:
        self.aborted = True


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=6),
    framing=st.sampled_from(["chunked", "length", "close"]),
    hints=st.booleans(),
    splits=st.lists(st.integers(min_value=0, max_value=3000), max_size=10),
    cut=st.none() | st.integers(min_value=0, max_value=3000),
)
def test_any_framing_split_anywhere_reads_back_the_body_or_says_it_was_cut(
    pieces: list[bytes], framing: str, hints: bool, splits: list[int], cut: int | None
) -> None:
    body = b"".join(pieces)
    head = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" if hints else b""
    if framing == "chunked":
        head += b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        wire = head + chunked(*pieces)
    elif framing == "length":
        head += b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        wire = head + body
    else:
        head += b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        wire = head + body
    sent = wire if cut is None else wire[: cut % (len(wire) + 1)]
    points = sorted({0, len(sent), *(c % (len(sent) + 1) for c in splits)})

    async def feed() -> tuple[bytes, BaseException | None, BaseException | None, bool]:
        async def connect(protocol: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
            made = protocol()
            made.connection_made(transport)  # type: ignore[arg-type]
            return made

        transport = _Transport()
        pool = Pool("upstream:80", connect)
        sending = asyncio.ensure_future(pool.send(b"POST / HTTP/1.1\r\n\r\n", pool.loop.time() + 60))
        await asyncio.sleep(0)
        (connection,) = pool._open
        assert isinstance(connection, Connection)
        for a, b in itertools.pairwise(points):
            connection.data_received(sent[a:b])
            await asyncio.sleep(0)
        if not (framing != "close" and len(sent) == len(wire)):
            connection.connection_lost(None)  # the upstream closes (early, or to end a body)
        await asyncio.wait([sending])
        if sending.exception() is not None:
            return b"", sending.exception(), None, False
        answer = sending.result()
        received = b""
        try:
            while chunk := await answer.readany():
                received += chunk
        except ConnectionResetError as error:
            return received, None, error, False
        answer.release()
        return received, None, None, bool(pool.idle)

    received, head_error, body_error, kept = asyncio.run(feed())
    if len(sent) < len(head):
        assert isinstance(head_error, ConnectionResetError) and received == b""
        return
    assert head_error is None and body.startswith(received)
    complete = len(sent) == len(wire)
    if complete or framing == "close":
        assert received == body[: len(sent) - len(head)] and body_error is None
        assert kept == (framing != "close")  # a body framed by the close ends its connection
    else:
        assert isinstance(body_error, ConnectionResetError)
