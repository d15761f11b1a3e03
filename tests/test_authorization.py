"""A session's events go only to requests whose credentials the upstream accepted for that session
(ARCHITECTURE.md, invariant #11).

The upstream here checks ``Authorization`` on every request, as the SDKs' servers do, and answers 401 with
a ``WWW-Authenticate`` challenge to any bearer token that does not own the session. Through the proxy, a
client holding the session id and another (valid) token must get that same refusal wherever the proxy would
answer from its window: the facts in a 409, a re-attach with the owner's cursors, a re-sent request id, and
the live standalone stream. A refreshed token the upstream accepts works as the old one did.

The same holds for upstreams that take credentials elsewhere (a cookie, an API key header, the query
string), for hostile spellings of the headers, and for upstreams that refuse in the JSON-RPC layer; a
request with another token claims nothing of the owner's, and costs one ping.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from mcpresume.core.credentials import (
    MAX_CREDENTIALS,
    MAX_PING_ANSWER,
    Access,
    PingAnswer,
    access,
    credential_digest,
    credential_fields,
    remember,
)
from mcpresume.daemon.app import RunningProxy
from tests.conftest import ServeApp
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy, sse_events
from tests.support.scripted import catch_all, initialize_answer

CHALLENGE = 'Bearer realm="mcp", error="invalid_token"'
SECRET = "the owner's secret result"


@dataclass
class AuthUpstream:
    """Checks the bearer token of every request; a session belongs to the user whose token began it."""

    users: dict[str | None, str] = field(
        default_factory=lambda: {
            "Bearer owner-1": "alice",
            "Bearer owner-2": "alice",  # alice's refreshed token
            "Bearer intruder": "mallory",  # a valid user of the upstream, not of alice's sessions
        }
    )
    sessions: dict[str, str] = field(default_factory=dict)
    seen: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # (HTTP, JSON-RPC, token)
    standalone: dict[str, asyncio.Queue[bytes]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    cut_ids: dict[str, int] = field(default_factory=dict)  # upstream event id -> the request it was cut in
    foreign_status: int = 401  # the answer to a valid token that does not own the session (or 404)
    ping_as_sse: bool = False  # answer a ping as the SDKs' servers do by default: an SSE stream
    # Where credentials come: a header (Cookie: sid=<token>; else <token>), or "?<name>", a query parameter.
    credential: str = "Authorization"
    # Ownership checked in the JSON-RPC layer: another user's request is answered 200 with an error, and
    # its notification 202 (nothing to answer), as a server whose tools check the caller does.
    in_band: bool = False
    hold: asyncio.Event | None = None  # set: mallory's requests wait for it (a slow token check)
    held: asyncio.Event = field(default_factory=asyncio.Event)  # set when one of mallory's is held
    cut: bool = False  # a tool's stream ends after its second event; the rest comes to GET + Last-Event-ID
    ping_status: int | None = None  # answer every ping with this status (an upstream in trouble)

    def app(self) -> web.Application:
        return catch_all(self.handle)

    def calls(self, method: str) -> list[str | None]:
        """The tokens of the JSON-RPC requests of ``method`` the upstream received."""
        return [token for _, seen, token in self.seen if seen == method]

    def refuse(self) -> web.Response:
        return web.Response(status=401, headers={"WWW-Authenticate": CHALLENGE}, text="invalid_token")

    def token_of(self, request: web.Request) -> str | None:
        if self.credential.startswith("?"):  # a query parameter: /mcp?api_key=<token>
            token = request.query.get(self.credential[1:])
            return None if token is None else f"Bearer {token}"
        value = request.headers.get(self.credential)
        if value is None or self.credential == "Authorization":
            return value
        return "Bearer " + value.removeprefix("sid=")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        token = self.token_of(request)
        message: dict[str, Any] = orjson.loads(await request.read()) if request.method == "POST" else {}
        self.seen.append((request.method, message.get("method"), token))
        user = self.users.get(token)
        if user is None:
            return self.refuse()
        if user == "mallory" and self.hold is not None:
            self.held.set()
            await self.hold.wait()
        if message.get("method") == "initialize":
            session_id = f"auth-session-{next(self._ids)}"
            self.sessions[session_id] = user
            return initialize_answer(message, session_id, "auth")
        session_id = request.headers.get("Mcp-Session-Id", "")
        if session_id not in self.sessions:
            return web.Response(status=404, text="session not found")
        if self.sessions[session_id] != user and self.in_band and request.method == "POST":
            if "id" not in message:
                return web.Response(status=202)
            error = {"code": -32001, "message": "this session is not yours"}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error})
        if self.sessions[session_id] != user:  # checked on every request: the session id is no credential
            return self.refuse() if self.foreign_status == 401 else web.Response(status=404, text="no such")
        if request.method == "GET" and "Last-Event-ID" in request.headers:
            return await self.tool_stream(request, self.cut_ids.pop(request.headers["Last-Event-ID"]))
        if request.method == "GET":
            return await self.standalone_stream(request, session_id)
        if request.method == "DELETE":
            return web.Response(status=200)
        if "id" not in message:
            return web.Response(status=202)
        if message["method"] == "ping" and self.ping_status is not None:
            return web.Response(status=self.ping_status, text="try later")
        if message["method"] == "ping":
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": {}}
            if not self.ping_as_sse:
                return web.json_response(answer)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"id: PING-0\ndata: \n\nid: PING-1\ndata: " + orjson.dumps(answer) + b"\n\n")
            return response
        return await self.tool_stream(request, message["id"])

    async def tool_stream(self, request: web.Request, request_id: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        resumed = "Last-Event-ID" in request.headers
        if self.cut and not resumed:
            await response.write(b"retry: 0\n\n")  # the proxy's pump resumes at once
        for k in range(2, 3) if resumed else range(3):
            if self.cut and not resumed and k == 2:
                self.cut_ids["UPSTREAM-1"] = request_id
                return response  # ended early: the pump resumes it with GET + Last-Event-ID
            note = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": k}}
            await response.write(f"id: UPSTREAM-{k}\ndata: ".encode() + orjson.dumps(note) + b"\n\n")
        result = {
            "jsonrpc": "2.0",
            "id": request_id,
            "result": {"content": [{"type": "text", "text": SECRET}]},
        }
        await response.write(b"id: UPSTREAM-3\ndata: " + orjson.dumps(result) + b"\n\n")
        return response

    async def standalone_stream(self, request: web.Request, session_id: str) -> web.StreamResponse:
        queue = self.standalone.setdefault(session_id, asyncio.Queue())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(b"data: " + await queue.get() + b"\n\n")


class Client(ScriptedClient):
    """The scripted client, with a token on every request (None: without credentials), in ``credential``:
    ``Authorization: Bearer <token>``, ``Cookie: sid=<token>``, or ``<header>: <token>``."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, token: str | None, credential: str = "Authorization"
    ) -> None:
        super().__init__(http, url)
        self.token = token
        self.credential = credential

    def headers(self, **extra: str) -> dict[str, str]:
        headers = super().headers(**extra)
        if self.token is not None:
            value = {"Authorization": "Bearer {}", "Cookie": "sid={}"}.get(self.credential, "{}")
            headers.setdefault(self.credential, value.format(self.token))
        return headers

    def as_(self, token: str | None) -> Client:
        """Another client presenting ``token`` with this client's session id."""
        other = Client(self.http, self.url, token, self.credential)
        other.session_id = self.session_id
        other.next_id = self.next_id
        return other


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def upstream() -> AuthUpstream:
    return AuthUpstream()


