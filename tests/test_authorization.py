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
from tests.support import playbook as pb
from tests.support.playbook import Playbook
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy, sse_events

CHALLENGE = 'Bearer realm="mcp", error="invalid_token"'
SECRET = "the owner's secret result"


USERS: dict[str | None, str] = {
    "Bearer owner-1": "alice",
    "Bearer owner-2": "alice",  # alice's refreshed token
    "Bearer intruder": "mallory",  # a valid user of the upstream, not of alice's sessions
}
REFUSAL = pb.status(401, "invalid_token", headers={"WWW-Authenticate": CHALLENGE})


def token(seen: pb.Seen, credential: str = "Authorization") -> str | None:
    """The token of a request, as ``Bearer <token>``, where the upstream takes it (``credential``): a header
    (``Cookie: sid=<token>``; else ``<header>: <token>``), or ``?<name>``, a query parameter."""
    if credential.startswith("?"):  # a query parameter: /mcp?api_key=<token>
        value = seen.query.get(credential[1:])
        return None if value is None else f"Bearer {value}"
    value = seen.header(credential)
    if value is None or credential == "Authorization":
        return value
    return "Bearer " + value.removeprefix("sid=")


def calls(upstream: Playbook, method: str, credential: str = "Authorization") -> list[str | None]:
    """The tokens of the JSON-RPC requests of ``method`` the upstream received."""
    return [token(seen, credential) for seen in upstream.requests(method)]


