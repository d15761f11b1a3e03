"""HTTP at the edges of the proxy, over real sockets: what crosses it (Expect, Content-Encoding, Location,
Host), which requests its DNS-rebinding checks cover, and how it holds up against connections that never
send a request (header timeout, connection cap).

The upstreams are playbooks (``tests/support/playbook.py``): they record what reached them, so "not forwarded"
is checked, not assumed.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.sse import frame_body
from tests.support import INITIALIZE_BODY, MCP_HEADERS
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.playbook import Playbook
from tests.support.poll import until
from tests.support.proxy import collect, error_of, running_proxy

TIMEOUT = 30.0  # hang guard only (a loaded 2-core box)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


SESSION = "edge-session"


def recording() -> Playbook:
    """The upstream of most of these tests: ``initialize`` at ``/mcp`` starts session ``edge-session``; every
    other request, whatever its HTTP method and path, is answered with the JSON ``{"path": <its path>}``."""
    upstream = Playbook(session_ids=[SESSION])
    upstream.on(None, pb.reply(lambda seen: {"path": seen.path}), http=None)
    upstream.on("initialize", pb.initialize(name="edges"), when=at("/mcp"))
    return upstream


def at(path: str) -> Callable[[pb.Seen], bool]:
    """A rule's ``when``: the requests to ``path``."""
    return lambda seen: seen.path == path


def received(upstream: Playbook) -> list[tuple[str, str, dict[str, str]]]:
    """What the upstream received: each request's HTTP method, path and headers."""
    return [(seen.http, seen.path, seen.headers) for seen in upstream.seen]


# -- 11. Expect: 100-continue -----------------------------------------------------------------------------


async def _no_continue(request: web.Request) -> None:
    """An upstream that never sends 100 Continue (allowed: it may wait for the body instead)."""


