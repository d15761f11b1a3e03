"""A stream the proxy resumes upstream speaks for its client with the freshest credentials the client
presented and the upstream accepted in the session, not forever with those of the POST that opened it
(issue 30, item 4).

The upstream here checks the bearer token of every request, as the SDKs' servers do; the client's token is
refreshed mid-call (the old one expires upstream). Before this fix the pump resumed with the old token: 401,
retried as if transient until ``upstream_resume_attempts`` ran out (about 31 s with the defaults), and the
call's result was replaced by ``upstream_stream_lost``, even after the client had re-attached with its new
token. Now a request with the new token hands it to the session's pumps, and a resume refused 401/403 waits
(``credential_wait`` at most) for the client to bring one, then retries with it at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from mcpresume.core.credentials import credential_digest, newest, remember
from mcpresume.daemon.app import RunningProxy
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, running_proxy, sse_events

CHALLENGE = 'Bearer realm="mcp", error="invalid_token"'
CALL_ID = 7


class Client(ScriptedClient):
    """The scripted client with a bearer token on every request."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str) -> None:
        super().__init__(http, url)
        self.token = token

    def headers(self, **extra: str) -> dict[str, str]:
        return super().headers(Authorization=f"Bearer {self.token}", **extra)


@dataclass
class Upstream:
    """Checks the token of every request (401 with a challenge unless it is valid now). A tools/call's
    stream sends a priming event and a progress event with ids, then ends when the test says (``cut``):
    a 2025-11-25 server closing it so that clients poll (SEP-1699). A resume of it is answered with the
    call's result."""

    valid: set[str] = field(default_factory=lambda: {"Bearer t1"})
    playbook: pb.Playbook = field(default_factory=pb.Playbook)

    def __post_init__(self) -> None:
        up = self.playbook
        up.on(None, pb.status(401, "invalid_token", headers={"WWW-Authenticate": CHALLENGE}), http=None)
        up.on("initialize", pb.initialize(), when=self.ok)
        up.on(None, pb.status(202), when=lambda s: self.ok(s) and s.id is None and s.message is not None)
        up.on("ping", pb.reply(pb.result({})), when=self.ok)
        call = pb.sse(pb.event(b"", id="u-0"), pb.event(pb.progress(1), id="u-1"), pb.wait("cut"), pb.end())
        up.on("tools/call", call, when=self.ok)
        result = {"jsonrpc": "2.0", "id": CALL_ID, "result": {"content": [{"type": "text", "text": "done"}]}}
        up.on(
            None, pb.sse(pb.event(result, id="u-2")), http="GET", when=lambda s: self.ok(s) and self.resume(s)
        )

    def ok(self, seen: pb.Seen) -> bool:
        return seen.header("Authorization") in self.valid

    @staticmethod
    def resume(seen: pb.Seen) -> bool:
        return seen.last_event_id == "u-1"

    def resumes(self) -> list[str | None]:
        """The token of each resume GET the upstream received, in order."""
        return [s.header("Authorization") for s in self.playbook.requests(http="GET") if self.resume(s)]


@pytest.fixture
def upstream() -> Upstream:
    return Upstream()


@pytest.fixture
async def proxy(serve: Any, upstream: Upstream) -> AsyncIterator[RunningProxy]:
    url = await serve(upstream.playbook.app())
    # One quick attempt without progress: without the fix a 401 is retried as transient, so given up here.
    async with running_proxy(url, retry_ms=10, upstream_resume_attempts=1, credential_wait=30.0) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def call_body() -> bytes:
    params = {"name": "work", "arguments": {}, "_meta": {"progressToken": "p"}}
    return orjson.dumps({"jsonrpc": "2.0", "id": CALL_ID, "method": "tools/call", "params": params})


async def started_call(client: Client) -> tuple[aiohttp.ClientResponse, bytes]:
    """The call's response, read through its progress event; the cursor of that event."""
    response = await client.http.post(client.url, data=call_body(), headers=client.headers())
    assert response.status == 200, await response.text()
    async for event in sse_events(response):
        if event.data:
            assert event.id is not None
            return response, event.id
    raise AssertionError("the call's stream ended before its progress event")


def messages(events: list[Any]) -> list[dict[str, Any]]:
    return [orjson.loads(e.data) for e in events if e.data]


