"""The test infrastructure itself, proven against real parts.

The official SDK client talks to the bundled example upstream (official SDK server under uvicorn in this
event loop) directly and through `CuttingRelay`; the relay's cuts are checked at the byte level with raw
aiohttp requests; the event-store upstream makes the SDK client resume on its own; Redis answers PING.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED

from mcpresume.examples.event_store import InMemoryEventStore
from mcpresume.examples.upstream import RunningUpstream, build_example_app, serve_example_upstream
from tests.support import EVENT_STORE_RETRY_MS, redis_ping
from tests.support.relay import CuttingRelay, HttpMessage
from tests.support.sdk import HANDSHAKE_VERSION, NotificationLog, count_slowly, result_text, sdk_session

TIMEOUT = 20.0  # generous: a loaded 2-core CI box must never trip it; nothing here waits on it when healthy

EXAMPLE_TOOLS = {"echo", "add", "tally", "count_slowly", "poll_me"}

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": HANDSHAKE_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "0"},
    },
}
MCP_ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def tool_call_response(relay: CuttingRelay, tool: str) -> HttpMessage | None:
    """The (first) response to the ``tools/call`` POST for ``tool`` seen by a recording relay."""
    for response in relay.responses():
        request = response.request
        if request is None or request.method != "POST" or not request.complete:
            continue
        body: Any = json.loads(bytes(request.body) or b"null")
        if isinstance(body, dict) and body.get("method") == "tools/call" and body["params"]["name"] == tool:
            return response
    return None


def resumption_gets(relay: CuttingRelay) -> list[HttpMessage]:
    return [r for r in relay.requests() if r.method == "GET" and r.header("last-event-id")]


def raw_session() -> aiohttp.ClientSession:
    """aiohttp without connection reuse: every request opens a new relay connection (and gets a new draw)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


# ------------------------------------------------------------------------------------------------------------
# SDK client <-> example upstream


async def test_initialize_and_list_tools(example_upstream: str) -> None:
    async with asyncio.timeout(TIMEOUT), sdk_session(example_upstream) as session:
        init = session.initialize_result
        assert init is not None
        assert init.protocol_version == HANDSHAKE_VERSION
        assert init.server_info.name == "mcpresume-example"
        tools = await session.list_tools()
        assert {tool.name for tool in tools.tools} == EXAMPLE_TOOLS


async def test_echo_and_add(example_upstream: str) -> None:
    async with asyncio.timeout(TIMEOUT), sdk_session(example_upstream) as session:
        echoed = await session.call_tool("echo", {"text": "hello, upstream"})
        assert not echoed.is_error
        assert result_text(echoed) == "hello, upstream"
        added = await session.call_tool("add", {"a": 40, "b": 2})
        assert result_text(added) == "42"
        assert added.structured_content == {"result": 42}


async def test_count_slowly_reports_progress_in_order(example_upstream: str) -> None:
    log = NotificationLog()
    async with asyncio.timeout(TIMEOUT), sdk_session(example_upstream, message_handler=log) as session:
        call = await count_slowly(session, n=4, delay=0.01)
    assert call.text == "counted to 4"
    assert call.progress == [(float(i), 4.0, f"step {i} of 4") for i in range(1, 5)]
    # The same notifications also reach the session's message_handler.
    progress = [n for n in log.notifications if isinstance(n, types.ProgressNotification)]
    assert [n.params.progress for n in progress] == [1.0, 2.0, 3.0, 4.0]
    assert log.errors == []


async def test_host_and_origin_checks_allow_any_loopback_port(example_upstream: str) -> None:
    """A proxy forwards the client's Host (its own port); loopback Hosts/Origins on any port must pass."""
    port = urlsplit(example_upstream).port
    async with asyncio.timeout(TIMEOUT), raw_session() as http:
        for host, origin, status in [
            (f"127.0.0.1:{port}", None, 200),
            ("127.0.0.1:1", "http://localhost:3", 200),
            ("localhost:65000", "http://127.0.0.1:9", 200),
            ("[::1]:8443", None, 200),
            ("evil.example:80", None, 421),
            ("127.0.0.1:1", "http://evil.example", 403),
        ]:
            headers = {**MCP_ACCEPT, "Host": host, **({"Origin": origin} if origin else {})}
            async with http.post(example_upstream, json=INITIALIZE, headers=headers) as response:
                assert response.status == status, (host, origin)
                await response.read()


