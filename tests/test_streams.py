"""How a session's streams share it: the window under overflow = pause, batched responses, views that
never read, parallel calls of one client, priming per protocol revision, and the order of a session's
requests (ARCHITECTURE.md, invariants #7 and #12)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.jsonrpc import response_keys
from mcpresume.core.sse import SSEEvent, SSEParser
from mcpresume.daemon.app import RunningProxy
from mcpresume.http import get as http_get
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, memory_session, running_proxy
from tests.support.relay import SseEvent, parse_sse
from tests.support.scripted import ScriptedUpstream
from tests.support.sdk import ProgressCall, count_slowly, sdk_session

TIMEOUT = 30.0  # a hang guard, never a timing assertion
READ_GUARD = 10.0  # a hang guard for one read of events that are due now


# -- overflow = pause protects undelivered events of every stream ------------------------------------------


async def test_pause_keeps_a_streams_unsent_result_while_another_stream_is_busy(serve: ServeApp) -> None:
    """A client drops right after its call's priming event; its call's events (the result included) wait in
    the window, sent to nobody. A second call of the session, whose client reads, must not evict them: its
    pump waits (overflow = pause) until the first client re-attaches and is sent them, then goes on."""
    upstream = ScriptedUpstream(total=10, start_delay=0.3)  # priming + 10 progress + result per call
    url = await serve(upstream.app())
    async with (
        running_proxy(url, window_events=16, overflow="pause") as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        first_id, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            first_events = SSEParser(1 << 20).feed(await response.content.readany())
        assert [e.data for e in first_events] == [b""]  # the priming event only: then the client is gone
        cursor = (first_events[0].id or b"").decode()
        await until(lambda: len(proxy.ctx.pumps) == 0, what="the first call read to its end")

        second_id, body = client.tool_call("work", {})

        async def second_call() -> list[dict[str, object]]:
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                return [orjson.loads(e.data) for e in await collect(response) if e.data]

        second = asyncio.ensure_future(second_call())
        local = proxy.ctx.local
        await until(
            lambda: second.done() or local.waiting_pumps() > 0, timeout=TIMEOUT, what="a pause (or the end)"
        )
        headers = client.headers(**{"Last-Event-ID": cursor})
        async with http.get(client.url, headers=headers) as response:
            assert response.status == 200  # 409 cursor_out_of_window when the second call evicted them
            first = [orjson.loads(e.data) for e in await collect(response) if e.data]
        later = await asyncio.wait_for(second, TIMEOUT)
    for messages, request_id in ((first, first_id), (later, second_id)):
        assert [m["params"]["progress"] for m in messages if "method" in m] == list(range(1, 11))  # type: ignore[index]
        assert [m["id"] for m in messages if "result" in m] == [request_id]


async def test_pause_keeps_a_streams_unsent_result_while_another_streams_error_is_synthesized(
    serve: ServeApp,
) -> None:
    """The same with the second call's upstream stream ending before its response (no ids: it cannot be
    resumed): the error the proxy synthesizes for it is an append too, and waits as the pump's do."""
    # 12 events of the first call (its priming delivered), the second's priming and 3 events: the last one
    # evicts the delivered priming, so the window is full of undelivered events when the error comes.
    upstream = ScriptedUpstream(total=10, start_delay=0.3, send_ids=False, drops=[None, 3])
    url = await serve(upstream.app())
    async with (
        running_proxy(url, window_events=15, overflow="pause") as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        first_id, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            first_events = SSEParser(1 << 20).feed(await response.content.readany())
        cursor = (first_events[0].id or b"").decode()
        await until(lambda: len(proxy.ctx.pumps) == 0, what="the first call read to its end")
        second_id, body = client.tool_call("work", {})

        async def second_call() -> list[dict[str, object]]:
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                return [orjson.loads(e.data) for e in await collect(response) if e.data]

        second = asyncio.ensure_future(second_call())
        local = proxy.ctx.local
        await until(
            lambda: second.done() or local.waiting_pumps() > 0, timeout=TIMEOUT, what="a pause (or the end)"
        )
        headers = client.headers(**{"Last-Event-ID": cursor})
        async with http.get(client.url, headers=headers) as response:
            assert response.status == 200  # 409 cursor_out_of_window when the error evicted them
            first = [orjson.loads(e.data) for e in await collect(response) if e.data]
        later = await asyncio.wait_for(second, TIMEOUT)
    assert [m["id"] for m in first if "result" in m] == [first_id]
    assert len([m for m in first if "method" in m]) == 10
    assert [(m["id"], m["error"]["data"]["reason"]) for m in later if "error" in m] == [  # type: ignore[index]
        (second_id, "upstream_stream_lost")
    ]


# -- batched SSE responses (2025-03-26) ---------------------------------------------------------------------


def test_response_keys_of_a_batch_event() -> None:
    batch = [
        {"jsonrpc": "2.0", "id": 1, "result": {}},
        {"jsonrpc": "2.0", "id": "b", "error": {"code": -1, "message": "no"}},
        {"jsonrpc": "2.0", "id": 9, "method": "sampling/createMessage", "params": {}},  # a request
        {"jsonrpc": "2.0", "method": "notifications/message", "params": {}},
        {"jsonrpc": "2.0", "id": True, "result": {}},  # not an id
    ]
    assert response_keys(orjson.dumps(batch)) == ("n:1", "s:b")
    assert response_keys(orjson.dumps(batch[2:])) == ()
    assert response_keys(orjson.dumps(batch[0])) == ("n:1",)
    assert response_keys(b"[not json") == ()


def batch_upstream() -> pb.Playbook:
    """A 2025-03-26 upstream: a batch POST is answered with an SSE stream of two events without ids (not
    resumable), a batch of a server request and a notification, then a batch of the responses (``{"n": id}``
    each); any other message but ``initialize`` gets 202."""
    upstream = pb.Playbook(session_ids=["batch-session"])
    server_batch = [
        {"jsonrpc": "2.0", "id": "s1", "method": "roots/list"},
        pb.notification("notifications/message", level="info", data="x"),
    ]

    def answers(seen: pb.Seen) -> list[dict[str, object]]:
        assert isinstance(seen.message, list)
        return [{"jsonrpc": "2.0", "id": item["id"], "result": {"n": item["id"]}} for item in seen.message]

    upstream.on(None, pb.status(202), when=lambda seen: isinstance(seen.message, dict))
    upstream.on("initialize", pb.initialize(name="batch"))
    batch = pb.sse(pb.event(server_batch), pb.event(answers))
    upstream.on(None, batch, when=lambda seen: isinstance(seen.message, list))
    return upstream


async def test_a_batch_event_settles_every_response_in_it_once(serve: ServeApp) -> None:
    """A 2025-03-26 upstream answers a batch POST with one SSE event holding both responses (after an event
    holding a batch of a server request and a notification). Each request id gets its result once, and no
    synthesized upstream_stream_lost error follows."""

    url = await serve(batch_upstream().app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        batch = [{"jsonrpc": "2.0", "id": i, "method": "tools/list"} for i in (1, 2)]
        headers = client.headers(**{"MCP-Protocol-Version": "2025-03-26"})
        async with http.post(client.url, data=orjson.dumps(batch), headers=headers) as response:
            assert response.status == 200
            events = [orjson.loads(e.data) for e in await collect(response) if e.data]
    assert events[0][0]["method"] == "roots/list"
    assert events[1:] == [
        [{"jsonrpc": "2.0", "id": 1, "result": {"n": 1}}, {"jsonrpc": "2.0", "id": 2, "result": {"n": 2}}]
    ]


# -- the official SDK client's parallel calls fit the default limits ---------------------------------------


async def test_twelve_parallel_calls_of_one_sdk_session_all_succeed(example_upstream: str) -> None:
    """The official client runs each concurrent call_tool on a POST stream of its own, next to its standalone
    GET: 12 parallel calls are 13 client views of one session. With default settings all 12 succeed, as
    they do against the upstream directly (they got 429 too_many_attachments beyond the 8th view)."""
    async with running_proxy(example_upstream) as proxy, sdk_session(proxy.url) as session:
        calls = [count_slowly(session, n=6, delay=0.25) for _ in range(12)]
        async with asyncio.timeout(TIMEOUT):
            results = await asyncio.gather(*calls, return_exceptions=True)
    assert [r.text if isinstance(r, ProgressCall) else repr(r) for r in results] == ["counted to 6"] * 12


# -- priming: every SSE response of a 2025-11-25 session starts with a cursor; none for older clients ------


def standalone_upstream(*, asks: list[bool] | None = None) -> tuple[pb.Playbook, asyncio.Queue[bytes]]:
    """An upstream whose standalone GET stream sends what the test puts in the queue returned (each item an
    event's data); ``tools/list`` is answered at once, any other request with an SSE stream of a
    notification and the result. With ``asks``, a tools/call first sends a server request on the standalone
    stream, when its session's GET is open at that instant (else it is lost, as with the SDK servers), and
    ``asks`` gets whether it was sent."""
    upstream = pb.Playbook(session_ids=[f"standalone-{n}" for n in range(1, 100)])
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    note = pb.notification("notifications/message", level="info", data="x")
    call = pb.sse(pb.event(note, name="message"), pb.event(pb.result({"content": []}), name="message"))
    upstream.on(None, call, when=lambda seen: seen.id is not None and seen.method is not None)
    upstream.on("initialize", pb.initialize(name="standalone"))
    upstream.on("tools/list", pb.reply(pb.result({"tools": []})))
    if asks is not None:
        upstream.on("tools/call", asking(queue, call, asks))
    upstream.on(None, pb.sse(pb.each(queue)), http="GET")
    return upstream, queue


def asking(queue: asyncio.Queue[bytes], then: pb.Answer, asks: list[bool]) -> pb.Answer:
    """Send a server request (``roots/list``) on the standalone stream if the caller's session has one open
    now (``asks`` gets whether it did), then answer with ``then``."""

    async def answer(playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        open_get = any(
            get.session_id == seen.session_id and get.number in playbook.answering
            for get in pb.gets(playbook)
        )
        if open_get:
            ask = {"jsonrpc": "2.0", "id": f"ask-{seen.number}", "method": "roots/list"}
            queue.put_nowait(orjson.dumps(ask))
        asks.append(open_get)
        return await then(playbook, request, seen)

    return answer


async def _first_event(response: aiohttp.ClientResponse) -> SSEEvent:
    """The first event with an id or data (a retry:-only block sets no cursor and fires nothing)."""
    parser = SSEParser(1 << 20)
    async with asyncio.timeout(READ_GUARD):
        while True:
            events = [e for e in parser.feed(await response.content.readany()) if e.id or e.data]
            if events:
                return events[0]


async def _raw_events(response: aiohttp.ClientResponse, count: int) -> list[SseEvent]:
    """The first ``count`` SSE events as a client's parser sees them (comments dropped, nothing else)."""
    body = b""
    async with asyncio.timeout(READ_GUARD):
        while len(events := parse_sse(body)) < count:
            body += await response.content.readany()
    return events


async def test_a_second_standalone_view_starts_with_a_priming_cursor(serve: ServeApp) -> None:
    """A second GET of a 2025-11-25 session joins the one upstream standalone stream at its head. It starts
    with a priming event carrying a cursor, so after a drop it re-attaches and gets the server message the
    first view received meanwhile (it had only a retry: hint, no cursor, and missed it)."""
    upstream, queue = standalone_upstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        async with http.get(client.url, headers=client.headers()) as first:
            first_priming = await _first_event(first)
            assert first_priming.id and first_priming.data == b""
            async with http.get(client.url, headers=client.headers()) as second:
                assert second.status == 200
                priming = await _first_event(second)
            assert priming.data == b"" and priming.id  # a cursor before any message
            queue.put_nowait(b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}')
            seen = await _first_event(first)
            assert seen.data.startswith(b'{"jsonrpc"')
            headers = client.headers(**{"Last-Event-ID": priming.id.decode()})
            async with http.get(client.url, headers=headers) as again:
                assert again.status == 200
                missed = await _first_event(again)
    assert (missed.data, missed.id) == (seen.data, seen.id)


async def test_clients_before_2025_11_25_get_no_priming_and_a_cursor_on_every_message(
    serve: ServeApp,
) -> None:
    """A 2025-06-18 client (the TypeScript SDK 1.20 parses every event's data as JSON): no event without data
    on a POST stream, the standalone stream, a second standalone view or a re-attach; every message event
    carries a cursor, and the first one resumes the stream."""
    upstream, queue = standalone_upstream()
    url = await serve(upstream.app())
    old = "2025-06-18"
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        headers = {
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
        }
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": old,
                "capabilities": {},
                "clientInfo": {"name": "ts", "version": "1"},
            },
        }
        async with http.post(proxy.url, data=orjson.dumps(init), headers=headers) as response:
            headers["Mcp-Session-Id"] = response.headers["Mcp-Session-Id"]
        headers["MCP-Protocol-Version"] = old
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "x", "arguments": {}}}
        async with http.post(proxy.url, data=orjson.dumps(call), headers=headers) as response:
            posted = parse_sse(await response.read())
        async with http.get(proxy.url, headers=headers) as first:
            async with http.get(proxy.url, headers=headers) as second:
                queue.put_nowait(b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}')
                queue.put_nowait(b'{"jsonrpc":"2.0","method":"notifications/message","params":{"n":2}}')
                joined = await _raw_events(second, 2)
            standalone = await _raw_events(first, 2)
            resume = {**headers, "Last-Event-ID": standalone[0].id or ""}
            async with http.get(proxy.url, headers=resume) as again:
                resumed = await _raw_events(again, 1)
    assert [orjson.loads(e.data).get("id") for e in posted] == [None, 2]
    for event in [*posted, *standalone, *joined, *resumed]:
        assert event.data and event.id and event.retry is None, event
    assert resumed == standalone[1:]


