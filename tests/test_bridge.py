"""The era bridge: handshake-era clients in front of a 2026-07-28-only upstream (issue 34)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import mcp_types as types
import orjson
import pytest
from mcp.client.client import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from mcpresume.core.era import UpstreamEra
from mcpresume.daemon.app import PROXY, RunningProxy
from mcpresume.daemon.demo import ScriptedClient, sse_events
from mcpresume.examples.upstream import RunningUpstream, build_example_app
from mcpresume.http.bridge import Bridge
from tests.support import INITIALIZE_BODY
from tests.support.conformance import Unavailable
from tests.support.modern_upstream import MODERN_VERSION, ModernOnly, serve_modern_upstream
from tests.support.pods import free_port
from tests.support.poll import until
from tests.support.proxy import collect, error_of, reattach, running_proxy
from tests.support.sdk import result_text, sdk_session
from tests.support.ts_sdk import with_script
from tests.test_tasks import FAST as TASKS_FAST
from tests.test_tasks import call as tasks_call
from tests.test_tasks import completed as tasks_completed

pytestmark = pytest.mark.asyncio

META = {
    "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
}
MODERN_HEADERS = {
    "accept": "application/json, text/event-stream",
    "content-type": "application/json",
    "mcp-protocol-version": MODERN_VERSION,
}


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps(body), headers={**MODERN_HEADERS, **headers}) as response:
        text = await response.text()
        return response.status, json.loads(text) if response.content_type == "application/json" else text


async def test_modern_upstream_refuses_the_handshake_era() -> None:
    async with serve_modern_upstream() as (url, guard), aiohttp.ClientSession() as session:
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        status, body = await _post(session, url, initialize, **{"mcp-protocol-version": "2025-06-18"})
        assert status == 400 and body["error"]["code"] == -32022
        async with session.get(url, headers=MODERN_HEADERS) as response:
            assert response.status == 405
        async with session.delete(url, headers=MODERN_HEADERS) as response:
            assert response.status == 405
        discover = {"jsonrpc": "2.0", "id": 2, "method": "server/discover", "params": {"_meta": META}}
        status, body = await _post(session, url, discover, **{"mcp-method": "server/discover"})
        assert status == 200 and body["result"]["supportedVersions"] == [MODERN_VERSION]
        assert guard.refused == ["initialize", "GET", "DELETE"]
        assert guard.methods == ["server/discover"]


async def test_a_handshake_era_sdk_client_gets_a_bridged_session() -> None:
    async with serve_modern_upstream() as (url, guard), running_proxy(url) as proxy:
        async with sdk_session(proxy.url, read_timeout_seconds=30) as session:
            assert session.initialize_result is not None
            assert session.initialize_result.server_info.name == "mcpresume-modern"
            assert session.initialize_result.protocol_version == "2025-11-25"
            assert result_text(await session.call_tool("echo", {"text": "hi"})) == "hi"
            seen: list[float] = []

            async def progress(value: float, total: float | None, message: str | None) -> None:
                seen.append(value)

            counted = await session.call_tool("count_slowly", {"n": 3}, progress_callback=progress)
            assert result_text(counted) == "counted to 3" and seen == [1.0, 2.0, 3.0]
            await session.send_ping()  # answered by the proxy: 2026-07-28 has no ping
            tools = await session.list_tools()
            assert "ask" in [tool.name for tool in tools.tools]
        # The upstream saw only 2026-07-28 requests (the proxy's probes, then the session's), each with
        # the routing headers and the envelope.
        assert guard.refused[:1] == ["initialize"]  # the client's: refused, then answered by the bridge
        assert "ping" not in guard.methods and guard.methods[0] == "server/discover"
        calls = [h for h in guard.headers if h.get("mcp-method") == "tools/call"]
        assert {h.get("mcp-name") for h in calls} == {"echo", "count_slowly"}
        assert all("mcp-session-id" not in h for h in guard.headers)
        eras = proxy.ctx.metrics.era_requests
        assert eras.labels("handshake", "bridged")._value.get() >= 5
        assert eras.labels("handshake", "resumable")._value.get() == 0  # the refused initialize: bridged


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The proxy's store settings: the memory store, or a real Redis (emptied)."""
    if request.param == "memory":
        return {}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return {
        "store": request.getfixturevalue("redis_db"),
        "port": port,
        "advertise_url": f"http://127.0.0.1:{port}/mcp",
    }


