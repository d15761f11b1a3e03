"""Limits and admission checks, over HTTP against the real proxy (and, for the window caps, at the store).

Each refusal is checked for its status, its JSON-RPC error body (``error.data.reason``), its metric where one
exists, and that nothing else broke: another session keeps working afterwards. A playbook upstream
(``tests/support/playbook.py``) produces what the SDK server can't on demand (a stream held open, an HTML
answer, a 10 KB event, a request that gets no headers) and records what reached it, so "not forwarded" is
checked, not assumed; paths other than the MCP endpoint have an aiohttp upstream of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.cursor import new_epoch
from mcpresume.core.flow import Guard
from mcpresume.core.headers import MAX_SESSION_ID_LEN
from mcpresume.core.session import NewEvent, SessionState, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import Event, EventKind, EvictReason, Window, WindowLimits
from mcpresume.process.local import LocalSessions
from mcpresume.process.logs import log_id
from mcpresume.store.memory import MemoryStore
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy
from tests.support.sdk import result_text, sdk_session

TIMEOUT = 10.0  # generous bound on anything a test awaits (a loaded 2-core box)


# -- fixtures and helpers --------------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def tool_upstream() -> pb.Playbook:
    """The upstream of these checks: a distinct session id per ``initialize``; each ``tools/call`` behaves as
    named (``params.name``), its result's text that name.

    * ``hold``: an SSE stream with one progress notification, then the response once gate ``hold`` opens.
    * ``stall``: no answer at all (not even headers) until gate ``stall`` opens, then an SSE response.
    * ``html``: ``200 text/html`` (not an answer the protocol allows for a request).
    * ``huge``: an SSE stream whose first event carries a 10 KB data line, then the response.
    * anything else: an SSE stream with the response at once.

    A GET opens a standalone SSE stream that stays open until gate ``standalone`` opens. ``release`` opens
    every gate; what reached the upstream is in its record (``requests``, ``tool_calls``).
    """
    upstream = pb.Playbook(session_ids=[f"tool-session-{n}" for n in range(1, 100)])
    response = pb.event(pb.result(_named), name="message")
    progress = pb.event(lambda seen: pb.progress(1, progressToken=seen.id, total=2), name="message")
    html = pb.status(200, "<html>not MCP</html>", headers={"Content-Type": "text/html; charset=utf-8"})
    upstream.on("initialize", pb.initialize(name="tools"))
    upstream.on("tools/call", pb.sse(response))
    upstream.on("tools/call", pb.sse(progress, pb.wait("hold"), response), when=_tool("hold"))
    upstream.on("tools/call", pb.held("stall", pb.sse(response)), when=_tool("stall"))
    upstream.on("tools/call", html, when=_tool("html"))
    upstream.on("tools/call", pb.sse(pb.event(b"x" * 10240, name="message"), response), when=_tool("huge"))
    upstream.on(None, pb.sse(pb.wait("standalone")), http="GET")
    return upstream


def _tool(name: str) -> Callable[[pb.Seen], bool]:
    return lambda seen: seen.params.get("name") == name


def _named(seen: pb.Seen) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": seen.params.get("name")}], "isError": False}


def release(upstream: pb.Playbook) -> None:
    """Open every gate of ``tool_upstream``: held calls answer, standalone streams end."""
    for gate in ("hold", "stall", "standalone"):
        upstream.open(gate)


def tool_calls(upstream: pb.Playbook) -> list[str]:
    """The tool names of the tools/call requests received, in order."""
    return [seen.params["name"] for seen in upstream.requests("tools/call")]


def last_authorization(upstream: pb.Playbook) -> str | None:
    """The ``Authorization`` header of the last POST received."""
    return upstream.requests(http="POST")[-1].header("Authorization")


class Client(ScriptedClient):
    """``ScriptedClient`` that sends ``extra`` headers (Origin, Host, ...) on every request it makes."""

    def __init__(self, http: aiohttp.ClientSession, url: str, extra: dict[str, str] | None = None) -> None:
        super().__init__(http, url)
        self.extra = extra or {}

    def headers(self, **extra: str) -> dict[str, str]:
        return super().headers(**{**self.extra, **extra})


def same_session(client: ScriptedClient, extra: dict[str, str] | None = None) -> Client:
    """Another client object on ``client``'s session (other default headers, fresh request ids)."""
    other = Client(client.http, client.url, extra)
    other.session_id = client.session_id
    other.next_id = client.next_id + 1000
    return other


def messages(events: list[Any]) -> list[dict[str, Any]]:
    return [orjson.loads(e.data) for e in events if e.data]


async def call_tool(client: ScriptedClient, name: str, arguments: dict[str, Any]) -> tuple[int, dict]:
    """One tools/call that must succeed; returns (request id, the JSON-RPC response)."""
    request_id, body = client.tool_call(name, arguments)
    async with client.http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        events = await collect(response)
    answers = [m for m in messages(events) if m.get("id") == request_id and "method" not in m]
    assert len(answers) == 1, answers
    return request_id, answers[0]