@pytest.fixture
async def proxy(serve: ServeApp, upstream: AuthUpstream) -> AsyncIterator[RunningProxy]:
    async with running_proxy(await serve(upstream.app())) as running:
        yield running


async def owner_with_a_result(
    http: aiohttp.ClientSession, proxy: RunningProxy, credential: str = "Authorization"
) -> tuple[Client, int, list[str]]:
    """Alice begins a session and calls a tool; its request id and the cursors of its stream."""
    owner = Client(http, proxy.url, "owner-1", credential)
    await owner.initialize()
    request_id, body = owner.tool_call("secret", {})
    async with http.post(proxy.url, data=body, headers=owner.headers()) as response:
        assert response.status == 200
        events = await collect(response)
    assert SECRET in events[-1].data.decode()
    return owner, request_id, [event.id.decode() for event in events if event.id]


async def refused(response: aiohttp.ClientResponse) -> bytes:
    """The upstream's own refusal, relayed: its status and challenge, and nothing of the session."""
    assert response.status == 401
    assert response.headers.getall("WWW-Authenticate") == [CHALLENGE]
    body = await response.read()
    assert orjson.loads(body)["error"]["data"] == {"reason": "credentials_refused"}
    return body


async def test_a_409_to_another_token_names_no_cursor_of_the_session(http, proxy, upstream) -> None:
    owner, _, cursors = await owner_with_a_result(http, proxy)
    epoch = cursors[0].split("-")[0]
    probes = ("aaaaaaaaaaaa-1-1", f"{epoch}-1-999999")  # foreign, ahead: both 409s name oldest and newest
    for cursor in probes:
        async with http.get(proxy.url, headers=owner.headers(**{"Last-Event-ID": cursor})) as response:
            assert response.status == 409  # the owner is told the session's facts
            assert (await error_of(response))["data"]["newest"] == cursors[-1]
    intruder = owner.as_("intruder")
    for cursor in probes:
        async with http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursor})) as response:
            body = await refused(response)
        assert epoch.encode() not in body
    assert upstream.calls("ping") == ["Bearer intruder"] * len(probes)  # asked each time, refused each time