# -- the order of a session's requests ---------------------------------------------------------------------


async def test_a_call_right_after_the_standalone_get_finds_that_stream_open(serve: ServeApp) -> None:
    """The official client opens its standalone GET a moment before its first call. The upstream sends a
    server request on its standalone stream as soon as a call arrives (as servers that elicit or sample
    do), so it must see the GET first: the proxy forwards the call only once the upstream has answered the
    GET's head (the tests below hold the GET where a race would let the call overtake it)."""
    asks: list[bool] = []
    upstream, _ = standalone_upstream(asks=asks)
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        for _ in range(50):
            async with asyncio.timeout(TIMEOUT), sdk_session(proxy.url) as session:
                await session.call_tool("ask", {})
    assert (asks.count(True), asks.count(False)) == (50, 0)


async def _call(http: aiohttp.ClientSession, client: ScriptedClient) -> list[dict[str, object]]:
    """A tools/call of ``client``'s session through the proxy: its messages."""
    _, body = client.tool_call("ask", {})
    async with asyncio.timeout(TIMEOUT):
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            return [orjson.loads(e.data) for e in await collect(response) if e.data]


async def _overtaking(
    upstream: pb.Playbook, proxy: RunningProxy, http: aiohttp.ClientSession, held: ScriptedClient
) -> list[pb.Seen]:
    """The calls of ``held``'s session that reached the upstream, once its call is claimed in the proxy (or
    has reached the upstream already) and a call of another session (no GET ahead of it), sent after that,
    has been answered: time for a call the proxy does not hold to reach the upstream."""

    def calls() -> list[pb.Seen]:
        return [seen for seen in upstream.requests("tools/call") if seen.session_id == held.session_id]

    await until(
        lambda: bool(calls()) or memory_session(proxy.ctx.store, held.session_id).in_flight == 1,
        timeout=TIMEOUT,
        what="the call claimed in the proxy",
    )
    other = ScriptedClient(http, proxy.url)
    await other.initialize()
    assert (await _call(http, other))[-1].get("result") is not None
    return calls()


