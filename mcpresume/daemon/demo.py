"""``mcpresume demo``: the point of the project, shown in one command.

It starts the bundled example upstream (the official MCP SDK's server, no event store: it cannot resume
anything itself), puts the proxy in front of it, and then, as a client would:

1. calls a tool through the proxy with the official SDK client: the proxy is invisible;
2. drops the connection in the middle of a tool call, re-attaches with ``Last-Event-ID`` and receives only
   what it missed, the result once;
3. tries a cursor whose events were evicted from the window: 409 ``cursor_out_of_window``;
4. tries an unknown session: 404 ``unknown_session`` (the client must re-initialize);

and prints a transcript of each exchange, the decision taken and the metric counters, then what the proxy
logged meanwhile (held until then: interleaved, its lines would break the exchanges apart). Then it keeps
both running for the user's own client until Ctrl-C (``--once`` exits instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any, Final

import aiohttp
import orjson

from mcpresume.core.sse import SSEEvent, SSEParser
from mcpresume.daemon.app import ListenError, RunningProxy, start_proxy
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.process.config import Settings

PROTOCOL_VERSION = "2025-11-25"


def say(text: str = "") -> None:
    print(text, flush=True)


# The most log records held while the transcript runs (the demo makes a few dozen requests).
HELD_RECORDS: Final = 10_000


class _Held(logging.Handler):
    """Log records kept, the newest HELD_RECORDS, to be written later by the handlers they were meant for."""

    def __init__(self) -> None:
        super().__init__()
        self.records: deque[logging.LogRecord] = deque(maxlen=HELD_RECORDS)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logs_after_the_transcript() -> Iterator[None]:
    """The log lines written while the transcript runs held, and written after it under a heading."""
    root = logging.getLogger()
    handlers, held = root.handlers[:], _Held()
    root.handlers[:] = [held]
    try:
        yield
    finally:
        root.handlers[:] = handlers
        if held.records:
            say()
            say("== What the proxy logged meanwhile (the access log: one line per request) ==")
            for record in held.records:
                for handler in handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)


async def run_demo(settings: Settings, *, once: bool = False) -> int:
    # The bundled upstream and the SDK client log every request at INFO; the transcript says it better.
    for name in ("mcp", "httpx2", "httpx", "uvicorn", "sse_starlette"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    async with serve_example_upstream() as upstream_url:
        proxy = await _start(settings, upstream_url)
        try:
            say(f"example upstream (official MCP SDK server, no event store): {upstream_url}")
            say(f"mcpresume proxy in front of it:                           {proxy.url}")
            say()
            with _logs_after_the_transcript():
                await _sdk_call(proxy.url)
                async with aiohttp.ClientSession() as http:
                    client = ScriptedClient(http, proxy.url)
                    await client.initialize()
                    await _drop_and_reattach(client)
                    await _evicted_cursor(client, settings.window_events)
                    await _unknown_session(client)
                await _print_counters(proxy)
            say()
            say(f"Point your own MCP client at {proxy.url}")
            if proxy.admin_url:
                say(f"Metrics: {proxy.admin_url}/metrics")
            if not once:
                say("Ctrl-C stops the proxy and the example upstream.")
                await _wait_for_interrupt()
        finally:
            await proxy.stop()
    say("stopped.")
    return 0


async def _start(settings: Settings, upstream_url: str) -> RunningProxy:
    demo_settings = settings.model_copy(update={"upstream": upstream_url})
    try:
        return await start_proxy(demo_settings)
    except ListenError as exc:
        if settings.model_fields_set & {"port", "metrics_port"}:
            raise  # ports the user chose: the caller says which is taken, and the demo does not run
        # The default ports are taken (a proxy already running?): any free ones will do for a demo.
        say(f"mcpresume demo: {exc}; using free ports instead (choose with --port, --metrics-port)")
        return await start_proxy(demo_settings.model_copy(update={"port": 0, "metrics_port": 0}))


async def _wait_for_interrupt() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _sdk_call(url: str) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    say("== 1. The official MCP SDK client, through the proxy ==")
    seen: list[float] = []

    # The SDK's ProgressFnT protocol is keyword-compatible: (progress, total, message).
    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
        info = await session.initialize()
        tools = await session.list_tools()
        result = await session.call_tool(
            "count_slowly", {"n": 3, "delay": 0.05}, progress_callback=on_progress
        )
    text = "".join(getattr(c, "text", "") for c in result.content)
    say(f"   initialize -> {info.server_info.name}, protocol {info.protocol_version}")
    say(f"   tools/list -> {', '.join(t.name for t in tools.tools)}")
    say(f"   tools/call count_slowly(n=3) -> progress {seen}, result {text!r}")
    say("   The proxy is invisible when nothing goes wrong.")
    say()


class ScriptedClient:
    """A raw HTTP client, so the demo can drop connections at will and show every byte that matters."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.session_id = ""
        self.next_id = 1

    def headers(self, **extra: str) -> dict[str, str]:
        headers = {
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "MCP-Protocol-Version": PROTOCOL_VERSION,
        }
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        headers.update(extra)
        return headers

    async def initialize(self) -> None:
        body = {
            "jsonrpc": "2.0",
            "id": self._id(),
            "method": "initialize",
            "params": {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "mcpresume-demo", "version": "1"},
            },
        }
        async with self.http.post(self.url, data=orjson.dumps(body), headers=self.headers()) as response:
            self.session_id = response.headers["Mcp-Session-Id"]
            async for _ in sse_events(response):
                pass
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        async with self.http.post(self.url, data=orjson.dumps(note), headers=self.headers()) as response:
            await response.read()

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def tool_call(self, name: str, arguments: dict[str, Any]) -> tuple[int, bytes]:
        request_id = self._id()
        body = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": {"progressToken": f"p{request_id}"}},
        }
        return request_id, orjson.dumps(body)


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[SSEEvent]:
    parser = SSEParser(1 << 22)
    async for chunk in response.content.iter_any():
        for event in parser.feed(chunk):
            yield event