@dataclass
class Users:
    """What the upstream knows: the user of each token, and the owner of each session (the user whose token
    began it). Its methods are the predicates of the upstream's rules."""

    credential: str
    users: dict[str | None, str]
    sessions: dict[str, str] = field(default_factory=dict)

    def user(self, seen: pb.Seen) -> str | None:
        return self.users.get(token(seen, self.credential))

    def unknown(self, seen: pb.Seen) -> bool:
        """A token the upstream does not know (or none)."""
        return self.user(seen) is None

    def lost(self, seen: pb.Seen) -> bool:
        """A session the upstream never began."""
        return seen.session_id not in self.sessions

    def foreign(self, seen: pb.Seen) -> bool:
        """A session of another user than the token's."""
        return self.sessions.get(seen.session_id or "") not in (None, self.user(seen))

    def begin(self) -> pb.Answer:
        """The answer to ``initialize``: a session begins, its owner the token's user."""

        async def answer(playbook: Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
            session_id = f"auth-session-{len(self.sessions)}"
            self.sessions[session_id] = self.users[token(seen, self.credential)]
            return await pb.initialize(session_id, name="auth")(playbook, request, seen)

        return answer


def cut_here(cuts: dict[str, Any], after: str) -> pb.Step:
    """End the stream early, after event ``after`` (the request remembered, for the resume from there)."""

    async def step(steps: pb.Steps) -> None:
        cuts[after] = steps.seen.id
        steps.end()

    return step


def auth_upstream(
    credential: str = "Authorization",
    *,
    users: dict[str | None, str] = USERS,
    foreign_status: int = 401,
    in_band: bool = False,
    cut: bool = False,
    ping_status: int | None = None,
    ping_as_sse: bool = False,
    standalone: asyncio.Queue[bytes] | None = None,
) -> Playbook:
    """An upstream that checks the token of every request; a session belongs to the user whose token began it.

    ``credential``: where the token comes (see ``token``). ``foreign_status``: the answer to a valid token
    that does not own the session, 401 (with the challenge) or 404. ``in_band``: ownership checked in the
    JSON-RPC layer: another user's request is answered 200 with an error, and its notification 202 (nothing
    to answer), as a server whose tools check the caller does. ``cut``: a tool's stream ends after its second
    event; the rest comes to GET + Last-Event-ID. ``ping_status``: the answer to every ping (an upstream in
    trouble). ``ping_as_sse``: a ping answered as the SDKs' servers do by default, with an SSE stream.
    ``standalone``: what the standalone GET streams. The rules read bottom up: the newest that matches
    answers.
    """
    known = Users(credential, dict(users))
    upstream = Playbook()
    # The session's own user: a tool's stream (three progress events, then the result), a resume of a cut
    # one, the standalone stream, pings. Notifications (202) and DELETE (200): the playbook's defaults.
    progress = [pb.event(pb.progress(k), id=f"UPSTREAM-{k}") for k in range(3)]
    secret = {"content": [{"type": "text", "text": SECRET}]}
    cuts: dict[str, Any] = {}  # upstream event id -> the request whose stream was cut after it
    if cut:  # retry: 0, so the proxy's pump resumes at once
        tool = pb.sse(pb.raw(b"retry: 0\n\n"), *progress[:2], cut_here(cuts, "UPSTREAM-1"))
    else:
        tool = pb.sse(*progress, pb.event(pb.result(secret), id="UPSTREAM-3"))
    upstream.on(None, tool, when=lambda seen: seen.id is not None)
    upstream.on(None, pb.sse(pb.each(asyncio.Queue() if standalone is None else standalone)), http="GET")

    def rest(seen: pb.Seen) -> dict[str, Any]:  # the result of the request cut after the GET's cursor
        return {"jsonrpc": "2.0", "id": cuts.pop(seen.last_event_id or ""), "result": secret}

    upstream.on(
        None,
        pb.sse(progress[2], pb.event(rest, id="UPSTREAM-3")),
        http="GET",
        when=lambda seen: seen.last_event_id is not None,
    )
    pong = pb.result({})
    upstream.on(
        "ping",
        pb.sse(pb.event(b"", id="PING-0"), pb.event(pong, id="PING-1")) if ping_as_sse else pb.reply(pong),
    )
    if ping_status is not None:
        upstream.on("ping", pb.status(ping_status, "try later"))
    # Another user's token: checked on every request (the session id is no credential).
    foreign = REFUSAL if foreign_status == 401 else pb.status(404, "no such")
    upstream.on(None, foreign, http=None, when=known.foreign)
    if in_band:
        upstream.on(None, pb.reply(pb.error(-32001, "this session is not yours")), when=known.foreign)
        upstream.on(None, pb.status(202), when=lambda seen: seen.id is None and known.foreign(seen))
    # Checked first (the newest rule that matches answers): a token the upstream knows, a session it began.
    upstream.on(None, pb.status(404, "session not found"), http=None, when=known.lost)
    upstream.on("initialize", known.begin())
    upstream.on(None, REFUSAL, http=None, when=known.unknown)
    return upstream


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
def pushes() -> asyncio.Queue[bytes]:
    """What the upstream sends on its standalone stream."""
    return asyncio.Queue()


@pytest.fixture
def upstream(request: pytest.FixtureRequest, pushes: asyncio.Queue[bytes]) -> Playbook:
    """``auth_upstream()``; a test's indirect parameter: its options."""
    return auth_upstream(standalone=pushes, **getattr(request, "param", {}))


@pytest.fixture
async def proxy(serve: ServeApp, upstream: Playbook) -> AsyncIterator[RunningProxy]:
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
    assert calls(upstream, "ping") == ["Bearer intruder"] * len(probes)  # asked each time, refused each time


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
    assert calls(upstream, "tools/call") == ["Bearer owner-1"]


async def test_a_resent_request_id_of_the_owner_is_refused(http, proxy, upstream) -> None:
    owner, request_id, _ = await owner_with_a_result(http, proxy)
    intruder = owner.as_("intruder")
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "x"}})
    async with http.post(proxy.url, data=body, headers=intruder.headers()) as response:
        assert SECRET.encode() not in await refused(response)
    assert calls(upstream, "tools/call") == ["Bearer owner-1"]  # not forwarded: the ping was refused
    assert calls(upstream, "ping") == ["Bearer intruder"]


