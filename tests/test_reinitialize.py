"""The session outlives its upstream (issue #33): an upstream that lost a session the proxy tracks.

The upstream here is the official MCP SDK's server in a process of its own (``python -m
mcpresume.examples.upstream``), killed with SIGKILL and started again on the same port: every session it
held is gone, as after a crash, an OOM kill or a redeploy beside the sidecar.

``upstream_session_lost = "end"`` (the default): the proxy ends the session, and the client is told so by
the proxy's own 404, ``data.reason`` ``upstream_session_lost`` (never the upstream's body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
import pytest

from mcpresume.core.errors import SessionGone
from mcpresume.core.reinit import Outcome, Recipe
from mcpresume.core.window import WindowLimits
from mcpresume.daemon.app import RunningProxy
from mcpresume.daemon.demo import PROTOCOL_VERSION
from mcpresume.http.reinit import begin_again
from mcpresume.store.memory import MemoryStore
from tests.support.conformance import Unavailable
from tests.support.metrics import sample
from tests.support.pods import kill, pods
from tests.support.proxy import ScriptedClient, collect, error_of, reattach, running_proxy, sse_events
from tests.support.redis import MakeRedisStore
from tests.support.sdk import result_text, sdk_session
from tests.support.ts_sdk import with_script

ROOT = Path(__file__).resolve().parent.parent
REINITS = "mcpresume_upstream_reinitializations_total"
TIMEOUT = 60  # generous: a loaded machine starts a Python process slowly


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class UpstreamProcess:
    """The example upstream (official SDK server) as a process on a fixed port: killed -9, started again."""

    def __init__(self, port: int, shaped: bool = False) -> None:
        self.port = port
        self.shaped = shaped  # tests/support/shaped_upstream.py instead of the example upstream
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        if self.shaped:
            args, ready = ["tests.support.shaped_upstream"], f"shaped upstream at {self.url}"
        else:
            args, ready = ["mcpresume.examples.upstream", "--any-host"], f"example MCP upstream: {self.url}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # printed once it listens
        assert line.strip() == ready, line

    def kill(self) -> None:
        """SIGKILL: no shutdown, every session of the process lost."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None


@contextmanager
def upstream_process(*, shaped: bool = False) -> Iterator[UpstreamProcess]:
    upstream = UpstreamProcess(free_port(), shaped)
    upstream.start()
    try:
        yield upstream
    finally:
        upstream.stop()


@asynccontextmanager
async def restarted(upstream: UpstreamProcess) -> AsyncIterator[None]:
    """Kill the upstream -9 and start it again on its port (off the loop: the start reads a pipe)."""
    await asyncio.to_thread(upstream.kill)
    await asyncio.to_thread(upstream.start)
    yield


async def call(http: aiohttp.ClientSession, client: ScriptedClient) -> aiohttp.ClientResponse:
    _, body = client.tool_call("add", {"a": 1, "b": 2})
    return await http.post(client.url, data=body, headers=client.headers())


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_end_an_upstream_restarted_under_a_session_is_the_proxys_404_upstream_session_lost(
    method: str,
) -> None:
    """``end``: after a kill -9 and restart of the SDK server, the next request of the session (a call, or
    the standalone GET) gets the proxy's own 404 with ``data.reason`` ``upstream_session_lost``; the session
    is no longer tracked, and a new one begins as usual."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with running_proxy(upstream.url) as proxy, aiohttp.ClientSession() as http:
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                async with await call(http, client) as response:
                    assert response.status == 200
                    messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                    assert messages[-1]["result"]["content"][0]["text"] == "3"
                async with restarted(upstream):
                    pass
                request = (
                    await call(http, client)
                    if method == "POST"
                    else await http.get(client.url, headers=client.headers(Accept="text/event-stream"))
                )
                async with request as response:
                    assert response.status == 404
                    error = await error_of(response)
                assert error["data"]["reason"] == "upstream_session_lost"
                assert error["message"] == SessionGone.UPSTREAM_FORGOT.value
                assert not await proxy.ctx.store.has_session(client.session_id)
                again = ScriptedClient(http, proxy.url)  # the client re-initializes: a new session
                await again.initialize()
                async with await call(http, again) as response:
                    assert response.status == 200


async def request(
    http: aiohttp.ClientSession, client: ScriptedClient, method: str, params: dict[str, object]
) -> int:
    """One request of the session to its answer's end; the HTTP status."""
    body = orjson.dumps({"jsonrpc": "2.0", "id": client._id(), "method": method, "params": params})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        await response.read()
        return response.status