def describe(event: SSEEvent) -> str:
    cursor = event.id.decode() if event.id else "-"
    if event.id is None and event.retry is not None:
        return f"retry: {event.retry} ms, with the comment ': resumed <cursor>' (the re-attach preface)"
    if not event.data:
        return f"id {cursor}  (priming: a cursor before any message)"
    message = orjson.loads(event.data)
    if "method" in message:
        params = message.get("params", {})
        return f"id {cursor}  {message['method']} {params.get('progress', '')}/{params.get('total', '')}"
    result = message.get("result") or message.get("error")
    return f"id {cursor}  response to request {message.get('id')}: {orjson.dumps(result).decode()[:80]}"


async def _drop_and_reattach(client: ScriptedClient) -> None:
    say("== 2. A client drops in the middle of a tool call, and re-attaches ==")
    request_id, body = client.tool_call("count_slowly", {"n": 8, "delay": 0.1})
    last_cursor = ""
    seen = 0
    async with client.http.post(client.url, data=body, headers=client.headers()) as response:
        status = f"{response.status} {response.content_type}"
        say(f"   POST tools/call count_slowly(n=8), request {request_id}: {status}")
        async for event in sse_events(response):
            say(f"   <- {describe(event)}")
            last_cursor = event.id.decode() if event.id else last_cursor
            seen += 1 if event.data else 0
            if seen == 3:
                break
    say("   -- the connection drops here (the client closed it). The upstream never learns of it. --")
    await asyncio.sleep(1.0)  # the tool keeps running upstream; the proxy keeps reading into the window
    say(f"   GET with Last-Event-ID: {last_cursor}")
    headers = client.headers(**{"Last-Event-ID": last_cursor})
    async with client.http.get(client.url, headers=headers) as response:
        say(f"   -> {response.status}: re-attached")
        async for event in sse_events(response):
            say(f"   <- {describe(event)}")
    say("   Only what was missed: progress 4..8 and the result, each exactly once.")
    say()


async def _evicted_cursor(client: ScriptedClient, window_events: int) -> None:
    say("== 3. A cursor whose events left the window ==")
    n = window_events + 10
    _, body = client.tool_call("count_slowly", {"n": n, "delay": 0})
    first_cursor = ""
    async with client.http.post(client.url, data=body, headers=client.headers()) as response:
        async for event in sse_events(response):
            first_cursor = first_cursor or (event.id.decode() if event.id else "")
    say(f"   a tool call streamed {n} progress events; the window keeps the last {window_events}")
    say(f"   GET with Last-Event-ID: {first_cursor} (the call's first cursor)")
    await _show_rejection(client, client.headers(**{"Last-Event-ID": first_cursor}))
    say("   An honest 409: replaying would leave a silent gap, so the proxy says so instead.")
    say()


async def _unknown_session(client: ScriptedClient) -> None:
    say("== 4. An unknown session ==")
    headers = client.headers(**{"Mcp-Session-Id": "no-such-session", "Last-Event-ID": "aaaaaaaaaaaa-1-1"})
    say("   GET with Mcp-Session-Id: no-such-session")
    await _show_rejection(client, headers)
    say("   404 means only 'session gone': the client starts a new session with initialize.")


async def _show_rejection(client: ScriptedClient, headers: dict[str, str]) -> None:
    async with client.http.get(client.url, headers=headers) as response:
        body = await response.read()
    say(f"   -> {response.status} {body.decode()}")


async def _print_counters(proxy: RunningProxy) -> None:
    proxy.ctx.metrics.store_stats(await proxy.ctx.store.stats())
    say()
    say("== Metric counters ==")
    wanted = (
        "mcpresume_resumptions_total",
        "mcpresume_replayed_events_total",
        "mcpresume_evicted_events_total",
        "mcpresume_sessions",
    )
    for line in proxy.ctx.metrics.render().decode().splitlines():
        if line.startswith(wanted):
            say(f"   {line}")
