"""Resumption over HTTP, against the official SDK server without an event store (it cannot resume itself).

Every row of the decision table, with the body checked; the re-POST case
(docs/how-it-works.md); POST with
Last-Event-ID; exactly once per request id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from mcpresume.core.errors import SessionGone
from mcpresume.core.sse import SSEEvent
from mcpresume.daemon.app import RunningProxy, reap_once
from tests.support.metrics import sample
from tests.support.proxy import ManualClock, ScriptedClient, collect, error_of, running_proxy


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def proxy(example_upstream: str) -> AsyncIterator[RunningProxy]:
    async with running_proxy(example_upstream, window_events=32) as running:
        yield running


async def started(http: aiohttp.ClientSession, proxy: RunningProxy) -> ScriptedClient:
    client = ScriptedClient(http, proxy.url)
    await client.initialize()
    return client


def messages(events: list) -> list[dict]:
    return [orjson.loads(e.data) for e in events if e.data]


def progress_values(events: list) -> list[float]:
    return [m["params"]["progress"] for m in messages(events) if m.get("method") == "notifications/progress"]


def responses(events: list) -> list[dict]:
    return [m for m in messages(events) if "result" in m or "error" in m]


async def test_design_note_sequence_resume_sends_only_what_was_missed(http, proxy) -> None:
    """e1, e2 read; drop; resume with e2: only e3 onwards, and the result exactly once."""
    client = await started(http, proxy)
    request_id, body = client.tool_call("count_slowly", {"n": 6, "delay": 0.05})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200
        assert response.headers["X-Accel-Buffering"] == "no"
        first = await collect(response, limit=2)  # e1, e2
    assert progress_values(first) == [1, 2]
    e2 = first[-1].id
    assert e2 is not None
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": e2.decode()})) as response:
        assert response.status == 200
        raw = await response.read()
    assert b": resumed " + e2 in raw
    assert b"retry: 1000" in raw
    events = await collect_bytes(raw)
    assert progress_values(events) == [3, 4, 5, 6]
    assert [r["id"] for r in responses(events)] == [request_id]
    ids = [e.id for e in events if e.id]
    assert e2 not in ids and len(ids) == len(set(ids))
    assert sample(proxy.ctx.metrics, "mcpresume_resumptions_total", outcome="reattach") == 1


async def collect_bytes(raw: bytes) -> list:
    from mcpresume.core.sse import SSEParser

    return SSEParser(1 << 20).feed(raw)


async def test_cursors_are_monotonic_across_streams_and_name_their_stream(http, proxy) -> None:
    client = await started(http, proxy)
    seen: list[tuple[int, int]] = []
    for _ in range(2):
        _, body = client.tool_call("echo", {"text": "x"})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            for event in await collect(response):
                _epoch, stream, seq = event.id.decode().split("-")
                seen.append((int(stream), int(seq)))
    seqs = [seq for _, seq in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert len({stream for stream, _ in seen}) == 2


async def test_unknown_session_is_404(http, proxy) -> None:
    headers = {"Mcp-Session-Id": "nope", "Last-Event-ID": "aaaaaaaaaaaa-1-1"}
    async with http.get(proxy.url, headers=headers) as response:
        assert response.status == 404
        error = await error_of(response)
    assert error["data"]["reason"] == "unknown_session"
    assert error["code"] == -32000


async def test_an_untracked_session_is_said_one_way_whatever_the_request(http, proxy) -> None:
    """POST, POST with a cursor, GET with and without one: the same 404 body, reason and message."""
    client = ScriptedClient(http, proxy.url)
    client.session_id = "nope"
    cursor = {"Last-Event-ID": "aaaaaaaaaaaa-1-1"}
    _, body = client.tool_call("echo", {"text": "x"})
    said = []
    for method, headers in [("POST", {}), ("POST", cursor), ("GET", {}), ("GET", cursor)]:
        data = body if method == "POST" else None
        async with http.request(method, client.url, data=data, headers=client.headers(**headers)) as response:
            assert response.status == 404
            error = await error_of(response)
        said.append((error["code"], error["data"]["reason"], error["message"]))
    assert said == [(-32000, "unknown_session", SessionGone.UNTRACKED.value)] * 4


async def test_deleted_session_is_404(http, proxy) -> None:
    client = await started(http, proxy)
    _, body = client.tool_call("echo", {"text": "x"})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        cursor = (await collect(response))[-1].id.decode()
    async with http.delete(client.url, headers=client.headers()) as response:
        assert response.status == 200
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": cursor})) as response:
        assert response.status == 404
        assert (await error_of(response))["data"]["reason"] == "unknown_session"


async def test_expired_session_is_404(http, example_upstream) -> None:
    clock = ManualClock()
    async with running_proxy(example_upstream, session_ttl=60, clock=clock) as proxy:
        client = await started(http, proxy)
        _, body = client.tool_call("echo", {"text": "x"})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            cursor = (await collect(response))[-1].id.decode()
        clock.advance(61)
        # Expired but not reaped yet: the decision itself treats it as gone.
        async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": cursor})) as response:
            assert response.status == 404
        await reap_once(proxy.ctx)
        assert (await proxy.ctx.store.stats()).sessions == 0
        assert sample(proxy.ctx.metrics, "mcpresume_expired_sessions_total") == 1


@pytest.mark.parametrize(
    "cursor",
    ["e2", "", "AAAAAAAAAAAA-1-1", "aaaaaaaaaaaa-01-1", "aaaaaaaaaaaa-1", "aaaaaaaaaaaa-1-1-1", "x" * 500],
)
async def test_malformed_cursor_is_400(http, proxy, cursor) -> None:
    client = await started(http, proxy)
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": cursor})) as response:
        assert response.status == 400
        assert (await error_of(response))["data"]["reason"] == "malformed_cursor"


async def test_cursor_of_another_session_is_409_foreign(http, proxy) -> None:
    alice, bob = await started(http, proxy), await started(http, proxy)
    _, body = alice.tool_call("echo", {"text": "secret"})
    async with http.post(alice.url, data=body, headers=alice.headers()) as response:
        alice_cursor = (await collect(response))[0].id.decode()
    async with http.get(bob.url, headers=bob.headers(**{"Last-Event-ID": alice_cursor})) as response:
        assert response.status == 409
        error = await error_of(response)
    assert error["data"]["reason"] == "foreign_cursor"
    assert error["data"]["cursor"] == alice_cursor


async def test_cursor_ahead_is_409(http, proxy) -> None:
    client = await started(http, proxy)
    _, body = client.tool_call("echo", {"text": "x"})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        epoch, stream, seq = (await collect(response))[-1].id.decode().split("-")
    ahead = f"{epoch}-{stream}-{int(seq) + 100}"
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": ahead})) as response:
        assert response.status == 409
        error = await error_of(response)
    assert error["data"]["reason"] == "cursor_ahead"
    assert error["data"]["newest"] == f"{epoch}-{stream}-{seq}"


async def test_evicted_cursor_is_409_out_of_window_with_facts(http, proxy) -> None:
    client = await started(http, proxy)
    # A burst bigger than the window: the pump waits for the reading client, so all of it arrives live.
    _, body = client.tool_call("count_slowly", {"n": 40, "delay": 0})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        events = await collect(response)
    assert len(events) == 42  # priming, 40 progress, the response: all delivered live
    first = events[0].id.decode()
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": first})) as response:
        assert response.status == 409
        error = await error_of(response)
    assert error["data"] == {
        "reason": "cursor_out_of_window",
        "cursor": first,
        "oldest": events[-32].id.decode(),  # window_events=32
        "newest": events[-1].id.decode(),
    }
    # A cursor still inside the window re-attaches: the events after it, the response last.
    inside = events[-5].id.decode()
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": inside})) as response:
        assert response.status == 200
        tail = [e for e in await collect(response) if e.id]
    assert [e.id for e in tail] == [e.id for e in events[-4:]]
    metrics = proxy.ctx.metrics
    assert sample(metrics, "mcpresume_resumptions_total", outcome="cursor_out_of_window") == 1
    assert sample(metrics, "mcpresume_resumptions_total", outcome="reattach") == 1


async def test_reattach_never_crosses_streams(http, proxy) -> None:
    client = await started(http, proxy)
    _, first = client.tool_call("count_slowly", {"n": 3, "delay": 0})
    async with http.post(client.url, data=first, headers=client.headers()) as response:
        a_events = await collect(response)
    _, second = client.tool_call("count_slowly", {"n": 3, "delay": 0})
    async with http.post(client.url, data=second, headers=client.headers()) as response:
        b_events = await collect(response)
    # Resume stream A from its priming cursor: A's events only, though B's came later in the session.
    async with http.get(
        client.url, headers=client.headers(**{"Last-Event-ID": a_events[0].id.decode()})
    ) as r:
        replay = [e for e in await collect(r) if e.id]
    assert [e.id for e in replay] == [e.id for e in a_events[1:]]
    assert not {e.id for e in replay} & {e.id for e in b_events}


async def test_resend_of_a_request_id_is_not_forwarded_twice(http, proxy) -> None:
    client = await started(http, proxy)
    request_id, body = client.tool_call("count_slowly", {"n": 2, "delay": 0})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        original = await collect(response)
    # The client re-sends the same request (same id) instead of resuming: it is attached to the original
    # stream (the same cursors: nothing was forwarded, so nothing new was appended).
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200
        again = await collect(response)
    assert [e.id for e in again] == [e.id for e in original]
    assert [r["id"] for r in responses(again)] == [request_id]
    assert sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total") == 1


async def test_resend_of_an_evicted_request_is_409(http, proxy) -> None:
    client = await started(http, proxy)
    _, body = client.tool_call("count_slowly", {"n": 40, "delay": 0})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        await collect(response)
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 409
        assert (await error_of(response))["data"]["reason"] == "cursor_out_of_window"


async def test_post_with_last_event_id_delivers_old_tail_then_new_request(http, proxy) -> None:
    client = await started(http, proxy)
    first_id, first = client.tool_call("count_slowly", {"n": 5, "delay": 0.05})
    async with http.post(client.url, data=first, headers=client.headers()) as response:
        seen = await collect(response, limit=2)
    cursor = seen[-1].id.decode()
    second_id, second = client.tool_call("echo", {"text": "after the drop"})
    headers = client.headers(**{"Last-Event-ID": cursor})
    async with http.post(client.url, data=second, headers=headers) as response:
        assert response.status == 200
        events = await collect(response)
    assert progress_values(events) == [3, 4, 5]
    assert sorted(r["id"] for r in responses(events)) == sorted([first_id, second_id])
    ids = [e.id for e in events if e.id]
    assert len(ids) == len(set(ids))


async def resend_with_cursor(
    http: aiohttp.ClientSession, proxy: RunningProxy, client: ScriptedClient, body: bytes, cursor: str
) -> list[SSEEvent]:
    """POST a request id sent before, with ``Last-Event-ID``: 200, and not forwarded again."""
    duplicates = sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total")
    async with http.post(
        client.url, data=body, headers=client.headers(**{"Last-Event-ID": cursor})
    ) as response:
        assert response.status == 200
        events = await collect(response)
    assert (
        sample(proxy.ctx.metrics, "mcpresume_duplicate_requests_total") == duplicates + 1
    )  # not forwarded again
    return events


def stream_of(event_id: bytes) -> int:
    return int(event_id.decode().rsplit("-", 2)[1])


async def test_a_re_attach_after_a_merged_view_follows_every_stream_of_it(http, proxy) -> None:
    """POST + Last-Event-ID merges the old stream's tail and the new request's events in one response; the
    client then holds one cursor, of whichever stream its last event came from. A re-attach with it follows
    both streams (they are grouped): it followed only the cursor's, and the other's response was lost."""
    client = await started(http, proxy)
    first_id, first = client.tool_call("count_slowly", {"n": 6, "delay": 0.05})
    async with http.post(client.url, data=first, headers=client.headers()) as response:
        cursor = (await collect(response, limit=2))[-1].id.decode()  # then the connection drops
    second_id, second = client.tool_call("count_slowly", {"n": 6, "delay": 0.05})
    async with http.post(
        client.url, data=second, headers=client.headers(**{"Last-Event-ID": cursor})
    ) as response:
        assert response.status == 200
        seen = await collect(response, limit=4)  # and drops again
    assert len({stream_of(e.id) for e in seen if e.id}) == 2  # the view carried both streams
    last = seen[-1].id.decode()
    async with http.get(client.url, headers=client.headers(**{"Last-Event-ID": last})) as response:
        assert response.status == 200
        rest = await collect(response)
    events = seen + rest
    assert sorted(r["id"] for r in responses(events)) == sorted([first_id, second_id])  # each once
    ids = [e.id for e in events if e.id]
    assert len(ids) == len(set(ids))


async def test_a_re_sent_request_with_a_cursor_gets_its_stream_and_the_cursors_tail(http, proxy) -> None:
    """A re-sent request id is never forwarded again; with Last-Event-ID its stream (begun after the cursor)
    comes with the cursor stream's tail. It came alone, and the tail, with its response, was lost."""
    client = await started(http, proxy)
    first_id, first = client.tool_call("count_slowly", {"n": 4, "delay": 0.05})
    async with http.post(client.url, data=first, headers=client.headers()) as response:
        cursor = (await collect(response, limit=2))[-1].id.decode()
    second_id, second = client.tool_call("count_slowly", {"n": 2, "delay": 0.05})
    async with http.post(client.url, data=second, headers=client.headers()) as response:
        assert response.status == 200  # forwarded; dropped before anything was read
    events = await resend_with_cursor(http, proxy, client, second, cursor)
    assert sorted(r["id"] for r in responses(events)) == sorted([first_id, second_id])
    second_stream = [e for e in events if e.id and stream_of(e.id) != stream_of(cursor.encode())]
    assert [m["params"]["progress"] for m in messages(second_stream) if "params" in m] == [1, 2]  # whole
    ids = [e.id for e in events if e.id]
    assert len(ids) == len(set(ids))


