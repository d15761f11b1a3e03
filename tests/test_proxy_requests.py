"""The requests the proxy sends upstream itself (a takeover's probe, a credential ping): an answer to one
never reaches a client, whichever stream of the session the upstream puts it on.

Two pods in front of one shared upstream (a playbook), over one shared store: pod a pumps the session's
standalone stream, drains, and pod b takes the stream over. b's probe (does the upstream know the session?)
is answered, by this upstream, on the standalone stream b then resumes: b's pump drops it, and the client
re-attached on b gets the upstream's next notification, never the probe's answer."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import orjson
from aiohttp import web

from mcpresume.core.jsonrpc import is_proxy_id
from mcpresume.core.window import WindowLimits
from mcpresume.store.memory import MemoryStore
from tests.conftest import ServeApp
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.pods import QUICK_TAKEOVER, pods
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect


def numbered(queue: asyncio.Queue[bytes], ids: itertools.count[int]) -> pb.Step:
    """Every message the test (or the upstream itself) puts in ``queue``, as an event with an upstream id
    of its own (so the stream is resumable), forever: a standalone stream."""

    async def step(steps: pb.Steps) -> None:
        while True:
            data = await queue.get()
            await steps.write(b"id: s-%d\ndata: " % next(ids) + data + b"\n\n")

    return step


def answering_pings_on_the_standalone_stream(queue: asyncio.Queue[bytes]) -> pb.Answer:
    """A ping's answer put on the standalone stream, the POST itself answered 202 (as an upstream that routes
    an answer whose request stream it no longer holds to the standalone one)."""

    async def answer(playbook: pb.Playbook, request: web.Request, seen: pb.Seen) -> web.StreamResponse:
        queue.put_nowait(orjson.dumps({"jsonrpc": "2.0", "id": seen.id, "result": {}}))
        return web.Response(status=202)

    return answer


def note(k: int) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": k}})


async def test_the_answer_to_a_takeovers_probe_never_reaches_a_client(serve: ServeApp) -> None:
    standalone: asyncio.Queue[bytes] = asyncio.Queue()
    upstream = pb.Playbook()
    upstream.on(None, pb.sse(numbered(standalone, itertools.count(1))), http="GET")
    upstream.on("ping", answering_pings_on_the_standalone_stream(standalone))
    url = await serve(upstream.app())
    store = MemoryStore(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=100)
    async with (
        pods(store, 2, shared_upstream=url, **QUICK_TAKEOVER) as (a, b),
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, a.url)
        await client.initialize()
        async with http.get(a.url, headers=client.headers(Accept="text/event-stream")) as response:
            assert response.status == 200
            standalone.put_nowait(note(1))
            (*_, first) = await collect(response, limit=1)
            assert orjson.loads(first.data)["params"]["data"] == 1
            await a.proxy.stop()  # drains: its pump hands the stream over, its lease is released
        assert first.id is not None
        headers = client.headers(**{"Last-Event-ID": first.id.decode(), "Accept": "text/event-stream"})
        async with http.get(b.url, headers=headers) as response:  # b takes a's sessions over
            assert response.status == 200
            await until(lambda: bool(upstream.requests("ping")), what="b's probe of the session")
            (probe,) = upstream.requests("ping")
            assert is_proxy_id(probe.id) and probe.id != "mcpresume-probe"  # its own id, with a random part
            standalone.put_nowait(note(2))
            async with asyncio.timeout(30):
                (*_, event) = await collect(response, limit=1)
        message = orjson.loads(event.data)
        assert message.get("params", {}).get("data") == 2, message  # the next one, not the probe's answer
        assert sample(b.proxy.ctx.metrics, "mcpresume_proxy_answers_dropped_total") == 1
        assert sample(b.proxy.ctx.metrics, "mcpresume_takeovers_total", outcome="taken") == 1
