"""A fast synthetic MCP-ish Streamable HTTP upstream (handshake era), for benchmarks only.

Run it in its own process (``python -m bench.upstream --port 0``; it prints ``READY <port>``), so it does
not share a core's event loop with the proxy under test. It speaks just enough HTTP/1.1 over raw asyncio
streams (uvloop when available):

* ``POST`` ``initialize`` -> 200 ``text/event-stream`` with an ``Mcp-Session-Id`` header and one event, the
  JSON-RPC response (Content-Length framed, keep-alive), so mcpresume starts tracking the session.
* ``POST`` of a notification or a response (no ``id``) -> 202.
* ``POST`` ``tools/call`` with ``arguments = {"count": N, "size": S, "rate": R}`` -> 200 ``text/event-stream``
  (chunked) with N ``notifications/progress`` events of exactly S bytes each (the whole SSE frame, from
  ``event:`` to the blank line), then the JSON-RPC response for the request id. ``rate = 0``: as fast as
  possible, many pre-built events per write (``batch`` bytes, default 64 KiB). ``rate > 0``: paced at R
  events/s (the first after ``delay`` seconds), each event stamped with ``time.time_ns()`` just before it
  is written (``"ts"``), so a client can compute the one-way latency. In burst mode the stamp is the
  stream's start time (payloads are pre-built once per request so the upstream is never the bottleneck).
* ``POST`` any other request -> 200 ``application/json`` ``{"result": {}}``.
* ``GET`` with ``Mcp-Session-Id`` -> the standalone SSE stream: headers and one comment, then it stays
  open, silent, until the client goes away.
* ``DELETE`` -> 200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from bench.pacer import Pacer

TS_DIGITS = 19  # time.time_ns() has 19 digits until the year 2286
_PREFIX = (
    b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress",'
    b'"params":{"progressToken":"bench","progress":1,"ts":'
)
_MIDDLE = b',"pad":"'
_SUFFIX = b'"}}\n\n'
MIN_EVENT_SIZE = len(_PREFIX) + TS_DIGITS + len(_MIDDLE) + len(_SUFFIX)

_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
)


@dataclass(frozen=True, slots=True)
class Framing:
    """How the upstream writes its events: all valid SSE and JSON, as real servers write them.

    ``json``: ``compact`` (``separators=(",", ":")``: pydantic, ``JSON.stringify``, Go's ``encoding/json``),
    ``default`` (``json.dumps``' own separators, ``", "`` and ``": "``: hand-written Python servers) or
    ``pretty`` (``indent=2``: one ``data:`` line per JSON line). ``ids``: an ``id:`` line first in every
    event (an SDK server with an event store). ``crlf``: CRLF line endings. ``comments``: a comment block
    (``: keep-alive``) before every event."""

    json: str = "compact"
    ids: bool = False
    crlf: bool = False
    comments: bool = False

    def to_args(self) -> dict[str, Any]:
        return {"json": self.json, "ids": self.ids, "crlf": self.crlf, "comments": self.comments}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Framing:
        framing = cls(
            json=str(args.get("json", "compact")),
            ids=bool(args.get("ids", False)),
            crlf=bool(args.get("crlf", False)),
            comments=bool(args.get("comments", False)),
        )
        if framing.json not in ("compact", "default", "pretty"):
            raise ValueError(f"unknown json spelling {framing.json!r}")
        return framing


CANONICAL = Framing()
# The framings the benchmark measures, by name (``canonical`` is the one the other scenarios use).
FRAMINGS: dict[str, Framing] = {
    "canonical": CANONICAL,
    "ids": Framing(ids=True),
    "default-json-ids": Framing(json="default", ids=True),
    "crlf": Framing(crlf=True),
    "pretty": Framing(json="pretty"),
    "comments": Framing(comments=True),
}

# Stands for the 19 digits of the stamp, and for the id's write number (burst mode), while framing.
_TS_MARK = 1234567890123456789
_WRITE_MARK = b"\x00" * 8


def _json(doc: Any, framing: Framing) -> str:
    if framing.json == "compact":
        return json.dumps(doc, separators=(",", ":"))
    if framing.json == "pretty":
        return json.dumps(doc, indent=2)
    return json.dumps(doc)


def frame(doc: Any, framing: Framing, event_id: bytes | None = None) -> bytes:
    """One SSE event carrying ``doc`` as ``framing`` spells it (an id line when ``framing.ids`` and an id)."""
    lines = []
    if framing.ids and event_id is not None:
        lines.append(b"id: " + event_id)
    lines.append(b"event: message")
    lines += [b"data: " + line.encode() for line in _json(doc, framing).split("\n")]
    end = b"\r\n" if framing.crlf else b"\n"
    text = end.join(lines) + end + end
    if framing.comments:
        text = b": keep-alive" + end + end + text
    return text


def _progress(pad: int) -> dict[str, Any]:
    params = {"progressToken": "bench", "progress": 1, "ts": _TS_MARK, "pad": "x" * pad}
    return {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}


def framed_parts(size: int, framing: Framing, event_id: bytes | None = None) -> tuple[bytes, bytes]:
    """(prefix, suffix) of a progress event of exactly ``size`` bytes in ``framing``: prefix + 19 ts digits
    + suffix."""
    unpadded = len(frame(_progress(0), framing, event_id))
    if size < unpadded:
        raise ValueError(f"event size must be >= {unpadded} in this framing")
    prefix, suffix = frame(_progress(size - unpadded), framing, event_id).split(b"%d" % _TS_MARK)
    return prefix, suffix


def event_parts(size: int) -> tuple[bytes, bytes]:
    """(prefix, suffix) of a progress event of exactly ``size`` bytes: prefix + 19 ts digits + suffix."""
    if size < MIN_EVENT_SIZE:
        raise ValueError(f"event size must be >= {MIN_EVENT_SIZE}")
    pad = b"x" * (size - MIN_EVENT_SIZE)
    return _PREFIX, _MIDDLE + pad + _SUFFIX


def make_event(size: int, ts_ns: int) -> bytes:
    prefix, suffix = event_parts(size)
    return prefix + b"%019d" % ts_ns + suffix


def burst_pieces(size: int, framing: Framing, count: int, ts_ns: int) -> list[bytes]:
    """``count`` events of ``size`` bytes in ``framing``, as pieces that ``write_number.join`` (8 bytes)
    turns into one write: with ids, every event's id is ``<write number>-<index in the write>``, so ids are
    unique across a stream at the cost of one C-level join per write."""
    if framing == CANONICAL:
        return [make_event(size, ts_ns) * count]
    events = []
    for k in range(count):
        event_id = _WRITE_MARK + b"-%04x" % k
        prefix, suffix = framed_parts(size, framing, event_id)
        events.append(prefix + b"%019d" % ts_ns + suffix)
    return b"".join(events).split(_WRITE_MARK)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def response_event(request_id: Any, result: dict[str, Any], framing: Framing = CANONICAL) -> bytes:
    doc = {"jsonrpc": "2.0", "id": request_id, "result": result}
    if framing == CANONICAL:
        return b"event: message\ndata: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"
    return frame(doc, framing, b"response")


class Upstream:
    def __init__(self) -> None:
        self.connections: set[asyncio.StreamWriter] = set()
        self.sessions_issued = 0
        self.pacer = Pacer()  # paced streams wait on it (asyncio.sleep would spin under uvloop)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        transport.set_write_buffer_limits(high=512 * 1024)
        self.connections.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                lines = head.split(b"\r\n")
                method, _target, _version = lines[0].split(b" ", 2)
                headers: dict[bytes, bytes] = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(b":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get(b"content-length", b"0"))
                body = await reader.readexactly(length) if length else b""
                keep = await self.dispatch(method, headers, body, reader, writer)
                if not keep or headers.get(b"connection", b"").lower() == b"close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self.connections.discard(writer)
            writer.close()

    async def dispatch(
        self,
        method: bytes,
        headers: dict[bytes, bytes],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        if method == b"POST":
            return await self.post(headers, body, writer)
        if method == b"GET":
            if b"mcp-session-id" not in headers:
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                return True
            writer.write(_SSE_HEAD + b"\r\n" + chunk(b": standalone stream open\n\n"))
            await writer.drain()
            # Silent until the client leaves: bounded by the client (the benchmark closes every stream).
            while await reader.read(65536):
                pass
            return False
        if method == b"DELETE":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return True
        writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
        return True

    async def post(self, headers: dict[bytes, bytes], body: bytes, writer: asyncio.StreamWriter) -> bool:
        doc = json.loads(body)
        msg = doc[0] if isinstance(doc, list) else doc
        if "id" not in msg or "method" not in msg:
            writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n")
            return True
        request_id = msg["id"]
        if msg["method"] == "initialize":
            self.sessions_issued += 1
            sid = uuid.uuid4().hex.encode()
            event = response_event(
                request_id,
                {
                    "protocolVersion": msg.get("params", {}).get("protocolVersion", "2025-06-18"),
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "bench-upstream", "version": "1"},
                },
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Mcp-Session-Id: " + sid + b"\r\nContent-Length: %d\r\n\r\n" % len(event) + event
            )
            return True
        if msg["method"] == "tools/call":
            args = msg.get("params", {}).get("arguments", {})
            await self.tool_stream(
                writer,
                request_id,
                count=int(args.get("count", 100)),
                size=int(args.get("size", 256)),
                rate=float(args.get("rate", 0)),
                batch=int(args.get("batch", 65536)),
                delay=float(args.get("delay", 0)),
                framing=Framing.from_args(args.get("framing", {})),
            )
            return True
        data = json.dumps({"jsonrpc": "2.0", "id": request_id, "result": {}}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
            + data
        )
        return True

    async def tool_stream(
        self,
        writer: asyncio.StreamWriter,
        request_id: Any,
        *,
        count: int,
        size: int,
        rate: float,
        batch: int,
        delay: float = 0.0,
        framing: Framing = CANONICAL,
    ) -> None:
        writer.write(_SSE_HEAD + b"\r\n")
        if rate <= 0:
            start_ns = time.time_ns()
            per_write = max(1, batch // size)
            pieces = burst_pieces(size, framing, per_write, start_ns)
            sent = writes = 0
            while count - sent >= per_write:
                writer.write(chunk((b"%08x" % (writes % 2**32)).join(pieces)))
                writes += 1
                sent += per_write
                await writer.drain()
            if count > sent:
                rest = burst_pieces(size, framing, count - sent, start_ns)
                writer.write(chunk((b"%08x" % (writes % 2**32)).join(rest)))
        else:
            interval = 1.0 / rate
            start = time.monotonic() + min(max(delay, 0.0), 10.0)
            sent = 0

            def parts_of(n: int) -> tuple[bytes, bytes]:
                if framing == CANONICAL:
                    return event_parts(size)
                return framed_parts(size, framing, b"%012d" % n)

            while sent < count:
                await self.pacer.until(start + sent * interval)
                now = time.monotonic()
                parts = []
                # every event that is due now, each stamped just before the write
                while sent < count and start + sent * interval <= now:
                    prefix, suffix = parts_of(sent)
                    parts.append(chunk(prefix + b"%019d" % time.time_ns() + suffix))
                    sent += 1
                writer.write(b"".join(parts))
                await writer.drain()
        done = response_event(request_id, {"content": [{"type": "text", "text": f"{count} events"}]}, framing)
        writer.write(chunk(done) + b"0\r\n\r\n")
        await writer.drain()


async def serve(host: str, port: int) -> None:
    upstream = Upstream()
    server = await asyncio.start_server(upstream.handle, host, port, backlog=4096, limit=1 << 20)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    async with server:
        await stop.wait()
        server.close()
        for writer in list(upstream.connections):
            writer.transport.abort()
    upstream.pacer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.host.startswith("127.") and args.host not in ("localhost", "::1"):
        print("bench.upstream: loopback only", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    with contextlib.suppress(ImportError, OSError):
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
