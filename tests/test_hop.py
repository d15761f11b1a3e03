"""The hop (mcpresume/replicas/hop.py) over real sockets: a front replica that routes with route.route and
forwards with Hop, and a real aiohttp "owner" on loopback that streams SSE at the test's pace and echoes what
it got.

The front is what the proxy's MCP handler will do once the store knows owners: read the body, decide, and
carry the decision out. The owner of the session is another replica whose URL the test's registry holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from yarl import URL

from mcpresume.core.headers import (
    HOP_HEADER,
    LAST_EVENT_ID_HEADER,
    MAX_SESSION_ID_LEN,
    SESSION_HEADER,
    end_to_end,
)
from mcpresume.core.route import Forward, Refuse, Route, Serve, TakeOver
from mcpresume.core.window import WindowLimits
from mcpresume.process.drain import Drain
from mcpresume.process.metrics import Metrics
from mcpresume.replicas.hop import Hop, decide, owner_head_timeout, routed_session
from mcpresume.store import Registry
from mcpresume.store.memory import MemoryStore
from tests.conftest import ServeApp
from tests.support.metrics import sample
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy

HERE = "pod-a"
OWNER = "pod-b"
SESSION = "sess-1"
HANG_GUARD = 10.0  # seconds: only so that a broken hop fails the test instead of hanging it


@dataclass
class Owner:
    """The owning replica, scripted: it records each request, streams SSE one event per ``step``."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    step: asyncio.Event = field(default_factory=asyncio.Event)
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)
    stream_finished: bool = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/mcp", self.echo)
        app.router.add_delete("/mcp", self.echo)
        app.router.add_get("/mcp", self.sse)
        app.router.add_get("/broken", self.broken)
        app.router.add_post("/silent", self.silent)
        return app

    def record(self, request: web.Request, body: bytes) -> dict[str, Any]:
        entry = {
            "method": request.method,
            "path_qs": request.path_qs,
            "headers": [[name, value] for name, value in request.headers.items()],
            "body": body.decode(),
        }
        self.seen.append(entry)
        return entry

    async def echo(self, request: web.Request) -> web.Response:
        entry = self.record(request, await request.read())
        status = int(request.query.get("status", "200"))
        return web.Response(
            status=status,
            body=orjson.dumps(entry),
            content_type="application/json",
            headers={SESSION_HEADER: SESSION, "X-Owner": OWNER},
        )

    async def sse(self, request: web.Request) -> web.StreamResponse:
        self.record(request, b"")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", SESSION_HEADER: SESSION})
        await response.prepare(request)
        try:
            await response.write(b"id: 1\ndata: first\n\n")
            await self.step.wait()  # the test reads the first event before this one is even written
            await response.write(b"id: 2\ndata: second\n\n")
            self.stream_finished = True
        finally:
            self.stream_closed.set()  # cancelled (handler_cancellation) when the hop's connection closes
        return response

    async def broken(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"id: 1\ndata: first\n\n")
        await self.step.wait()
        assert request.transport is not None
        request.transport.abort()  # the owner dies in the middle of the stream
        return response

    async def silent(self, request: web.Request) -> web.StreamResponse:
        self.record(request, await request.read())
        await asyncio.Event().wait()  # never answers its head
        raise AssertionError("unreachable")


@dataclass
class FakeOwners:
    """The store's owner registry: every session is the owner's; its URL is what ``registry`` holds."""

    registry: dict[str, str]
    path: str | None = None
    asked: list[str] = field(default_factory=list)

    async def owner(self, session_id: str) -> str | None:
        self.asked.append(session_id)
        return OWNER

    async def replica_url(self, replica_id: str, now: float) -> str | None:
        url = self.registry.get(replica_id)
        return url.replace("/mcp", self.path) if url is not None and self.path else url


@dataclass
class Front:
    url: str
    metrics: Metrics
    registry: dict[str, str]  # replica id -> live URL: what the store's replica_url answers
    owners: FakeOwners
    handlers: list[asyncio.Task[Any]]
    drain: Drain