async def test_a_reattach_with_the_owners_cursors_is_refused(http, proxy, upstream) -> None:
    owner, _, cursors = await owner_with_a_result(http, proxy)
    intruder = owner.as_("intruder")
    for cursor in cursors[:-1]:  # every one below the newest would replay the result
        async with http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursor})) as response:
            assert SECRET.encode() not in await refused(response)
    # POST + Last-Event-ID (the re-POST case): refused before anything is forwarded.
    _, body = intruder.tool_call("secret", {})
    async with http.post(
        proxy.url, data=body, headers=intruder.headers(**{"Last-Event-ID": cursors[0]})
    ) as response:
        assert SECRET.encode() not in await refused(response)
    assert upstream.calls("tools/call") == ["Bearer owner-1"]


async def test_a_resent_request_id_of_the_owner_is_refused(http, proxy, upstream) -> None:
    owner, request_id, _ = await owner_with_a_result(http, proxy)
    intruder = owner.as_("intruder")
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "x"}})
    async with http.post(proxy.url, data=body, headers=intruder.headers()) as response:
        assert SECRET.encode() not in await refused(response)
    assert upstream.calls("tools/call") == ["Bearer owner-1"]  # not forwarded: the ping was refused
    assert upstream.calls("ping") == ["Bearer intruder"]


async def test_the_live_standalone_stream_is_not_joined_with_another_token(http, proxy, upstream) -> None:
    owner, _, _ = await owner_with_a_result(http, proxy)
    async with http.get(proxy.url, headers=owner.headers()) as standalone:
        assert standalone.status == 200
        events = aiter(sse_events(standalone))
        assert (await anext(events)).data == b""  # priming: the upstream GET is open, its pump running
        async with http.get(proxy.url, headers=owner.as_("intruder").headers()) as response:
            await refused(response)
        async with http.get(proxy.url, headers=owner.as_(None).headers()) as response:
            await refused(response)  # no credentials at all: asked about too, and refused
        upstream.standalone[owner.session_id].put_nowait(b'{"jsonrpc":"2.0","method":"notifications/x"}')
        assert b"notifications/x" in (await anext(events)).data  # the owner still gets them
    assert [token for method, _, token in upstream.seen if method == "GET"] == ["Bearer owner-1"]