async def test_a_call_cut_mid_way_is_resumed_with_its_cursor_and_runs_once(store: dict[str, Any]) -> None:
    """Memory or Redis: the bridged session is kept in the store like any."""
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url, **store) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("slow_tally", {"delay": 1.0})
        cursor: bytes | None = None
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            async for event in sse_events(response):
                if event.id:  # the first event with a cursor (priming, or the progress): cut here
                    cursor = event.id
                    break
        assert cursor is not None
        # The upstream's stream is read to its end by the pump although the client left: the modern
        # "a closed stream cancels the request" never fires on a client's dropped connection.
        messages = await reattach(http, client, proxy.url, cursor)
        answers = [m for m in messages if m.get("id") == request_id]
        assert len(answers) == 1 and answers[0]["result"]["structuredContent"] == {"result": 1}
        # The same request id again: the original stream, never run upstream twice.
        async with http.post(proxy.url, data=body, headers=client.headers()) as again:
            replayed = [orjson.loads(e.data) for e in await collect(again) if e.data]
        assert [m["result"]["structuredContent"] for m in replayed if m.get("id") == request_id] == [
            {"result": 1}
        ]
        assert guard.slow_tallies["slow"] == 1  # type: ignore[attr-defined]


async def test_a_json_answer_is_a_one_event_stream_resumable_like_any() -> None:
    async with (
        serve_modern_upstream(json_response=True) as (url, _guard),
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("echo", {"text": "once"})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            assert response.content_type == "text/event-stream"
            events = await collect(response)
        answers = [orjson.loads(e.data) for e in events if e.data]
        assert [a["id"] for a in answers] == [request_id]
        first = next(e for e in events if e.id)
        again = await reattach(http, client, proxy.url, first.id)
        assert [m["id"] for m in again] == [request_id]


async def test_the_proxy_answers_ping_and_delete_and_an_unknown_method_is_no_session_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mcpresume.access")
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        ping = {"jsonrpc": "2.0", "id": 50, "method": "ping"}
        async with http.post(proxy.url, data=orjson.dumps(ping), headers=client.headers()) as response:
            assert response.status == 200 and (await response.json())["result"] == {}
        # A 2026-07-28 server answers an unknown method with HTTP 404: to a handshake-era client that would
        # end its session, so it gets the JSON-RPC error with 200, and the session lives on.
        odd = {"jsonrpc": "2.0", "id": 51, "method": "completion/nothing", "params": {}}
        async with http.post(proxy.url, data=orjson.dumps(odd), headers=client.headers()) as response:
            assert response.status == 200 and (await response.json())["error"]["code"] == -32601
        async with http.post(
            proxy.url, data=orjson.dumps({**ping, "id": 52}), headers=client.headers()
        ) as response:
            assert response.status == 200
        async with http.delete(proxy.url, headers=client.headers()) as response:
            assert response.status == 200
        async with http.post(
            proxy.url, data=orjson.dumps({**ping, "id": 53}), headers=client.headers()
        ) as response:
            assert (
                response.status == 404 and (await error_of(response))["data"]["reason"] == "unknown_session"
            )
        assert "DELETE" not in guard.refused and "GET" not in guard.refused and "ping" not in guard.methods
        lines = [r.getMessage() for r in caplog.records if r.name == "mcpresume.access"]
        assert any(" 200 answered " in line and "rpc=ping" in line for line in lines), lines
        assert any(" 200 forwarded " in line and "rpc=completion/nothing" in line for line in lines), lines


async def test_bridge_off_leaves_a_handshake_era_client_the_upstreams_refusal() -> None:
    async with (
        serve_modern_upstream() as (url, _guard),
        running_proxy(url, bridge="off") as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        async with http.post(proxy.url, data=orjson.dumps(initialize), headers=client.headers()) as response:
            assert response.status == 400 and "Mcp-Session-Id" not in response.headers


async def test_a_dual_era_upstream_is_served_as_without_the_bridge(example_upstream: str) -> None:
    async with running_proxy(example_upstream) as proxy:
        async with sdk_session(proxy.url, read_timeout_seconds=30) as session:
            assert result_text(await session.call_tool("echo", {"text": "hi"})) == "hi"
        bridge = proxy.ctx.metrics.era_requests
        assert bridge.labels("handshake", "bridged")._value.get() == 0
        assert bridge.labels("handshake", "resumable")._value.get() >= 2


@pytest.mark.parametrize(
    ("tool", "said", "progress"),
    [
        ("ask", "you said tangerine (asked)", []),  # a JSON answer
        # An event stream (the SDK's SSE mode, committed at its first progress), the result held back.
        ("ask_later", "you said tangerine (asked-later, 1)", [0, 1]),
    ],
)
async def test_an_input_required_result_becomes_an_elicitation_of_the_handshake_era(
    tool: str, said: str, progress: list[float]
) -> None:
    asked: list[str] = []
    reported: list[float] = []

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"word": "tangerine"})

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        reported.append(done)

    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        streamable_http_client(proxy.url) as (read, write),
        ClientSession(read, write, elicitation_callback=elicit, read_timeout_seconds=30) as session,
    ):
        await session.initialize()
        answered = await session.call_tool(tool, {"question": "A fruit?"}, progress_callback=on_progress)
        assert result_text(answered) == said
        assert asked == ["A fruit?"]
        # The progress of the first answer and of the retry's, on the one stream of the call.
        assert reported == progress
        # Sent twice upstream: the first call, then the retry with the client's answer and the state.
        assert guard.methods.count("tools/call") == 2


