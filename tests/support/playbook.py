"""The scripted upstream of the tests: a playbook of what it answers, request by request, step by step.

The official SDK server (``tests/conftest.py``'s ``example_upstream``) is the upstream wherever it does what a
test needs. For what it cannot do on demand (hold an answer until the test says so, end a stream early, cut
the connection, answer 500, never answer, check a token on every request), a test writes the upstream's part
as a playbook, to be read top to bottom like the test itself::

    from tests.support import playbook as pb

    upstream = pb.Playbook()
    upstream.on(
        "tools/call", pb.sse(pb.event(pb.progress(1), id="u-1"), pb.wait("late"), pb.event(pb.result()))
    )
    upstream.on("json", pb.reply(pb.result({"json": True})))
    url = await serve(upstream.app())
    ...
    await upstream.arrived("late").wait()  # the call is held upstream, at its gate
    upstream.open("late")                   # and now it ends

Each rule (``on``) names the requests it answers: a JSON-RPC method (or ``None``: any), the HTTP method,
and a predicate on the request (``when``); the newest matching rule answers (a test's own rule overrides a
fixture's). With no rule, ``initialize`` starts a session (ids from ``session_ids``), a notification or a
response gets 202, a DELETE 200, and anything else 501 (a test that reaches it is missing a rule).

Every request is recorded (``seen``: method, JSON-RPC method and id, headers, query, body). Gates are named
``asyncio.Event``s: ``wait(name)`` holds a step until the test calls ``open(name)``; ``arrived(name)`` is set
when a step reaches it, ``left(name)`` when the request was abandoned there (the proxy closed it). A name
may be a function of the request (``wait(by_id)``: one gate per request id).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import orjson
from aiohttp import web

from mcpresume.core.bridge import PROBE_CLIENT

SESSION = "playbook-session"

JsonBody = dict[str, Any] | list[Any]


@dataclass(frozen=True)
class Seen:
    """One request the upstream received."""

    http: str  # the HTTP method
    path: str
    headers: dict[str, str]
    message: JsonBody | None  # the JSON body of a POST (a batch is a list), None otherwise
    number: int  # 1 for the first request the upstream saw
    query: dict[str, str] = field(default_factory=dict)  # the URL's query parameters (the first of each)

    @property
    def method(self) -> str | None:
        """The JSON-RPC method (None: not a request or notification)."""
        return self.message.get("method") if isinstance(self.message, dict) else None

    @property
    def id(self) -> Any:
        return self.message.get("id") if isinstance(self.message, dict) else None

    @property
    def params(self) -> dict[str, Any]:
        params = self.message.get("params") if isinstance(self.message, dict) else None
        return params if isinstance(params, dict) else {}

    @property
    def text(self) -> str | None:
        """A tool call's ``text`` argument (how the tests tell their calls apart)."""
        arguments = self.params.get("arguments")
        return arguments.get("text") if isinstance(arguments, dict) else None

    def header(self, name: str) -> str | None:
        """A header's value, its name in any case (``headers`` keeps each name as it was sent: the proxy
        forwards an SDK client's ``mcp-session-id`` in lower case)."""
        wanted = name.lower()
        return next((value for key, value in self.headers.items() if key.lower() == wanted), None)

    @property
    def session_id(self) -> str | None:
        return self.header("Mcp-Session-Id")

    @property
    def last_event_id(self) -> str | None:
        return self.header("Last-Event-ID")


Name = str | Callable[[Seen], str]  # a gate's name, or how to name it from the request
Data = bytes | JsonBody | Callable[[Seen], bytes | JsonBody]  # an event's data or a body, or how to make it


def by_id(seen: Seen) -> str:
    """One gate per JSON-RPC request id: ``wait(by_id)``, opened with ``open(str(request_id))``."""
    return str(seen.id)


def by_text(seen: Seen) -> str:
    """One gate per tool call ``text`` argument."""
    return str(seen.text)


def _name(name: Name, seen: Seen) -> str:
    return name if isinstance(name, str) else name(seen)