@pytest.mark.parametrize("ping_as_sse", [False, True])
async def test_a_refreshed_token_the_upstream_accepts_is_served(http, proxy, upstream, ping_as_sse) -> None:
    upstream.ping_as_sse = ping_as_sse
    owner, request_id, cursors = await owner_with_a_result(http, proxy)
    refreshed = owner.as_("owner-2")
    for _ in range(2):
        async with http.get(
            proxy.url, headers=refreshed.headers(**{"Last-Event-ID": cursors[1]})
        ) as response:
            assert response.status == 200
            events = await collect(response)
        assert [e.id.decode() for e in events if e.id] == cursors[2:]
        assert SECRET in events[-1].data.decode()
    assert upstream.calls("ping") == ["Bearer owner-2"]  # asked once; then remembered
    # The re-sent request id too, and the old token is still one the upstream accepted.
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "x"}})
    for client in (refreshed, owner):
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    assert upstream.calls("ping") == ["Bearer owner-2"]
    assert upstream.calls("tools/call") == ["Bearer owner-1"]


async def test_a_session_begun_without_credentials_is_served_as_before(http, serve) -> None:
    upstream = AuthUpstream()
    upstream.users[None] = "anonymous"
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = Client(http, proxy.url, None)
        await client.initialize()
        _, body = client.tool_call("secret", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            cursors = [e.id.decode() for e in await collect(response) if e.id]
        async with http.get(proxy.url, headers=client.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    assert upstream.calls("ping") == []


def bearer(*tokens: str) -> bytes:
    return credential_digest([("authorization", f"Bearer {token}") for token in tokens])


def test_access_decision_table() -> None:
    one, two = bearer("a"), bearer("b")
    none = credential_digest([])
    assert access((), one) is Access.OPEN
    assert access((), none) is Access.OPEN
    assert access((one,), one) is Access.ALLOW
    assert access((two, one), one) is Access.ALLOW
    assert access((one,), two) is Access.VERIFY
    assert access((one,), none) is Access.VERIFY
    assert none not in (one, two, credential_digest([("authorization", "")]))
    assert bearer("a", "b") not in (one, two)


def test_the_credentials_are_every_credential_header_together() -> None:
    names = ("authorization", "cookie", "x-api-key")
    request = [("Cookie", "b=2"), ("Accept", "*/*"), ("AUTHORIZATION", "Bearer a"), ("cookie", "a=1")]
    fields = credential_fields(request, names)
    assert fields == (("authorization", "Bearer a"), ("cookie", "b=2"), ("cookie", "a=1"))
    assert credential_digest(fields) != bearer("a")  # the cookies count too
    assert credential_fields(request, ()) == ()  # credential_headers = []: nothing is a credential
    # The same value in another header is other credentials.
    assert credential_digest([("cookie", "k")]) != credential_digest([("x-api-key", "k")])


def test_remember_keeps_the_newest_few() -> None:
    digests = [bearer(str(i)) for i in range(MAX_CREDENTIALS + 2)]
    assert remember((), digests[0]) == ()  # a session begun without credentials stays open
    stored: tuple[bytes, ...] = (digests[0],)
    for digest in digests[1:]:
        stored = remember(stored, digest)
    assert stored == tuple(digests[-MAX_CREDENTIALS:])
    assert remember(stored, digests[-MAX_CREDENTIALS]) == (
        *digests[-MAX_CREDENTIALS + 1 :],
        digests[-MAX_CREDENTIALS],
    )


def ping_accepted(status: int, content_type: str, body: bytes, ping_id: str, chunk: int = 1 << 20) -> bool:
    answer = PingAnswer(status, content_type, ping_id)
    for start in range(0, len(body), chunk):
        if answer.feed(body[start : start + chunk]):
            break
    return answer.end()


def test_ping_accepted_only_for_a_2xx_with_its_result() -> None:
    result = b'{"jsonrpc":"2.0","id":"p","result":{}}'
    assert ping_accepted(200, "application/json", result, "p")
    assert ping_accepted(200, "text/event-stream", b"id: 1\ndata: " + result + b"\n\n", "p")
    assert not ping_accepted(401, "application/json", result, "p")
    assert not ping_accepted(200, "application/json", result, "q")
    assert not ping_accepted(200, "application/json", b'{"jsonrpc":"2.0","id":"p","error":{}}', "p")
    assert not ping_accepted(200, "text/plain", result, "p")
    assert not ping_accepted(200, "text/event-stream", b"data: " + result, "p")  # not a complete event
    sse = b": hello\n\nid: 1\ndata: \n\nid: 2\ndata: " + result + b"\n\n"
    assert all(ping_accepted(200, "text/event-stream", sse, "p", chunk) for chunk in (1, 7, len(sse)))
    assert all(ping_accepted(200, "application/json", result, "p", chunk) for chunk in (1, 5))
    big = b"data: " + b"x" * MAX_PING_ANSWER + b"\n\n" + b"data: " + result + b"\n\n"
    assert not ping_accepted(200, "text/event-stream", big, "p", 4096)  # more than a ping's answer


async def test_an_upstream_404_to_another_users_token_does_not_end_the_session(http, serve) -> None:
    """Some upstreams answer 404 to a session id of another user: that ends nothing for the owner."""
    upstream = AuthUpstream(foreign_status=404)
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        intruder = owner.as_("intruder")
        _, body = intruder.tool_call("secret", {})
        async with http.post(proxy.url, data=body, headers=intruder.headers()) as response:
            assert response.status == 404  # the upstream's answer, relayed
        async with http.get(proxy.url, headers=intruder.headers()) as response:
            assert response.status == 404
            assert (await error_of(response))["data"]["reason"] == "unknown_session"  # the ping's answer
        async with http.delete(proxy.url, headers=intruder.headers()) as response:
            assert response.status == 404
        assert await proxy.ctx.store.has_session(owner.session_id)
        async with http.get(proxy.url, headers=owner.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()


async def test_the_official_sdk_server_answers_the_ping_and_accepts_new_credentials(
    http, example_upstream
) -> None:
    """The SDK's server (no auth configured) accepts any credentials: the ping in its session, answered
    as it answers every POST, lets a re-attach with another token through."""
    async with running_proxy(example_upstream) as proxy:
        owner = Client(http, proxy.url, "one")
        await owner.initialize()
        _, body = owner.tool_call("count_slowly", {"n": 3, "delay": 0})
        async with http.post(proxy.url, data=body, headers=owner.headers()) as response:
            cursors = [e.id.decode() for e in await collect(response) if e.id]
        other = owner.as_("two")
        async with http.get(proxy.url, headers=other.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 200
            assert [e.id.decode() for e in await collect(response) if e.id] == cursors[1:]
        granted = await proxy.ctx.store.access(owner.session_id)
        assert granted is not None and len(granted.credentials) == 2
        assert granted.protocol_version == "2025-11-25"


# -- hostile clients, and upstreams that take credentials elsewhere -------------------------------------


@pytest.mark.parametrize(
    ("credential", "settings"),
    [
        ("Cookie", {}),
        ("X-API-Key", {}),
        ("X-Tenant-Token", {"credential_headers": ["Authorization", "X-Tenant-Token"]}),
    ],
)
async def test_credentials_in_other_headers_are_bound_too(http, serve, credential, settings) -> None:
    """An upstream that authenticates with a cookie or an API key header: the session is bound to that
    header as to ``Authorization``; the ping and the pump's own upstream resume carry it."""
    upstream = AuthUpstream(credential=credential, cut=True)
    async with running_proxy(await serve(upstream.app()), **settings) as proxy:
        owner, request_id, cursors = await owner_with_a_result(http, proxy, credential)
        assert [method for method, _, _ in upstream.seen].count("GET") == 1  # the pump's resume, accepted
        for intruder in (owner.as_("intruder"), owner.as_(None)):
            async with http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursors[0]})) as r:
                assert SECRET.encode() not in await refused(r)
            body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {}})
            async with http.post(proxy.url, data=body, headers=intruder.headers()) as response:
                assert SECRET.encode() not in await refused(response)
        async with http.get(
            proxy.url, headers=owner.as_("owner-2").headers(**{"Last-Event-ID": cursors[0]})
        ) as response:
            assert response.status == 200  # a refreshed credential the upstream accepts, when asked
            assert SECRET in (await collect(response))[-1].data.decode()
    assert upstream.calls("ping") == ["Bearer intruder", "Bearer intruder", None, None, "Bearer owner-2"]
    assert upstream.calls("tools/call") == ["Bearer owner-1"]


