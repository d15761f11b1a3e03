"""Upstream-side resumption: the proxy resumes the upstream's stream itself, so the client sees one
continuous stream whatever happens upstream."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from mcpresume.core.errors import SessionGone
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.proxy import ScriptedClient, collect, error_of, memory_session, running_proxy
from tests.support.relay import CuttingRelay
from tests.support.scripted import SESSION, ScriptedUpstream, random_drops
from tests.support.sdk import count_slowly, sdk_session


async def call(proxy_url: str, total: int) -> tuple[list[int], list[dict[str, object]]]:
    """One tools/call through the proxy with a raw client; returns (progress values, responses) received."""
    async with aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy_url)
        await client.initialize()
        _, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            events = await collect(response)
    messages = [orjson.loads(e.data) for e in events if e.data]
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    return progress, [m for m in messages if "id" in m and "method" not in m]


@pytest.mark.parametrize("abort", [False, True], ids=["clean-close", "connection-abort"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_upstream_drops_at_random_points_and_every_call_completes_once_in_order(
    serve, seed, abort
) -> None:
    upstream = ScriptedUpstream(total=30, drops=random_drops(seed, 6, 8), abort=abort)
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        progress, responses = await call(proxy.url, 30)
        resumed = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome="resumed")
    assert progress == list(range(1, 31))
    assert len(responses) == 1 and responses[0]["result"]["done"] is True
    assert resumed == len(upstream.gets) > 0  # the proxy, not the client, reconnected upstream


async def test_upstream_replaying_events_twice_reaches_the_client_once(serve) -> None:
    upstream = ScriptedUpstream(total=12, drops=[4, 4, 4], overlap=2)
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy:
        progress, responses = await call(proxy.url, 12)
        duplicates = sample(proxy.ctx.metrics, "mcpresume_upstream_duplicates_total")
    assert progress == list(range(1, 13))
    assert len(responses) == 1
    assert duplicates == 2 * 3  # the overlap of each of the three resumes


@pytest.mark.parametrize(
    ("script", "outcome"),
    [
        ({"drops": [3], "resumable": False}, "refused"),
        ({"drops": [3], "send_ids": False}, "not_resumable"),
        ({"drops": [3, 0, 0, 0]}, "exhausted"),
    ],
    ids=["upstream-404", "no-ids", "no-progress"],
)
async def test_unresumable_upstream_gives_the_client_a_synthesized_error_promptly(
    serve, script: dict[str, Any], outcome
) -> None:
    upstream = ScriptedUpstream(total=10, **copy.deepcopy(script))  # per run: it consumes its drops
    url = await serve(upstream.app())
    async with running_proxy(url, upstream_resume_attempts=3) as proxy:
        async with asyncio.timeout(10):  # retry 10 ms, doubling: well under a second
            progress, responses = await call(proxy.url, 10)
        counted = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome=outcome)
        synthesized = sample(
            proxy.ctx.metrics, "mcpresume_synthesized_errors_total", reason="upstream_stream_lost"
        )
    assert progress == [1, 2, 3]
    assert len(responses) == 1
    error = responses[0]["error"]
    assert isinstance(error, dict) and error["data"]["reason"] == "upstream_stream_lost"
    assert counted == 1 and synthesized == 1
    if outcome == "exhausted":
        assert len(upstream.gets) == 3  # upstream_resume_attempts


async def test_sdk_server_that_closes_streams_to_make_clients_poll(
    example_upstream_with_event_store: str,
) -> None:
    """The SDK server with an event store and retry_interval closes the SSE stream mid-call (poll_me); through
    the proxy the SDK client's call completes and the client never reconnects: the proxy polled for it."""
    async with running_proxy(example_upstream_with_event_store) as proxy:
        relay = CuttingRelay("127.0.0.1", proxy.port, record=True)
        async with relay, sdk_session(relay.url_for("/mcp"), read_timeout_seconds=30) as session:
            call = await count_slowly(session, n=3, delay=0.01, tool="poll_me")
        resumed = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome="resumed")
    assert call.text == "polled 3 times"
    assert [p for p, _, _ in call.progress] == [1, 2, 3]
    assert resumed >= 1  # the upstream closed the stream mid-call
    client_resumes = [r for r in relay.requests() if r.header("last-event-id") is not None]
    assert client_resumes == []


