"""The upstream of the calls scenario: an MCP Streamable HTTP server answering short requests in microseconds.

Run it in its own process (``python -m bench.callee --port 0``; it prints ``READY <port>``). One asyncio
``Protocol`` per connection (uvloop), no streams, no tasks: a request is parsed out of the bytes it came in
and answered in the same callback, so the upstream stays far from being the bottleneck of what it measures
(``python -m bench --only calls`` reports its CPU per call).

* ``POST`` ``initialize`` -> 200 ``text/event-stream`` with an ``Mcp-Session-Id`` header and the JSON-RPC
  response (so a proxy tracks the session).
* ``POST`` of a notification or a response (no ``id``) -> 202.
* ``POST`` ``tools/call`` -> the JSON-RPC response, in the form ``params.arguments.answer`` names
  (``ANSWERS``): ``sse-ids`` (200 SSE, chunked: a priming event, an ``id:`` and an empty ``data:``, then the
  response event with an ``id:`` line, as the official SDK's server with an event store answers from
  protocol revision 2025-11-25 on), ``sse`` (200 SSE, chunked: the response event alone, as that server
  answers without an event store) or ``json`` (200 ``application/json``, Content-Length framed).
* ``POST`` any other request -> 200 ``application/json`` ``{"result": {}}``.
* ``DELETE`` -> 200. Any other method -> 405 (no standalone stream: the calls scenario never opens one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import uuid
from typing import Any, cast

ANSWERS = ("sse-ids", "sse", "json")

# The largest request head and body this upstream takes: the calls scenario's requests are a few hundred
# bytes; anything larger is a mistake of the benchmark's, answered 413 and the connection closed.
MAX_REQUEST = 1 << 20

_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
_ACCEPTED = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"
_OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
_NOT_ALLOWED = b"HTTP/1.1 405 Method Not Allowed\r\nAllow: POST, DELETE\r\nContent-Length: 0\r\n\r\n"
_TOO_LARGE = b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_RESULT = {"content": [{"type": "text", "text": "ok"}], "isError": False}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _response(request_id: Any, result: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}, separators=(",", ":")).encode()


def answer(request_id: Any, kind: str, event_id: int) -> bytes:
    """The whole HTTP response to a ``tools/call`` answered as ``kind`` (one of ``ANSWERS``); ``event_id``
    numbers the SSE events of ``sse-ids`` (the priming event's, the response's is the next)."""
    body = _response(request_id, _RESULT)
    if kind == "json":
        return _JSON_HEAD % len(body) + body
    event = b"event: message\ndata: " + body + b"\n\n"
    if kind == "sse-ids":
        event = b"id: %d\ndata: \n\nid: %d\n" % (event_id, event_id + 1) + event
    elif kind != "sse":
        raise ValueError(f"unknown answer kind {kind!r}")
    return _SSE_HEAD + _chunk(event) + b"0\r\n\r\n"


def content_length(head: bytes) -> int:
    """The Content-Length of a request head (0 when there is none)."""
    lowered = head.lower()
    at = lowered.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = lowered.find(b"\r\n", at + 2)
    return int(lowered[at + 17 : end if end >= 0 else len(lowered)])


class Callee(asyncio.Protocol):
    """One connection: requests parsed out of the bytes as they come, each answered at once."""

    events = 0  # every connection's SSE events are numbered from one counter

    def __init__(self, connections: set[Callee]) -> None:
        self.connections = connections
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        buffer = self.buffer + data if self.buffer else data
        out = []
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buffer[:end]
            length = content_length(head)
            if end + 4 + length > MAX_REQUEST:
                self.transport.write(_TOO_LARGE)
                self.transport.close()
                return
            if len(buffer) < end + 4 + length:
                break
            body = buffer[end + 4 : end + 4 + length]
            buffer = buffer[end + 4 + length :]
            out.append(self.respond(head[: head.find(b" ")], body))
        if len(buffer) > MAX_REQUEST:
            self.transport.write(_TOO_LARGE)
            self.transport.close()
            return
        self.buffer = buffer
        if out:
            self.transport.write(b"".join(out))

    def respond(self, method: bytes, body: bytes) -> bytes:
        if method == b"DELETE":
            return _OK_EMPTY
        if method != b"POST":
            return _NOT_ALLOWED
        msg = json.loads(body)
        if isinstance(msg, list):
            msg = msg[0]
        if "id" not in msg or "method" not in msg:
            return _ACCEPTED
        if msg["method"] == "tools/call":
            kind = msg.get("params", {}).get("arguments", {}).get("answer", "json")
            Callee.events += 2
            return answer(msg["id"], kind, Callee.events)
        if msg["method"] == "initialize":
            result = {
                "protocolVersion": msg.get("params", {}).get("protocolVersion", "2025-11-25"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "bench-callee", "version": "1"},
            }
            event = b"event: message\ndata: " + _response(msg["id"], result) + b"\n\n"
            return (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Mcp-Session-Id: " + uuid.uuid4().hex.encode() + b"\r\n"
                b"Content-Length: %d\r\n\r\n" % len(event) + event
            )
        body = _response(msg["id"], {})
        return _JSON_HEAD % len(body) + body


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    connections: set[Callee] = set()
    server = await loop.create_server(lambda: Callee(connections), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()
        server.close()
        for connection in list(connections):
            if connection.transport is not None:
                connection.transport.abort()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.callee", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.host.startswith("127.") and args.host not in ("localhost", "::1"):
        print("bench.callee: loopback only", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