async def works(
    http: aiohttp.ClientSession,
    url: str,
    tool: str = "echo",
    arguments: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> Client:
    """A fresh session initializes and completes a tool call through the proxy (nothing else broke)."""
    client = Client(http, url, extra)
    async with asyncio.timeout(TIMEOUT):
        await client.initialize()
        assert client.session_id
        _, answer = await call_tool(client, tool, {"text": "still here"} if arguments is None else arguments)
    assert "result" in answer, answer
    return client


def raw_request(
    method: str, port: int, headers: list[tuple[bytes, bytes]], body: bytes = b"", path: bytes = b"/mcp"
) -> bytes:
    """An HTTP/1.1 request as bytes, for what aiohttp's client would refuse to send (raw bytes in headers)."""
    lines = [method.encode() + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1:%d" % port]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def raw_exchange(port: int, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` on a fresh connection; return the status and body of the (Content-Length) answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(TIMEOUT):
            writer.write(data)
            await writer.drain()
            return await read_response(reader)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return status, await reader.readexactly(length)


def raw_error(body: bytes) -> dict[str, Any]:
    message = orjson.loads(body)
    assert message["jsonrpc"] == "2.0"
    error: dict[str, Any] = message["error"]
    return error


# -- 1. headers ------------------------------------------------------------------------------------------


async def test_headers_over_max_header_bytes_are_431_and_not_forwarded(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_header_bytes=4096) as proxy:
        client = await works(http, proxy.url)
        posts = len(upstream.requests(http="POST"))
        # Many medium headers: each line far under aiohttp's own 8190-byte line limit, 6 KB in total.
        filler = {f"X-Filler-{i}": "v" * 1000 for i in range(6)}
        _, body = client.tool_call("echo", {"text": "x"})
        async with http.post(client.url, data=body, headers=client.headers(**filler)) as response:
            assert response.status == 431
            error = await error_of(response)
        assert error["data"]["reason"] == "headers_too_large"
        assert len(upstream.requests(http="POST")) == posts  # refused before anything was forwarded
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="431") == 1
        # Under the limit, the same session goes on; so does another one.
        small = {f"X-Filler-{i}": "v" * 1000 for i in range(2)}
        _, answer = await call_tool(same_session(client, small), "echo", {"text": "y"})
        assert "result" in answer
        await works(http, proxy.url)


async def test_a_header_line_over_8_kib_within_max_header_bytes_is_forwarded(serve, http) -> None:
    # aiohttp's parser alone would refuse a line over 8190 bytes with a plain 400 before the proxy saw it.
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:  # max_header_bytes: 16 KiB
        client = await works(http, proxy.url)
        bearer = {"Authorization": "Bearer " + "t" * 9000}
        _, answer = await call_tool(same_session(client, bearer), "echo", {"text": "long"})
        assert "result" in answer
        assert last_authorization(upstream) == bearer["Authorization"]  # forwarded untouched
        # Lines that each fit, over the limit together: 431 with its JSON-RPC body.
        for headers in ({"X-A": "v" * 9000, "X-B": "v" * 9000}, {f"X-H-{i}": "v" * 200 for i in range(100)}):
            _, body = client.tool_call("echo", {"text": "x"})
            async with http.post(client.url, data=body, headers=client.headers(**headers)) as response:
                assert response.status == 431
                assert (await error_of(response))["data"]["reason"] == "headers_too_large"
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="431") == 2


@pytest.mark.parametrize(
    "headers, body",
    [
        ([(b"Transfer-Encoding", b"chunked")], b"zz\r\n"),  # not a chunk size
        ([(b"X-Big", b"v" * 17000)], b"{}"),  # one line longer than max_header_bytes: the parser's limit
    ],
    ids=["bad-chunk", "line-over-max-header-bytes"],
)
async def test_a_request_that_is_not_valid_http_is_one_warning_line_and_harms_nothing(
    serve, http, caplog: pytest.LogCaptureFixture, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        client = await works(http, proxy.url)
        posts = len(upstream.requests(http="POST"))
        request = raw_request("POST", proxy.port, [(b"Content-Type", b"application/json"), *headers], body)
        with caplog.at_level(logging.INFO):
            status, _ = await raw_exchange(proxy.port, request)
        assert status == 400
        assert len(upstream.requests(http="POST")) == posts
        records = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert len(records) == 1, [r.getMessage() for r in records]
        (record,) = records
        assert record.levelno == logging.WARNING and record.exc_info is None  # no traceback
        assert record.getMessage().startswith("unparsable request from 127.0.0.1: ")
        assert "vvvv" not in record.getMessage()  # the offending line is not quoted (it may hold a token)
        _, answer = await call_tool(client, "echo", {"text": "after"})  # the session goes on
        assert "result" in answer


# -- 2. slow bodies --------------------------------------------------------------------------------------


async def test_body_arriving_slower_than_body_timeout_is_408_and_the_proxy_keeps_serving(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, body_timeout=0.3) as proxy:
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Accept", b"application/json, text/event-stream"),
            (b"Content-Length", b"100"),
        ]
        head = raw_request("POST", proxy.port, headers)
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            started = loop.time()
            writer.write(head + b'{"jsonrpc":"2.0","id":1,')  # 24 of the 100 bytes announced, then nothing
            await writer.drain()
            async with asyncio.timeout(TIMEOUT):
                status, body = await read_response(reader)
            elapsed = loop.time() - started
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        assert status == 408
        assert raw_error(body)["data"]["reason"] == "body_timeout"
        assert 0.25 <= elapsed < 5.0, elapsed
        assert len(upstream.requests(http="POST")) == 0
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="408") == 1
        await works(http, proxy.url)


