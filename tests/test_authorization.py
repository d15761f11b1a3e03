"""A session's events go only to requests whose credentials the upstream accepted for that session.

The upstream here checks ``Authorization`` on every request, as the SDKs' servers do, and answers 401 with
a ``WWW-Authenticate`` challenge to any bearer token that does not own the session. Through the proxy, a
client holding the session id and another (valid) token must get that same refusal wherever the proxy would
answer from its window: the facts in a 409, a re-attach with the owner's cursors, a re-sent request id, and
the live standalone stream. A refreshed token the upstream accepts works as the old one did.
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

from mcpresume.app import RunningProxy
from mcpresume.credentials import (
    MAX_CREDENTIALS,
    Access,
    access,
    credential_digest,
    ping_accepted,
    remember,
)
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
    foreign_status: int = 401  # the answer to a valid token that does not own the session (or 404)
    ping_as_sse: bool = False  # answer a ping as the SDKs' servers do by default: an SSE stream

    def app(self) -> web.Application:
        return catch_all(self.handle)

    def calls(self, method: str) -> list[str | None]:
        """The tokens of the JSON-RPC requests of ``method`` the upstream received."""
        return [token for _, seen, token in self.seen if seen == method]

    def refuse(self) -> web.Response:
        return web.Response(status=401, headers={"WWW-Authenticate": CHALLENGE}, text="invalid_token")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        token = request.headers.get("Authorization")
        message: dict[str, Any] = orjson.loads(await request.read()) if request.method == "POST" else {}
        self.seen.append((request.method, message.get("method"), token))
        user = self.users.get(token)
        if user is None:
            return self.refuse()
        if message.get("method") == "initialize":
            session_id = f"auth-session-{next(self._ids)}"
            self.sessions[session_id] = user
            return initialize_answer(message, session_id, "auth")
        session_id = request.headers.get("Mcp-Session-Id", "")
        if session_id not in self.sessions:
            return web.Response(status=404, text="session not found")
        if self.sessions[session_id] != user:  # checked on every request: the session id is no credential
            return self.refuse() if self.foreign_status == 401 else web.Response(status=404, text="no such")
        if request.method == "GET":
            return await self.standalone_stream(request, session_id)
        if request.method == "DELETE":
            return web.Response(status=200)
        if "id" not in message:
            return web.Response(status=202)
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
        for k in range(3):
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
    """The scripted client, with a bearer token on every request (None: without ``Authorization``)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str | None) -> None:
        super().__init__(http, url)
        self.token = token

    def headers(self, **extra: str) -> dict[str, str]:
        headers = super().headers(**extra)
        if self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        return headers

    def as_(self, token: str | None) -> Client:
        """Another client presenting ``token`` with this client's session id."""
        other = Client(self.http, self.url, token)
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
    http: aiohttp.ClientSession, proxy: RunningProxy
) -> tuple[Client, int, list[str]]:
    """Alice begins a session and calls a tool; its request id and the cursors of its stream."""
    owner = Client(http, proxy.url, "owner-1")
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
    # POST + Last-Event-ID (the design note's client): refused before anything is forwarded.
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


def test_access_decision_table() -> None:
    one, two = credential_digest(["Bearer a"]), credential_digest(["Bearer b"])
    none = credential_digest([])
    assert access((), one) is Access.OPEN
    assert access((), none) is Access.OPEN
    assert access((one,), one) is Access.ALLOW
    assert access((two, one), one) is Access.ALLOW
    assert access((one,), two) is Access.VERIFY
    assert access((one,), none) is Access.VERIFY
    assert none not in (one, two, credential_digest([""]))
    assert credential_digest(["Bearer a", "Bearer b"]) not in (one, two)


def test_remember_keeps_the_newest_few() -> None:
    digests = [credential_digest([f"Bearer {i}"]) for i in range(MAX_CREDENTIALS + 2)]
    assert remember((), digests[0]) == ()  # a session begun without credentials stays open
    stored: tuple[bytes, ...] = (digests[0],)
    for digest in digests[1:]:
        stored = remember(stored, digest)
    assert stored == tuple(digests[-MAX_CREDENTIALS:])
    assert remember(stored, digests[-MAX_CREDENTIALS]) == (
        *digests[-MAX_CREDENTIALS + 1 :],
        digests[-MAX_CREDENTIALS],
    )


def test_ping_accepted_only_for_a_2xx_with_its_result() -> None:
    result = b'{"jsonrpc":"2.0","id":"p","result":{}}'
    assert ping_accepted(200, "application/json", result, "p")
    assert ping_accepted(200, "text/event-stream", b"id: 1\ndata: " + result + b"\n\n", "p")
    assert not ping_accepted(401, "application/json", result, "p")
    assert not ping_accepted(200, "application/json", result, "q")
    assert not ping_accepted(200, "application/json", b'{"jsonrpc":"2.0","id":"p","error":{}}', "p")
    assert not ping_accepted(200, "text/plain", result, "p")
    assert not ping_accepted(200, "text/event-stream", b"data: " + result, "p")  # not a complete event


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