@pytest.mark.parametrize("setting", ["end", "reinitialize"])
async def test_reinitialize_records_the_initialize_and_the_shaping_requests_and_end_records_nothing(
    setting: str,
) -> None:
    """``reinitialize``: the session's recipe holds the client's initialize params, the last level, the
    subscriptions left after an unsubscribe, and the standalone GET; other requests add nothing. ``end``:
    the store keeps no recipe (nothing is parsed or written on the request path)."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost=setting) as proxy,
                aiohttp.ClientSession() as http,
            ):
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                for method, params in [
                    ("logging/setLevel", {"level": "debug"}),
                    ("resources/subscribe", {"uri": "file:///a"}),
                    ("resources/subscribe", {"uri": "file:///b"}),
                    ("logging/setLevel", {"level": "error"}),
                    ("resources/unsubscribe", {"uri": "file:///a"}),
                    ("tools/list", {}),
                ]:
                    assert await request(http, client, method, params) == 200
                async with http.get(client.url, headers=client.headers(Accept="text/event-stream")) as get:
                    assert get.status == 200
                    granted = await proxy.ctx.store.access(client.session_id)
                    assert granted is not None
                    kept = await proxy.ctx.store.recipe(client.session_id, granted.epoch)
        if setting == "end":
            assert kept is None
            return
        assert kept is not None
        recipe = Recipe.decode(kept)
        assert recipe.params["clientInfo"] == {"name": "mcpresume-demo", "version": "1"}
        assert recipe.params["protocolVersion"] == PROTOCOL_VERSION
        assert recipe.level == "error" and recipe.subscriptions == {"file:///b"} and recipe.standalone
        # What the initialize's answer told the client (kept on its notifications/initialized).
        assert recipe.version == PROTOCOL_VERSION
        assert recipe.capabilities is not None and "tools" in recipe.capabilities


async def recorded_session(
    http: aiohttp.ClientSession, proxy_url: str, proxy: RunningProxy
) -> tuple[ScriptedClient, Recipe]:
    client = ScriptedClient(http, proxy_url)
    await client.initialize()
    assert await request(http, client, "logging/setLevel", {"level": "debug"}) == 200
    granted = await proxy.ctx.store.access(client.session_id)
    assert granted is not None
    kept = await proxy.ctx.store.recipe(client.session_id, granted.epoch)
    assert kept is not None
    return client, Recipe.decode(kept)


async def test_begin_again_replays_the_recipe_into_a_restarted_sdk_server_and_counts_it() -> None:
    """``http.reinit.begin_again`` after a kill -9 and restart: the SDK server gives a new session, which
    serves a call at once (the handshake and the level were replayed); counted once, ``reinitialized``."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client, recipe = await recorded_session(http, proxy.url, proxy)
                async with restarted(upstream):
                    pass
                begun = await begin_again(proxy.ctx, "/mcp", [], recipe)
                assert begun.outcome is Outcome.REINITIALIZED and begun.upstream_id is not None
                assert begun.upstream_id != client.session_id  # the upstream's own, new
                direct = ScriptedClient(http, upstream.url)
                direct.session_id = begun.upstream_id
                async with await call(http, direct) as response:
                    assert response.status == 200
                    messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                assert messages[-1]["result"]["content"][0]["text"] == "3"
                # Counted once the mapping is won (http.reinit.recover), not here.
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 0