def _data(data: Data, seen: Seen) -> bytes:
    made = data(seen) if callable(data) else data
    return made if isinstance(made, bytes) else orjson.dumps(made)


# -- what the upstream sends: JSON-RPC messages ------------------------------------------------------------


def result(
    value: dict[str, Any] | Callable[[Seen], dict[str, Any]] | None = None,
) -> Callable[[Seen], JsonBody]:
    """The JSON-RPC result of the request being answered (``{"done": True}`` unless given; ``value`` may be
    made from the request)."""

    def made(seen: Seen) -> JsonBody:
        given = {"done": True} if value is None else value(seen) if callable(value) else value
        return {"jsonrpc": "2.0", "id": seen.id, "result": given}

    return made


def echo(seen: Seen) -> dict[str, Any]:
    """A tool result whose text is the call's ``text`` argument: ``result(echo)``."""
    return {"content": [{"type": "text", "text": seen.text}]}


def error(code: int, message: str) -> Callable[[Seen], JsonBody]:
    """A JSON-RPC error answering the request."""
    return lambda seen: {"jsonrpc": "2.0", "id": seen.id, "error": {"code": code, "message": message}}


def progress(k: int, **params: Any) -> JsonBody:
    return {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": k, **params}}


def notification(method: str, **params: Any) -> JsonBody:
    return {"jsonrpc": "2.0", "method": method, "params": params}


# -- the steps of an SSE answer ----------------------------------------------------------------------------


class Steps:
    """What a step of an SSE answer may do: write, wait at a gate, end."""

    def __init__(self, playbook: Playbook, request: web.Request, response: web.StreamResponse, seen: Seen):
        self.playbook, self.request, self.response, self.seen = playbook, request, response, seen
        self.ended = False

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    async def wait(self, name: str) -> None:
        await self.playbook.hold(name)

    def end(self, *, abort: bool = False) -> None:
        self.ended = True
        if abort and self.request.transport is not None:
            self.request.transport.abort()


Step = Callable[[Steps], Awaitable[None]]


def event(data: Data, *, id: str | Callable[[Seen], str] | None = None, name: str | None = None) -> Step:
    """One SSE event (``id``: the upstream's own event id; ``name``: its ``event:`` field)."""

    async def step(steps: Steps) -> None:
        frame = b"" if name is None else f"event: {name}\n".encode()
        if id is not None:
            frame += f"id: {_name(id, steps.seen)}\n".encode()
        await steps.write(frame + b"data: " + _data(data, steps.seen) + b"\n\n")

    return step


def raw(data: bytes) -> Step:
    """Bytes as they are: a ``retry:`` line, a comment, a malformed frame."""

    async def step(steps: Steps) -> None:
        await steps.write(data)

    return step


def wait(name: Name) -> Step:
    """Hold the answer at gate ``name`` until the test opens it."""

    async def step(steps: Steps) -> None:
        await steps.wait(_name(name, steps.seen))

    return step


def pause(seconds: float) -> Step:
    """Let time pass (for what a test must see take a while, as an upstream's slow first event)."""

    async def step(steps: Steps) -> None:
        await asyncio.sleep(seconds)

    return step


def end() -> Step:
    """End the body here, cleanly (the rest of the steps are not taken)."""

    async def step(steps: Steps) -> None:
        steps.end()

    return step


def abort() -> Step:
    """Cut the TCP connection here (the rest of the steps are not taken)."""

    async def step(steps: Steps) -> None:
        steps.end(abort=True)

    return step


def each(queue: asyncio.Queue[bytes]) -> Step:
    """Send every message the test puts in ``queue`` as an event, forever (a standalone stream)."""

    async def step(steps: Steps) -> None:
        while True:
            await steps.write(b"data: " + await queue.get() + b"\n\n")

    return step


# -- answers -----------------------------------------------------------------------------------------------


Answer = Callable[["Playbook", web.Request, Seen], Awaitable[web.StreamResponse]]


def sse(*steps: Step, headers: dict[str, str] | None = None) -> Answer:
    """A 200 ``text/event-stream`` answer, its body the steps in order."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await response.prepare(request)
        taken = Steps(playbook, request, response, seen)
        for step in steps:
            await step(taken)
            if taken.ended:
                break
        return response

    return answer


def reply(body: Data, *, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    """An ``application/json`` answer."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        return web.Response(
            status=status, body=_data(body, seen), content_type="application/json", headers=headers
        )

    return answer