async def routed(owners: Registry, request: web.Request, here: str, now: float) -> Route:
    """Where ``request`` goes as routing decides it: its session and kind, the owner read, then ``decide``."""
    asked = routed_session(request, request.headers.get(SESSION_HEADER))
    if asked is None:
        return Serve()
    return await decide(owners, request, asked, await owners.owner(asked.session_id), here, now)


@pytest.fixture
def owner() -> Owner:
    return Owner()


@contextlib.asynccontextmanager
async def running_front(serve: ServeApp, owner_url: str) -> AsyncIterator[Front]:
    """This replica: every session is owned by ``OWNER``, whose URL the registry has as ``owner_url``."""
    metrics = Metrics()
    registry = {OWNER: owner_url}
    drain = Drain()  # the replica's drain, as app.build_app gives it to its hop
    hop = Hop(HERE, metrics, connect_timeout=5.0, first_byte_timeout=1.0, stall_timeout=5.0, drain=drain)
    await hop.start()
    owners = FakeOwners(registry)
    handlers: list[asyncio.Task[Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        body = await request.read()
        owners.path = request.query.get("path")  # a test's pick among the owner's paths
        decision = await routed(owners, request, HERE, now=0.0)
        match decision:
            case Forward(url=url):
                return await hop.forward(request, body, url, request_id=7)
            case Refuse(error=error):
                return hop.reject(request, error, None)
            case Serve():
                return web.Response(text="served here")
            case TakeOver():
                return web.Response(status=599, text="take over")
        raise AssertionError(decision)

    app = web.Application()
    app.router.add_route("*", "/mcp", handler)
    url = await serve(app)
    try:
        yield Front(url, metrics, registry, owners, handlers, drain)
    finally:
        await hop.close()


@pytest.fixture
async def front(serve: ServeApp, owner: Owner) -> AsyncIterator[Front]:
    async with running_front(serve, await serve(owner.app())) as front:
        yield front


async def _first_event(resp: aiohttp.ClientResponse) -> bytes:
    return await asyncio.wait_for(resp.content.readuntil(b"\n\n"), HANG_GUARD)


def _forwarded(metrics: Metrics, outcome: str) -> float:
    return sample(metrics, "mcpresume_forwarded_requests_total", outcome=outcome)


async def test_an_sse_answer_streams_through_the_hop_event_by_event(front: Front, owner: Owner) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(front.url, headers={SESSION_HEADER: SESSION, "Accept": "text/event-stream"}) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers[SESSION_HEADER] == SESSION
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), HANG_GUARD)
        assert first == b"id: 1\ndata: first\n\n"
        assert not owner.stream_finished  # it came through while the owner's answer was still going
        owner.step.set()
        rest = await asyncio.wait_for(resp.content.read(), HANG_GUARD)
    assert rest == b"id: 2\ndata: second\n\n"
    assert owner.stream_finished
    assert _forwarded(front.metrics, "relayed") == 1
    assert [entry["method"] for entry in owner.seen] == ["GET"]