@pytest.mark.parametrize(
    ("told", "outcome"),
    [
        ({"version": "2024-11-05"}, Outcome.VERSION_CHANGED),
        ({"capabilities": {"tools": {"listChanged": True}, "sampling": {}}}, Outcome.FEWER_CAPABILITIES),
    ],
    ids=["another-version", "fewer-capabilities"],
)
async def test_begin_again_refuses_an_upstream_that_offers_other_terms_and_ends_its_session(
    told: dict[str, object], outcome: Outcome
) -> None:
    """The client was told another version, or capabilities the new upstream does not offer: not begun
    again (the session ends with a reason), and the upstream session begun for it is ended there."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                _, recipe = await recorded_session(http, proxy.url, proxy)
                version, caps = told.get("version", PROTOCOL_VERSION), told.get("capabilities", {})
                assert isinstance(version, str) and isinstance(caps, dict)
                recipe = replace(recipe, version=version, capabilities=caps)
                begun = await begin_again(proxy.ctx, "/mcp", [], recipe)
                assert begun.outcome is outcome and begun.upstream_id is None
                assert sample(proxy.ctx.metrics, REINITS, outcome=outcome.value) == 1


async def test_reinitialize_the_next_call_in_the_same_session_succeeds_after_a_kill_9() -> None:
    """``reinitialize``, a raw client: the SDK server killed -9 and started again under the session; the
    next call, same session id, is answered (begun again upstream, the call sent again: it never ran); the
    client's id never changes; one re-initialization is counted, and a second call needs none."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client, _ = await recorded_session(http, proxy.url, proxy)
                async with restarted(upstream):
                    pass
                for _ in range(2):
                    async with await call(http, client) as response:
                        assert response.status == 200, await response.text()
                        assert "Mcp-Session-Id" not in response.headers or (
                            response.headers["Mcp-Session-Id"] == client.session_id
                        )
                        messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                    assert messages[-1]["result"]["content"][0]["text"] == "3"
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1
                granted = await proxy.ctx.store.access(client.session_id)
                assert granted is not None and granted.upstream_id not in (None, client.session_id)


async def test_reinitialize_with_the_official_python_sdk_client() -> None:
    """The official Python SDK client: a call, the SDK server killed -9 and restarted, the next call in the
    same ``ClientSession`` succeeds."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy:
                async with sdk_session(proxy.url, read_timeout_seconds=30) as session:
                    assert result_text(await session.call_tool("add", {"a": 1, "b": 2})) == "3"
                    async with restarted(upstream):
                        pass
                    assert result_text(await session.call_tool("add", {"a": 2, "b": 2})) == "4"
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1


async def test_end_the_official_python_sdk_clients_next_call_fails() -> None:
    """``end`` (the default), the same kill -9: the SDK client's next call fails (404), as before."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with running_proxy(upstream.url) as proxy:
                async with sdk_session(
                    proxy.url, read_timeout_seconds=30, terminate_on_close=False
                ) as session:
                    assert result_text(await session.call_tool("add", {"a": 1, "b": 2})) == "3"
                    async with restarted(upstream):
                        pass
                    with pytest.raises(Exception):  # noqa: B017 - the SDK's own error for a 404
                        await session.call_tool("add", {"a": 2, "b": 2})
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 0


async def test_a_call_in_flight_at_the_kill_ends_with_the_synthesized_error_once_and_the_window_stays() -> (
    None
):
    """``reinitialize``: a call in flight when the SDK server is killed -9 ends with ``upstream_stream_lost``,
    once (its execution is lost: its stream is not resumed in the new upstream session); the next call is
    answered; a re-attach with a cursor from before the kill still reads the window, the error included."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize", retry_ms=50) as proxy,
                aiohttp.ClientSession() as http,
            ):
                client, _ = await recorded_session(http, proxy.url, proxy)
                slow_id, slow = client.tool_call("count_slowly", {"n": 10000, "delay": 0.05})
                inflight = await http.post(client.url, data=slow, headers=client.headers())
                assert inflight.status == 200
                events = aiter(sse_events(inflight))
                first = None
                while first is None:  # the first progress event: a cursor from before the kill
                    event = await anext(events)
                    first = event if event.data and b"progress" in event.data else None
                cursor = first.id
                assert cursor
                async with restarted(upstream):
                    pass
                async with await call(http, client) as response:
                    assert response.status == 200, await response.text()
                    answered = [orjson.loads(e.data) for e in await collect(response) if e.data]
                assert answered[-1]["result"]["content"][0]["text"] == "3"
                rest = [orjson.loads(e.data) async for e in events if e.data]
                inflight.release()
                ends = [m for m in rest if m.get("id") == slow_id]
                assert len(ends) == 1 and ends[0]["error"]["data"]["reason"] == "upstream_stream_lost"
                again = await reattach(http, client, proxy.url, cursor)
                assert [m for m in again if m.get("id") == slow_id] == ends
                assert not any("result" in m for m in again if m.get("id") == slow_id)


async def test_the_log_level_and_a_subscription_are_in_force_after_the_upstream_restarted() -> None:
    """An SDK server that keeps each session's level and subscriptions (tests/support/shaped_upstream.py),
    killed -9 and restarted: the session begun again tells the same state, set by the replayed requests
    (the level last set; the subscription left after an unsubscribe)."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process(shaped=True) as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                for method, params in [
                    ("logging/setLevel", {"level": "debug"}),
                    ("resources/subscribe", {"uri": "test://a"}),
                    ("resources/subscribe", {"uri": "test://b"}),
                    ("logging/setLevel", {"level": "warning"}),
                    ("resources/unsubscribe", {"uri": "test://a"}),
                ]:
                    assert await request(http, client, method, params) == 200
                before = await state_of(http, client)
                assert before == {"level": "warning", "subscriptions": ["test://b"]}
                async with restarted(upstream):
                    pass
                assert await state_of(http, client) == before
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1


