"""Run the real proxy (real sockets, the same start-up path as the daemon) in front of an upstream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from mcpresume.core.session import SessionState
from mcpresume.core.sse import SSEEvent
from mcpresume.daemon.app import RunningProxy, start_proxy
from mcpresume.daemon.demo import ScriptedClient, sse_events
from mcpresume.process.config import load_settings
from mcpresume.store import SessionStore
from mcpresume.store.memory import MemoryStore

__all__ = [
    "ManualClock",
    "ScriptedClient",
    "collect",
    "error_of",
    "memory_session",
    "reattach",
    "running_proxy",
    "sse_events",
]


class ManualClock:
    """A clock the test moves: session and window expiry without sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def memory_session(store: SessionStore, session_id: str) -> SessionState:
    """A session of a proxy's memory store, as it is now (``MemoryStore.session``, the inspection door)."""
    assert isinstance(store, MemoryStore), "the session's state is inspected on the memory store"
    session = store.session(session_id)
    assert session is not None, "the session is not in the store"
    return session


@contextlib.asynccontextmanager
async def running_proxy(upstream: str, **settings: Any) -> AsyncIterator[RunningProxy]:
    clock = settings.pop("clock", None)
    store = settings.pop("store_instance", None)  # a store shared by several proxies (a restart, replicas)
    values = {"upstream": upstream, "port": 0, "metrics_port": 0, **settings}
    kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
    if store is not None:
        kwargs["store"] = store
    proxy = await start_proxy(load_settings(values), **kwargs)
    try:
        yield proxy
    finally:
        await proxy.stop()


async def collect(response: aiohttp.ClientResponse, limit: int | None = None) -> list[SSEEvent]:
    """The SSE events of a response (stopping after ``limit`` message events, if given)."""
    events: list[SSEEvent] = []
    messages = 0
    async for event in sse_events(response):
        events.append(event)
        messages += 1 if event.data else 0
        if limit is not None and messages >= limit:
            break
    return events


async def reattach(
    http: aiohttp.ClientSession, client: ScriptedClient, url: str, cursor: bytes
) -> list[dict[str, Any]]:
    """A re-attach of ``client``'s session at ``cursor`` (GET + Last-Event-ID) to ``url``: the JSON-RPC
    messages of the stream, to its end."""
    headers = client.headers(**{"Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"})
    async with http.get(url, headers=headers) as response:
        assert response.status == 200, await response.text()
        return [orjson.loads(e.data) for e in await collect(response) if e.data]


async def error_of(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """The JSON-RPC error object of a proxy rejection."""
    assert response.content_type == "application/json"
    body = orjson.loads(await response.read())
    assert body["jsonrpc"] == "2.0"
    error: dict[str, Any] = body["error"]
    return error