async def test_the_hop_keeps_the_clients_headers_and_adds_only_its_own(front: Front, owner: Owner) -> None:
    headers = [
        (SESSION_HEADER, SESSION),
        ("Authorization", "Bearer token-1"),
        ("MCP-Protocol-Version", "2025-06-18"),
        ("X-Repeated", "one"),
        ("X-Repeated", "two"),
        ("Host", "mcp.example.com"),
        ("Origin", "https://app.example.com"),
        ("Connection", "keep-alive, X-Per-Hop"),  # names a field as hop-by-hop for this message
        ("X-Per-Hop", "dropped"),
        ("TE", "trailers"),
        ("Content-Type", "application/json"),
    ]
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}'
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding", "User-Agent"]) as http,
        http.post(URL(front.url + "?a=%2F%20b&c=d%26e", encoded=True), headers=headers, data=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["X-Owner"] == OWNER  # the owner's answer headers come back
        assert resp.headers[SESSION_HEADER] == SESSION
        echoed = await resp.json()
    (seen,) = owner.seen
    assert seen == echoed
    assert seen["method"] == "POST" and seen["body"] == body.decode()
    assert seen["path_qs"] == "/mcp?a=%2F%20b&c=d%26e"  # the query as the client sent it
    got = [(name.lower(), value) for name, value in seen["headers"]]
    named = dict(got)
    assert named[SESSION_HEADER.lower()] == SESSION
    assert named["authorization"] == "Bearer token-1"
    assert named["mcp-protocol-version"] == "2025-06-18"
    assert [value for name, value in got if name == "x-repeated"] == ["one", "two"]
    assert named["host"] == "mcp.example.com"  # the owner checks allowed_hosts against the client's Host
    assert named["origin"] == "https://app.example.com"
    assert named["x-forwarded-for"] == "127.0.0.1"
    assert named["x-forwarded-host"] == "mcp.example.com"
    assert named[HOP_HEADER.lower()] == HERE  # the one header the hop adds: who forwarded it
    assert [value for name, value in got if name == HOP_HEADER.lower()] == [HERE]
    for dropped in ("x-per-hop", "te", "accept-encoding", "user-agent"):
        assert dropped not in named, dropped  # hop-by-hop, or never sent by the client
    assert _forwarded(front.metrics, "relayed") == 1


async def test_the_owners_status_and_body_come_back_as_they_are(front: Front, owner: Owner) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.delete(front.url + "?status=404", headers={SESSION_HEADER: SESSION}) as resp,
    ):
        assert resp.status == 404
        assert resp.content_type == "application/json"
        assert (await resp.json())["method"] == "DELETE"
    assert [entry["method"] for entry in owner.seen] == ["DELETE"]


async def test_a_request_that_already_hopped_is_not_forwarded_again(front: Front, owner: Owner) -> None:
    async with aiohttp.ClientSession() as http:
        for method in ("POST", "GET", "DELETE"):
            async with http.request(
                method, front.url, headers={SESSION_HEADER: SESSION, HOP_HEADER: "pod-c"}, data=b"{}"
            ) as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
                assert error["data"]["reason"] == "misrouted_hop"
        # A re-attach is served wherever it lands, with or without the header: never forwarded.
        async with http.get(
            front.url, headers={SESSION_HEADER: SESSION, LAST_EVENT_ID_HEADER: "c1", HOP_HEADER: "pod-c"}
        ) as resp:
            assert resp.status == 200 and await resp.text() == "served here"
    assert owner.seen == []  # the owner never saw any of them
    assert sum(_forwarded(front.metrics, o) for o in ("relayed", "client_gone", "owner_broke")) == 0


async def test_requests_routing_does_not_depend_on_never_ask_the_store(front: Front, owner: Owner) -> None:
    async with aiohttp.ClientSession() as http:
        # initialize (no session id), another method, and a session id the handler refuses (400)
        for method, headers in (
            ("POST", {}),
            ("PUT", {SESSION_HEADER: SESSION}),
            ("POST", {SESSION_HEADER: "x" * (MAX_SESSION_ID_LEN + 1)}),
        ):
            async with http.request(method, front.url, headers=headers, data=b"{}") as resp:
                assert resp.status == 200 and await resp.text() == "served here"
    assert front.owners.asked == [] and owner.seen == []


def test_a_hop_header_from_outside_is_never_passed_on() -> None:
    # What arrives under the hop header's name is dropped from every forwarded request (to the upstream
    # and to another replica); a forwarding replica sets its own (checked above).
    headers = [(HOP_HEADER, "pod-z"), (HOP_HEADER.lower(), "pod-y"), ("X-Kept", "1")]
    assert end_to_end(headers, request=True) == [("X-Kept", "1")]