def status(code: int, text: str = "", *, headers: dict[str, str] | None = None) -> Answer:
    """A bare HTTP status (``text/plain``)."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        return web.Response(status=code, text=text, headers=headers)

    return answer


def held(name: Name, then: Answer) -> Answer:
    """Hold the request at gate ``name`` before any answer (no head sent: what a slow upstream does), then
    answer with ``then``."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        await playbook.hold(_name(name, seen))
        return await then(playbook, request, seen)

    return answer


def never(name: Name) -> Answer:
    """Never answer (``arrived(name)`` when the request is held, ``left(name)`` when the proxy gave up)."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        await playbook.hold(_name(name, seen), forever=True)
        raise AssertionError("unreachable")

    return answer


def initialize(
    session_id: str | None = None, *, name: str = "playbook", version: str = "2025-11-25"
) -> Answer:
    """The answer to ``initialize``: a session begins (``session_id``, else the playbook's next one)."""

    async def answer(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        given = session_id if session_id is not None else playbook.next_session()
        body = {
            "jsonrpc": "2.0",
            "id": seen.id,
            "result": {
                "protocolVersion": version,
                "capabilities": {},
                "serverInfo": {"name": name, "version": "1"},
            },
        }
        return web.json_response(body, headers={"Mcp-Session-Id": given})

    return answer


# -- the upstream ------------------------------------------------------------------------------------------


@dataclass
class Rule:
    method: str | None  # the JSON-RPC method; None: any
    http: str | None  # the HTTP method; None: any
    when: Callable[[Seen], bool] | None
    answer: Answer
    unread: bool = False  # matched before the body is read (on what the head says): the answer reads it

    def matches(self, seen: Seen) -> bool:
        return (
            (self.http is None or self.http == seen.http)
            and (self.method is None or self.method == seen.method)
            and (self.when is None or self.when(seen))
        )


# What a handshake-era server answers a ``server/discover`` (a method it does not know).
DISCOVER_UNKNOWN: Final = {
    "jsonrpc": "2.0",
    "id": 0,
    "error": {"code": -32601, "message": "Method not found"},
}


def is_era_probe(message: object) -> bool:
    """Whether a request is the proxy's era probe (``core.bridge.discover_request``: its client info)."""
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    info = meta.get("io.modelcontextprotocol/clientInfo") if isinstance(meta, dict) else None
    return isinstance(info, dict) and info == PROBE_CLIENT


@dataclass
class Playbook:
    """An MCP upstream that answers by its rules (see the module docstring)."""

    session_ids: list[str] = field(default_factory=lambda: [SESSION])  # one per initialize; the last repeats
    seen: list[Seen] = field(default_factory=list)
    answering: set[int] = field(default_factory=set)  # the ``number`` of each request still being answered
    rules: list[Rule] = field(default_factory=list)
    _gates: dict[str, asyncio.Event] = field(default_factory=dict)
    _arrived: dict[str, asyncio.Event] = field(default_factory=dict)
    _left: dict[str, asyncio.Event] = field(default_factory=dict)
    _sessions: int = 0

    def on(
        self,
        method: str | None,
        answer: Answer,
        *,
        http: str | None = "POST",
        when: Callable[[Seen], bool] | None = None,
        unread: bool = False,
    ) -> Playbook:
        """Answer the requests of JSON-RPC ``method`` (None: any) over ``http`` (None: any) that ``when``
        accepts with ``answer``. The newest matching rule answers. ``unread``: the rule is matched on the
        request's head before its body is read (``when`` sees no message, so ``method`` must be None), and
        its answer reads the body if it wants it: an upstream that answers before a body has arrived."""
        assert not (unread and method is not None), "an unread rule cannot match a JSON-RPC method"
        self.rules.append(Rule(method, http, when, answer, unread))
        return self

    def app(self, *, expect_handler: Any = None) -> web.Application:
        """The upstream as an aiohttp app, every method and path to its rules (``expect_handler``: how it
        answers ``Expect: 100-continue``, aiohttp's own when None)."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=expect_handler)
        return app

    # -- gates ---------------------------------------------------------------------------------------------

    def open(self, name: str) -> None:
        self._event(self._gates, name).set()

    def arrived(self, name: str) -> asyncio.Event:
        """Set when a request reached gate ``name``."""
        return self._event(self._arrived, name)

    def left(self, name: str) -> asyncio.Event:
        """Set when a request held at gate ``name`` was abandoned there (its connection closed)."""
        return self._event(self._left, name)

    async def hold(self, name: str, *, forever: bool = False) -> None:
        self.arrived(name).set()
        try:
            await (asyncio.Event().wait() if forever else self._event(self._gates, name).wait())
        except asyncio.CancelledError:
            self.left(name).set()
            raise

    def open_all(self) -> None:
        """Open every gate (a fixture's clean-up: nothing stays held when the test ends)."""
        for gate in self._gates.values():
            gate.set()

    @staticmethod
    def _event(events: dict[str, asyncio.Event], name: str) -> asyncio.Event:
        return events.setdefault(name, asyncio.Event())

    # -- what it received ----------------------------------------------------------------------------------

    def requests(self, method: str | None = None, *, http: str | None = None) -> list[Seen]:
        """The requests received of JSON-RPC ``method`` (None: any), over ``http`` (None: any)."""
        return [
            seen
            for seen in self.seen
            if (method is None or seen.method == method) and (http is None or seen.http == http)
        ]

    def next_session(self) -> str:
        self._sessions += 1
        return self.session_ids[min(self._sessions, len(self.session_ids)) - 1]

    # -- answering -----------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        number = len(self.seen) + 1
        head = Seen(request.method, request.path, dict(request.headers), None, number, dict(request.query))
        unread = next((rule for rule in reversed(self.rules) if rule.unread and rule.matches(head)), None)
        if unread is not None:
            self.seen.append(head)
            return await self._answer(unread.answer, request, head)
        body = await request.read() if request.method == "POST" else b""
        message: JsonBody | None = None
        if body:
            with contextlib.suppress(orjson.JSONDecodeError):
                message = orjson.loads(body)
        seen = replace(head, message=message, number=len(self.seen) + 1)
        if is_era_probe(message) and not any(rule.method == seen.method for rule in self.rules):
            # The proxy's era probe (at its start): answered as a handshake-era server does, and not
            # recorded, so a test's rules and counts see the client's traffic only.
            return web.json_response(DISCOVER_UNKNOWN, status=400)
        self.seen.append(seen)
        rule = next((rule for rule in reversed(self.rules) if not rule.unread and rule.matches(seen)), None)
        return await self._answer(self._default if rule is None else rule.answer, request, seen)

    async def _answer(self, answer: Answer, request: web.Request, seen: Seen) -> web.StreamResponse:
        self.answering.add(seen.number)
        try:
            return await answer(self, request, seen)
        finally:
            self.answering.discard(seen.number)

    @staticmethod
    async def _default(playbook: Playbook, request: web.Request, seen: Seen) -> web.StreamResponse:
        if seen.method == "initialize":
            return await initialize()(playbook, request, seen)
        if request.method == "DELETE":
            return web.Response(status=200)
        if request.method == "POST" and isinstance(seen.message, dict) and seen.id is None:
            return web.Response(status=202)  # a notification
        if request.method == "POST" and isinstance(seen.message, dict) and seen.method is None:
            return web.Response(status=202)  # a response to a server request
        return web.Response(status=501, text=f"no rule for {request.method} {seen.method}")


def gets(playbook: Playbook) -> Sequence[Seen]:
    """The standalone GETs (no ``Last-Event-ID``) the upstream received."""
    return [seen for seen in playbook.requests(http="GET") if seen.last_event_id is None]