async def test_no_credential_headers_turns_the_binding_off(http, serve) -> None:
    upstream = AuthUpstream()
    async with running_proxy(await serve(upstream.app()), credential_headers=[]) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        async with http.get(proxy.url, headers=owner.as_(None).headers(**{"Last-Event-ID": cursors[0]})) as r:
            assert r.status == 200  # as documented: nothing is checked
    assert upstream.calls("ping") == []


async def test_another_token_claims_no_request_id_while_the_upstream_checks_it(http, proxy, upstream) -> None:
    """A client with the session id and another token sends the owner's next request id: while the
    upstream takes its time refusing it, the owner's own request with that id is forwarded and answered,
    not refused as a duplicate (nor counted against the owner's views)."""
    owner = Client(http, proxy.url, "owner-1")
    await owner.initialize()
    _, body = owner.tool_call("secret", {})
    upstream.hold = asyncio.Event()
    intruder = asyncio.ensure_future(http.post(proxy.url, data=body, headers=owner.as_("intruder").headers()))
    try:
        await upstream.held.wait()  # mallory's request reached the upstream, which is checking it
        async with http.post(proxy.url, data=body, headers=owner.headers()) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    finally:
        upstream.hold.set()
        async with await intruder as response:
            await refused(response)
    assert upstream.calls("tools/call") == ["Bearer owner-1"]


