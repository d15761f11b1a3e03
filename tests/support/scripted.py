"""A streaming playbook, for what the SDK server can't do on demand: drop a stream after a chosen number of
events, resume (or refuse to) from ``Last-Event-ID``, replay events twice."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from tests.support.playbook import Playbook, Seen, initialize, status

SESSION = "scripted-session-1"


@dataclass
class ScriptedUpstream(Playbook):
    """A playbook (``tests/support/playbook.py``) that streams: each request streams ``total`` progress
    notifications then its response, with ids ``<req>-<k>``, and a GET + ``Last-Event-ID`` resumes after k.

    ``drops``: how each connection of a call ends early: a list consumed in order; each item is the number
    of events that connection sends before it ends (``None``: no early end). ``abort``: end by aborting the
    TCP connection (else a clean end of the chunked body). ``resumable``: answer GET + Last-Event-ID (else
    404). ``overlap``: on resume, replay this many events at or before the cursor (a sloppy event store).
    ``send_ids``: put ids on events at all. What it received: ``posts``, ``gets`` (the Last-Event-ID of
    each GET), ``sessions`` (initialize requests answered, each with a fresh session id).
    """

    total: int = 20
    drops: list[int | None] = field(default_factory=list)
    abort: bool = False
    resumable: bool = True
    overlap: int = 0
    send_ids: bool = True
    retry_ms: int = 10
    forget_session: bool = False  # answer every POST in a session with 404 (the upstream restarted)
    pad: int = 0  # bytes of padding in each progress notification
    start_delay: float = 0.0  # seconds before a stream's first event (after its retry: line)

    def __post_init__(self) -> None:
        self.on(None, self._call, when=lambda seen: seen.id is not None)
        self.on("initialize", initialize(name="s"))
        self.on(None, self._get, http="GET")
        forgotten = status(404, "session not found")
        self.on(None, forgotten, when=lambda seen: self.forget_session and seen.session_id is not None)

    def next_session(self) -> str:
        self._sessions += 1
        return SESSION if self._sessions == 1 else f"{SESSION}-{self._sessions}"

    @property
    def posts(self) -> int:
        return len(self.requests(http="POST"))

    @property
    def gets(self) -> list[str | None]:
        return [seen.last_event_id for seen in self.requests(http="GET")]

    @property
    def sessions(self) -> int:
        return len(self.requests("initialize"))

    async def _call(self, playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        return await self.stream(request, seen.id, 0)

    async def _get(self, playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        cursor = seen.last_event_id
        if cursor is None:  # the standalone stream: server-initiated messages, as request "0"
            return await self.stream(request, 0, 0)
        if not self.resumable:
            return web.Response(status=404)
        request_id, _, k = cursor.rpartition("-")
        return await self.stream(request, int(request_id), max(0, int(k) + 1 - self.overlap))

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