async def test_the_design_notes_client_re_sends_its_request_with_its_last_id_and_gets_only_the_rest(
    http, proxy
) -> None:
    """The re-POST case, exactly: the client has e1 and e2, drops, and re-POSTs the same request with
    Last-Event-ID: e2. It gets exactly what follows e2 (its stream was replayed from the start: e1 and e2
    twice), and the request is not run again."""
    client = await started(http, proxy)
    request_id, body = client.tool_call("count_slowly", {"n": 5, "delay": 0.05})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        seen = await collect(response, limit=2)
    cursor = seen[-1].id.decode()
    rest = await resend_with_cursor(http, proxy, client, body, cursor)
    assert progress_values(seen) + progress_values(rest) == [1, 2, 3, 4, 5]
    assert [r["id"] for r in responses(rest)] == [request_id]
    ids = [e.id for e in seen + rest if e.id]
    assert len(ids) == len(set(ids))


async def test_post_with_a_cursor_of_the_standalone_stream_ends_with_its_request(http, proxy) -> None:
    """The standalone stream never ends: merged into a POST response it held that response open for good.
    The response carries the request's events and ends; the standalone stream's stay for a GET re-attach."""
    client = await started(http, proxy)
    async with http.get(client.url, headers=client.headers()) as standalone:
        assert standalone.status == 200
        priming = await anext(aiter(_events(standalone)))
    assert priming.id is not None
    cursor = priming.id.decode()
    request_id, body = client.tool_call("echo", {"text": "with a standalone cursor"})
    async with http.post(
        client.url, data=body, headers=client.headers(**{"Last-Event-ID": cursor})
    ) as response:
        assert response.status == 200
        async with asyncio.timeout(10):
            events = await collect(response)
    assert [r["id"] for r in responses(events)] == [request_id]