@dataclass
class FormUpstream:
    """Paths other than the MCP endpoint (an OAuth token endpoint), as a playbook whose rules see a request
    while its body is still arriving (``unread``): ``/token`` reads its body whole, then answers; ``/early``
    answers before it reads the body, then waits for the body; any other path answers at once. ``started``
    and ``ended`` count the requests to those two that reached them and that ended (read whole, or cut),
    ``bodies`` the bodies read to their end."""

    playbook: pb.Playbook = field(default_factory=pb.Playbook)
    started: int = 0
    ended: int = 0
    bodies: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.playbook.on(None, pb.reply(lambda seen: {"path": seen.path}), http=None)
        self.playbook.on(None, self._token, http=None, when=lambda seen: seen.path == "/token", unread=True)
        self.playbook.on(None, self._early, http=None, when=lambda seen: seen.path == "/early", unread=True)

    def app(self) -> web.Application:
        return self.playbook.app()

    async def _read(self, request: web.Request) -> None:
        self.started += 1
        try:
            self.bodies.append(await request.read())
        finally:
            self.ended += 1

    async def _token(self, playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        await self._read(request)
        return web.json_response({"path": seen.path})

    async def _early(self, playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        early = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await early.prepare(request)
        await early.write(b"begun ")
        await self._read(request)
        await early.write(b"and done")
        return early


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_passthrough_body_slower_than_body_timeout_is_408(serve, http, framing: str) -> None:
    upstream = FormUpstream()
    url = await serve(upstream.app())
    async with running_proxy(url, body_timeout=0.5) as proxy:
        length = (
            (b"Content-Length", b"100") if framing == "content-length" else (b"Transfer-Encoding", b"chunked")
        )
        headers = [(b"Content-Type", b"application/x-www-form-urlencoded"), length]
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)

        async def trickle() -> None:  # a byte at a time, paced: 100 of them take 5 s, ten times the limit
            for _ in range(100):
                writer.write(b"x" if framing == "content-length" else b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)

        try:
            writer.write(raw_request("POST", proxy.port, headers, path=b"/token"))
            trickling = asyncio.ensure_future(trickle())
            await until(lambda: upstream.started == 1, what="the request reached the upstream")
            async with http.get(f"http://127.0.0.1:{proxy.port}/other") as other:  # others are served
                assert other.status == 200
                assert await other.json() == {"path": "/other"}
            async with asyncio.timeout(TIMEOUT):
                status, body = await read_response(reader)
            trickling.cancel()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        assert status == 408
        assert raw_error(body)["data"]["reason"] == "body_timeout"
        await until(lambda: upstream.ended == 1, what="the upstream's request ended")
        assert upstream.bodies == []  # cut: the upstream never got a whole body
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="408") == 1
        async with http.post(f"http://127.0.0.1:{proxy.port}/token", data=b"a=1") as token:  # in time
            assert token.status == 200
        assert upstream.bodies == [b"a=1"]


async def test_a_passthrough_body_too_slow_after_its_answer_began_cuts_the_connection(serve, http) -> None:
    upstream = FormUpstream()
    url = await serve(upstream.app())
    async with running_proxy(url, body_timeout=0.5) as proxy:
        headers = [(b"Content-Type", b"text/plain"), (b"Content-Length", b"100")]
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)

        async def trickle() -> None:  # paced: 100 bytes take 5 s, ten times the limit
            for _ in range(100):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.05)

        writer.write(raw_request("POST", proxy.port, headers, path=b"/early"))
        trickling = asyncio.ensure_future(trickle())
        try:
            async with asyncio.timeout(TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                rest = b""
                # until the proxy closes the connection: a close, or a reset when a byte of the trickle
                # reached the closed socket first (then what was read before it is all there is)
                with contextlib.suppress(ConnectionResetError):
                    while chunk := await reader.read(65536):
                        rest += chunk
        finally:
            trickling.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, RuntimeError):
                await trickling  # (its write after the cut fails: the transport is closed)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        assert head.startswith(b"HTTP/1.1 200")
        assert b"begun" in rest
        assert not rest.endswith(b"0\r\n\r\n")  # cut: no last chunk, so the client knows it is not whole
        assert upstream.bodies == []


# -- 3. large bodies -------------------------------------------------------------------------------------


async def test_chunked_body_over_max_body_bytes_is_413_without_content_length(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_body_bytes=2048) as proxy:
        client = await works(http, proxy.url)
        posts = len(upstream.requests(http="POST"))

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"jsonrpc":"2.0","id":99,"method":"tools/call","params":{"name":"echo","x":"'
            for _ in range(8):
                yield b"a" * 1024
            yield b'"}}'

        async with http.post(client.url, data=chunks(), headers=client.headers()) as response:
            assert response.status == 413
            assert response.request_info.headers.get("Transfer-Encoding") == "chunked"
            assert "Content-Length" not in response.request_info.headers
            error = await error_of(response)
        assert error["data"]["reason"] == "body_too_large"
        assert error["data"]["limit"] == 2048
        assert len(upstream.requests(http="POST")) == posts
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="413") == 1
        _, answer = await call_tool(client, "echo", {"text": "small"})  # the session goes on
        assert "result" in answer
        await works(http, proxy.url)


# -- 4. Origin and Host ----------------------------------------------------------------------------------


async def test_allowed_origins_refuse_others_and_accept_listed_or_absent(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, allowed_origins="http://a, http://good") as proxy:
        assert proxy.ctx.settings.allowed_origins == ["http://a", "http://good"]  # parsed from one string
        good = await works(http, proxy.url, extra={"Origin": "http://good"})
        absent = await works(http, proxy.url)  # no Origin: a non-browser client
        posts = len(upstream.requests(http="POST"))
        for client in (good, absent):
            _, body = client.tool_call("echo", {"text": "x"})
            headers = client.headers(Origin="http://evil")
            async with http.post(client.url, data=body, headers=headers) as response:
                assert response.status == 403
                assert (await error_of(response))["data"]["reason"] == "origin_not_allowed"
        async with http.get(good.url, headers=good.headers(Origin="http://evil")) as response:
            assert response.status == 403
            assert (await error_of(response))["data"]["reason"] == "origin_not_allowed"
        assert len(upstream.requests(http="POST")) == posts and len(upstream.requests(http="GET")) == 0
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="403") == 2
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="GET", status="403") == 1
        _, answer = await call_tool(good, "echo", {"text": "after"})
        assert "result" in answer
        await works(http, proxy.url, extra={"Origin": "http://a"})


async def test_allowed_hosts_refuse_a_host_not_listed(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, allowed_hosts="good.example,also.example:8080") as proxy:
        assert proxy.ctx.settings.allowed_hosts == ["good.example", "also.example:8080"]
        client = await works(http, proxy.url, extra={"Host": "good.example"})
        posts = len(upstream.requests(http="POST"))
        for host in ("evil.example", f"127.0.0.1:{proxy.port}", "also.example"):
            _, body = client.tool_call("echo", {"text": "x"})
            async with http.post(client.url, data=body, headers=client.headers(Host=host)) as response:
                assert response.status == 403, host
                assert (await error_of(response))["data"]["reason"] == "host_not_allowed"
        assert len(upstream.requests(http="POST")) == posts
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="403") == 3
        await works(http, proxy.url, extra={"Host": "also.example:8080"})