@pytest.mark.parametrize(
    ("json_response", "stateless", "progress_expected"),
    [
        (True, False, False),  # a JSON body has no room for notifications: the SDK server drops them
        (False, True, True),
        (True, True, False),
    ],
)
async def test_other_upstream_modes(json_response: bool, stateless: bool, progress_expected: bool) -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        serve_example_upstream(json_response=json_response, stateless=stateless) as url,
        sdk_session(url) as session,
    ):
        assert result_text(await session.call_tool("echo", {"text": "mode"})) == "mode"
        call = await count_slowly(session, n=2, delay=0.01)
    assert call.text == "counted to 2"
    assert call.progress == (
        [(1.0, 2.0, "step 1 of 2"), (2.0, 2.0, "step 2 of 2")] if progress_expected else []
    )


# ------------------------------------------------------------------------------------------------------------
# Through the relay


async def test_sdk_through_relay_without_cuts(example_upstream: str) -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        CuttingRelay.for_url(example_upstream, record=True) as relay,
        sdk_session(relay.relayed(example_upstream)) as session,
    ):
        tools = await session.list_tools()
        assert {tool.name for tool in tools.tools} == EXAMPLE_TOOLS
        assert result_text(await session.call_tool("echo", {"text": "via relay"})) == "via relay"
        call = await count_slowly(session, n=3, delay=0.01)
        assert call.text == "counted to 3"
        assert call.progress == [(float(i), 3.0, f"step {i} of 3") for i in range(1, 4)]

        # What the transport carried: no event store, so no priming event -- 3 progress events + the result.
        response = tool_call_response(relay, "count_slowly")
        assert response is not None and response.status == 200 and response.is_sse and response.complete
        events = response.sse_events()
        assert [e.event for e in events] == ["message"] * 4
        assert all(e.id is None for e in events)
        methods = [json.loads(e.data).get("method") for e in events]
        assert methods == ["notifications/progress"] * 3 + [None]
        assert json.loads(events[-1].data)["result"]["content"][0]["text"] == "counted to 3"
        # Every request carried the negotiated version and the session id (Host is the relay's, and passed).
        post = response.request
        assert post is not None
        assert post.header("mcp-protocol-version") == HANDSHAKE_VERSION
        assert post.header("mcp-session-id")
        assert post.header("host") == f"127.0.0.1:{relay.port}"
    assert relay.cuts == 0
    assert relay.accepted >= 1


async def test_relay_cuts_each_connection_after_exact_byte_count(example_upstream: str) -> None:
    async with asyncio.timeout(TIMEOUT), CuttingRelay.for_url(example_upstream, record=True) as relay:
        url = relay.relayed(example_upstream)
        async with raw_session() as http, http.post(url, json=INITIALIZE, headers=MCP_ACCEPT) as response:
            assert response.status == 200
            full_body = await response.read()
        full = relay.connections[0]
        await relay.wait_for(lambda r: r.connections[0].closed)
        head_size = full.responses[0].head_size
        assert full.down_bytes == full.responses[0].raw_size > head_size + 20
        assert b"event: message" in full_body

        # Cut the next connection 20 bytes into the response body (chunk framing counts as body bytes).
        budget = head_size + 20
        relay.set_policy(cut_after=budget)
        received = bytearray()
        async with raw_session() as http, http.post(url, json=INITIALIZE, headers=MCP_ACCEPT) as response:
            assert response.status == 200  # the head got through
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in response.content.iter_any():
                    received += chunk
        cut = relay.connections[1]
        assert cut.cut and cut.cut_at == budget
        assert cut.down_bytes == budget
        assert cut.responses[0].cut and not cut.responses[0].complete
        assert len(received) < len(full_body)
        assert relay.cuts == relay.policy_cuts == 1


async def test_relay_hard_cut_resets_the_client(example_upstream: str) -> None:
    async with asyncio.timeout(TIMEOUT), CuttingRelay.for_url(example_upstream, hard_cut=True) as relay:
        relay.set_policy(cut_after=(300, 320))
        with pytest.raises(aiohttp.ClientError):
            async with (
                raw_session() as http,
                http.post(relay.relayed(example_upstream), json=INITIALIZE, headers=MCP_ACCEPT) as r,
            ):
                await r.read()
        await relay.wait_for(lambda r: r.accepted == 1 and r.connections[0].closed)
    (conn,) = relay.connections
    assert conn.cut and conn.cut_at is not None and 300 <= conn.cut_at <= 320
    assert conn.down_bytes == conn.cut_at
    assert relay.policy_cuts == 1