SUPPORT = Path(__file__).parent / "support"


async def _run_ts(script_name: str, url: str) -> dict[str, Any]:
    try:
        node, script = with_script(SUPPORT / script_name)
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        raise
    client = await asyncio.create_subprocess_exec(
        node, str(script), url, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(client.communicate(), 120)
    assert client.returncode == 0, err.decode()
    answer: dict[str, Any] = json.loads(out)
    return answer


async def test_the_typescript_sdk_client_through_the_bridge() -> None:
    async with serve_modern_upstream() as (url, guard), running_proxy(url) as proxy:
        got = await _run_ts("ts_bridge_client.mjs", proxy.url)
        assert got == {
            "counted": "counted to 3",
            "progress": [1, 2, 3],
            "answered": "you said kumquat (asked)",
            "answeredLater": "you said kumquat (asked-later, 1)",
            "progressLater": [0, 1],
            "asked": ["A fruit?", "A fruit?"],
            "server": "mcpresume-modern",
        }
        assert "DELETE" not in guard.refused  # the proxy's session ended at the proxy


async def test_the_typescript_sdk_client_reconnecting_with_its_session_id_through_the_bridge() -> None:
    """The TS SDK client that saved its session id: no initialize the second time, ids from 0 again."""
    async with serve_modern_upstream() as (url, _guard), running_proxy(url) as proxy:
        runs = await _run_ts("ts_sdk_client.mjs", proxy.url)
        assert runs["run1"] == ["hello from run 1", "3"]
        assert runs["run2"] == ["hello from run 2", "42"]


async def test_the_python_sdk_client_in_legacy_mode_and_in_auto_mode() -> None:
    """``Client(mode="legacy")`` speaks the handshake era: bridged. ``Client(mode="auto")`` probes
    ``server/discover``, which the upstream answers: it speaks 2026-07-28 and is passed through."""

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"word": "lime"})

    async with serve_modern_upstream() as (url, _guard), running_proxy(url) as proxy:
        async with Client(
            proxy.url, mode="legacy", elicitation_callback=elicit, read_timeout_seconds=30
        ) as client:
            assert result_text(await client.call_tool("add", {"a": 2, "b": 3})) == "5"
            assert result_text(await client.call_tool("ask", {})) == "you said lime (asked)"
        async with Client(
            proxy.url, mode="auto", elicitation_callback=elicit, read_timeout_seconds=30
        ) as client:
            assert result_text(await client.call_tool("add", {"a": 4, "b": 5})) == "9"
        eras = proxy.ctx.metrics.era_requests
        assert eras.labels("handshake", "bridged")._value.get() >= 3
        assert eras.labels("modern", "passed_through")._value.get() >= 2