async def test_the_live_standalone_stream_is_not_joined_with_another_token(
    http, proxy, upstream, pushes
) -> None:
    owner, _, _ = await owner_with_a_result(http, proxy)
    async with http.get(proxy.url, headers=owner.headers()) as standalone:
        assert standalone.status == 200
        events = aiter(sse_events(standalone))
        assert (await anext(events)).data == b""  # priming: the upstream GET is open, its pump running
        async with http.get(proxy.url, headers=owner.as_("intruder").headers()) as response:
            await refused(response)
        async with http.get(proxy.url, headers=owner.as_(None).headers()) as response:
            await refused(response)  # no credentials at all: asked about too, and refused
        pushes.put_nowait(b'{"jsonrpc":"2.0","method":"notifications/x"}')
        assert b"notifications/x" in (await anext(events)).data  # the owner still gets them
    assert [token(seen) for seen in upstream.requests(http="GET")] == ["Bearer owner-1"]


@pytest.mark.parametrize(
    "upstream", [{"ping_as_sse": False}, {"ping_as_sse": True}], indirect=True, ids=["json_ping", "sse_ping"]
)
async def test_a_refreshed_token_the_upstream_accepts_is_served(http, proxy, upstream) -> None:
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
    assert calls(upstream, "ping") == ["Bearer owner-2"]  # asked once; then remembered
    # The re-sent request too (the same id, the same call), and the old token is still one the upstream
    # accepted.
    refreshed.next_id = request_id
    _, body = refreshed.tool_call("secret", {})
    for client in (refreshed, owner):
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    assert calls(upstream, "ping") == ["Bearer owner-2"]
    assert calls(upstream, "tools/call") == ["Bearer owner-1"]