async def test_standalone_get_stream_is_resumed_upstream(serve) -> None:
    upstream = ScriptedUpstream(total=12, drops=[3, 4, 2])
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        async with http.get(client.url, headers=client.headers()) as response:
            assert response.status == 200
            events = await collect(response, limit=12)
        resumed = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome="resumed")
    progress = [orjson.loads(e.data)["params"]["progress"] for e in events if e.data]
    assert progress == list(range(1, 13))
    assert resumed >= 3
    assert upstream.gets[0] is None and all(g is not None for g in upstream.gets[1:])


async def test_upstream_that_forgot_the_session_gives_404_and_the_proxy_drops_it(serve) -> None:
    upstream = ScriptedUpstream()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        assert await proxy.ctx.store.has_session(client.session_id)
        upstream.forget_session = True
        _, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            assert response.status == 404  # the client must re-initialize
        assert not await proxy.ctx.store.has_session(client.session_id)


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_the_upstreams_404_for_a_tracked_session_is_answered_with_the_proxys_own_reason(
    serve, method
) -> None:
    """The proxy ends the session when its upstream forgot it (a restart; after a takeover, an upstream that
    never saw it): the answer is the proxy's own 404 ``unknown_session``, its reason in ``data``, as every
    answer the proxy decides; not the upstream's body: ``upstream_session_lost``, an ``unknown_session``
    that says the upstream lost it. A tool call, and the standalone GET."""
    upstream = pb.Playbook()
    forgot = asyncio.Event()
    lost = pb.status(404, "session not found")
    upstream.on(None, lost, http=None, when=lambda seen: forgot.is_set() and seen.session_id is not None)
    async with running_proxy(await serve(upstream.app())) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        forgot.set()
        _, body = client.tool_call("work", {})
        request = (
            http.post(client.url, data=body, headers=client.headers())
            if method == "POST"
            else http.get(client.url, headers=client.headers(Accept="text/event-stream"))
        )
        async with request as response:
            assert response.status == 404
            error = await error_of(response)
        assert error["data"]["reason"] == "upstream_session_lost"
        assert error["message"] == SessionGone.UPSTREAM_FORGOT.value
        assert not await proxy.ctx.store.has_session(client.session_id)
        assert upstream.requests(http=method)[-1].session_id == client.session_id  # it was the upstream's 404


def id_upstream(upstream_id: bytes) -> pb.Playbook:
    """A request streams one progress event with the upstream's id ``upstream_id`` (written as it is) and
    ends before its response; a GET (the resume) streams the response to request 2."""
    upstream = pb.Playbook(session_ids=[SESSION])
    note = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p2","progress":1}}'
    cut = pb.sse(pb.raw(b"id:" + upstream_id + b"\nretry: 10\ndata: " + note + b"\n\n"))
    upstream.on(None, cut, when=lambda seen: seen.id is not None)
    upstream.on("initialize", pb.initialize(name="ids"))
    upstream.on(
        None, pb.sse(pb.raw(b'data: {"jsonrpc":"2.0","id":2,"result":{"content":[]}}\n\n')), http="GET"
    )
    return upstream


@pytest.mark.parametrize(
    ("upstream_id", "resumed"),
    [(b"   7", True), (b"a\x0bb", False)],
    ids=["spaces-around-the-id", "a-control-character-in-the-id"],
)
async def test_an_upstream_id_goes_back_as_a_header_can_carry_it_or_the_resume_is_refused_at_once(
    serve, upstream_id: bytes, resumed: bool
) -> None:
    """An SSE id keeps the spaces after the one its colon takes; a header value cannot have them (a recipient
    strips them): they are stripped. An id with a control character cannot be sent back at all: the resume is
    refused without a GET or a retry, and the client gets the synthesized error."""
    upstream = id_upstream(upstream_id)
    url = await serve(upstream.app())
    async with running_proxy(url, upstream_resume_attempts=3) as proxy:
        async with asyncio.timeout(10):
            progress, responses = await call(proxy.url, 1)
        refused = sample(proxy.ctx.metrics, "mcpresume_upstream_resumptions_total", outcome="refused")
    assert progress == [1]
    gets = [seen.last_event_id for seen in upstream.requests(http="GET")]
    if resumed:
        assert gets == ["7"]
        assert responses == [{"jsonrpc": "2.0", "id": 2, "result": {"content": []}}]
    else:
        assert gets == [] and refused == 1
        assert responses[0]["error"]["data"]["reason"] == "upstream_stream_lost"