# -- 5. session ids and cursors --------------------------------------------------------------------------


async def test_invalid_session_ids_are_400_and_malformed_cursors_400(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        client = await works(http, proxy.url)
        posts = len(upstream.requests(http="POST"))
        port = proxy.port
        for bad in ("s" * (MAX_SESSION_ID_LEN + 1), "has space"):
            _, body = client.tool_call("echo", {"text": "x"})
            headers = client.headers(**{"Mcp-Session-Id": bad})
            async with http.post(client.url, data=body, headers=headers) as response:
                assert response.status == 400, bad[:20]
                assert (await error_of(response))["data"]["reason"] == "bad_session_id"
        _, body = client.tool_call("echo", {"text": "x"})
        base = [(b"Content-Type", b"application/json"), (b"Accept", b"application/json, text/event-stream")]
        headers = [*base, (b"Mcp-Session-Id", "café".encode()), (b"Content-Length", str(len(body)).encode())]
        status, answer = await raw_exchange(port, raw_request("POST", port, headers, body))
        assert status == 400
        assert raw_error(answer)["data"]["reason"] == "bad_session_id"
        assert len(upstream.requests(http="POST")) == posts
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="400") == 3

        # Cursors, with a valid session: a huge one, a non-ASCII one (raw bytes).
        headers = client.headers(**{"Last-Event-ID": "a" * 5000})
        async with http.get(client.url, headers=headers) as response:
            assert response.status == 400
            assert (await error_of(response))["data"]["reason"] == "malformed_cursor"
        sid = client.session_id.encode()
        for cursor in ("q7m2k4xa2c3d-1-é".encode(), b"\xff-1-1"):
            headers = [
                (b"Accept", b"text/event-stream"),
                (b"Mcp-Session-Id", sid),
                (b"Last-Event-ID", cursor),
            ]
            status, answer = await raw_exchange(port, raw_request("GET", port, headers))
            assert status == 400, cursor
            assert raw_error(answer)["data"]["reason"] == "malformed_cursor"
        assert sample(proxy.ctx.metrics, "mcpresume_resumptions_total", outcome="malformed_cursor") == 3
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="GET", status="400") == 3
        assert len(upstream.requests(http="GET")) == 0
        _, answer = await call_tool(client, "echo", {"text": "after"})  # the session itself is unharmed
        assert "result" in answer
        await works(http, proxy.url)


# -- 6. client views per session -------------------------------------------------------------------------


async def test_views_per_session_beyond_max_attached_are_429_until_one_closes(example_upstream, http) -> None:
    async with running_proxy(example_upstream, max_attached_per_session=2, drain_timeout=1) as proxy:
        local = proxy.ctx.local

        async def attached(n: int) -> bool:
            return local.attached_total() == n

        client = Client(http, proxy.url)
        await client.initialize()
        views: list[aiohttp.ClientResponse] = []
        try:
            async with asyncio.timeout(TIMEOUT):
                for _ in range(2):  # the standalone stream, then a second view joining it at its head
                    views.append(await http.get(client.url, headers=client.headers()))
                    assert views[-1].status == 200
                assert await attached(2)
                async with http.get(client.url, headers=client.headers()) as third:
                    assert third.status == 429
                    error = await error_of(third)
                assert error["data"]["reason"] == "too_many_attachments"
                assert error["data"]["limit"] == 2
                assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="GET", status="429") == 1
                views.pop(0).close()
            await until(lambda: attached(1), timeout=TIMEOUT, what="the closed view is detached")
            async with asyncio.timeout(TIMEOUT):
                async with http.get(client.url, headers=client.headers()) as fourth:
                    assert fourth.status == 200
                await works(http, proxy.url)
        finally:
            for view in views:
                view.close()
        async with http.delete(client.url, headers=client.headers()) as response:
            assert response.status == 200  # ends the standalone stream's pump


async def test_each_request_and_resume_is_counted_once_when_its_outcome_is_known(serve, http) -> None:
    """A stream whose client drops (the drop the proxy exists for) is a request counted with the 200 it was
    answered, though its handler is cancelled, and a request whose client leaves before any answer is counted
    499; a re-attach refused 429 is ``too_many_attachments``, not ``reattach`` (both were counted so before
    the view was admitted, and the cancelled requests not at all); an admitted one is timed."""
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_attached_per_session=1, drain_timeout=1) as proxy:
        metrics, local = proxy.ctx.metrics, proxy.ctx.local

        def requests(method: str, status: str) -> float:
            return sample(metrics, "mcpresume_requests_total", method=method, status=status)

        def resumes(outcome: str) -> float:
            return sample(metrics, "mcpresume_resumptions_total", outcome=outcome)

        client = Client(http, proxy.url)
        try:
            async with asyncio.timeout(TIMEOUT):
                await client.initialize()
                answered = requests("POST", "200")
                hold_id, body = client.tool_call("hold", {})
                held = await http.post(client.url, data=body, headers=client.headers())
                assert held.status == 200
                progress = (await collect(held, limit=1))[-1]  # the upstream holds the rest
                assert progress.id is not None and progress.data
                cursor = {"Last-Event-ID": progress.id.decode()}
                # The POST's view is the session's one: a re-attach now is refused, and counted so.
                async with http.get(client.url, headers=client.headers(**cursor)) as refused:
                    assert refused.status == 429
                assert (resumes("reattach"), resumes("too_many_attachments")) == (0, 1)
                held.close()  # the client drops: its handler is cancelled
            await until(lambda: requests("POST", "200") == answered + 1, what="the dropped stream counted")
            await until(lambda: local.attached_total() == 0, what="the dropped view detached")
            async with asyncio.timeout(TIMEOUT):
                async with http.get(client.url, headers=client.headers(**cursor)) as resumed:
                    assert resumed.status == 200
                    assert resumes("reattach") == 1
                    upstream.open("hold")
                    rest = await collect(resumed)
                assert [m["id"] for m in messages(rest) if "result" in m] == [hold_id]
                assert sample(metrics, "mcpresume_resume_latency_seconds_count") == 1
                assert requests("GET", "200") == 1 and requests("GET", "429") == 1
                # A client that leaves while its request waits for the upstream's answer.
                _, body = client.tool_call("stall", {})
                leaving = asyncio.ensure_future(http.post(client.url, data=body, headers=client.headers()))
                await upstream.arrived("stall").wait()
                leaving.cancel()
            await until(lambda: requests("POST", "499") == 1, what="the request its client left counted")
            release(upstream)
            await works(http, proxy.url)
            assert requests("POST", "499") == 1 and requests("POST", "200") == answered + 3
            assert (resumes("reattach"), resumes("too_many_attachments")) == (1, 1)
        finally:
            release(upstream)