async def test_post_with_bad_cursor_is_rejected_before_forwarding(http, proxy) -> None:
    client = await started(http, proxy)
    request_id, body = client.tool_call("echo", {"text": "never forwarded"})
    headers = client.headers(**{"Last-Event-ID": "garbage"})
    async with http.post(client.url, data=body, headers=headers) as response:
        assert response.status == 400
        error_body = orjson.loads(await response.read())
    assert error_body["id"] == request_id
    # Not forwarded, not claimed: the same request id can now be sent normally.
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert [r["id"] for r in responses(await collect(response))] == [request_id]


async def test_post_with_a_cursor_of_a_session_the_proxy_does_not_know_is_404_not_an_adoption(
    http, proxy
) -> None:
    client = await started(http, proxy)
    _, body = client.tool_call("echo", {"text": "x"})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        cursor = (await collect(response))[-1].id.decode()
    # The proxy forgets the session (a restart, say); the upstream still knows it.
    assert await proxy.ctx.store.delete_session(client.session_id)
    request_id, body = client.tool_call("echo", {"text": "with the old cursor"})
    async with http.post(
        client.url, data=body, headers=client.headers(**{"Last-Event-ID": cursor})
    ) as response:
        assert response.status == 404  # as a GET with that cursor: the events after it cannot be resumed
        error_body = orjson.loads(await response.read())
    assert error_body["id"] == request_id and error_body["error"]["data"]["reason"] == "unknown_session"
    assert not await proxy.ctx.store.has_session(client.session_id)  # not adopted
    # Without a cursor too: a session the proxy does not track is gone for its clients (they re-initialize).
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 404
        assert (await error_of(response))["data"]["reason"] == "unknown_session"
    assert not await proxy.ctx.store.has_session(client.session_id)


async def test_get_without_cursor_replays_no_history(http, proxy) -> None:
    client = await started(http, proxy)
    _, body = client.tool_call("echo", {"text": "x"})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        await collect(response)
    async with http.get(client.url, headers=client.headers()) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        first = await anext(aiter(_events(response)))
    assert first.data == b""  # the standalone stream's priming event, nothing from the POST stream


async def _events(response):
    from tests.support.proxy import sse_events

    async for event in sse_events(response):
        yield event


async def test_initialize_beyond_max_sessions_is_503_and_not_forwarded(http, example_upstream) -> None:
    async with running_proxy(example_upstream, max_sessions=1) as proxy:
        first = await started(http, proxy)
        assert first.session_id
        refused = ScriptedClient(http, proxy.url)
        with pytest.raises(KeyError):  # no Mcp-Session-Id: the proxy answered itself
            await refused.initialize()
        body = orjson.dumps({"jsonrpc": "2.0", "id": 9, "method": "initialize", "params": {}})
        async with http.post(proxy.url, data=body, headers=refused.headers()) as response:
            assert response.status == 503
            assert (await error_of(response))["data"]["reason"] == "too_many_sessions"
        assert (await proxy.ctx.store.stats()).sessions == 1  # the active session was not evicted