async def test_expect_100_continue_is_answered_by_the_proxy_and_not_forwarded(serve, http) -> None:
    upstream = recording()
    url = await serve(upstream.app(expect_handler=_no_continue))
    # Without the fix the upstream hop waits for a 100 that never comes: 504 after first_byte_timeout.
    async with running_proxy(url, first_byte_timeout=5.0) as proxy, asyncio.timeout(TIMEOUT):
        async with http.post(
            proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS, expect100=True
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Mcp-Session-Id"] == "edge-session"
        other = proxy.url.replace("/mcp", "/oauth/token")
        async with http.post(other, data=b"grant_type=x", expect100=True) as response:
            assert response.status == 200
            assert await response.json() == {"path": "/oauth/token"}
    assert [path for _, path, _ in received(upstream)] == ["/mcp", "/oauth/token"]
    assert all("Expect" not in headers for _, _, headers in received(upstream))


# -- 7. DNS-rebinding checks on every path ----------------------------------------------------------------


PATHS = ["/mcp", "/MCP", "/mcp/", "/Mcp/", "/.well-known/oauth-authorization-server"]


@pytest.mark.parametrize("path", PATHS)
async def test_origin_and_host_checks_cover_every_relayed_path(serve, http, path: str) -> None:
    upstream = recording()
    url = await serve(upstream.app())
    settings = {"allowed_origins": "http://good.example", "allowed_hosts": "good.example"}
    async with running_proxy(url, **settings) as proxy, asyncio.timeout(TIMEOUT):
        target = proxy.url.replace("/mcp", path)
        good = {**MCP_HEADERS, "Host": "good.example", "Origin": "http://good.example"}
        for headers, reason in [
            ({**good, "Origin": "http://evil.example"}, "origin_not_allowed"),
            ({**good, "Host": "evil.example"}, "host_not_allowed"),
        ]:
            for method in ("POST", "GET"):
                async with http.request(method, target, data=INITIALIZE_BODY, headers=headers) as response:
                    assert response.status == 403, (method, headers)
                    assert (await error_of(response))["data"]["reason"] == reason
        assert received(upstream) == []  # nothing refused reached the upstream
        async with http.post(target, data=INITIALIZE_BODY, headers=good) as response:
            assert response.status == 200
    assert [p for _, p, _ in received(upstream)] == [path]


# -- 15. the upstream's DNS-rebinding protection, kept -----------------------------------------------------


async def test_default_settings_keep_the_sdk_upstreams_host_check(example_upstream: str, http) -> None:
    """The official SDK server refuses a foreign Host on loopback (421); through the proxy, which sends the
    upstream its own authority, a foreign Host must still be refused, and loopback names on any port pass."""
    async with running_proxy(example_upstream) as proxy, asyncio.timeout(TIMEOUT):
        for host in ("evil.example.com", "evil.example.com:80", f"evil.example.com:{proxy.port}"):
            async with http.post(
                proxy.url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == 403, host
                assert (await error_of(response))["data"]["reason"] == "host_not_allowed"
            async with http.get(proxy.url.replace("/mcp", "/.well-known/x"), headers={"Host": host}) as r:
                assert r.status == 403, host
        for host in (f"127.0.0.1:{proxy.port}", "localhost:1", "localhost", "[::1]:8443", "LOCALHOST:9"):
            async with http.post(
                proxy.url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == 200, host
                assert response.headers.get("Mcp-Session-Id")


async def test_on_a_non_loopback_address_the_default_refuses_a_rebinding_host(example_upstream, http) -> None:
    """The proxy sends the upstream its own authority, never the client's Host, so the SDK server's
    DNS-rebinding check sees the proxy's address whatever the client sent: a page rebinding its own DNS name
    to the proxy's address got through it to the upstream when the proxy listened on a non-loopback address
    (any Host accepted there by default). By default there, the proxy accepts IP addresses and the loopback
    names only; a name the clients use is listed in allowed_hosts."""
    async with running_proxy(example_upstream, host="0.0.0.0") as proxy, asyncio.timeout(TIMEOUT):
        url = f"http://127.0.0.1:{proxy.port}/mcp"
        for host in ("rebound.example", f"rebound.example:{proxy.port}", "10.0.0.5.nip.io:80"):
            async with http.post(
                url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == 403, host
                error = await error_of(response)
            assert error["data"]["reason"] == "host_not_allowed"
            assert "list the names clients use in allowed_hosts" in error["message"]
            async with http.get(url.replace("/mcp", "/.well-known/x"), headers={"Host": host}) as response:
                assert response.status == 403, host  # every path the proxy relays
        for host in (f"127.0.0.1:{proxy.port}", "10.0.0.5:8080", "[fd00::5]", "localhost"):
            async with http.post(
                url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == 200, host
    # What the SDK server's own check would have let through: the proxy's Host is the upstream's authority.
    async with (
        running_proxy(example_upstream, host="0.0.0.0", allowed_hosts="*") as proxy,
        http.post(
            f"http://127.0.0.1:{proxy.port}/mcp",
            data=INITIALIZE_BODY,
            headers={**MCP_HEADERS, "Host": "rebound.example"},
        ) as r,
    ):
        assert r.status == 200
    async with running_proxy(example_upstream, host="0.0.0.0", allowed_hosts="mcp.example") as proxy:
        url = f"http://127.0.0.1:{proxy.port}/mcp"
        for host, status in (("mcp.example:80", 200), (f"127.0.0.1:{proxy.port}", 403)):  # as listed
            async with http.post(
                url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == status, host


async def test_allowed_hosts_without_a_port_match_any_port(serve, http) -> None:
    upstream = recording()
    url = await serve(upstream.app())
    async with running_proxy(url, allowed_hosts="127.0.0.1,localhost,pinned.example:8443") as proxy:
        for host, status in [
            (f"127.0.0.1:{proxy.port}", 200),  # what every client of the proxy sends
            ("localhost:1", 200),
            ("pinned.example:8443", 200),
            ("pinned.example:8444", 403),
            ("pinned.example", 403),
            ("evil.example", 403),
        ]:
            async with http.post(
                proxy.url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": host}
            ) as response:
                assert response.status == status, host
    async with (
        running_proxy(url, allowed_hosts="*") as proxy,  # any Host, on loopback too
        http.post(
            proxy.url, data=INITIALIZE_BODY, headers={**MCP_HEADERS, "Host": "evil.example"}
        ) as response,
    ):
        assert response.status == 200


# -- 12. redirects keep the client on the proxy ------------------------------------------------------------


def redirecting(upstream: Playbook, origin: str) -> None:
    """``/mcp/`` redirects to the upstream's own ``/mcp`` (``origin``: its scheme and authority), as
    Starlette's trailing-slash redirect does, and ``/elsewhere`` to another server; the MCP endpoint answers
    with ``Content-Location`` at the upstream's address, on JSON (``initialize``) and on SSE (any other POST).
    """
    upstream.on(
        None,
        pb.sse(pb.event(pb.result({}), name="message"), headers={"Content-Location": f"{origin}/mcp#s"}),
    )
    initialize = pb.initialize(name="edges")
    upstream.on("initialize", with_headers(initialize, {"Content-Location": f"{origin.upper()}/mcp"}))
    upstream.on(None, pb.status(307, headers={"Location": f"{origin}/mcp?x=1"}), http=None, when=at("/mcp/"))
    elsewhere = {"Location": "http://other.example:8080/mcp", "Content-Location": "/relative"}
    upstream.on(None, pb.status(302, headers=elsewhere), http=None, when=at("/elsewhere"))


def with_headers(answer: pb.Answer, headers: dict[str, str]) -> pb.Answer:
    """``answer`` (a response not yet sent: not an SSE answer) with ``headers`` added."""

    async def answered(playbook: Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        response = await answer(playbook, request, seen)
        response.headers.update(headers)
        return response

    return answered


async def test_locations_at_the_upstream_point_at_the_proxy(serve, http) -> None:
    upstream = Playbook(session_ids=[SESSION])
    url = await serve(upstream.app())
    redirecting(upstream, url.removesuffix("/mcp"))
    async with running_proxy(url) as proxy, asyncio.timeout(TIMEOUT):
        base = proxy.url.removesuffix("/mcp")
        async with http.post(
            f"{base}/mcp/", data=INITIALIZE_BODY, headers=MCP_HEADERS, allow_redirects=False
        ) as response:
            assert response.status == 307
            assert response.headers["Location"] == "/mcp?x=1"
        async with http.post(
            f"{base}/mcp/", data=INITIALIZE_BODY, headers=MCP_HEADERS
        ) as response:  # followed: the proxy
            assert response.status == 200
            assert str(response.url) == f"{proxy.url}?x=1"
            assert response.headers["Content-Location"] == "/mcp"
            session = response.headers["Mcp-Session-Id"]
        call = orjson.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "x"}})
        headers = {**MCP_HEADERS, "Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(proxy.url, data=call, headers=headers) as response:
            assert response.status == 200
            assert response.headers["Content-Location"] == "/mcp#s"
            answers = [orjson.loads(e.data) for e in await collect(response) if e.data]
            assert answers == [{"jsonrpc": "2.0", "id": 2, "result": {}}]
        async with http.get(f"{base}/elsewhere", allow_redirects=False) as response:  # not the upstream's
            assert response.headers["Location"] == "http://other.example:8080/mcp"
            assert response.headers["Content-Location"] == "/relative"


# -- 3. compressed answers from the upstream ---------------------------------------------------------------


def compressing() -> Playbook:
    """Compresses every answer with gzip whatever the request's ``Accept-Encoding`` says (SSE flushed per
    event, as a compressing server streams it); the tool ``brotli`` is answered in ``br``, which the proxy
    cannot read. A GET opens a standalone stream with one notification, held at gate ``release``."""
    upstream = Playbook(session_ids=[SESSION])
    progress = pb.progress(1, progressToken=2, total=1)
    upstream.on(None, gzip_sse(progress, pb.result({"content": [], "isError": False})))
    note = pb.notification("notifications/message", data="hi")
    upstream.on(None, gzip_sse(note, held_at="release"), http="GET")
    upstream.on("initialize", gzipped(pb.initialize(name="edges")))
    brotli = pb.sse(pb.raw(b"\x8b\x03\x80not really brotli\x03"), headers={"Content-Encoding": "br"})
    upstream.on(None, brotli, when=lambda seen: seen.params.get("name") == "brotli")
    return upstream


def gzip_sse(*messages: pb.Data, held_at: str | None = None) -> pb.Answer:
    """An SSE answer of ``messages`` in gzip, each event flushed (as a compressing server streams it); then
    the gzip stream ends, or (``held_at``) the answer waits at that gate, its gzip stream unfinished."""

    async def answer(playbook: Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        gzip = zlib.compressobj(wbits=31)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
        await stream.prepare(request)
        for message in messages:
            data = orjson.dumps(message(seen) if callable(message) else message)
            await stream.write(gzip.compress(frame_body(data)) + gzip.flush(zlib.Z_SYNC_FLUSH))
        if held_at is None:
            await stream.write(gzip.flush())
        else:
            await playbook.hold(held_at)
        return stream

    return answer


def gzipped(answer: pb.Answer) -> pb.Answer:
    """``answer`` (a whole ``web.Response``, not yet sent), its body compressed with gzip."""

    async def answered(playbook: Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        plain = await answer(playbook, request, seen)
        assert isinstance(plain, web.Response) and isinstance(plain.body, bytes)
        gzip = zlib.compressobj(wbits=31)
        plain.body = gzip.compress(plain.body) + gzip.flush()
        plain.headers["Content-Encoding"] = "gzip"
        return plain

    return answered


async def test_compressed_answers_are_read_decoded_and_relayed_plain(serve) -> None:
    upstream = compressing()
    url = await serve(upstream.app())
    gzip_client = {**MCP_HEADERS, "Accept-Encoding": "gzip, deflate"}
    # auto_decompress=False: the client sees the bytes the proxy sends, and their Content-Encoding.
    async with (
        running_proxy(url) as proxy,
        aiohttp.ClientSession(auto_decompress=False) as http,
        asyncio.timeout(TIMEOUT),
    ):
        async with http.post(proxy.url, data=INITIALIZE_BODY, headers=gzip_client) as response:
            assert response.status == 200
            assert "Content-Encoding" not in response.headers
            assert orjson.loads(await response.read())["result"]["serverInfo"]["name"] == "edges"
            session = response.headers["Mcp-Session-Id"]
        in_session = {**gzip_client, "Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-11-25"}
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "gz"}}
        async with http.post(proxy.url, data=orjson.dumps(call), headers=in_session) as response:
            assert response.status == 200
            assert "Content-Encoding" not in response.headers
            answers = [orjson.loads(e.data) for e in await collect(response) if e.data]
        assert [a.get("method") for a in answers] == ["notifications/progress", None]
        assert answers[-1]["result"] == {"content": [], "isError": False}  # not upstream_stream_lost
        async with http.get(proxy.url, headers=in_session) as response:  # the standalone (held) GET
            assert response.status == 200
            assert "Content-Encoding" not in response.headers
            events = await collect(response, limit=1)
            assert orjson.loads(events[-1].data)["params"] == {"data": "hi"}
        upstream.open("release")
        brotli = {**call, "id": 3, "params": {"name": "brotli"}}
        async with http.post(proxy.url, data=orjson.dumps(brotli), headers=in_session) as response:
            assert response.status == 502
            assert (await error_of(response))["data"]["reason"] == "upstream_bad_response"
        async with http.post(proxy.url, data=orjson.dumps(brotli), headers=in_session) as response:
            assert response.status == 409  # it ran upstream: never forwarded again
    # The proxy asked for every MCP answer as is; what it passes through untouched keeps the client's ask.
    assert {headers.get("Accept-Encoding") for _, _, headers in received(upstream)} == {"identity"}
    assert len(upstream.seen) == 4


async def test_a_request_passed_through_carries_no_header_the_client_did_not_send(serve) -> None:
    """Requests passed through as is (any path but the MCP endpoint) keep the client's ``Accept-Encoding``,
    absent included: aiohttp's client added one (and ``User-Agent``, ``Accept``) to a request without it, so
    a client that never asked for compression (curl, a raw client) got a gzip body from an upstream that
    compresses what its clients accept. A client that asks for it still gets it."""

    async def compressing(playbook: Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        response = web.json_response({"path": seen.path, "padding": "x" * 2000})
        response.enable_compression()  # gzip or deflate when the request accepts one, else none
        return response

    upstream = Playbook()
    upstream.on(None, compressing, http=None)
    url = await serve(upstream.app())
    nothing_added = {"Accept-Encoding", "User-Agent", "Accept"}  # this test client's own defaults, off
    async with (
        running_proxy(url) as proxy,
        aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=nothing_added) as http,
        asyncio.timeout(TIMEOUT),
    ):
        base = proxy.url.removesuffix("/mcp")
        async with http.get(f"{base}/plain") as response:
            assert response.status == 200
            assert "Content-Encoding" not in response.headers
            assert orjson.loads(await response.read())["path"] == "/plain"
        async with http.get(f"{base}/asked", headers={"Accept-Encoding": "gzip"}) as response:
            assert response.status == 200
            assert response.headers["Content-Encoding"] == "gzip"
            assert orjson.loads(zlib.decompress(await response.read(), wbits=31))["path"] == "/asked"
    plain, asked = upstream.seen
    assert [plain.header(name) for name in sorted(nothing_added)] == [None, None, None]
    assert asked.header("Accept-Encoding") == "gzip"


# -- 8. header timeout and connection cap ----------------------------------------------------------------


async def _eof_or_answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the proxy sends until it closes the connection."""
    async with asyncio.timeout(TIMEOUT):
        return await reader.read()


async def test_connections_without_a_complete_head_are_closed_after_header_timeout(serve, http) -> None:
    upstream = recording()
    url = await serve(upstream.app())
    async with running_proxy(url, header_timeout=0.5) as proxy:
        silent = await asyncio.open_connection("127.0.0.1", proxy.port)
        trickling = await asyncio.open_connection("127.0.0.1", proxy.port)
        trickling[1].write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        for reader, writer in (silent, trickling):
            assert await _eof_or_answer(reader) == b""  # closed, without an answer
            writer.close()
        await until(lambda: proxy.connections.open == 0, what="both connections counted closed")
        async with http.post(
            proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS
        ) as response:  # a real client is served
            assert response.status == 200
    assert [p for _, p, _ in received(upstream)] == ["/mcp"]


async def _served(port: int, before: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keep-alive connection that made a request (after the bytes ``before``) and got its answer (it waits
    for no head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _ping(reader, writer, before)
    return reader, writer


async def _ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, before: bytes = b"") -> None:
    """A GET /ping on an open connection, answered 200 and read to its end."""
    writer.write(before + b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    async with asyncio.timeout(TIMEOUT):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)


async def test_connections_over_max_connections_get_a_clean_503(serve) -> None:
    upstream = recording()
    url = await serve(upstream.app())
    async with running_proxy(url, max_connections=8, header_timeout=60.0) as proxy:
        assert proxy.connections.limit == 8
        idle = [await _served(proxy.port) for _ in range(8)]  # every one sent a request: none is evicted
        assert proxy.connections.open == 8
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        answer = await _eof_or_answer(reader)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"Connection: close" in head
        error = orjson.loads(body)["error"]
        assert error["data"] == {"reason": "too_many_connections", "limit": 8}
        assert sample(proxy.ctx.metrics, "mcpresume_refused_connections_total", how="refused") == 1
        assert sample(proxy.ctx.metrics, "mcpresume_client_connections") == 8
        idle.pop()[1].close()  # room for one
        await until(lambda: proxy.connections.open == 7, what="a connection counted closed")
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS) as response,
        ):
            assert response.status == 200
        for _, idle_writer in idle:
            idle_writer.close()
    assert [p for _, p, _ in received(upstream)] == ["/ping"] * 8 + ["/mcp"]


async def test_at_the_cap_the_oldest_connection_without_a_request_makes_room(serve) -> None:
    """More slowloris connections than max_connections cannot lock a fresh client out: each new
    connection takes the place of the oldest one still waiting for its first request head."""
    upstream = recording()
    url = await serve(upstream.app())
    async with running_proxy(url, max_connections=20, header_timeout=300.0) as proxy:
        served = await _served(proxy.port)  # sent a request: never evicted
        slow = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(40)]
        for _, writer in slow[::2]:
            writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")  # a head, never finished
        await until(lambda: proxy.connections.evicted == 21, what="21 slow connections evicted")
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS) as response,
        ):
            assert response.status == 200
        assert proxy.connections.evicted == 22 and proxy.connections.refused == 0
        closed = [await _eof_or_answer(reader) == b"" for reader, _ in slow[:22]]
        assert closed == [True] * 22  # the oldest 22, in order of arrival
        assert not any(reader.at_eof() for reader, _ in slow[22:])
        assert sample(proxy.ctx.metrics, "mcpresume_refused_connections_total", how="evicted") == 22
        served[1].write(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # still open, still served
        assert (await served[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        for _, writer in [served, *slow]:
            writer.close()


async def test_at_the_cap_connections_that_sent_only_empty_lines_make_room(serve) -> None:
    """Empty lines before a request line are no request (RFC 9112 section 2.2: a server ignores them): a
    connection that sent only CRLFs (or bare CRs and LFs) is still waiting for its first head, evicted at the
    cap for a fresh client; a request after empty lines is a request like any other."""
    upstream = recording()
    url = await serve(upstream.app())
    async with running_proxy(url, max_connections=6, header_timeout=300.0) as proxy:
        served = await _served(proxy.port, before=b"\r\n\r\n")  # sent a request: never evicted
        empty_lines = [b"\r\n\r\n", b"\r\n" * 64, b"\n\n\n", b"\r\r\r\r", b"\r\n\r"]
        blank = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in empty_lines]
        for (_, writer), lines in zip(blank, empty_lines, strict=True):
            writer.write(lines)
        await until(lambda: proxy.connections.open == 6, what="six connections open")
        # Every empty line is read before the fresh clients come (the HTTP server reads whatever arrives).
        await _ping(*blank[-1], before=b"\n")  # the newest blank one asks at last: a request
        fresh = await _served(proxy.port)  # takes the place of the oldest blank one
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS) as response,
        ):
            assert response.status == 200  # and of the next
        assert proxy.connections.evicted == 2 and proxy.connections.refused == 0
        assert [await _eof_or_answer(reader) == b"" for reader, _ in blank[:2]] == [True, True]
        assert not any(reader.at_eof() for reader, _ in blank[2:])
        await _ping(*served)  # still open, still served
        for _, writer in [served, fresh, *blank]:
            writer.close()
    assert [p for _, p, _ in received(upstream)] == ["/ping"] * 3 + ["/mcp", "/ping"]


SLOWLORIS = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for i in range(int(sys.argv[2])):
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    if i % 2:  # half say nothing, half trickle a head they never finish
        sock.sendall(b"POST /mcp HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nContent-Type: appl")
    held.append(sock)
print("ready", flush=True)
sys.stdin.read()
"""


async def test_a_fresh_client_is_served_while_1000_slowloris_connections_are_open(serve) -> None:
    """The issue's case: under the usual soft limit of 1024 descriptors, 1,000 connections that never send
    a request left none for a fresh client's connection and its upstream request. The proxy raises its
    soft limit to what max_connections needs (here the hard limit allows it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * 1001 + 256:  # the cap would be below 1,001
        pytest.skip(f"the hard descriptor limit ({hard}) cannot hold 1,001 client connections")
    upstream = recording()
    url = await serve(upstream.app())
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        # header_timeout well above the test's length: the 1,000 stay open throughout, however slow the box.
        async with running_proxy(url, header_timeout=300.0) as proxy:
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                SLOWLORIS,
                str(proxy.port),
                "1000",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            assert child.stdin is not None and child.stdout is not None
            try:
                async with asyncio.timeout(120.0):
                    assert await child.stdout.readline() == b"ready\n"
                    async with (
                        aiohttp.ClientSession() as http,
                        http.post(proxy.url, data=INITIALIZE_BODY, headers=MCP_HEADERS) as response,
                    ):
                        assert response.status == 200
                        assert response.headers["Mcp-Session-Id"] == "edge-session"
                        assert proxy.connections.open >= 1001  # the thousand, and this client's
            finally:
                child.stdin.close()
                await child.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_cap_fits_the_descriptor_limit() -> None:
    """Under a hard limit of 1024 descriptors (a process that cannot raise it), max_connections is lowered
    so that every client connection and its upstream connection fit, with the reserve; a soft limit below
    a higher hard one is raised as far as the cap needs."""
    code = """
import resource
import subprocess
from mcpresume.http.listener import connection_budget
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
print(connection_budget(4096), connection_budget(100))
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 1024))
print(connection_budget(200), resource.getrlimit(resource.RLIMIT_NOFILE))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.splitlines() == ["(384, 1024) (100, 1024)", "(200, 656) (656, 1024)"]