async def test_relay_sse_only_policy_spares_other_responses(example_upstream: str) -> None:
    seed, lo, hi = 7, 10, 40
    async with (
        asyncio.timeout(TIMEOUT),
        CuttingRelay.for_url(
            example_upstream, seed=seed, cut_after=(lo, hi), sse_only=True, record=True
        ) as relay,
        raw_session() as http,
    ):
        url = relay.relayed(example_upstream)
        # Not acceptable (no text/event-stream): a JSON error answer, which the policy leaves alone.
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        async with http.post(url, json=INITIALIZE, headers=headers) as response:
            assert response.status == 406
            assert (await response.json())["error"]["message"].startswith("Not Acceptable")
        # A 200 text/event-stream answer: cut inside its head, so the client never even sees a status line.
        with pytest.raises(aiohttp.ClientError):
            async with http.post(url, json=INITIALIZE, headers=MCP_ACCEPT) as response:
                await response.read()
        await relay.wait_for(lambda r: r.accepted == 2 and all(c.closed for c in r.connections))
    spared, cut = relay.connections
    assert not spared.cut and spared.responses[0].status == 406 and spared.responses[0].complete
    expected = random.Random(seed).randint(lo, hi)  # the first draw of the seeded generator
    assert cut.cut and cut.cut_at == expected == cut.down_bytes
    assert cut.responses[0].is_sse and cut.responses[0].cut
    assert relay.policy_cuts == 1


async def test_cut_all_breaks_a_non_resumable_stream(example_upstream: str) -> None:
    """Without an upstream event store there is no priming event, so the SDK client cannot resume."""
    async with (
        asyncio.timeout(TIMEOUT),
        CuttingRelay.for_url(example_upstream, record=True) as relay,
        sdk_session(relay.relayed(example_upstream)) as session,
    ):
        call = asyncio.create_task(count_slowly(session, n=20, delay=0.05))

        def first_progress_seen(r: CuttingRelay) -> bool:
            response = tool_call_response(r, "count_slowly")
            return response is not None and len(response.sse_events()) >= 1

        await relay.wait_for(first_progress_seen)
        assert relay.cut_all() >= 1
        with pytest.raises(MCPError) as error:
            await call
        assert error.value.code == CONNECTION_CLOSED
        response = tool_call_response(relay, "count_slowly")
        assert response is not None and not response.complete
    assert resumption_gets(relay) == []


# ------------------------------------------------------------------------------------------------------------
# Upstream with its own event store: the SDK client resumes by itself


async def test_poll_me_completes_through_server_initiated_polling(
    example_upstream_with_event_store: str, event_store: InMemoryEventStore
) -> None:
    url = example_upstream_with_event_store
    async with (
        asyncio.timeout(TIMEOUT),
        CuttingRelay.for_url(url, record=True) as relay,
        sdk_session(relay.relayed(url)) as session,
    ):
        call = await count_slowly(session, n=3, delay=0.01, tool="poll_me")
        assert call.text == "polled 3 times"
        assert call.progress == [(float(i), 3.0, f"poll {i} of 3") for i in range(1, 4)]

        # The POST's stream opened with a priming event; the server closed it without the result. (The
        # close is abrupt: progress 1, queued but not yet written, may only arrive via the replay.)
        response = tool_call_response(relay, "poll_me")
        assert response is not None and response.complete
        events = response.sse_events()
        assert events[0].data == "" and events[0].id and events[0].retry == EVENT_STORE_RETRY_MS
        assert all(json.loads(e.data)["method"] == "notifications/progress" for e in events[1:])
        # The client came back with GET + Last-Event-ID (after the 200 ms retry) and got the rest replayed.
        gets = resumption_gets(relay)
        assert gets and gets[0].header("last-event-id") == events[-1].id
        # Between the two, every progress event crossed the wire exactly once, then the result.
        live = [json.loads(e.data) for e in events[1:]]
        replayed = [
            json.loads(e.data)
            for r in relay.responses(sse=True)
            if r.request in gets
            for e in r.sse_events()
            if e.data  # the resumed stream has its own priming event (after the replay)
        ]
        messages = live + replayed
        assert [m["params"]["progress"] for m in messages[:-1]] == [1, 2, 3]
        assert messages[-1]["result"]["content"][0]["text"] == "polled 3 times"
    assert event_store.size > 0


async def test_sdk_client_resumes_after_a_network_cut(
    example_upstream_with_event_store: str, event_store: InMemoryEventStore
) -> None:
    url = example_upstream_with_event_store
    async with (
        asyncio.timeout(TIMEOUT),
        CuttingRelay.for_url(url, record=True) as relay,
        sdk_session(relay.relayed(url)) as session,
    ):
        # 4 progress events 20 ms apart: all are stored upstream before the client's 200 ms retry fires, so
        # the resumption replays them (none races the SDK's own replay -> live hand-off).
        call = asyncio.create_task(count_slowly(session, n=4, delay=0.02))

        def priming_and_progress_seen(r: CuttingRelay) -> bool:
            response = tool_call_response(r, "count_slowly")
            return response is not None and len(response.sse_events()) >= 2

        await relay.wait_for(priming_and_progress_seen)
        assert relay.cut_all() >= 1
        result = await call
        assert result.text == "counted to 4"
        assert result.progress == [(float(i), 4.0, f"step {i} of 4") for i in range(1, 5)]
        assert len(resumption_gets(relay)) >= 1
    assert relay.cuts >= 1