async def test_a_notification_the_upstream_takes_from_anyone_admits_no_one(http, serve) -> None:
    """An upstream that checks who calls in its JSON-RPC layer answers another user's notification 202
    (there is nothing to refuse) and its requests with an error: neither makes those credentials ones
    the session's window is served to."""
    upstream = AuthUpstream(in_band=True)
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        intruder = owner.as_("intruder")
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"})
        async with http.post(proxy.url, data=note, headers=intruder.headers()) as response:
            assert response.status == 202
        async with http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 403  # the ping's answer was an error: refused
            assert SECRET.encode() not in await response.read()
    assert upstream.calls("ping") == ["Bearer intruder"]


@pytest.mark.parametrize(
    "extra",
    [
        [("authorization", "Bearer intruder")],  # another casing of the name
        [("Authorization", "Bearer intruder"), ("Authorization", "Bearer intruder")],  # repeated
        [("Authorization", "")],
        [("Proxy-Authorization", "Bearer owner-1")],  # for the proxy: never forwarded, so no credential
        [("Cookie", "sid=owner-1")],  # the owner's token where this upstream does not read it
        [("Authorization", "Bearer owner-1, Bearer intruder")],
    ],
)
async def test_header_tricks_get_the_upstreams_refusal(http, proxy, upstream, extra) -> None:
    owner, _, cursors = await owner_with_a_result(http, proxy)
    headers = CIMultiDict(owner.as_(None).headers(**{"Last-Event-ID": cursors[0]}))
    for name, value in extra:
        headers.add(name, value)
    async with http.get(proxy.url, headers=headers) as response:
        assert SECRET.encode() not in await refused(response)
    assert len(upstream.calls("ping")) == 1


