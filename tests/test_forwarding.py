"""The proxy is invisible when nothing goes wrong, and honest when the upstream fails.

The official SDK client sees the same results through the proxy as directly; scripted upstreams (playbooks)
produce what the SDK server can't on demand (a slow first byte, a refused connection, malformed SSE,
huge headers, other paths).
"""

from __future__ import annotations

import socket

import aiohttp
import orjson
from aiohttp import web

from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.proxy import error_of, running_proxy
from tests.support.sdk import count_slowly, sdk_session


async def sdk_transcript(url: str) -> dict[str, object]:
    async with sdk_session(url) as session:
        tools = sorted(t.name for t in (await session.list_tools()).tools)
        echo = await session.call_tool("echo", {"text": "héllo"})
        add = await session.call_tool("add", {"a": 2, "b": 40})
        counted = await count_slowly(session, n=4, delay=0.01)
        info = session.initialize_result
        assert info is not None
        return {
            "server": info.server_info.name,
            "protocol": info.protocol_version,
            "tools": tools,
            "echo": echo.model_dump(),
            "add": add.model_dump(),
            "count": counted.result.model_dump(),
            "progress": counted.progress,
        }


async def test_sdk_session_through_proxy_equals_direct(example_upstream: str) -> None:
    direct = await sdk_transcript(example_upstream)
    async with running_proxy(example_upstream) as proxy:
        proxied = await sdk_transcript(proxy.url)
        assert sample(proxy.ctx.metrics, "mcpresume_requests_total", method="DELETE", status="200") == 1
        assert (await proxy.ctx.store.stats()).sessions == 0  # DELETE dropped the session's state
    assert proxied == direct
    assert direct["progress"] == [
        (1.0, 4.0, "step 1 of 4"),
        (2.0, 4.0, "step 2 of 4"),
        (3.0, 4.0, "step 3 of 4"),
        (4.0, 4.0, "step 4 of 4"),
    ]


# -- scripted upstreams ----------------------------------------------------------------------------------


INIT = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
)
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def test_refused_connection_is_502_with_reason() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        async with running_proxy(f"http://127.0.0.1:{port}/mcp") as proxy, aiohttp.ClientSession() as http:
            async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
                assert response.status == 502
                error = await error_of(response)
                body_id = orjson.loads(await response.read())["id"]
            assert (
                sample(proxy.ctx.metrics, "mcpresume_upstream_errors_total", reason="upstream_unreachable")
                == 1
            )
    assert error["data"]["reason"] == "upstream_unreachable"
    assert error["code"] == -32000
    assert body_id == 7


async def test_slow_first_byte_is_504(serve: ServeApp) -> None:
    upstream = pb.Playbook()
    upstream.on(None, pb.held("release", pb.status(200, "late")), http=None)
    url = await serve(upstream.app())
    async with running_proxy(url, first_byte_timeout=0.2) as proxy, aiohttp.ClientSession() as http:
        async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
            assert response.status == 504
            assert (await error_of(response))["data"]["reason"] == "upstream_timeout"
        upstream.open("release")


async def test_other_paths_pass_through_with_hop_by_hop_headers_dropped(serve: ServeApp) -> None:
    seen: dict[str, object] = {}  # what the playbook does not record: the raw body, the path with its query

    async def oauth(playbook: pb.Playbook, request: web.Request, head: pb.Seen) -> web.StreamResponse:
        seen["body"] = await request.read()
        seen["path"] = request.path_qs
        response = web.Response(status=401, text="{}", content_type="application/json")
        response.headers["WWW-Authenticate"] = 'Bearer resource_metadata="x"'
        response.headers["Connection"] = "X-Private"
        response.headers["X-Private"] = "hop"
        return response

    upstream = pb.Playbook()
    # Only the other path's requests: the proxy's era probe (POST /mcp, asked again every while it is not
    # answered) may come at any time. unread: the answer reads the (non-JSON) body itself.
    oauth_path = lambda head: head.path.startswith("/.well-known/")  # noqa: E731
    upstream.on(None, oauth, http=None, when=oauth_path, unread=True)
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        base = proxy.url.removesuffix("/mcp")
        headers = {
            "Authorization": "Bearer t",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "1",
            "TE": "trailers",
        }
        async with http.post(f"{base}/.well-known/oauth?x=1", data=b"abc", headers=headers) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"] == 'Bearer resource_metadata="x"'
            assert "X-Private" not in response.headers
    (received,) = [head.headers for head in upstream.seen if oauth_path(head)]
    assert seen["path"] == "/.well-known/oauth?x=1" and seen["body"] == b"abc"
    assert received["Authorization"] == "Bearer t"
    assert "X-Hop" not in received and "TE" not in received
    assert received["X-Forwarded-For"] == "127.0.0.1"
    assert received["X-Forwarded-Proto"] == "http"
    assert received["X-Forwarded-Host"] == f"127.0.0.1:{proxy.port}"


