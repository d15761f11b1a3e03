"""A scripted MCP upstream (aiohttp) for what the SDK server can't do on demand: drop a stream after a
chosen number of events, resume (or refuse to) from ``Last-Event-ID``, replay events twice."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

SESSION = "scripted-session-1"


def catch_all(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    """An aiohttp app sending every method and path to ``handler``: an MCP endpoint wherever it is put."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


def initialize_answer(message: dict[str, Any], session_id: str, name: str) -> web.Response:
    """A scripted upstream's answer to ``initialize``: it starts session ``session_id``."""
    result = {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "serverInfo": {"name": name, "version": "1"},
    }
    return web.json_response(
        {"jsonrpc": "2.0", "id": message["id"], "result": result}, headers={"Mcp-Session-Id": session_id}
    )


@dataclass
class ScriptedUpstream:
    """Each tools/call streams ``total`` progress notifications then the response, with ids ``<req>-<k>``.

    ``drops``: how each connection of a call ends early: a list consumed in order; each item is the number
    of events that connection sends before it ends (``None``: no early end). ``abort``: end by aborting the
    TCP connection (else a clean end of the chunked body). ``resumable``: answer GET + Last-Event-ID (else
    404). ``overlap``: on resume, replay this many events at or before the cursor (a sloppy event store).
    ``send_ids``: put ids on events at all.
    """

    total: int = 20
    drops: list[int | None] = field(default_factory=list)
    abort: bool = False
    resumable: bool = True
    overlap: int = 0
    send_ids: bool = True
    retry_ms: int = 10
    gets: list[str | None] = field(default_factory=list)  # Last-Event-ID of every GET received
    posts: int = 0
    forget_session: bool = False  # answer every POST in a session with 404 (the upstream restarted)
    pad: int = 0  # bytes of padding in each progress notification
    start_delay: float = 0.0  # seconds before a stream's first event (after its retry: line)
    sessions: int = 0  # initialize requests answered (each gets a fresh session id)

    def app(self) -> web.Application:
        return catch_all(self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "DELETE":
            return web.Response(status=200)
        if request.method == "GET":
            cursor = request.headers.get("Last-Event-ID")
            self.gets.append(cursor)
            if cursor is None:  # the standalone stream: server-initiated messages, as request "0"
                return await self.stream(request, 0, 0)
            if not self.resumable:
                return web.Response(status=404)
            request_id, _, k = cursor.rpartition("-")
            return await self.stream(request, int(request_id), max(0, int(k) + 1 - self.overlap))
        self.posts += 1
        message = orjson.loads(await request.read())
        if self.forget_session and "Mcp-Session-Id" in request.headers:
            return web.Response(status=404, text="session not found")
        if message.get("method") == "initialize":
            self.sessions += 1
            return initialize_answer(
                message, SESSION if self.sessions == 1 else f"{SESSION}-{self.sessions}", "s"
            )
        if "id" not in message:
            return web.Response(status=202)
        return await self.stream(request, message["id"], 0)

    def event(self, request_id: int, k: int) -> bytes:
        if k < self.total:
            params: dict[str, object] = {"progressToken": request_id, "progress": k + 1, "total": self.total}
            if self.pad:
                params["pad"] = "x" * self.pad
            body = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
        else:
            body = {"jsonrpc": "2.0", "id": request_id, "result": {"content": [], "done": True}}
        frame = b"event: message\n"
        if self.send_ids:
            frame += f"id: {request_id}-{k}\n".encode()
        return frame + b"data: " + orjson.dumps(body) + b"\n\n"

    async def stream(self, request: web.Request, request_id: int, start: int) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Mcp-Session-Id": SESSION}
        )
        await response.prepare(request)
        await response.write(f"retry: {self.retry_ms}\n\n".encode())
        budget = self.drops.pop(0) if self.drops else None
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        for k in range(start, self.total + 1):
            if budget is not None and k - start >= budget:
                if self.abort and request.transport is not None:
                    request.transport.abort()
                return response
            await response.write(self.event(request_id, k))
        return response


def random_drops(seed: int, connections: int, most: int) -> list[int | None]:
    """Seeded early ends; the first connection sends at least one event, so there is an id to resume from."""
    rng = random.Random(seed)
    return [rng.randint(1, most)] + [rng.randint(0, most) for _ in range(connections - 1)]
