"""How a session's streams share it: the window under overflow = pause, batched responses, views that
never read, parallel calls of one client, priming per protocol revision, and the order of a session's
requests."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from mcpresume.sse import SSEParser
from tests.conftest import ServeApp
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, running_proxy
from tests.support.scripted import ScriptedUpstream

TIMEOUT = 30.0  # a hang guard, never a timing assertion


# -- overflow = pause protects undelivered events of every stream ------------------------------------------


async def test_pause_keeps_a_streams_unsent_result_while_another_stream_is_busy(serve: ServeApp) -> None:
    """A client drops right after its call's priming event; its call's events (the result included) wait in
    the window, sent to nobody. A second call of the session, whose client reads, must not evict them: its
    pump waits (overflow = pause) until the first client re-attaches and is sent them, then goes on."""
    upstream = ScriptedUpstream(total=10, start_delay=0.3)  # priming + 10 progress + result per call
    url = await serve(upstream.app())
    async with (
        running_proxy(url, window_events=16, overflow="pause") as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        first_id, body = client.tool_call("work", {})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            first_events = SSEParser(1 << 20).feed(await response.content.readany())
        assert [e.data for e in first_events] == [b""]  # the priming event only: then the client is gone
        cursor = (first_events[0].id or b"").decode()
        await until(lambda: len(proxy.ctx.pumps) == 0, what="the first call read to its end")

        second_id, body = client.tool_call("work", {})

        async def second_call() -> list[dict[str, object]]:
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                return [orjson.loads(e.data) for e in await collect(response) if e.data]

        second = asyncio.ensure_future(second_call())
        parked = proxy.ctx.store._readers_moved  # type: ignore[attr-defined]  # pumps waiting for room
        await until(lambda: second.done() or len(parked) > 0, timeout=TIMEOUT, what="a pause (or the end)")
        headers = client.headers(**{"Last-Event-ID": cursor})
        async with http.get(client.url, headers=headers) as response:
            assert response.status == 200  # 409 cursor_out_of_window when the second call evicted them
            first = [orjson.loads(e.data) for e in await collect(response) if e.data]
        later = await asyncio.wait_for(second, TIMEOUT)
    for messages, request_id in ((first, first_id), (later, second_id)):
        assert [m["params"]["progress"] for m in messages if "method" in m] == list(range(1, 11))  # type: ignore[index]
        assert [m["id"] for m in messages if "result" in m] == [request_id]