def ending_standalone() -> pb.Playbook:
    """An upstream whose standalone GET sends one message without an id (``params.get``: which GET it is)
    and ends (not resumable); a request streams 10 progress events, then its response."""
    upstream = pb.Playbook(session_ids=[SESSION])
    progress = [pb.event(pb.progress(k)) for k in range(10)]
    call = pb.sse(*progress, pb.event(pb.result({"content": []})))
    upstream.on(None, call, when=lambda seen: seen.id is not None)
    upstream.on("initialize", pb.initialize(name="standalone"))
    upstream.on(None, numbered_note, http="GET")
    return upstream


async def numbered_note(playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
    """A standalone GET's one message, numbered by the GETs received so far."""
    number = len([get for get in playbook.requests(http="GET") if get.number <= seen.number])
    note = pb.notification("notifications/message", get=number)
    return await pb.sse(pb.event(note))(playbook, request, seen)


def notes(events: list[Any]) -> list[int]:
    """The standalone GETs' messages (which GET sent each)."""
    return [orjson.loads(e.data)["params"]["get"] for e in events if e.data]


async def test_a_standalone_stream_the_upstream_ended_goes_on_in_a_new_one_for_a_client_that_has_it_all(
    serve,
) -> None:
    """The upstream ends its standalone GET without event ids (not resumable). A client that re-attaches with
    the last cursor of it gets a new standalone stream (a new upstream GET), as it would connected directly;
    a re-attach to the ended one answered an empty stream to every retry, and no server message came again.
    A cursor before its end still gets the tail first, and only the tail."""
    upstream = ending_standalone()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        async with asyncio.timeout(10):
            async with http.get(client.url, headers=client.headers()) as response:
                first = await collect(response)  # until the proxy ends it
            assert notes(first) == [1]
            assert first[0].id is not None and first[-1].id is not None
            priming, last = first[0].id.decode(), first[-1].id.decode()
            # A cursor before the end: the tail, then the end (the ended stream is still the one named).
            async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": priming})) as response:
                assert response.status == 200
                tail = await collect(response)
            assert notes(tail) == [1] and len(upstream.requests(http="GET")) == 1
            # The whole of it: a new standalone stream.
            async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": last})) as response:
                assert response.status == 200
                fresh = await collect(response)
            assert notes(fresh) == [2] and len(upstream.requests(http="GET")) == 2
            assert fresh[-1].id is not None
            assert fresh[-1].id.decode().split("-")[1] != last.split("-")[1]  # another stream
        reattached = sample(proxy.ctx.metrics, "mcpresume_resumptions_total", outcome="reattach")
    assert reattached == 2


async def test_a_standalone_stream_the_upstream_ended_goes_on_after_it_left_the_window(serve) -> None:
    """As above, once the ended stream's events were all evicted: a re-attach with its last cursor still
    opens a new standalone stream (it got 409 "no longer retained", and the SDK client stopped retrying: no
    server message came again); a cursor before its end is 409, since events after it were lost."""
    upstream = ending_standalone()
    url = await serve(upstream.app())
    async with running_proxy(url, window_events=6) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        async with asyncio.timeout(10):
            async with http.get(client.url, headers=client.headers()) as response:
                first = await collect(response)
            assert first[0].id is not None and first[-1].id is not None
            priming, last = first[0].id.decode(), first[-1].id.decode()
            _, body = client.tool_call("work", {})
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                await collect(response)
            stream = int(last.split("-")[1])
            assert stream not in memory_session(proxy.ctx.store, client.session_id).streams
            async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": priming})) as response:
                assert response.status == 409
                assert (await error_of(response))["data"]["reason"] == "cursor_out_of_window"
            async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": last})) as response:
                assert response.status == 200
                fresh = await collect(response)
    assert notes(fresh) == [2] and len(upstream.requests(http="GET")) == 2