async def test_a_session_begun_without_credentials_is_served_as_before(http, serve) -> None:
    upstream = auth_upstream(users={**USERS, None: "anonymous"})
    async with running_proxy(await serve(upstream.app())) as proxy:
        client = Client(http, proxy.url, None)
        await client.initialize()
        _, body = client.tool_call("secret", {})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            cursors = [e.id.decode() for e in await collect(response) if e.id]
        async with http.get(proxy.url, headers=client.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    assert calls(upstream, "ping") == []


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
    request = CIMultiDict(
        [("Cookie", "b=2"), ("Accept", "*/*"), ("AUTHORIZATION", "Bearer a"), ("cookie", "a=1")]
    )
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
    upstream = auth_upstream(foreign_status=404)
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
    upstream = auth_upstream(credential, cut=True)
    async with running_proxy(await serve(upstream.app()), **settings) as proxy:
        owner, request_id, cursors = await owner_with_a_result(http, proxy, credential)
        assert len(upstream.requests(http="GET")) == 1  # the pump's resume, accepted
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
    assert calls(upstream, "ping", credential) == [
        "Bearer intruder",
        "Bearer intruder",
        None,
        None,
        "Bearer owner-2",
    ]
    assert calls(upstream, "tools/call", credential) == ["Bearer owner-1"]


async def test_no_credential_headers_turns_the_binding_off(http, serve) -> None:
    upstream = auth_upstream()
    async with running_proxy(await serve(upstream.app()), credential_headers=[]) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        async with http.get(proxy.url, headers=owner.as_(None).headers(**{"Last-Event-ID": cursors[0]})) as r:
            assert r.status == 200  # as documented: nothing is checked
    assert calls(upstream, "ping") == []


async def test_another_token_claims_no_request_id_while_the_upstream_checks_it(http, proxy, upstream) -> None:
    """A client with the session id and another token sends the owner's next request id: while the
    upstream takes its time refusing it, the owner's own request with that id is forwarded and answered,
    not refused as a duplicate (nor counted against the owner's views)."""
    owner = Client(http, proxy.url, "owner-1")
    await owner.initialize()
    _, body = owner.tool_call("secret", {})
    # A slow token check: mallory's requests wait at the gate "mallory", then get the refusal.
    upstream.on(
        None, pb.held("mallory", REFUSAL), http=None, when=lambda seen: token(seen) == "Bearer intruder"
    )
    intruder = asyncio.ensure_future(http.post(proxy.url, data=body, headers=owner.as_("intruder").headers()))
    try:
        # mallory's request reached the upstream, which is checking it
        await upstream.arrived("mallory").wait()
        async with http.post(proxy.url, data=body, headers=owner.headers()) as response:
            assert response.status == 200
            assert SECRET in (await collect(response))[-1].data.decode()
    finally:
        upstream.open("mallory")
        async with await intruder as response:
            await refused(response)
    assert calls(upstream, "tools/call") == ["Bearer owner-1"]


async def test_a_notification_the_upstream_takes_from_anyone_admits_no_one(http, serve) -> None:
    """An upstream that checks who calls in its JSON-RPC layer answers another user's notification 202
    (there is nothing to refuse) and its requests with an error: neither makes those credentials ones
    the session's window is served to."""
    upstream = auth_upstream(in_band=True)
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        intruder = owner.as_("intruder")
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"})
        async with http.post(proxy.url, data=note, headers=intruder.headers()) as response:
            assert response.status == 202
        async with http.get(proxy.url, headers=intruder.headers(**{"Last-Event-ID": cursors[0]})) as response:
            assert response.status == 403  # the ping's answer was an error: refused
            assert SECRET.encode() not in await response.read()
    assert calls(upstream, "ping") == ["Bearer intruder"]


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
    assert len(calls(upstream, "ping")) == 1


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
    assert calls(upstream, "ping") == ["Bearer intruder"] * 30
    assert calls(upstream, "tools/call") == ["Bearer owner-1"]
    assert upstream.requests(http="GET") == []


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
    assert len(calls(upstream, "ping")) == 1


async def test_an_upstream_failing_the_ping_is_not_called_a_refusal(http, serve) -> None:
    """A 5xx to the ping says the upstream is in trouble, not that the credentials are wrong: the client is
    told so (and not served), rather than sent to re-authorize."""
    upstream = auth_upstream(ping_status=503)
    async with running_proxy(await serve(upstream.app())) as proxy:
        owner, _, cursors = await owner_with_a_result(http, proxy)
        refreshed = owner.as_("owner-2")
        async with http.get(proxy.url, headers=refreshed.headers(**{"Last-Event-ID": cursors[0]})) as r:
            assert r.status == 502
            assert (await error_of(r))["data"] == {"reason": "upstream_bad_response", "status": 503}


async def test_credentials_in_the_query_string_are_bound_too(http, serve) -> None:
    """Hosted MCP servers often take an API key in the endpoint's URL (``/mcp?api_key=...``): the query
    string counts with the credential headers, so a request at another query (or none) is asked about."""
    upstream = auth_upstream("?api_key")
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
    assert calls(upstream, "ping", "?api_key") == ["Bearer intruder", None, "Bearer owner-1"]


async def test_a_call_reads_its_credentials_once(http, proxy, upstream, monkeypatch) -> None:
    """A tools/call in a session whose standalone stream is pumped is checked (``authorize``), hands its
    credentials to the session's pumps, and records them for its own stream's resumes: one reading of its
    credential headers and one digest serve all three."""
    counted = {"fields": 0, "digests": 0}

    def fields(*args: Any) -> tuple[tuple[str, str], ...]:
        counted["fields"] += 1
        return credential_fields(*args)

    def digest(*args: Any) -> bytes:
        counted["digests"] += 1
        return credential_digest(*args)

    owner, _, _ = await owner_with_a_result(http, proxy)
    async with http.get(proxy.url, headers=owner.headers()) as standalone:
        assert (await anext(aiter(sse_events(standalone)))).data == b""  # its pump is running
        monkeypatch.setattr("mcpresume.http.credentials.credential_fields", fields)
        monkeypatch.setattr("mcpresume.http.credentials.credential_digest", digest)
        for calls_made in (1, 2):
            _, body = owner.tool_call("secret", {})
            async with http.post(proxy.url, data=body, headers=owner.headers()) as response:
                assert SECRET in (await collect(response))[-1].data.decode()
            assert counted == {"fields": calls_made, "digests": calls_made}
    assert calls(upstream, "ping") == []  # the owner's own token: never asked about