# -- 7. live streams per session -------------------------------------------------------------------------


async def test_a_second_concurrent_stream_beyond_max_streams_is_429_and_not_forwarded(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_streams_per_session=1, drain_timeout=1) as proxy:
        client = Client(http, proxy.url)
        try:
            async with asyncio.timeout(TIMEOUT):
                await client.initialize()
                first_id, body = client.tool_call("hold", {})
                async with http.post(client.url, data=body, headers=client.headers()) as held:
                    assert held.status == 200
                    head = await collect(held, limit=1)  # the upstream is holding the stream open
                    assert messages(head)[0]["method"] == "notifications/progress"
                    second_id, body = client.tool_call("echo", {"text": "x"})
                    async with http.post(client.url, data=body, headers=client.headers()) as response:
                        assert response.status == 429
                        answer = orjson.loads(await response.read())
                    assert answer["id"] == second_id
                    assert answer["error"]["data"]["reason"] == "too_many_streams"
                    assert answer["error"]["data"]["limit"] == 1
                    assert tool_calls(upstream) == ["hold"]  # the second call was not forwarded
                    release(upstream)
                    rest = await collect(held)
                assert [m["id"] for m in messages(rest) if "result" in m] == [first_id]
                assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="429") == 1
                # The held stream ended (its view ends only then): the same request id is not a duplicate
                # (it was never forwarded), and the session has room again.
                async with http.post(client.url, data=body, headers=client.headers()) as response:
                    assert response.status == 200
                    events = await collect(response)
                assert [m["id"] for m in messages(events) if "result" in m] == [second_id]
                assert tool_calls(upstream) == ["hold", "echo"]
                await works(http, proxy.url)
        finally:
            release(upstream)


# -- 8. what the upstream answers ------------------------------------------------------------------------