async def state_of(http: aiohttp.ClientSession, client: ScriptedClient) -> dict[str, object]:
    _, body = client.tool_call("state", {})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
    told: dict[str, object] = orjson.loads(messages[-1]["result"]["content"][0]["text"])
    return told


TS_CLIENT = Path(__file__).parent / "support" / "ts_sdk_reinit_client.mjs"


@pytest.mark.parametrize("setting", ["end", "reinitialize"])
async def test_the_typescript_sdk_client_across_a_kill_9_of_the_upstream(setting: str) -> None:
    """The official TypeScript SDK client, one session: a call; the SDK server killed -9 and restarted; the
    next call in the same session succeeds with ``reinitialize``, and fails (the session's 404) with
    ``end``; the client's session id never changes."""
    try:
        node, script = with_script(TS_CLIENT)  # beside its node_modules, where node resolves the SDK from
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        raise
    async with asyncio.timeout(TIMEOUT * 2):
        with upstream_process() as upstream:
            async with running_proxy(upstream.url, upstream_session_lost=setting) as proxy:
                client = await asyncio.create_subprocess_exec(
                    node,
                    str(script),
                    proxy.url,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                try:
                    assert client.stdout is not None and client.stdin is not None
                    first = json.loads(await client.stdout.readline())
                    assert first["first"] == "3"
                    async with restarted(upstream):
                        pass
                    client.stdin.write(b"go\n")
                    await client.stdin.drain()
                    second = json.loads(await client.stdout.readline())
                    assert second["sessionId"] == first["sessionId"]
                    if setting == "reinitialize":
                        assert second["second"] == "4"
                        assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1
                    else:
                        assert second["second"].startswith("error")
                    assert await client.wait() == 0
                finally:
                    if client.returncode is None:
                        client.kill()
                        await client.wait()


async def test_reinitialize_a_standalone_get_first_after_the_restart_begins_the_session_again() -> None:
    """The first request after the kill -9 is the client's standalone GET (an SDK client reopens it at
    once): the session is begun again and the stream opened in the new upstream session; the next call is
    answered with no second re-initialization."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client, _ = await recorded_session(http, proxy.url, proxy)
                async with restarted(upstream):
                    pass
                async with http.get(client.url, headers=client.headers(Accept="text/event-stream")) as get:
                    assert get.status == 200, await get.text()
                    async with await call(http, client) as response:
                        assert response.status == 200
                        messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
                    assert messages[-1]["result"]["content"][0]["text"] == "3"
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1


async def test_sidecar_layout_with_redis_a_pod_killed_the_client_goes_on_with_its_session_on_another(
    redis_db: str, redis_stores: MakeRedisStore
) -> None:
    """Two pods (each an SDK upstream with a proxy as its sidecar) over Redis; the session's pod killed -9
    mid-call. The call in flight ends with ``upstream_stream_lost`` (re-attached on b: the window's tail,
    then the error); b's upstream never saw the session, and under ``reinitialize`` the takeover keeps it:
    its next call on b begins it again on b's upstream, from the recipe in Redis, and is answered."""
    store = await redis_stores(redis_db, WindowLimits(256, 1 << 20, 300.0), session_ttl=60.0)
    settings = {"owner_lease_ttl": 1.0, "session_ttl": 60.0, "upstream_session_lost": "reinitialize"}
    async with (
        asyncio.timeout(TIMEOUT),
        pods(store, 2, **settings) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, slow = client.tool_call("count_slowly", {"n": 200, "delay": 0.05})
        async with http.post(a.url, data=slow, headers=client.headers()) as response:
            head = await collect(response, limit=3)
            await kill(a.proxy)  # kill -9, mid-call
        cursor = head[-1].id
        assert cursor is not None
        tail = await reattach(http, client, b.url, cursor)
        (error,) = [m for m in tail if "error" in m]
        assert error["error"]["data"]["reason"] == "upstream_stream_lost"
        async with await call(http, client_on(client, b.url)) as answer:
            assert answer.status == 200, await answer.text()
            messages = [orjson.loads(e.data) for e in await collect(answer) if e.data]
        assert messages[-1]["result"]["content"][0]["text"] == "3"
        assert sample(b.proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1
        granted = await store.access(client.session_id)
        assert granted is not None and granted.upstream_id not in (None, client.session_id)


def client_on(client: ScriptedClient, url: str) -> ScriptedClient:
    """The same session's client, its requests sent to another pod."""
    moved = ScriptedClient(client.http, url)
    moved.session_id, moved.next_id = client.session_id, client.next_id
    return moved


@pytest.mark.parametrize("first", ["POST", "GET"])
async def test_the_client_is_told_the_lists_may_have_changed_where_its_capabilities_say_so(
    first: str,
) -> None:
    """The SDK server announces ``tools.listChanged`` (not prompts', not resources'): after the session is
    begun again (by a call, or by the standalone GET itself), the client's standalone stream carries
    ``notifications/tools/list_changed`` first (none waits any more)."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process(shaped=True) as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                async with restarted(upstream):
                    pass
                if first == "POST":
                    assert (await state_of(http, client))["level"] is None
                async with http.get(client.url, headers=client.headers(Accept="text/event-stream")) as get:
                    assert get.status == 200, await get.text()
                    (note,) = [orjson.loads(e.data) for e in await collect(get, limit=1) if e.data]
                assert note == {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1
                assert proxy.ctx.list_changes == {}


class RecipeCounting(MemoryStore):
    """A memory store counting the calls ``reinitialize`` adds (recipe reads and writes, the mapping)."""

    def __init__(self) -> None:
        super().__init__(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=100, retry_ms=100)
        self.calls = 0

    async def recipe(self, session_id: str, epoch: str) -> bytes | None:
        self.calls += 1
        return await super().recipe(session_id, epoch)

    async def keep_recipe(self, session_id: str, epoch: str, expected: bytes | None, recipe: bytes) -> bool:
        self.calls += 1
        return await super().keep_recipe(session_id, epoch, expected, recipe)

    async def map_upstream(self, session_id: str, epoch: str, expected: str | None, upstream_id: str) -> bool:
        self.calls += 1
        return await super().map_upstream(session_id, epoch, expected, upstream_id)


async def test_end_asks_the_store_nothing_more_on_any_request() -> None:
    """``end`` (the default): an initialize, the shaping requests, a call and a standalone GET make no
    recipe or mapping call to the store (the request path costs what it did); ``reinitialize`` makes some."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process(shaped=True) as upstream:
            for setting, expected_none in (("end", True), ("reinitialize", False)):
                store = RecipeCounting()
                async with (
                    running_proxy(upstream.url, upstream_session_lost=setting, store_instance=store) as proxy,
                    aiohttp.ClientSession() as http,
                ):
                    client = ScriptedClient(http, proxy.url)
                    await client.initialize()
                    assert await request(http, client, "logging/setLevel", {"level": "info"}) == 200
                    assert await request(http, client, "resources/subscribe", {"uri": "test://a"}) == 200
                    assert await state_of(http, client) == {"level": "info", "subscriptions": ["test://a"]}
                    async with http.get(
                        client.url, headers=client.headers(Accept="text/event-stream")
                    ) as get:
                        assert get.status == 200
                assert (store.calls == 0) is expected_none, (setting, store.calls)


async def test_a_new_upstream_offering_fewer_capabilities_ends_the_session_with_its_reason() -> None:
    """The server restarted on the same port is another one (the shaped upstream: no prompts, which the
    client was told of): not begun again; the call gets the proxy's 404 ``upstream_session_lost`` with
    ``data.outcome`` ``fewer_capabilities``, the session ends, and it is counted so."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process() as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client, recipe = await recorded_session(http, proxy.url, proxy)
                assert recipe.capabilities is not None and "prompts" in recipe.capabilities
                await asyncio.to_thread(upstream.kill)
                upstream.shaped = True
                await asyncio.to_thread(upstream.start)
                async with await call(http, client) as response:
                    assert response.status == 404
                    error = await error_of(response)
                assert error["data"] == {"reason": "upstream_session_lost", "outcome": "fewer_capabilities"}
                assert not await proxy.ctx.store.has_session(client.session_id)
                assert sample(proxy.ctx.metrics, REINITS, outcome="fewer_capabilities") == 1
                assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 0


async def touch(http: aiohttp.ClientSession, client: ScriptedClient) -> str:
    """The shaped upstream's ``touch``: resources/updated per URI subscribed, on the standalone stream."""
    _, body = client.tool_call("touch", {})
    async with http.post(client.url, data=body, headers=client.headers()) as response:
        assert response.status == 200, await response.text()
        messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
    text: str = messages[-1]["result"]["content"][0]["text"]
    return text


async def test_the_standalone_stream_the_client_holds_goes_on_in_the_session_begun_again() -> None:
    """The client holds its standalone GET open, subscribed to a resource; the SDK server killed -9 and
    restarted. Its view of the standalone stream never ends: once the session is begun again (by the next
    call, which replays the subscription), the proxy opens the stream again in the new upstream session,
    and the same view carries ``notifications/tools/list_changed`` and then the ``resources/updated`` the
    new upstream sends for the replayed subscription."""
    async with asyncio.timeout(TIMEOUT):
        with upstream_process(shaped=True) as upstream:
            async with (
                running_proxy(upstream.url, upstream_session_lost="reinitialize") as proxy,
                aiohttp.ClientSession() as http,
            ):
                client = ScriptedClient(http, proxy.url)
                await client.initialize()
                assert await request(http, client, "resources/subscribe", {"uri": "test://a"}) == 200
                headers = client.headers(Accept="text/event-stream")
                async with http.get(client.url, headers=headers) as get:
                    assert get.status == 200
                    async with view_messages(get) as received:
                        await until_received(http, client, received, UPDATED)  # before the restart
                        async with restarted(upstream):
                            pass
                        async with await call(http, client) as response:  # begins the session again
                            assert response.status == 200, await response.text()
                            await response.read()
                        assert sample(proxy.ctx.metrics, REINITS, outcome="reinitialized") == 1
                        assert await received.get() == TOOLS_CHANGED
                        # The new upstream's notification for the replayed subscription, on the same view.
                        await until_received(http, client, received, UPDATED)


UPDATED = {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": "test://a"}}
TOOLS_CHANGED = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
Received = asyncio.Queue[dict[str, object] | None]


@asynccontextmanager
async def view_messages(view: aiohttp.ClientResponse) -> AsyncIterator[Received]:
    """The JSON-RPC messages of an SSE response, as they come (None once it ended), read in a task."""
    received: Received = asyncio.Queue()

    async def read() -> None:
        async for event in sse_events(view):
            if event.data:
                await received.put(orjson.loads(event.data))
        await received.put(None)  # the view ended

    reader = asyncio.ensure_future(read())
    try:
        yield received
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def until_received(
    http: aiohttp.ClientSession, client: ScriptedClient, received: Received, expected: dict[str, object]
) -> None:
    """``touch`` until the view receives ``expected`` (a notification the upstream sends before its standalone
    GET is open again is not delivered: the next touch is); the view must not end meanwhile."""
    while True:
        assert await touch(http, client) == "1"
        try:
            async with asyncio.timeout(1.0):
                message = await received.get()
        except TimeoutError:
            continue
        assert message is not None, "the client's view of the standalone stream ended"
        assert message == expected, message
        return