async def test_a_call_waits_until_the_upstream_has_answered_the_standalone_gets_head(
    serve: ServeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written is not enough: the proxy writes the GET on a new upstream connection and the call on an open
    one, and the upstream may read the call first (the conformance suite's TypeScript fixture server lost 9
    elicitations in 100 so). Here the upstream holds the GET before its head: the call that came after the
    GET must not reach the upstream until the head is sent."""
    monkeypatch.setattr(http_get, "ORDER_WAIT", 60.0)  # the bound never lets the call go here
    upstream, queue = standalone_upstream()
    upstream.on(None, pb.held("head", pb.sse(pb.each(queue))), http="GET")
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        get = asyncio.ensure_future(http.get(proxy.url, headers=client.headers()))
        try:
            async with asyncio.timeout(TIMEOUT):
                await upstream.arrived("head").wait()
            call = asyncio.ensure_future(_call(http, client))
            assert await _overtaking(upstream, proxy, http, client) == []
            upstream.open("head")
            async with asyncio.timeout(TIMEOUT):
                (await get).close()
            assert (await call)[-1].get("result") is not None
        finally:
            upstream.open_all()
            get.cancel()
    (standalone,) = pb.gets(upstream)
    (called,) = [seen for seen in upstream.requests("tools/call") if seen.session_id == client.session_id]
    assert standalone.number < called.number


async def test_a_call_waits_for_a_get_that_came_first_and_is_still_in_the_proxy(
    serve: ServeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET holds the session's calls from the moment it reaches the proxy, not from when the proxy opens it
    upstream: before that it asks the store (a shared store: round trips) or, here, the upstream, with a
    ping held at a gate, about credentials new to the session; a call that came after it (with the
    credentials the session began with: no ping) must not overtake it meanwhile (a Redis store let one
    through in 100 conformance runs)."""
    monkeypatch.setattr(http_get, "ORDER_WAIT", 60.0)  # the bound never lets the call go here
    upstream, _ = standalone_upstream()
    upstream.on("ping", pb.held("ping", pb.reply(pb.result({}))))
    url = await serve(upstream.app())
    async with (
        running_proxy(url) as proxy,
        aiohttp.ClientSession(headers={"Authorization": "Bearer first"}) as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        headers = client.headers(Authorization="Bearer refreshed")
        get = asyncio.ensure_future(http.get(proxy.url, headers=headers))
        try:
            async with asyncio.timeout(TIMEOUT):
                await upstream.arrived("ping").wait()
            call = asyncio.ensure_future(_call(http, client))
            assert await _overtaking(upstream, proxy, http, client) == []
            assert pb.gets(upstream) == []  # the GET is still in the proxy
            upstream.open("ping")
            async with asyncio.timeout(TIMEOUT):
                (await get).close()
            assert (await call)[-1].get("result") is not None
        finally:
            upstream.open_all()
            get.cancel()
    (standalone,) = pb.gets(upstream)
    (called,) = [seen for seen in upstream.requests("tools/call") if seen.session_id == client.session_id]
    assert standalone.number < called.number


# -- views whose clients never read hold a small constant each ---------------------------------------------

HIGH_WATER = 64 * 1024  # asyncio's and uvloop's default write high-water mark, which aiohttp keeps
VIEW_BOUND = 256 * 1024  # what one view may make the proxy hold: about the high-water mark and one write
VIEWS = 4


async def test_views_that_never_read_hold_a_bounded_buffer_each(serve: ServeApp) -> None:
    """Re-attach views of a window of ~9 MiB whose clients never read (a tiny receive buffer, nothing
    read): each one writes only while its socket buffer is under the high-water mark, so each holds about
    that and one write, not a whole read of the window (the first write alone put 1 MiB in the buffer)."""
    # More than the kernel takes into a socket's send buffer (4 MiB on loopback here): the rest is the
    # proxy's to hold.
    upstream = ScriptedUpstream(total=8000, pad=1000, send_ids=False)
    url = await serve(upstream.app())
    async with (
        running_proxy(url, window_events=10_000, window_bytes=16 << 20) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            cursor = (await collect(response, limit=1))[0].id
        assert cursor is not None
        await until(lambda: len(proxy.ctx.pumps) == 0, what="the call read to its end")
        loop = asyncio.get_running_loop()
        request = (
            f"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\nAccept: text/event-stream\r\n"
            f"Mcp-Session-Id: {client.session_id}\r\nMCP-Protocol-Version: 2025-11-25\r\n"
            f"Last-Event-ID: {cursor.decode()}\r\n\r\n"
        ).encode()
        readers = []
        try:
            for _ in range(VIEWS):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", proxy.port))
                await loop.sock_sendall(sock, request)
                readers.append(sock)
            server = proxy.runners[0].server
            assert server is not None

            def buffers() -> list[int]:  # what each client connection's transport holds, unsent
                return [c.transport.get_write_buffer_size() for c in server.connections if c.transport]

            await until(
                lambda: len([b for b in buffers() if b > HIGH_WATER]) == VIEWS,
                timeout=TIMEOUT,
                what="every view writing into a full socket buffer",
            )
            assert max(buffers()) <= VIEW_BOUND, buffers()
        finally:
            for sock in readers:
                sock.close()