async def test_an_owner_that_cannot_be_reached_is_502_owner_unreachable(front: Front) -> None:
    with socket.socket() as sock:  # a port nothing listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    front.registry[OWNER] = f"http://127.0.0.1:{port}/mcp"
    async with (
        aiohttp.ClientSession() as http,
        http.post(front.url, headers={SESSION_HEADER: SESSION}, data=b"{}") as resp,
    ):
        assert resp.status == 502
        body = await resp.json()
    assert body["id"] == 7 and body["error"]["data"]["reason"] == "owner_unreachable"
    assert _forwarded(front.metrics, "owner_unreachable") == 1


async def test_an_owner_that_sends_no_answer_head_in_time_is_502(front: Front, owner: Owner) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(front.url + "?path=/silent", headers={SESSION_HEADER: SESSION}, data=b"{}") as resp,
    ):
        assert resp.status == 502
        assert (await resp.json())["error"]["data"]["reason"] == "owner_unreachable"
    assert len(owner.seen) == 1  # it got there: the owner took it and said nothing within the bound
    assert _forwarded(front.metrics, "owner_unreachable") == 1


def test_the_hop_waits_longer_for_the_owners_head_than_the_owner_waits_for_its_upstream() -> None:
    # The owner answers a slow upstream with its own 504 after a credential ping and the request, each a
    # connect plus a first byte at most: the hop's bound is past both, so the client gets that 504.
    connect, first_byte = 10.0, 120.0
    assert owner_head_timeout(connect, first_byte) > 2 * (connect + first_byte)


async def test_a_client_that_leaves_closes_the_hop(front: Front, owner: Owner) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.get(front.url, headers={SESSION_HEADER: SESSION})
        assert await _first_event(resp) == b"id: 1\ndata: first\n\n"
        resp.close()  # the client goes away in the middle of the stream
        await asyncio.wait_for(owner.stream_closed.wait(), HANG_GUARD)
    assert not owner.stream_finished  # the owner's handler was cancelled: its client (the hop) left
    assert _forwarded(front.metrics, "client_gone") == 1
    assert _forwarded(front.metrics, "relayed") == 0


async def test_an_owner_that_dies_mid_stream_ends_the_clients_stream(front: Front, owner: Owner) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(front.url + "?path=/broken", headers={SESSION_HEADER: SESSION}) as resp,
    ):
        assert await _first_event(resp) == b"id: 1\ndata: first\n\n"
        owner.step.set()
        # The stream ends (the client re-attaches with its cursor, on any replica): no hang, no more events.
        assert await asyncio.wait_for(resp.content.read(), HANG_GUARD) == b""
    assert _forwarded(front.metrics, "owner_broke") == 1


async def test_a_drain_ends_a_forwarded_stream_cleanly_and_closes_the_hop(front: Front, owner: Owner) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(front.url, headers={SESSION_HEADER: SESSION}) as resp,
    ):
        assert await _first_event(resp) == b"id: 1\ndata: first\n\n"
        assert len(front.handlers) == 1  # the one stream being relayed
        assert front.drain.end_views() == 1  # what the drain does at its deadline (Drain.run, step 4)
        # The client's stream ends cleanly (it re-attaches with its cursor elsewhere); nothing more comes.
        assert await asyncio.wait_for(resp.content.read(), HANG_GUARD) == b""
        await asyncio.wait_for(owner.stream_closed.wait(), HANG_GUARD)
    assert not owner.stream_finished  # the hop closed: the owner saw its client (this replica) leave
    assert _forwarded(front.metrics, "drained") == 1