async def test_in_memory_event_store_replays_one_stream_and_stays_bounded() -> None:
    store = InMemoryEventStore(max_events=4)

    def note(i: int) -> types.JSONRPCMessage:
        return types.JSONRPCNotification(
            jsonrpc="2.0", method="notifications/progress", params={"progress": i}
        )

    priming = await store.store_event("a", None)
    first = await store.store_event("a", note(1))
    await store.store_event("b", note(100))
    await store.store_event("a", note(2))
    replayed: list[tuple[str | None, Any]] = []

    async def send(event: Any) -> None:
        replayed.append((event.event_id, event.message.params["progress"]))

    assert await store.replay_events_after(priming, send) == "a"
    assert [progress for _, progress in replayed] == [1, 2]  # not b's event, not the priming event
    assert replayed[0][0] == first
    # A fifth event evicts the oldest (the priming event): its id is unknown now and replays nothing.
    await store.store_event("a", note(3))
    assert store.size == 4 and store.evicted == 1
    replayed.clear()
    assert await store.replay_events_after(priming, send) is None
    assert replayed == []
    assert await store.replay_events_after(first, send) == "a"
    assert [progress for _, progress in replayed] == [2, 3]
    assert await InMemoryEventStore().replay_events_after(first, send) is None  # another store's id
    assert store.messages("b") == [note(100)]


# ------------------------------------------------------------------------------------------------------------
# Lifecycle


async def test_upstream_stops_promptly_with_a_client_still_attached() -> None:
    """An SSE stream a client keeps open must not hold up shutdown, and nothing may be left running."""
    upstream = RunningUpstream(build_example_app(), shutdown_grace=0.2)
    await upstream.start()
    try:
        async with (
            asyncio.timeout(TIMEOUT),
            CuttingRelay.for_url(upstream.url, record=True) as relay,
            sdk_session(relay.relayed(upstream.url), terminate_on_close=False) as session,
        ):
            assert result_text(await session.call_tool("echo", {"text": "x"})) == "x"
            # Wait until the SDK's standalone GET stream is established (its 200 head passed the relay).
            await relay.wait_for(
                lambda r: any(
                    m.is_sse and m.request is not None and m.request.method == "GET" for m in r.responses()
                )
            )
            started = time.monotonic()
            await upstream.stop()
            assert time.monotonic() - started < 5.0
    finally:
        await upstream.stop()
    leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert leftovers == []


async def test_upstream_restarts_on_the_same_port() -> None:
    async with asyncio.timeout(TIMEOUT):
        async with RunningUpstream(build_example_app()) as first:
            url, port = first.url, first.port
            async with sdk_session(url) as session:
                assert result_text(await session.call_tool("add", {"a": 1, "b": 2})) == "3"
        async with RunningUpstream(build_example_app(), port=port) as second:
            assert second.url == url
            async with sdk_session(url) as session:
                assert result_text(await session.call_tool("add", {"a": 2, "b": 2})) == "4"


# ------------------------------------------------------------------------------------------------------------
# Redis


async def test_redis_fixture_answers(redis_server: str) -> None:
    parts = urlsplit(redis_server)
    assert parts.scheme == "redis" and parts.hostname == "127.0.0.1" and parts.path == "/0"
    assert parts.port is not None and redis_ping(parts.port)
    async with asyncio.timeout(TIMEOUT):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n*2\r\n$3\r\nGET\r\n$3\r\nkey\r\n")
            await writer.drain()
            assert await reader.readexactly(5) == b"+OK\r\n"
            assert await reader.readexactly(11) == b"$5\r\nvalue\r\n"
        finally:
            writer.close()
            await writer.wait_closed()


def test_the_example_upstream_runs_on_its_own() -> None:
    """``python -m mcpresume.examples.upstream`` (the compose file's upstream): serves, stops on SIGTERM."""
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "mcpresume.examples.upstream", "--port", "0", "--any-host"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it listens
        assert line.startswith("example MCP upstream: http://127.0.0.1:")
        url = line.split(": ", 1)[1].strip()
        request = urllib.request.Request(
            url, method="GET", headers={"Host": "mcp.example", "Accept": "text/plain"}
        )
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as exc:  # answered by the SDK (no session), not refused for the Host
            assert exc.code != 421, exc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