async def test_each_refused_request_costs_one_ping_and_no_more(http, proxy, upstream) -> None:
    """A flood of requests with another token asks the upstream once per request (what forwarding each
    would cost), concurrently or not; none is forwarded as itself."""
    owner, request_id, cursors = await owner_with_a_result(http, proxy)
    intruder = owner.as_("intruder")
    resend = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {}})

    async def probe(k: int) -> None:
        if k % 3 == 0:
            request = http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursors[k % 4]}))
        elif k % 3 == 1:
            request = http.get(proxy.url, headers=intruder.headers())
        else:
            request = http.post(proxy.url, data=resend, headers=intruder.headers())
        async with request as response:
            await refused(response)

    await asyncio.gather(*(probe(k) for k in range(30)))
    assert upstream.calls("ping") == ["Bearer intruder"] * 30
    assert upstream.calls("tools/call") == ["Bearer owner-1"]
    assert [method for method, _, _ in upstream.seen].count("GET") == 0


async def test_another_token_cannot_end_the_session(http, proxy, upstream) -> None:
    owner, _, cursors = await owner_with_a_result(http, proxy)
    for intruder in (owner.as_("intruder"), owner.as_(None)):
        async with http.delete(proxy.url, headers=intruder.headers()) as response:
            assert response.status == 401  # the upstream's refusal, relayed
    assert await proxy.ctx.store.has_session(owner.session_id)
    async with http.get(proxy.url, headers=owner.headers(**{"Last-Event-ID": cursors[0]})) as response:
        assert SECRET in (await collect(response))[-1].data.decode()


async def test_credentials_that_are_not_utf8_are_refused_cleanly(http, proxy, upstream) -> None:
    """Header bytes that are not UTF-8 (obs-text) digest like any other value: refused, no crash."""
    owner, _, cursors = await owner_with_a_result(http, proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(
            b"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
            b"Mcp-Session-Id: " + owner.session_id.encode() + b"\r\n"
            b"Last-Event-ID: " + cursors[0].encode() + b"\r\n"
            b"Authorization: Bearer \xff\xfe\x80\r\nConnection: close\r\n\r\n"
        )
        answer = await reader.read()
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert SECRET.encode() not in answer
    assert len(upstream.calls("ping")) == 1


async def test_an_upstream_failing_the_ping_is_not_called_a_refusal(http, serve) -> None:
    """A 5xx to the ping says the upstream is in trouble, not that the credentials are wrong: the client is
    told so (and not served), rather than sent to re-authorize."""
    upstream = AuthUpstream(ping_status=503)
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        refreshed = owner.as_("owner-2")
        async with http.get(proxy.url, headers=refreshed.headers(**{"Last-Event-ID": cursors[0]})) as r:
            assert r.status == 502
            assert (await error_of(r))["data"] == {"reason": "upstream_bad_response", "status": 503}


async def test_credentials_in_the_query_string_are_bound_too(http, serve) -> None:
    """Hosted MCP servers often take an API key in the endpoint's URL (``/mcp?api_key=...``): the query
    string counts with the credential headers, so a request at another query (or none) is asked about."""
    upstream = AuthUpstream(credential="?api_key")
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner = Client(http, proxy.url + "?api_key=owner-1", None)
        await owner.initialize()
        _, body = owner.tool_call("secret", {})
        async with http.post(owner.url, data=body, headers=owner.headers()) as response:
            cursors = [e.id.decode() for e in await collect(response) if e.id]
        for url in (proxy.url + "?api_key=intruder", proxy.url):
            async with http.get(url, headers=owner.headers(**{"Last-Event-ID": cursors[0]})) as response:
                assert SECRET.encode() not in await refused(response)
        other = proxy.url + "?x=1&api_key=owner-1"  # another URL with the owner's key: accepted when asked
        async with http.get(other, headers=owner.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert SECRET in (await collect(response))[-1].data.decode()
        async with http.get(owner.url, headers=owner.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert SECRET in (await collect(response))[-1].data.decode()  # the owner's own URL: no ping
    assert upstream.calls("ping") == ["Bearer intruder", None, "Bearer owner-1"]