async def test_upstream_answering_a_request_with_html_is_502_with_the_request_id(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        client = await works(http, proxy.url)
        request_id, body = client.tool_call("html", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 502
            answer = orjson.loads(await response.read())
        assert answer["id"] == request_id
        assert answer["error"]["data"]["reason"] == "upstream_bad_response"
        assert answer["error"]["data"]["content_type"] == "text/html"
        assert (
            sample(proxy.ctx.metrics, "mcpresume_upstream_errors_total", reason="upstream_bad_response") == 1
        )
        # The upstream did run it: re-sending the same id is refused, never forwarded twice (invariant #8).
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 409
            assert (await error_of(response))["data"]["reason"] == "duplicate_request"
        assert tool_calls(upstream) == ["echo", "html"]
        _, answer = await call_tool(client, "echo", {"text": "after"})
        assert "result" in answer
        await works(http, proxy.url)


async def test_upstream_event_over_max_event_bytes_completes_the_request_with_an_error(serve, http) -> None:
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_event_bytes=2048) as proxy:
        client = await works(http, proxy.url)
        request_id, body = client.tool_call("huge", {})
        async with asyncio.timeout(TIMEOUT):
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                assert response.status == 200
                events = await collect(response)
        assert all(len(e.data) <= 2048 for e in events)  # nothing of the huge event reached the client
        answers = messages(events)
        assert len(answers) == 1, answers
        assert answers[0]["id"] == request_id
        assert answers[0]["error"]["data"]["reason"] == "upstream_stream_lost"
        metrics = proxy.ctx.metrics
        assert sample(metrics, "mcpresume_upstream_errors_total", reason="event_too_large") == 1
        assert sample(metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost") == 1
        _, answer = await call_tool(client, "echo", {"text": "after"})
        assert "result" in answer
        await works(http, proxy.url)


# -- 10. logs --------------------------------------------------------------------------------------------


async def test_full_session_ids_never_appear_in_logs(example_upstream, http, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_proxy(example_upstream) as proxy:
        client = Client(http, proxy.url)
        async with asyncio.timeout(TIMEOUT):
            await client.initialize()
            _, answer = await call_tool(client, "add", {"a": 2, "b": 40})
            assert "result" in answer
            headers = client.headers(**{"Last-Event-ID": "not-a-cursor"})
            async with http.get(client.url, headers=headers) as response:
                assert response.status == 400
                assert (await error_of(response))["data"]["reason"] == "malformed_cursor"
            async with http.delete(client.url, headers=client.headers()) as response:
                assert response.status == 200
    sid = client.session_id
    assert len(sid) >= 16
    # The proxy's own records (the in-process SDK upstream logs under mcp.*/uvicorn.* and is not the proxy).
    ours = [r for r in caplog.records if r.name.startswith(("mcpresume", "aiohttp"))]
    leaks = [r.getMessage() for r in ours if sid in r.getMessage()]
    assert leaks == []
    hashed = [r.getMessage() for r in ours if log_id(sid) in r.getMessage()]
    assert any("begins" in m for m in hashed), hashed
    assert any("malformed_cursor" in m for m in hashed), hashed
    assert any("ends (DELETE)" in m for m in hashed), hashed


# -- 11. the all-sessions cap on window bytes ------------------------------------------------------------


async def _held(store: MemoryStore, session_id: str, stream: int) -> int:
    """The bytes a session still holds of its one stream (public store API only): the events as kept,
    without the id lines written in front of them when they are sent."""
    view = await store.view(session_id, stream)
    assert view is not None and view.stream is not None
    result = await store.read(session_id, [stream], view.stream.evicted_through)
    assert result is not None and not result.gap
    return sum(segment.size for segment in result.segments)


async def _evicted_through(store: MemoryStore, session_id: str, stream: int) -> int:
    view = await store.view(session_id, stream)
    assert view is not None and view.stream is not None
    return view.stream.evicted_through


async def test_total_window_cap_trims_idle_least_recent_first_and_attached_last() -> None:
    """Sessions with a view open are touched at every housekeeping round: the most recently active, they
    are trimmed after the idle ones."""
    cap = 8000
    store = MemoryStore(
        WindowLimits(10_000, 1 << 20, 1e9),
        session_ttl=300,
        max_sessions=10,
        retry_ms=None,
        max_total_bytes=cap,
    )
    item = NewEvent(frame_body(b"x" * 700), EventKind.MESSAGE)
    streams: dict[str, int] = {}
    # Created in this order, so the trim order below is by activity, not by insertion.
    for sid in ("attached", "idle-recent", "idle-old"):
        await store.create_session(sid, 0.0)
        opened = await store.open_stream(sid, StreamOrigin.GET, (), 0.0)
        assert opened is not None
        streams[sid] = opened.number
    for sid, now in (("attached", 0.0), ("idle-old", 1.0), ("idle-recent", 2.0)):
        appended = await store.append(sid, streams[sid], [item] * 3, now)
        assert not appended.evicted
        await store.touch([sid], now)  # a client came and went at `now`: the session's last activity
    await store.touch(["attached"], 3.0)  # its view is still open: touched at the last round
    assert (await store.stats()).window_bytes <= cap

    trimmed_at: dict[str, int] = {}  # the append at which each session first lost an event
    first_global = None
    for step in range(20):
        before = {sid: await _evicted_through(store, sid, n) for sid, n in streams.items()}
        evicted = (await store.append("attached", streams["attached"], [item], 0.0)).evicted
        stats = await store.stats()
        assert stats.window_bytes <= cap  # after every append
        held = {sid: await _held(store, sid, n) for sid, n in streams.items()}
        assert sum(held.values()) == stats.window_bytes
        trimmed = {sid for sid, n in streams.items() if await _evicted_through(store, sid, n) > before[sid]}
        for sid in trimmed:
            trimmed_at.setdefault(sid, step)
        if evicted and first_global is None:
            first_global = evicted
        # The older idle session goes first; nothing of the attached one while an idle one holds anything.
        if "idle-recent" in trimmed:
            assert held["idle-old"] == 0, step
        if "attached" in trimmed:
            assert held["idle-old"] == held["idle-recent"] == 0, step
    assert set(trimmed_at) == set(streams), trimmed_at  # the cap reached every session in the end
    assert trimmed_at["idle-old"] <= trimmed_at["idle-recent"] < trimmed_at["attached"], trimmed_at
    assert first_global is not None
    assert set(first_global.counts) == {EvictReason.GLOBAL_BYTES}
    # No client was ever sent anything: every eviction is of a never-delivered event.
    assert first_global.undelivered[0] == first_global.counts[EvictReason.GLOBAL_BYTES][0]


async def test_an_append_over_the_total_cap_costs_what_it_trims_not_a_pass_over_every_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10,000 idle sessions, then one session's appends go over the cap: each append trims a few idle
    windows, and looks at about that many sessions (it sorted all of them on every append over the cap)."""
    idle = 10_000
    store = MemoryStore(
        WindowLimits(10_000, 1 << 20, 1e9),
        session_ttl=300,
        max_sessions=idle + 1,
        retry_ms=None,
        max_total_bytes=1 << 20,
    )
    for k in range(idle):
        await store.create_session(f"idle-{k}", 0.0)
        assert await store.open_stream(f"idle-{k}", StreamOrigin.GET, (), float(k)) is not None
    held_idle = (await store.stats()).window_bytes
    store.max_total_bytes = held_idle + 10_000  # the busy session's first events fit, then each one trims
    await store.create_session("busy", 0.0)
    opened = await store.open_stream("busy", StreamOrigin.GET, (), float(idle))
    assert opened is not None
    await store.touch(["busy"], float(idle))
    primed = await _held(store, "busy", opened.number)
    looked_at = 0
    real_idle = SessionState.idle

    def counted(self: SessionState) -> bool:
        nonlocal looked_at
        looked_at += 1
        return real_idle(self)

    monkeypatch.setattr(SessionState, "idle", counted)
    item = NewEvent(frame_body(b"x" * 700), EventKind.MESSAGE)
    per_append = []
    for _ in range(40):
        looked_at = 0
        await store.append("busy", opened.number, [item], float(idle))
        per_append.append(looked_at)
        assert (await store.stats()).window_bytes <= store.max_total_bytes
    assert await _held(store, "busy", opened.number) == primed + 40 * len(item.body)  # idle ones trimmed
    # The first append over the cap orders the sessions once; each later one looks at about the sessions
    # it trims (a 700-byte event, about 90 priming events of 8 bytes), not at every session.
    assert max(per_append) <= idle + 1, per_append  # once: every session held
    assert sorted(per_append)[-2] < 200, per_append


# -- 12. overflow: evict or pause, and undelivered evictions ---------------------------------------------


def _message(size: int = 10) -> NewEvent:
    return NewEvent(frame_body(b"m" * size), EventKind.MESSAGE)


def test_keeping_undelivered_events_needs_a_client_sent_past_them() -> None:
    state = SessionState("s", new_epoch(), WindowLimits(4, 1 << 20, 1e9), None, 0.0)
    stream = state.open_stream(StreamOrigin.POST, ("k",), 0.0).stream  # the priming event, seq 1
    state.append(stream, [_message()] * 3, 0.0)  # seqs 2-4: the window is full, nothing delivered
    assert len(state.window) == 4
    pause = Guard(keep_undelivered=True)
    assert state.blocked(1, 10, None) is None  # overflow = evict, no reader: the oldest may go
    assert state.blocked(1, 10, pause) == ()  # overflow = pause: nothing was delivered
    reader = Guard(readers=(((stream,), 0),))
    assert state.blocked(1, 10, reader) == (0,)  # a reader at 0 has yet to send everything
    state.mark_delivered([stream], 2)  # a client was sent the priming event and the first message
    assert state.blocked(2, 10, pause) is None
    assert state.blocked(3, 10, pause) == ()  # seq 3 was never delivered
    state.mark_delivered([stream], 4)
    assert state.blocked(4, 10, pause) is None


def test_evictions_of_never_delivered_events_are_counted_as_undelivered() -> None:
    state = SessionState("s", new_epoch(), WindowLimits(3, 1 << 20, 1e9), None, 0.0)
    stream = state.open_stream(StreamOrigin.POST, ("k",), 0.0).stream  # seq 1
    evicted = state.append(stream, [_message()] * 2, 0.0)  # seqs 2, 3: full, nothing evicted
    assert not evicted and evicted.undelivered == [0, 0]
    state.mark_delivered([stream], 2)  # seqs 1 and 2 were sent to a client
    sizes = [len(e.body) for e in state.window]
    evicted = state.append(stream, [_message()] * 3, 0.0)  # seqs 4-6 evict 1-3 (overflow = evict)
    assert evicted.counts == {EvictReason.COUNT: [3, sum(sizes)]}
    assert evicted.undelivered == [1, sizes[2]]  # only seq 3 was never delivered

    # The window alone: without delivery records nothing counts as undelivered; with them, per event.
    limits = WindowLimits(2, 1 << 20, 1e9)
    events = [Event(seq, 1, b"x" * seq, 0.0) for seq in range(1, 6)]
    plain, judged = (
        Window(limits),
        Window(limits, {1: SimpleNamespace(delivered=4)}),
    )  # seqs 1-4 of stream 1: sent
    for event in events:
        plain.append(event, 0.0)
        judged.append(event, 0.0)
    shed = judged.shed(0)  # the global cap trims the same way, and counts the same way
    assert shed.counts == {EvictReason.GLOBAL_BYTES: [2, 4 + 5]}
    assert shed.undelivered == [1, 5]
    plain_shed = plain.shed(0)
    assert plain_shed.undelivered == [0, 0]


async def test_a_paused_pump_is_woken_when_a_reader_moves() -> None:
    """Flow control's wait (Pump._store): blocked, the pump parks until a reader of the session moves
    (or is removed), then tries again."""
    local = LocalSessions()
    token = local.add_reader("s", [1], 0)
    waiter = asyncio.ensure_future(local.readers_moved("s", TIMEOUT))
    other = asyncio.ensure_future(local.readers_moved("t", TIMEOUT))
    for _ in range(5):
        await asyncio.sleep(0)  # let it park
    assert not waiter.done()
    local.move_reader("s", token, 1)  # the priming event reached a client
    async with asyncio.timeout(TIMEOUT):
        assert await waiter
    assert not other.done()  # another session's pump sleeps on
    later = asyncio.ensure_future(local.readers_moved("s", TIMEOUT))
    await asyncio.sleep(0)
    local.remove_reader("s", token)
    async with asyncio.timeout(TIMEOUT):
        assert await later
    other.cancel()


async def test_client_that_drops_at_once_loses_undelivered_events_with_overflow_evict(
    example_upstream, http
) -> None:
    async with running_proxy(example_upstream, window_events=4, overflow="evict", stall_timeout=5) as proxy:
        metrics, pumps = proxy.ctx.metrics, proxy.ctx.pumps
        client = Client(http, proxy.url)
        async with asyncio.timeout(TIMEOUT):
            await client.initialize()
            # A client that reads: the pump waits for it, so the small window loses nothing it was owed.
            _, answer = await call_tool(client, "count_slowly", {"n": 12, "delay": 0.005})
            assert answer["result"]["content"][0]["text"] == "counted to 12"
        assert sample(metrics, "mcpresume_evicted_events_total", reason="count") > 0
        assert sample(metrics, "mcpresume_evicted_events_total", reason="undelivered") == 0
        # A client that drops as soon as the stream starts: the call goes on (disconnection is not
        # cancellation) and the window, 4 events, drops what no client was ever sent.
        _, body = client.tool_call("count_slowly", {"n": 12, "delay": 0.02})
        async with asyncio.timeout(TIMEOUT):
            response = await http.post(client.url, data=body, headers=client.headers())
            assert response.status == 200
            response.close()

        async def finished() -> bool:
            return len(pumps) == 0

        await until(finished, timeout=TIMEOUT, what="the dropped call's pump finished")
        undelivered = sample(metrics, "mcpresume_evicted_events_total", reason="undelivered")
        assert undelivered > 0
        assert undelivered <= sample(metrics, "mcpresume_evicted_events_total", reason="count")
        assert sample(metrics, "mcpresume_evicted_bytes_total", reason="undelivered") > 0
        await works(http, proxy.url)


# -- regressions: bugs found while writing this file, fixed in 9463c29 ----------------------------------


async def test_max_streams_counts_requests_still_being_forwarded(serve, http) -> None:
    """A request still at the upstream (no answer, so no stream yet) counts against max_streams_per_session:
    truly concurrent POSTs cannot all pass the limit."""
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_streams_per_session=1, drain_timeout=1) as proxy:
        client = Client(http, proxy.url)
        async with asyncio.timeout(TIMEOUT):
            await client.initialize()
        _, stall = client.tool_call("stall", {})
        first = asyncio.ensure_future(http.post(client.url, data=stall, headers=client.headers()))
        try:
            async with asyncio.timeout(TIMEOUT):
                await upstream.arrived("stall").wait()  # the first request is upstream, not answered yet
                _, body = client.tool_call("echo", {"text": "x"})
                async with http.post(client.url, data=body, headers=client.headers()) as response:
                    assert tool_calls(upstream) == ["stall"]  # not forwarded
                    assert response.status == 429
                    assert (await error_of(response))["data"]["reason"] == "too_many_streams"
        finally:
            release(upstream)
            async with asyncio.timeout(TIMEOUT):
                (await first).close()
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="429") == 1


async def test_post_refused_for_too_many_attachments_is_not_forwarded(serve, http) -> None:
    """The view a POST will get is counted before the POST is forwarded: a 429 never ran upstream."""
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url, max_attached_per_session=1, drain_timeout=1) as proxy:
        client = Client(http, proxy.url)
        try:
            async with asyncio.timeout(TIMEOUT):
                await client.initialize()
                async with http.get(client.url, headers=client.headers()) as view:  # the session's one view
                    assert view.status == 200
                    _, body = client.tool_call("echo", {"text": "x"})
                    async with http.post(client.url, data=body, headers=client.headers()) as response:
                        assert response.status == 429
                        assert (await error_of(response))["data"]["reason"] == "too_many_attachments"
                    assert tool_calls(upstream) == []  # a 429 means "not processed": it must not have run
        finally:
            release(upstream)
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="POST", status="429") == 1


async def test_an_upstream_session_id_is_carried_up_to_the_bound_and_refused_at_initialize_beyond(
    serve, http
) -> None:
    """One bound on both sides: a signed id the upstream issues (a JWT, 1,500 characters) is a session like
    any other; one the proxy cannot carry (over the bound, or not visible ASCII) is refused at its
    ``initialize`` with 502 ``upstream_bad_session_id``, and no session is begun (it was a 200, then 400
    ``bad_session_id`` on every request, and a ``max_sessions`` slot held until the TTL)."""
    signed = "eyJhbGciOiJIUzI1NiJ9." + "c" * 1450 + ".sig"
    too_long = "t" * (MAX_SESSION_ID_LEN + 1)
    upstream = tool_upstream()
    upstream.session_ids = [signed, too_long, "not visible", "tool-session-fresh"]
    tools = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
    upstream.on("tools/list", pb.reply(pb.result(tools)))  # the SDK client lists them after a call
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        try:  # the official SDK client: initialize, the standalone stream, a tool call, DELETE at the end
            async with asyncio.timeout(TIMEOUT), sdk_session(proxy.url) as session:
                assert result_text(await session.call_tool("echo", {"text": "signed"})) == "echo"
        finally:
            upstream.open("standalone")
        assert len(signed) == 1475 and {seen.session_id for seen in upstream.seen[1:]} == {signed}
        assert upstream.requests(http="DELETE")[-1].session_id == signed  # the SDK's own DELETE
        upstream.seen.clear()
        fresh = Client(http, proxy.url)
        for refused in (too_long, "not visible"):
            params = {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            }
            body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params})
            async with http.post(proxy.url, data=body, headers=fresh.headers()) as response:
                assert response.status == 502
                assert "Mcp-Session-Id" not in response.headers
                error = await error_of(response)
            assert error["data"] == {
                "reason": "upstream_bad_session_id",
                "length": len(refused),
                "limit": MAX_SESSION_ID_LEN,
            }
        assert (await proxy.ctx.store.stats()).sessions == 0  # none begun (the signed one was DELETEd)
        # The upstream's session is ended where its id can be sent back (too long, but visible ASCII).
        await until(lambda: upstream.requests(http="DELETE"), what="the upstream's session ended")
        assert [seen.session_id for seen in upstream.requests(http="DELETE")] == [too_long]
        reason = "upstream_bad_session_id"
        assert sample(proxy.ctx.metrics, "mcpresume_upstream_errors_total", reason=reason) == 2
        await works(http, proxy.url)  # the next session begins as ever


async def test_session_id_with_bytes_that_are_not_utf8_is_400(serve, http) -> None:
    """aiohttp decodes non-UTF-8 header bytes to surrogates; hashing them for the log line must not fail
    (it was a plain-text 500)."""
    upstream = tool_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}})
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Accept", b"application/json, text/event-stream"),
            (b"Mcp-Session-Id", b"\xff\xfe"),
            (b"Content-Length", str(len(body)).encode()),
        ]
        status, answer = await raw_exchange(proxy.port, raw_request("POST", proxy.port, headers, body))
        assert status == 400
        assert raw_error(answer)["data"]["reason"] == "bad_session_id"
        assert len(upstream.requests(http="POST")) == 0
        await works(http, proxy.url)


async def test_max_total_window_bytes_setting_caps_the_windows_of_a_running_proxy(
    example_upstream, http
) -> None:
    cap = 1024
    async with running_proxy(example_upstream, max_total_window_bytes=cap) as proxy:
        client = Client(http, proxy.url)
        async with asyncio.timeout(TIMEOUT):
            await client.initialize()
            _, body = client.tool_call("count_slowly", {"n": 10, "delay": 0.001})
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                await response.read()  # the view may be cut short by the cap: only the totals matter here

        async def finished() -> bool:
            return len(proxy.ctx.pumps) == 0

        await until(finished, timeout=TIMEOUT, what="the call's pump finished")
        assert (await proxy.ctx.store.stats()).window_bytes <= cap
        assert sample(proxy.ctx.metrics, "mcpresume_evicted_events_total", reason="global_bytes") > 0