async def test_notifications_cancelled_closes_the_upstream_stream_the_modern_cancellation() -> None:
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url, cancel_grace=0.1) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        request_id, body = client.tool_call("slow_tally", {"delay": 60.0})
        async with http.post(proxy.url, data=body, headers=client.headers()) as response:
            async for event in sse_events(response):
                if event.data:  # the progress: the tool runs upstream
                    break
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}}
        async with http.post(proxy.url, data=orjson.dumps(cancel), headers=client.headers()) as response:
            assert response.status == 202
        tallies = guard.slow_tallies  # type: ignore[attr-defined]
        await until(lambda: tallies["cancelled"] == 1, timeout=30, what="the upstream's handler cancelled")
        assert tallies["slow"] == 0
        assert "notifications/cancelled" not in guard.methods  # 2026-07-28 has no such notification


MCP1_PYTHON = Path.home() / ".cache" / "mcpresume" / "mcp1" / "bin" / "python"


async def test_the_python_sdk_1x_client_through_the_bridge() -> None:
    """The 1.x SDK in a venv of its own (see tests/support/mcp1_client.py for how to make it)."""
    if not MCP1_PYTHON.exists():
        pytest.skip(f'no 1.x SDK venv at {MCP1_PYTHON.parent.parent} (python -m venv, pip install "mcp<2")')
    async with serve_modern_upstream() as (url, _guard), running_proxy(url) as proxy:
        client = await asyncio.create_subprocess_exec(
            str(MCP1_PYTHON),
            str(SUPPORT / "mcp1_client.py"),
            proxy.url,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(client.communicate(), 120)
        assert client.returncode == 0, err.decode()[-2000:]
        got = json.loads(out.splitlines()[-1])
        assert got == {
            "version": "2025-11-25",
            "counted": "counted to 3",
            "progress": [1.0, 2.0, 3.0],
            "answered": "you said quince (asked)",
            "asked": ["A fruit?"],
        }


async def test_other_credentials_in_a_bridged_session_are_checked_with_a_discover() -> None:
    """A bridged session is bound to its initialize's credentials like any; other ones (a refreshed token)
    are asked of the upstream with a 2026-07-28 server/discover (it has no session to ping in)."""
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        original = client.headers
        client.headers = lambda **extra: original(**{"Authorization": "Bearer first", **extra})  # type: ignore[method-assign]
        await client.initialize()
        guard.bad_tokens.add("Bearer stolen")
        ping = {"jsonrpc": "2.0", "id": 70, "method": "ping"}
        refreshed = client.headers(Authorization="Bearer refreshed")
        async with http.post(proxy.url, data=orjson.dumps(ping), headers=refreshed) as response:
            assert response.status == 200
        stolen = client.headers(Authorization="Bearer stolen")
        async with http.post(proxy.url, data=orjson.dumps({**ping, "id": 71}), headers=stolen) as response:
            assert response.status == 401
            assert (await error_of(response))["data"]["reason"] == "credentials_refused"
        discovers = [h for h in guard.headers if h.get("mcp-method") == "server/discover"]
        assert [h.get("authorization") for h in discovers][-1:] == ["Bearer refreshed"]


async def test_a_bridged_initialize_past_max_sessions_is_503() -> None:
    async with (
        serve_modern_upstream() as (url, _guard),
        running_proxy(url, max_sessions=1) as proxy,
        aiohttp.ClientSession() as http,
    ):
        await ScriptedClient(http, proxy.url).initialize()
        second = ScriptedClient(http, proxy.url)
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        async with http.post(proxy.url, data=orjson.dumps(initialize), headers=second.headers()) as response:
            assert response.status == 503
            assert (await error_of(response))["data"]["reason"] == "too_many_sessions"


def _bridge(proxy: RunningProxy) -> Bridge:
    return proxy.app[PROXY].bridge


def _eras(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the era lines say: the era learnt, and the one before it (``was``)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "mcpresume.bridge"]
    return [line.split(" (it ")[0] for line in lines if line.startswith("the upstream's era:")]


async def _handshake_initialize(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    async with http.post(url, data=INITIALIZE_BODY, headers=ScriptedClient(http, url).headers()) as response:
        await response.read()
        return response


async def test_a_dual_era_upstream_sees_one_probe_then_the_same_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``bridge = "auto"`` in front of an upstream that takes the handshake era: the era probe at start (a
    ``server/discover``, a modern request it answers), then no translation; what it is sent is what the
    client sent. The era: modern at the probe's answer, dual once it took a client's ``initialize``."""
    caplog.set_level(logging.INFO, logger="mcpresume.bridge")
    guard = ModernOnly(build_example_app(), refuse=False)
    async with RunningUpstream(guard) as upstream, running_proxy(upstream.url) as proxy:
        await until(lambda: _bridge(proxy).era is UpstreamEra.MODERN, timeout=30, what="the probe at start")
        async with sdk_session(proxy.url, read_timeout_seconds=30) as session:
            assert result_text(await session.call_tool("echo", {"text": "hi"})) == "hi"
            await session.send_ping()
        assert _bridge(proxy).era is UpstreamEra.DUAL
    assert guard.methods[:4] == ["server/discover", "initialize", "notifications/initialized", "tools/call"]
    assert guard.methods.count("server/discover") == 1 and "ping" in guard.methods
    assert all(h.get("mcp-protocol-version") != MODERN_VERSION for h in guard.headers[1:])
    assert all("mcp-session-id" in h for h in guard.headers[2:])
    assert _eras(caplog) == ["the upstream's era: modern", "the upstream's era: dual (was modern)"]


async def test_the_era_probed_at_start_bridges_the_first_initialize_with_no_second_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A modern-only upstream: the probe at start says it speaks 2026-07-28; the first client's initialize
    is refused upstream, and bridged on the probe's answer (no probe again); every later one is answered by
    the proxy without asking the upstream."""
    caplog.set_level(logging.INFO, logger="mcpresume.bridge")
    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        await until(lambda: _bridge(proxy).era is UpstreamEra.MODERN, timeout=30, what="the probe at start")
        for _ in range(3):
            await ScriptedClient(http, proxy.url).initialize()
        assert _bridge(proxy).era is UpstreamEra.MODERN_ONLY
    assert guard.refused == ["initialize"]  # the first client's; the others never reached it
    assert guard.methods == ["server/discover"]  # the probe at start, once
    assert _eras(caplog) == ["the upstream's era: modern", "the upstream's era: modern_only (was modern)"]


async def test_an_upstream_whose_probe_fails_at_start_is_probed_again_and_the_replica_is_ready() -> None:
    """The probe at start is not answered (a 503): the replica is ready all the same, a client's
    ``initialize`` meanwhile learns the era the old way (refused: probed; still no answer: the refusal
    relayed), and the probe is sent again in the background until the upstream answers it; then the era is
    known of both (modern-only), and the next ``initialize`` is bridged without reaching the upstream."""
    async with serve_modern_upstream() as (url, guard), aiohttp.ClientSession() as http:
        guard.discover_down = True
        async with running_proxy(url, metrics_port=free_port()) as proxy:
            await until(lambda: "server/discover" in guard.refused, timeout=30, what="the probe at start")
            assert proxy.admin_url is not None
            async with http.get(proxy.admin_url + "/readyz") as ready:
                assert ready.status == 200
            refused = await _handshake_initialize(http, proxy.url)
            assert refused.status == 400 and _bridge(proxy).era is UpstreamEra.UNKNOWN
            guard.discover_down = False
            # The probe answered at last: with the refusal seen meanwhile, the era is known whole.
            await until(lambda: _bridge(proxy).era is not UpstreamEra.UNKNOWN, timeout=60, what="the probe")
            assert _bridge(proxy).era is UpstreamEra.MODERN_ONLY
            client = ScriptedClient(http, proxy.url)
            await client.initialize()
            assert client.session_id
        assert guard.refused.count("initialize") == 1  # the next one was bridged without asking
        assert guard.refused.count("server/discover") >= 2  # at start, for the refusal, perhaps more


async def test_an_upstream_that_changes_era_is_probed_again(caplog: pytest.LogCaptureFixture) -> None:
    """The dual-era SDK server, then made modern-only (the guard refuses the handshake era): a refusal from
    an upstream believed dual-era is probed again and bridged; then dual-era again: a handshake-era request
    of a session of its own taken by an upstream believed modern-only is probed again too."""
    caplog.set_level(logging.INFO, logger="mcpresume.bridge")
    guard = ModernOnly(build_example_app(), refuse=False)
    async with (
        RunningUpstream(guard) as upstream,
        running_proxy(upstream.url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        await until(lambda: _bridge(proxy).era is UpstreamEra.MODERN, timeout=30, what="the probe at start")
        own = ScriptedClient(http, proxy.url)
        await own.initialize()  # a session of the upstream's own
        assert _bridge(proxy).era is UpstreamEra.DUAL
        guard.refuse = True
        bridged = ScriptedClient(http, proxy.url)
        await bridged.initialize()
        assert _bridge(proxy).era is UpstreamEra.MODERN_ONLY
        assert guard.methods.count("server/discover") == 2  # at start, then for the refusal
        guard.refuse = False
        _, body = own.tool_call("echo", {"text": "still here"})
        async with http.post(proxy.url, data=body, headers=own.headers()) as response:
            assert response.status == 200
            await response.read()
        await until(lambda: _bridge(proxy).era is UpstreamEra.DUAL, timeout=30, what="the probe again")
        assert guard.methods.count("server/discover") == 3
        _, body = bridged.tool_call("echo", {"text": "bridged still"})  # a bridged session stays bridged
        async with http.post(proxy.url, data=body, headers=bridged.headers()) as response:
            answers = [orjson.loads(e.data) for e in await collect(response) if e.data]
        assert answers[-1]["result"]["structuredContent"] == {"result": "bridged still"}
    assert _eras(caplog) == [
        "the upstream's era: modern",
        "the upstream's era: dual (was modern)",
        "the upstream's era: modern_only (was dual)",
        "the upstream's era: dual (was modern_only)",
    ]


async def test_the_standalone_get_is_the_upstreams_listen_stream() -> None:
    """A bridged session's GET: the upstream's subscriptions/listen, its list-changed notifications."""
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with (
        serve_modern_upstream() as (url, guard),
        running_proxy(url) as proxy,
        sdk_session(proxy.url, message_handler=on_message, read_timeout_seconds=30) as session,
    ):
        await until(
            lambda: "subscriptions/listen" in guard.methods, timeout=30, what="the listen stream open"
        )
        assert result_text(await session.call_tool("change_tools", {})) == "changed"
        async with asyncio.timeout(30):
            await changed.wait()
        assert "GET" not in guard.refused


async def test_requests_served_by_the_tasks_path_are_counted_by_era(example_upstream: str) -> None:
    """A long 2026-07-28 call made a task, and its ``tasks/get`` polls: each counted once, ``task``."""
    async with running_proxy(example_upstream, **TASKS_FAST) as proxy:
        status, doc = await tasks_call(proxy.url, n=6, delay=0.25)  # 1.5 s, task_after 0.5 s
        assert status == 200 and doc["result"]["resultType"] == "task"
        assert (await tasks_completed(proxy.url, doc["result"]["taskId"]))["status"] == "completed"
        metrics = proxy.ctx.metrics
        polls = metrics.task_polls._value.get()
        assert polls >= 1
        assert metrics.era_requests.labels("modern", "task")._value.get() == 1 + polls
        assert metrics.era_requests.labels("modern", "passed_through")._value.get() == 0