async def test_a_resume_after_the_client_reattached_with_a_refreshed_token_uses_it(
    proxy: RunningProxy, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    client = Client(http, proxy.url, "t1")
    await client.initialize()
    response, cursor = await started_call(client)
    response.close()  # the client drops
    upstream.valid = {"Bearer t2"}  # its token is refreshed: the old one expires upstream
    client.token = "t2"
    headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
    async with http.get(client.url, headers=headers) as reattached:  # checked with a ping in the session
        assert reattached.status == 200
        upstream.playbook.open("cut")  # the upstream closes the stream: the proxy resumes it
        got = messages(await collect(reattached))
    assert got[-1] == {
        "jsonrpc": "2.0",
        "id": CALL_ID,
        "result": {"content": [{"type": "text", "text": "done"}]},
    }
    assert upstream.resumes() == ["Bearer t2"]


async def test_a_resume_refused_401_waits_for_the_clients_fresh_token_and_retries_with_it(
    proxy: RunningProxy, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    client = Client(http, proxy.url, "t1")
    await client.initialize()
    response, _ = await started_call(client)
    async with response:  # the client keeps reading its call's stream
        upstream.valid = {"Bearer t2"}
        upstream.playbook.open("cut")
        await until(lambda: len(upstream.resumes()) == 1, what="a resume refused with the old token")
        client.token = "t2"  # the client's next request carries its refreshed token
        ping = orjson.dumps({"jsonrpc": "2.0", "id": 99, "method": "ping"})
        async with http.post(client.url, data=ping, headers=client.headers()) as answered:
            assert answered.status == 200
        got = messages(await collect(response))
    assert got[-1]["id"] == CALL_ID and got[-1]["result"]["content"][0]["text"] == "done"
    assert upstream.resumes() == ["Bearer t1", "Bearer t2"]  # the 401 was not retried with the old one
    synthesized = sample(
        proxy.ctx.metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost"
    )
    assert synthesized == 0


async def test_without_fresh_credentials_a_refused_resume_is_lost_after_credential_wait_not_retried(
    serve: Any, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    url = await serve(upstream.playbook.app())
    async with running_proxy(url, retry_ms=10, upstream_resume_attempts=3, credential_wait=0.2) as proxy:
        client = Client(http, proxy.url, "t1")
        await client.initialize()
        response, _ = await started_call(client)
        async with response:
            upstream.valid = {"Bearer t2"}
            upstream.playbook.open("cut")
            got = messages(await collect(response))
        refused = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome="refused")
    error = got[-1]["error"]
    assert error["data"]["reason"] == "upstream_stream_lost"
    assert "401" in error["message"] and "credentials" in error["message"]
    assert upstream.resumes() == ["Bearer t1"]  # once: a 401 is not retried with the same credentials
    assert refused == 1


async def test_an_older_token_still_accepted_does_not_replace_the_newest(
    proxy: RunningProxy, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Of the credentials the upstream accepted in the session, the newest one resumes: a request with an
    older one, still accepted, does not set the stream back to it."""
    client = Client(http, proxy.url, "t1")
    await client.initialize()
    response, _ = await started_call(client)
    async with response:
        upstream.valid = {"Bearer t1", "Bearer t2"}
        for token in ("t2", "t1"):  # t2 checked with a ping (the newest now), then t1 again (an older one)
            client.token = token
            ping = orjson.dumps({"jsonrpc": "2.0", "id": f"ping-{token}", "method": "ping"})
            async with http.post(client.url, data=ping, headers=client.headers()) as answered:
                assert answered.status == 200
        upstream.valid = {"Bearer t2"}
        upstream.playbook.open("cut")
        got = messages(await collect(response))
    assert got[-1]["id"] == CALL_ID and "result" in got[-1]
    assert upstream.resumes() == ["Bearer t2"]


def test_the_newest_credentials_are_the_last_the_upstream_accepted() -> None:
    t1, t2 = (credential_digest([("authorization", f"Bearer {t}")]) for t in ("t1", "t2"))
    stored = remember((t1,), t2)
    assert newest(stored, t2) and not newest(stored, t1)
    assert not newest((), t1)  # a session without credentials: nothing to refresh
    assert newest(remember(stored, t1), t1)  # accepted again after a ping: the newest once more
