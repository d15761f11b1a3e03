"""The campaign's upstream: an official-SDK MCP server whose tool ``work`` runs for a while, sending progress,
and records each execution in an append-only log (``upstream-<name>.jsonl``, `faults.history`).

``python -m faults.upstream --name upstream-a --port P --log FILE [--event-store]``: serves ``/mcp`` on
127.0.0.1:P until SIGTERM (or SIGKILL: the log is written a line at a time with ``O_APPEND``, so a killed
upstream leaves whole lines). It prints ``READY <port>`` once it listens.

``work(tag, steps, delay)`` sends progress ``1..steps`` (total ``steps``), ``delay`` seconds apart, and
returns ``done <tag>``; it logs ``begin`` (session id, JSON-RPC id, tag) before its first step and ``end``
before it returns, so a client holding the result implies an ``end`` line. The sessions it creates (an
``initialize`` answered with ``Mcp-Session-Id``) and ends (a DELETE) are logged too, by a thin ASGI layer.

``--event-store``: the SDK keeps every event, so a stream broken at the proxy tier resumes here with
``Last-Event-ID`` (the shared layout); without it (the sidecar layout) a stream lives only as long as its
connection. The store (`FollowingStore`) is the campaign's own, for two faults of the SDK's pairing with the
bundled example store (`mcpresume.examples.event_store`), which would show as the proxy's gaps:

- the SDK names a POST's stream by its JSON-RPC id, which two sessions share (each client counts from 1),
  and hands one store to every session: a store shared by all sessions replays another session's stream
  of the same id on a ``Last-Event-ID`` of this one. Here each session has a store of its own.
- the SDK registers a resumed stream's live tail only after the store's replay returns (its code calls
  the "replay -> live-tail ordering window" a known gap): an event stored in between reaches no connection.
  Here the replay follows the stream itself until its response, and returns nothing for the SDK to tail.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import mcp.server.streamable_http_manager as session_manager
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import (
    GET_STREAM_KEY,
    EventCallback,
    EventId,
    EventMessage,
    EventStore,
    StreamableHTTPServerTransport,
    StreamId,
)
from mcp_types import JSONRPCError, JSONRPCMessage, JSONRPCResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from faults.history import JsonLines
from mcpresume.examples.upstream import RunningUpstream, local_transport_security

MCP_PATH = "/mcp"
SESSION_HEADER = b"mcp-session-id"
# The SDK sends `retry:` with this hint only when it has an event store; a resumed stream waits this long.
RETRY_MS = 500
# Enough for every event of a session's streams a campaign may resume (each call 20-40 progress events).
STORED_EVENTS = 5_000
# A replay follows a stream that stays silent this long no further: it hands the stream to the SDK's own
# live tail (nothing was stored meanwhile, so nothing falls in its window). The standalone stream at once.
FOLLOW_IDLE = 30.0


class FollowingStore(EventStore):
    """One session's events, bounded (oldest first out); a replay sends a stream's events after the given id
    and then those stored after, until the stream's response (see the module's docstring)."""

    def __init__(self, max_events: int = STORED_EVENTS) -> None:
        self.max_events = max_events
        self._epoch = os.urandom(4).hex()
        self._entries: dict[int, tuple[EventId, StreamId, JSONRPCMessage | None]] = {}
        self._seq_by_id: dict[EventId, int] = {}
        self._first = 0
        self._next = 0
        self._news = asyncio.Condition()

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        seq, self._next = self._next, self._next + 1
        event_id = f"{self._epoch}-{seq}"
        self._entries[seq] = (event_id, stream_id, message)
        self._seq_by_id[event_id] = seq
        while len(self._entries) > self.max_events:
            evicted = self._entries.pop(self._first)
            del self._seq_by_id[evicted[0]]
            self._first += 1
        async with self._news:
            self._news.notify_all()
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        seq = self._seq_by_id.get(last_event_id)
        if seq is None:
            return None
        stream = self._entries[seq][1]
        cursor = seq + 1
        while True:
            while cursor < self._next:
                entry = self._entries.get(max(cursor, self._first))
                cursor = max(cursor, self._first) + 1
                if entry is None or entry[1] != stream or entry[2] is None:
                    continue
                await send_callback(EventMessage(entry[2], entry[0]))
                if isinstance(entry[2], JSONRPCResponse | JSONRPCError):
                    return None  # the stream is complete: nothing for the SDK to follow
            if stream == GET_STREAM_KEY:
                return stream
            if not await self._wait_past(cursor - 1):
                return stream

    async def _wait_past(self, seq: int) -> bool:
        """Whether an event after ``seq`` was stored within `FOLLOW_IDLE` seconds."""
        try:
            async with self._news:
                await asyncio.wait_for(self._news.wait_for(lambda: self._next > seq + 1), FOLLOW_IDLE)
        except TimeoutError:
            return False
        return True


class SessionStores(StreamableHTTPServerTransport):
    """The SDK's transport for one session, given an event store of its own when the app has one."""

    def __init__(self, *, event_store: EventStore | None = None, **options: Any) -> None:
        if event_store is not None:
            event_store = FollowingStore()
        super().__init__(event_store=event_store, **options)


def build_server(log: JsonLines, name: str) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer(name, log_level="WARNING")
    pid = os.getpid()

    @server.tool(description="Send `steps` progress notifications, `delay` seconds apart, then return.")
    async def work(ctx: Context[Any, Any], tag: str, steps: int = 30, delay: float = 0.1) -> str:
        headers = ctx.headers or {}
        ids = {"upstream": name, "pid": pid, "sid": headers.get("mcp-session-id"), "rid": ctx.request_id}
        log.write("begin", tag=tag, steps=steps, **ids)
        try:
            for step in range(1, steps + 1):
                await ctx.report_progress(step, steps, f"{tag} {step}/{steps}")
                await asyncio.sleep(delay)
        except BaseException:
            log.write("cancelled", tag=tag, **ids)
            raise
        log.write("end", tag=tag, **ids)
        return f"done {tag}"

    return server


class SessionLog:
    """An ASGI layer that logs the sessions the SDK creates and ends."""

    def __init__(self, app: ASGIApp, log: JsonLines, name: str) -> None:
        self.app, self.log, self.name, self.pid = app, log, name, os.getpid()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = dict(scope.get("headers", [])).get(SESSION_HEADER)
        method = scope.get("method", "")

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if method == "POST" and asked is None and status < 300:
                    sid = dict(message.get("headers", [])).get(SESSION_HEADER)
                    if sid:
                        self.log.write("session", upstream=self.name, pid=self.pid, sid=sid.decode())
                elif method == "DELETE" and asked is not None and status < 300:
                    self.log.write("delete", upstream=self.name, pid=self.pid, sid=asked.decode())
            await send(message)

        await self.app(scope, receive, logging_send)


async def serve(name: str, port: int, log_path: Path, event_store: bool) -> None:
    log = JsonLines(log_path)
    session_manager.StreamableHTTPServerTransport = SessionStores  # type: ignore[attr-defined,assignment]
    server = build_server(log, name)
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        event_store=FollowingStore() if event_store else None,  # a marker: each session gets its own
        retry_interval=RETRY_MS if event_store else None,
        session_idle_timeout=None,
        transport_security=local_transport_security(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with RunningUpstream(SessionLog(app, log, name), port=port) as running:
        log.write("start", upstream=name, pid=os.getpid(), port=running.port)
        print(f"READY {running.port}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.upstream", description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--event-store", action="store_true")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.name, args.port, args.log, args.event_store))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