async def test_through_the_hop_a_real_owner_serves_its_session_unchanged(
    serve: ServeApp, example_upstream: str
) -> None:
    """The owner is a real proxy in front of the SDK's example server: a call made through the hop
    streams with the owner's session id and cursors (a re-attach at the owner with one of them gets
    exactly the rest), and a DELETE through the hop ends the session at the owner."""
    async with (
        running_proxy(example_upstream) as proxy,
        running_front(serve, proxy.url) as front,
        aiohttp.ClientSession() as http,
    ):
        at_owner = ScriptedClient(http, proxy.url)
        await at_owner.initialize()  # initialize is served where it lands: here, the owner
        via_hop = ScriptedClient(http, front.url)
        via_hop.session_id = at_owner.session_id
        via_hop.next_id = at_owner.next_id  # the session's next request id (a re-used one is a duplicate)
        request_id, body = via_hop.tool_call("count_slowly", {"n": 4, "delay": 0.01})
        async with http.post(via_hop.url, data=body, headers=via_hop.headers()) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert resp.headers[SESSION_HEADER] == at_owner.session_id
            events = await collect(resp)
        messages = [(e.id.decode() if e.id else "", orjson.loads(e.data)) for e in events if e.data]
        progress = [
            m["params"]["progress"] for _, m in messages if m.get("method") == "notifications/progress"
        ]
        assert progress == [1, 2, 3, 4]
        assert [m for _, m in messages if m.get("id") == request_id] != []
        # The cursors are the owner's: a re-attach at the owner after the second event gets the rest.
        cursor = messages[1][0]
        headers = at_owner.headers(**{LAST_EVENT_ID_HEADER: cursor})
        async with http.get(proxy.url, headers=headers) as resp:
            assert resp.status == 200
            rest = [orjson.loads(e.data) for e in await collect(resp) if e.data]
        assert rest == [m for _, m in messages[2:]]
        async with http.delete(via_hop.url, headers=via_hop.headers()) as resp:
            assert resp.status < 300
        async with http.post(proxy.url, data=body, headers=at_owner.headers()) as resp:
            assert resp.status == 404
            assert (await error_of(resp))["data"]["reason"] == "unknown_session"
    assert _forwarded(front.metrics, "relayed") == 2


def _memory_store() -> MemoryStore:
    return MemoryStore(WindowLimits(64, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None)


def _request(method: str, headers: dict[str, str]) -> web.Request:
    return make_mocked_request(method, "/mcp", headers=headers)


async def test_routing_on_the_memory_stores_owners_and_leases() -> None:
    """Routing on a real store (the memory backend's registry): the owner it recorded at create_session, its
    URL while the lease lives, no URL once it lapsed or was released."""
    store = _memory_store()
    await store.create_session("theirs", now=0.0, owner=OWNER)
    await store.create_session("mine", now=0.0, owner=HERE)
    await store.create_session("untagged", now=0.0)  # no owner recorded: one replica, as today
    await store.register_replica(OWNER, "http://10.0.0.2:8080/mcp", ttl=10.0, now=0.0)

    async def planned(session: str, now: float, method: str = "POST", **headers: str) -> Route:
        return await routed(store, _request(method, {SESSION_HEADER: session, **headers}), HERE, now)

    assert await planned("theirs", 5.0) == Forward("http://10.0.0.2:8080/mcp")
    assert await planned("mine", 5.0) == Serve()
    assert await planned("untagged", 5.0) == Serve()
    assert await planned("unknown", 5.0) == Serve()  # the handler answers 404 (or adopts) as today
    assert await planned("theirs", 5.0, "GET", **{LAST_EVENT_ID_HEADER: "c"}) == Serve()  # re-attach
    # A POST with a cursor carries messages for the upstream too: the owner's.
    assert await planned("theirs", 5.0, **{LAST_EVENT_ID_HEADER: "c"}) == Forward("http://10.0.0.2:8080/mcp")
    refused = await planned("theirs", 5.0, **{HOP_HEADER: "pod-c"})
    assert isinstance(refused, Refuse) and refused.error.reason == "misrouted_hop"
    assert await planned("theirs", 10.0) == TakeOver(OWNER)  # the lease lapsed
    await store.register_replica(OWNER, "http://10.0.0.2:8080/mcp", ttl=10.0, now=10.0)  # renewed
    assert await planned("theirs", 15.0) == Forward("http://10.0.0.2:8080/mcp")
    await store.release_replica(OWNER)  # a drain released it: the takeover starts at once
    assert await planned("theirs", 15.0) == TakeOver(OWNER)
    assert await planned("theirs", 15.0, "GET", **{LAST_EVENT_ID_HEADER: "c"}) == Serve(lost_owner=OWNER)
