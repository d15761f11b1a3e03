"""A modern-only (2026-07-28) upstream: the official `mcp` 2.x server behind a handshake-era guard.

The `mcp` 2.x server serves both eras. A modern-only server (SEP-2567, SEP-2575) answers GET and DELETE with
405 and refuses a handshake-era request: an ``initialize`` (or any POST whose ``MCP-Protocol-Version`` is not
2026-07-28) gets a JSON-RPC -32022 "Unsupported protocol version" naming the versions it speaks, with HTTP 400
(the SDK's own `ERROR_CODE_HTTP_STATUS` for that code). Everything else is the SDK's modern path untouched.

Tools: the example server's (``echo``, ``add``, ``tally``, ``count_slowly`` with progress), plus ``ask``,
which answers the first call with an input-required result (MRTR, SEP-2322) carrying an elicitation and
completes the retry with what the client answered; ``slow_tally``, a side effect after a delay (a call to
cut a connection in the middle of); ``ask_later`` and ``sample_later``, which report progress first (so their
answers are SSE streams whenever the client asks for progress: the SDK's SSE mode commits to an event stream
at the first notification) and then ask for a word by elicitation, or for a message by sampling, reporting
progress again on the retry before the result; and ``whoami``, the client's capabilities and info as this
request's ``_meta`` envelope carried them (a 2026-07-28 server knows its client by nothing else). A resource,
``note://greeting``, which ``update_note`` changes (a ``notifications/resources/updated`` to the listen
streams subscribed to it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from mcp.server.mcpserver import Context
from mcp_types import InputRequiredResult
from starlette.types import ASGIApp, Receive, Scope, Send

from mcpresume.examples.upstream import (
    MCP_PATH,
    RunningUpstream,
    build_example_server,
    local_transport_security,
)

MODERN_VERSION = "2026-07-28"
UNSUPPORTED_PROTOCOL_VERSION = -32022


class ModernOnly:
    """ASGI guard: refuse the handshake era as a modern-only server does; count what it refused."""

    def __init__(self, app: ASGIApp, *, refuse: bool = True) -> None:
        self.app = app
        self.refuse = refuse  # False: a dual-era server, only what it is asked is recorded
        self.refused: list[str] = []  # "GET", "DELETE", or the refused POST's method
        self.methods: list[str] = []  # the methods of the modern POSTs it let through
        self.headers: list[dict[str, str]] = []  # their headers (lower-case names)
        self.metas: list[dict[str, Any]] = []  # their params' _meta (the envelope)
        self.listens: list[dict[str, Any]] = []  # the subscriptions/listen filters (params.notifications)
        self.bad_tokens: set[str] = set()  # Authorization values answered 401 (an authenticating server)
        self.discover_down = False  # True: server/discover answered 503 (a server still starting, say)
        self.down = False  # True: every POST answered 503 (an upstream restarting, say)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") != MCP_PATH:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if authorization in self.bad_tokens:
            await _answer(send, 401, b"", [(b"www-authenticate", b'Bearer error="invalid_token"')])
            return
        if method in ("GET", "DELETE") and self.refuse:
            self.refused.append(method)
            await _answer(send, 405, b"", [(b"allow", b"POST")])
            return
        if method != "POST":
            await self.app(scope, receive, send)
            return
        if self.down:
            await _answer(send, 503, b"restarting", [(b"content-type", b"text/plain")])
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            parsed = None
        rpc_method = parsed.get("method") if isinstance(parsed, dict) else None
        if rpc_method == "server/discover" and self.discover_down:
            self.refused.append("server/discover")
            await _answer(send, 503, b"", [])
            return
        handshake = rpc_method == "initialize" or headers.get("mcp-protocol-version") != MODERN_VERSION
        if handshake and self.refuse:
            self.refused.append(str(rpc_method))
            request_id = parsed.get("id") if isinstance(parsed, dict) else None
            refusal = {
                "jsonrpc": "2.0",
                "id": request_id,
                "error": {
                    "code": UNSUPPORTED_PROTOCOL_VERSION,
                    "message": "Unsupported protocol version",
                    "data": {"supported": [MODERN_VERSION], "requested": headers.get("mcp-protocol-version")},
                },
            }
            await _answer(send, 400, json.dumps(refusal).encode(), [(b"content-type", b"application/json")])
            return
        self.methods.append(str(rpc_method))
        self.headers.append(headers)
        params = parsed.get("params") if isinstance(parsed, dict) else None
        meta = params.get("_meta") if isinstance(params, dict) else None
        self.metas.append(meta if isinstance(meta, dict) else {})
        if rpc_method == "subscriptions/listen" and isinstance(params, dict):
            self.listens.append(params.get("notifications") or {})
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _word_request(question: str) -> dict[str, Any]:
    """An elicitation of one word (``ask``'s and ``ask_later``'s input request)."""
    schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
    return {
        "method": "elicitation/create",
        "params": {"mode": "form", "message": question, "requestedSchema": schema},
    }


def _word_of(answer: Any) -> str:
    """The word an elicitation's result carries (a dict, or the SDK's model of it)."""
    content = answer.get("content") if isinstance(answer, dict) else getattr(answer, "content", None)
    return str((content or {}).get("word", "")) if isinstance(content, dict) else ""


def _wire(model: Any) -> Any:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_modern_app(*, json_response: bool = False) -> ModernOnly:
    """The guarded app (one uvicorn lifetime, as `build_example_app`)."""
    server = build_example_server(name="mcpresume-modern")
    tallies = {"slow": 0, "cancelled": 0, "asked": 0}

    @server.tool(description="Ask the client for a word (an elicitation through an input-required result).")
    async def ask(ctx: Context[Any, Any], question: str = "Which word?") -> Any:
        answers = ctx.input_responses or {}
        answer = answers.get("word")
        if answer is None:
            return InputRequiredResult(
                input_requests={"word": _word_request(question)}, request_state="asked"
            )
        return f"you said {_word_of(answer)} ({ctx.request_state})"

    @server.tool(description="Report progress, then ask for a word (input required in an event stream).")
    async def ask_later(
        ctx: Context[Any, Any], question: str = "Which word?", rounds: int = 1, roots: bool = False
    ) -> Any:
        # Asked ``rounds`` times (the state says how many answers came: ``round-k``, the last one's
        # ``asked-later``); with ``roots``, the client's roots asked for too, in the same result.
        answers = ctx.input_responses or {}
        state = ctx.request_state or ""
        done = int(state.removeprefix("round-")) if state.startswith("round-") else rounds if answers else 0
        await ctx.report_progress(done, rounds + 1, "answered" if done else "about to ask")
        if done < rounds:
            asking: dict[str, Any] = {"word": _word_request(question)}
            if roots:
                asking["roots"] = {"method": "roots/list"}
            last = done + 1 == rounds
            return InputRequiredResult(
                input_requests=asking, request_state="asked-later" if last else f"round-{done + 1}"
            )
        tallies["asked"] += 1
        listed = answers.get("roots")
        listed = listed.get("roots") if isinstance(listed, dict) else getattr(listed, "roots", None)
        among = f", {len(listed)} root(s)" if listed is not None else ""
        return f"you said {_word_of(answers.get('word'))} ({ctx.request_state}, {tallies['asked']}{among})"

    @server.tool(description="Report progress, then ask the client's model (sampling in an event stream).")
    async def sample_later(ctx: Context[Any, Any], prompt: str = "Say a word") -> Any:
        answer = (ctx.input_responses or {}).get("reply")
        if answer is None:
            await ctx.report_progress(0, 2, "about to sample")
            return InputRequiredResult(
                input_requests={
                    "reply": {
                        "method": "sampling/createMessage",
                        "params": {
                            "messages": [{"role": "user", "content": {"type": "text", "text": prompt}}],
                            "maxTokens": 16,
                        },
                    }
                },
                request_state="sampled",
            )
        await ctx.report_progress(1, 2, "sampled")
        content = answer.get("content") if isinstance(answer, dict) else getattr(answer, "content", None)
        text = content.get("text") if isinstance(content, dict) else getattr(content, "text", None)
        return f"the model said {text} ({ctx.request_state})"

    @server.tool(description="The client's capabilities and info this request's _meta envelope carried.")
    async def whoami(ctx: Context[Any, Any]) -> dict[str, Any]:
        capabilities = ctx.client_capabilities
        params = ctx.session.client_params
        info = params.client_info if params is not None else None
        return {
            "capabilities": None if capabilities is None else _wire(capabilities),
            "info": None if info is None else _wire(info),
        }

    @server.tool(description="Tell the listening clients the tool list changed.")
    async def change_tools(ctx: Context[Any, Any]) -> str:
        await ctx.notify_tools_changed()
        return "changed"

    notes = {"note://greeting": "hello"}

    @server.resource("note://greeting", description="A note the `update_note` tool changes.")
    async def greeting() -> str:
        return notes["note://greeting"]

    @server.tool(description="Change a note and tell the listening clients subscribed to it.")
    async def update_note(ctx: Context[Any, Any], text: str, uri: str = "note://greeting") -> str:
        notes[uri] = text
        await ctx.notify_resource_updated(uri)
        return "updated"

    @server.tool(description="Wait `delay` seconds, then count this call (a side effect).")
    async def slow_tally(ctx: Context[Any, Any], delay: float = 0.5) -> int:
        await ctx.report_progress(0, 1)
        try:
            await anyio.sleep(delay)
        except anyio.get_cancelled_exc_class():
            tallies["cancelled"] += 1  # its response stream closed: the 2026-07-28 cancellation
            raise
        tallies["slow"] += 1
        return tallies["slow"]

    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        session_idle_timeout=None,
        transport_security=local_transport_security(),
    )
    guard = ModernOnly(app)
    guard.slow_tallies = tallies  # type: ignore[attr-defined]
    return guard


@asynccontextmanager
async def serve_modern_upstream(*, json_response: bool = False) -> AsyncIterator[tuple[str, ModernOnly]]:
    """Run a modern-only upstream in this loop; yields its MCP URL and the guard (what it refused, saw)."""
    guard = build_modern_app(json_response=json_response)
    async with RunningUpstream(guard) as upstream:
        yield upstream.url, guard