def sse_upstream(
    body: bytes, *, session: str | None = "sess-1", extra: dict[str, str] | None = None
) -> web.Application:
    """An upstream answering every request with an SSE stream whose body is ``body``, as is."""
    headers = {**(extra or {}), **({"Mcp-Session-Id": session} if session else {})}
    upstream = pb.Playbook()
    upstream.on(None, pb.sse(pb.raw(body), headers=headers), http=None)
    return upstream.app()


async def test_upstream_closing_mid_event_completes_request_with_synthesized_error(serve: ServeApp) -> None:
    url = await serve(sse_upstream(b'event: message\ndata: {"jsonrpc":"2.0","method":"x"}\n\ndata: {"js'))
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
            assert response.status == 200
            raw = await response.read()
        assert (
            sample(proxy.ctx.metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost")
            == 1
        )
    frames = [f for f in raw.split(b"\n\n") if b"data: {" in f]
    assert len(frames) == 2  # the notification, then the proxy's error for request 7
    error = orjson.loads(frames[1].split(b"data: ", 1)[1])
    assert error["id"] == 7
    assert error["error"]["data"]["reason"] == "upstream_stream_lost"


async def test_malformed_sse_bytes_pass_as_data_without_crashing(serve: ServeApp) -> None:
    body = b"\xff\xfe: comment\r\nevent: message\rdata: \xc3\x28 not utf8\r\n\r\n" + (
        b'data: {"jsonrpc":"2.0","id":7,"result":{}}\n\n'
    )
    url = await serve(sse_upstream(body))
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
            raw = await response.read()
        assert b"\xc3\x28 not utf8" in raw  # bytes are relayed, never decoded
        assert b'"id":7,"result":{}' in raw
        assert (
            sample(proxy.ctx.metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost")
            == 0
        )


async def test_huge_upstream_header_is_a_clean_502(serve: ServeApp) -> None:
    upstream = pb.Playbook()
    upstream.on(None, pb.status(200, "{}", headers={"X-Big": "a" * 200_000}), http=None)
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
            assert response.status == 502
            assert (await error_of(response))["data"]["reason"] == "upstream_unreachable"
        # and the proxy still serves the next request
        async with http.post(proxy.url, data=INIT, headers=HEADERS) as response:
            assert response.status == 502


async def test_bad_client_bodies_get_jsonrpc_errors(example_upstream: str) -> None:
    async with running_proxy(example_upstream, max_body_bytes=2048) as proxy, aiohttp.ClientSession() as http:
        cases = [
            (b"not json", 400, "invalid_json"),
            (b'{"id":1}', 400, "bad_request"),
            (b"[]", 400, "bad_request"),
            (b'{"jsonrpc":"2.0","id":1,"method":"x","params":"' + b"a" * 4096 + b'"}', 413, "body_too_large"),
        ]
        for body, status, reason in cases:
            async with http.post(proxy.url, data=body, headers=HEADERS) as response:
                assert response.status == status, body[:20]
                assert (await error_of(response))["data"]["reason"] == reason


async def test_modern_era_requests_pass_straight_through(serve: ServeApp) -> None:
    upstream = pb.Playbook()
    upstream.on(None, pb.reply({"jsonrpc": "2.0", "id": 1, "result": {"ok": True}}), http=None)
    url = await serve(upstream.app())
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {}})
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        async with http.post(
            proxy.url, data=body, headers={**HEADERS, "MCP-Protocol-Version": "2026-07-28"}
        ) as r:
            assert r.status == 200
            assert await r.json() == {"jsonrpc": "2.0", "id": 1, "result": {"ok": True}}
        assert (await proxy.ctx.store.stats()).sessions == 0
    assert upstream.seen[0].headers["MCP-Protocol-Version"] == "2026-07-28"


async def test_admin_endpoints(example_upstream: str) -> None:
    async with running_proxy(example_upstream, metrics_port=0) as proxy:
        assert proxy.admin_url is None  # metrics_port = 0 disables the admin listener
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    async with running_proxy(example_upstream, metrics_port=free) as proxy, aiohttp.ClientSession() as http:
        await sdk_transcript(proxy.url)
        async with http.get(f"{proxy.admin_url}/healthz") as r:
            assert r.status == 200
        async with http.get(f"{proxy.admin_url}/readyz") as r:
            assert r.status == 200
        async with http.get(f"{proxy.admin_url}/metrics") as r:
            text = await r.text()
    assert 'mcpresume_requests_total{method="POST",status="200"}' in text
    assert "mcpresume_open_streams" in text
    assert "mcpresume_sessions 0.0" in text
