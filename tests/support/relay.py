"""A real TCP relay for tests that can cut connections, deterministically.

`CuttingRelay` listens on ``127.0.0.1:<free port>`` and forwards every accepted connection to a target. It
understands just enough HTTP/1.1 (message heads, ``Content-Length`` and chunked framing, keep-alive) to
attribute every forwarded byte to a request or response, which lets it

* cut the server->client direction of a connection after a number of bytes drawn from a seeded
  `random.Random` -- either counted from the start of the connection, or (``sse_only=True``) counted from the
  first byte of each ``200`` ``text/event-stream`` response, so SSE streams are cut but plain POST answers
  (``202``, JSON bodies, errors) pass untouched;
* record what went through: raw bytes per direction, and each parsed request / response with its decoded
  (de-chunked) body, so a test can count SSE events as they appeared on the wire.

A cut delivers exactly the allowed prefix to the client and then closes the client connection (FIN by
default, RST with ``hard_cut=True``), and aborts the upstream connection, so the upstream sees the client go
away just as it would on a real network failure. `CuttingRelay.cut_all` aborts every open connection pair at
once.

Bytes the relay cannot parse as HTTP/1.1 (or anything after a ``101``) are forwarded verbatim ("passthrough");
the connection-level policy still applies to them.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "CuttingRelay",
    "HttpMessage",
    "RelayConnection",
    "SseEvent",
    "parse_sse",
    "sse_events_of",
]

_MAX_HEAD = 64 * 1024
_READ_SIZE = 64 * 1024


# ----------------------------------------------------------------------------------------------------
# HTTP/1.1 framing


@dataclass
class HttpMessage:
    """One HTTP/1.1 request or response seen by the relay."""

    kind: Literal["request", "response"]
    start_line: str
    headers: list[tuple[str, str]]  # names lower-cased, in wire order
    head_size: int
    body: bytearray = field(default_factory=bytearray)
    """The decoded body bytes (chunk framing removed) that were *forwarded*; only filled when recording.

    After a cut this is exactly the body prefix the peer received, even when the cut fell inside a chunk."""
    raw_size: int = 0
    """Bytes of this message forwarded so far (head and framing included)."""
    complete: bool = False
    """Every byte of the message was forwarded."""
    cut: bool = False
    """The relay cut the connection while this message was being forwarded."""
    request: HttpMessage | None = field(default=None, repr=False)
    """For a response: the request it answers (matched in order on the connection)."""

    @property
    def method(self) -> str | None:
        return self.start_line.split(" ", 1)[0] if self.kind == "request" else None

    @property
    def target(self) -> str | None:
        return self.start_line.split(" ", 2)[1] if self.kind == "request" else None

    @property
    def status(self) -> int | None:
        if self.kind != "response":
            return None
        try:
            return int(self.start_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            return None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)

    @property
    def is_sse(self) -> bool:
        content_type = self.header("content-type") or ""
        return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"

    def sse_events(self) -> list[SseEvent]:
        """The SSE events in the forwarded body (needs ``record=True``); a partial last event is dropped."""
        return parse_sse(bytes(self.body))

    def delivered_sse_events(self) -> list[SseEvent]:
        """The SSE events the client's SSE parser can have dispatched: those whose terminating blank line was
        forwarded. HTTP/1.1 clients (h11 under httpx, aiohttp) hand partial chunk data to the application
        as it arrives, so what counts is the event terminator, not the chunk boundary: an event whose chunk
        lost only its trailing CRLF to a cut *was* delivered. Same as `sse_events` (which never includes a
        partial event); the name says what a test means by it.
        """
        return self.sse_events()


_State = Literal["head", "length", "chunk_size", "chunk_data", "chunk_crlf", "trailers", "eof", "raw"]


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of bytes the framer released, all of one kind and of one message."""

    raw: bytes
    message: HttpMessage | None  # None: passthrough bytes
    data: bool = False  # body payload (as opposed to a head or chunk framing)
    ends_message: bool = False  # the message is complete once all of ``raw`` is forwarded


class _Framer:
    """Incremental HTTP/1.1 framer for one direction of one connection.

    `feed` buffers bytes and returns the segments that can be forwarded now. A message head is held back
    until it is complete (so a policy can look at it before any of its bytes are forwarded); body bytes are
    released as soon as their framing is understood. The framer only parses: what was *forwarded* (and so
    recorded, counted, completed) is up to the pump, which may forward a prefix and cut.
    """

    def __init__(
        self,
        kind: Literal["request", "response"],
        requests: deque[HttpMessage],
        on_message: Callable[[HttpMessage], None],
    ) -> None:
        self.kind = kind
        self._requests = requests  # unanswered requests in order; the response side pops them
        self._on_message = on_message
        self._buf = bytearray()
        self._state: _State = "head"
        self._remaining = 0
        self._current: HttpMessage | None = None

    def feed(self, data: bytes) -> list[_Segment]:
        self._buf += data
        out: list[_Segment] = []
        while self._buf:
            segment = self._step()
            if segment is None:
                break
            out.append(segment)
        return out

    def flush(self) -> list[_Segment]:
        """At end of stream: release whatever is still held back (an incomplete head, say) verbatim."""
        ends = self._state == "eof" and self._current is not None  # a body delimited by the close
        segment = _Segment(self._take(len(self._buf)), self._current if ends else None, ends_message=ends)
        self._reset()
        return [segment]

    def _take(self, n: int) -> bytes:
        piece = bytes(self._buf[:n])
        del self._buf[:n]
        return piece

    def _reset(self) -> None:
        self._current = None
        self._state = "head"

    def _step(self) -> _Segment | None:
        state = self._state
        if state == "raw":
            return _Segment(self._take(len(self._buf)), None)
        if state == "head":
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self._state = "raw"
                    return _Segment(self._take(len(self._buf)), None)
                return None
            head = self._take(end + 4)
            message = self._parse_head(head)
            if message is None:
                self._state = "raw"
                return _Segment(head, None)
            self._current = message
            self._on_message(message)
            ends = self._start_body(message)
            if ends:
                self._reset()
            return _Segment(head, message, ends_message=ends)
        message = self._current
        if state == "eof":
            return _Segment(self._take(len(self._buf)), message, data=True)
        if state == "length":
            piece = self._take(min(self._remaining, len(self._buf)))
            self._remaining -= len(piece)
            ends = self._remaining == 0
            if ends:
                self._reset()
            return _Segment(piece, message, data=True, ends_message=ends)
        if state == "chunk_size":
            end = self._buf.find(b"\r\n")
            if end < 0:
                return None
            line = self._take(end + 2)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._state = "raw"
                return _Segment(line, None)
            if size == 0:
                self._state = "trailers"
            else:
                self._remaining = size
                self._state = "chunk_data"
            return _Segment(line, message)
        if state == "chunk_data":
            piece = self._take(min(self._remaining, len(self._buf)))
            self._remaining -= len(piece)
            if self._remaining == 0:
                self._state = "chunk_crlf"
            return _Segment(piece, message, data=True)
        if state == "chunk_crlf":
            if len(self._buf) < 2:
                return None
            self._state = "chunk_size"
            return _Segment(self._take(2), message)
        # trailers: header lines until an empty line
        end = self._buf.find(b"\r\n")
        if end < 0:
            return None
        line = self._take(end + 2)
        ends = line == b"\r\n"
        if ends:
            self._reset()
        return _Segment(line, message, ends_message=ends)

    def _parse_head(self, head: bytes) -> HttpMessage | None:
        lines = head.decode("latin-1")[:-4].split("\r\n")
        start = lines[0]
        if self.kind == "response" and not start.startswith("HTTP/1."):
            return None
        if self.kind == "request" and not start.endswith((" HTTP/1.1", " HTTP/1.0")):
            return None
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return None
            headers.append((name.strip().lower(), value.strip()))
        return HttpMessage(self.kind, start, headers, head_size=len(head))

    def _start_body(self, message: HttpMessage) -> bool:
        """Set up body framing after ``message``'s head; True if the message has no body."""
        transfer_encoding = (message.header("transfer-encoding") or "").lower()
        content_length = message.header("content-length")
        if self.kind == "request":
            self._requests.append(message)
            no_body = False
        else:
            status = message.status or 0
            if status == 101:
                self._state = "raw"  # protocol switch: nothing after this is HTTP/1.1
                self._current = None
                return True
            if 100 <= status < 200:
                return True  # interim response; the final one follows
            message.request = self._requests.popleft() if self._requests else None
            method = message.request.method if message.request is not None else None
            no_body = method == "HEAD" or status in (204, 304)
        if no_body:
            return True
        if "chunked" in transfer_encoding:
            self._state = "chunk_size"
            return False
        if content_length is not None and content_length.strip().isdigit():
            self._remaining = int(content_length)
            self._state = "length"
            return self._remaining == 0
        if self.kind == "response":
            self._state = "eof"  # delimited by connection close
            return False
        return True


# ----------------------------------------------------------------------------------------------------
# SSE


@dataclass(frozen=True)
class SseEvent:
    """One dispatched Server-Sent Event (fields as received; ``data`` lines joined with ``\\n``)."""

    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None


def parse_sse(body: bytes) -> list[SseEvent]:
    """Parse an ``text/event-stream`` body into events (per the WHATWG rules; comments ignored).

    Unlike a browser, an event with empty data but an ``id`` (an MCP priming event) is returned too.
    """
    events: list[SseEvent] = []
    text = body.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    blocks = text.split("\n\n")
    for block in blocks[:-1]:  # the last block is not terminated by a blank line yet
        data: list[str] = []
        event = event_id = None
        retry = None
        seen = False
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, sep, value = line.partition(":")
            if sep and value.startswith(" "):
                value = value[1:]
            seen = True
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            elif name == "id":
                event_id = value
            elif name == "retry" and value.isdigit():
                retry = int(value)
        if seen:
            events.append(SseEvent("\n".join(data), event, event_id, retry))
    return events


# ----------------------------------------------------------------------------------------------------
# The relay


@dataclass
class RelayConnection:
    """One accepted client connection and its upstream counterpart."""

    index: int
    up_bytes: int = 0
    """Client->server bytes forwarded."""
    down_bytes: int = 0
    """Server->client bytes forwarded."""
    up_raw: bytearray = field(default_factory=bytearray)
    down_raw: bytearray = field(default_factory=bytearray)
    requests: list[HttpMessage] = field(default_factory=list)
    responses: list[HttpMessage] = field(default_factory=list)
    cut: bool = False
    """The relay cut this connection (policy or `CuttingRelay.cut_all`)."""
    cut_at: int | None = None
    """For a policy cut: the byte budget that ran out (counted per connection, or per SSE response)."""
    closed: bool = False
    _client: asyncio.StreamWriter | None = field(default=None, repr=False)
    _upstream: asyncio.StreamWriter | None = field(default=None, repr=False)
    _pumps: list[asyncio.Task[None]] = field(default_factory=list, repr=False)


class CuttingRelay:
    """TCP relay ``127.0.0.1:<port>`` -> ``target_host:target_port`` that can cut connections.

    Args:
        target_host, target_port: where to forward.
        seed: seeds the `random.Random` that draws each cut point.
        cut_after: ``None`` (never cut), an ``int`` (exact), or ``(lo, hi)`` (uniform, inclusive): how many
            server->client bytes pass before the cut.
        sse_only: count ``cut_after`` from the first byte of each ``200 text/event-stream`` response (one
            draw per such response) instead of from the start of each connection (one draw per connection).
        max_cuts: stop cutting (by policy) after this many cuts; ``None`` = no limit.
        hard_cut: close the client side with RST (``SO_LINGER 0``) instead of FIN. With RST the client's
            kernel may drop bytes it had not yet handed to the application, so "exactly N bytes" only holds
            for the default FIN.
        record: keep raw bytes and decoded message bodies (`RelayConnection.down_raw`, `HttpMessage.body`).

    The policy can be changed while running (`set_policy`). Use as ``async with CuttingRelay(...) as relay``;
    `port` / `url_for` give the address.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        seed: int = 0,
        cut_after: int | tuple[int, int] | None = None,
        sse_only: bool = False,
        max_cuts: int | None = None,
        hard_cut: bool = False,
        record: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.rng = random.Random(seed)
        self.record = record
        self.hard_cut = hard_cut
        self.cut_after: tuple[int, int] | None = None
        self.sse_only = False
        self.max_cuts: int | None = None
        self.set_policy(cut_after=cut_after, sse_only=sse_only, max_cuts=max_cuts)
        self.connections: list[RelayConnection] = []
        self.cuts = 0
        self.policy_cuts = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self.port = 0

    @classmethod
    def for_url(cls, url: str, **kwargs: Any) -> CuttingRelay:
        """A relay in front of the host and port of ``url`` (use `url_for` for the relayed URL)."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"URL needs an explicit host and port: {url!r}")
        return cls(parts.hostname, parts.port, **kwargs)

    def relayed(self, url: str) -> str:
        """``url`` with its host and port replaced by the relay's."""
        parts = urlsplit(url)
        return urlunsplit(parts._replace(netloc=f"{self.host}:{self.port}"))

    # -- configuration ---------------------------------------------------------------------------------------

    def set_policy(
        self,
        *,
        cut_after: int | tuple[int, int] | None,
        sse_only: bool | None = None,
        max_cuts: int | None = None,
    ) -> None:
        """Replace the cut policy. Applies to connections / responses that start after the call."""
        if isinstance(cut_after, int):
            cut_after = (cut_after, cut_after)
        if cut_after is not None and not 0 <= cut_after[0] <= cut_after[1]:
            raise ValueError("cut_after must satisfy 0 <= lo <= hi")
        self.cut_after = cut_after
        if sse_only is not None:
            self.sse_only = sse_only
        self.max_cuts = max_cuts

    # -- inspection ------------------------------------------------------------------------------------------

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        return len(self.connections)

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self.connections if not c.closed)

    def url_for(self, path: str = "/mcp") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def requests(self) -> list[HttpMessage]:
        return [m for c in self.connections for m in c.requests]

    def responses(self, *, sse: bool | None = None) -> list[HttpMessage]:
        return [m for c in self.connections for m in c.responses if sse is None or m.is_sse == sse]

    async def wait_for(self, predicate: Callable[[CuttingRelay], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate(self)`` holds; re-checked whenever a connection, message or cut happens."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                self._changed.clear()
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> CuttingRelay:
        if self._server is not None:
            raise RuntimeError("relay already started")
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening, abort every open connection, and wait for all relay tasks."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in self.connections:
            self._abort(conn)
            for pump in conn._pumps:
                pump.cancel()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> CuttingRelay:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- cutting ---------------------------------------------------------------------------------------------

    def cut_all(self) -> int:
        """Abort every open connection pair (both sides, immediately). Returns how many were cut."""
        open_ = [c for c in self.connections if not c.closed and not c.cut]
        for conn in open_:
            conn.cut = True
            self.cuts += 1
            self._abort(conn)
            for pump in conn._pumps:
                pump.cancel()
        self._notify()
        return len(open_)

    def _abort(self, conn: RelayConnection) -> None:
        for writer in (conn._client, conn._upstream):
            if writer is not None:
                writer.transport.abort()

    def _draw_budget(self) -> int | None:
        if self.cut_after is None:
            return None
        if self.max_cuts is not None and self.policy_cuts >= self.max_cuts:
            return None
        lo, hi = self.cut_after
        return self.rng.randint(lo, hi)

    # -- the relay itself ------------------------------------------------------------------------------------

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = RelayConnection(index=len(self.connections), _client=client_writer)
        self.connections.append(conn)
        self._notify()
        pumps: list[asyncio.Task[None]] = []
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                client_writer.transport.abort()
                return
            conn._upstream = upstream_writer
            if conn.cut:  # cut_all() ran while we were connecting
                self._abort(conn)
                return
            unanswered: deque[HttpMessage] = deque()
            up = _Framer("request", unanswered, self._on_message(conn.requests))
            down = _Framer("response", unanswered, self._on_message(conn.responses))
            pumps.append(asyncio.create_task(self._pump_up(conn, client_reader, upstream_writer, up)))
            pumps.append(asyncio.create_task(self._pump_down(conn, upstream_reader, client_writer, down)))
            conn._pumps = pumps
            await asyncio.wait(pumps)  # unlike gather(), does not raise when a cut cancelled one pump
        except asyncio.CancelledError:
            # close() cancels handlers stuck before their pumps started. asyncio (3.11) logs an error for a
            # cancelled client_connected_cb task, so end normally: this task is the connection's top level.
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            conn.closed = True
            # close() flushes first: after a FIN cut the client still gets the allowed prefix. Transports that
            # were aborted (cut_all, hard cut, upstream side of a cut) ignore it.
            client_writer.close()
            if conn._upstream is not None:
                conn._upstream.close()
            self._handlers.discard(task)
            self._notify()

    async def _pump_up(
        self,
        conn: RelayConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        framer: _Framer,
    ) -> None:
        try:
            while not conn.cut:
                data = await reader.read(_READ_SIZE)
                if conn.cut:
                    return
                for segment in framer.feed(data) if data else framer.flush():
                    self._forward(conn, writer, segment, segment.raw, up=True)
                self._notify()
                if not data:
                    break
                await writer.drain()
            if writer.can_write_eof() and not writer.transport.is_closing():
                writer.write_eof()  # half-close: the client is done sending
        except OSError:
            self._abort(conn)  # a reset on one side resets the pair

    async def _pump_down(
        self,
        conn: RelayConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        framer: _Framer,
    ) -> None:
        drawn = None if self.sse_only else self._draw_budget()
        budget = drawn  # bytes still allowed through; None = no cut armed
        try:
            while not conn.cut:
                data = await reader.read(_READ_SIZE)
                if conn.cut:
                    return
                for segment in framer.feed(data) if data else framer.flush():
                    message = segment.message
                    if self.sse_only and message is not None and message.raw_size == 0:
                        # A response head: arm a budget for a 200 SSE response, disarm for anything else.
                        ok = message.status == 200 and message.is_sse
                        drawn = budget = self._draw_budget() if ok else None
                    if budget is not None and len(segment.raw) >= budget and (segment.raw or budget == 0):
                        self._forward(conn, writer, segment, segment.raw[:budget], up=False)
                        self._policy_cut(conn, message, drawn)
                        return
                    self._forward(conn, writer, segment, segment.raw, up=False)
                    if budget is not None:
                        budget -= len(segment.raw)
                self._notify()
                if not data:
                    break
                await writer.drain()
            if writer.can_write_eof() and not writer.transport.is_closing():
                writer.write_eof()
        except OSError:
            self._abort(conn)

    def _forward(
        self, conn: RelayConnection, writer: asyncio.StreamWriter, segment: _Segment, raw: bytes, *, up: bool
    ) -> None:
        """Write ``raw`` (all or a prefix of ``segment.raw``) and account for exactly what was written."""
        if raw:
            writer.write(raw)
        message = segment.message
        if message is not None:
            message.raw_size += len(raw)
            if segment.data and self.record:
                message.body += raw
            if segment.ends_message and len(raw) == len(segment.raw):
                message.complete = True
        if up:
            conn.up_bytes += len(raw)
            if self.record:
                conn.up_raw += raw
        else:
            conn.down_bytes += len(raw)
            if self.record:
                conn.down_raw += raw

    def _policy_cut(self, conn: RelayConnection, message: HttpMessage | None, drawn: int | None) -> None:
        conn.cut = True
        conn.cut_at = drawn
        if message is not None and not message.complete:
            message.cut = True
        self.cuts += 1
        self.policy_cuts += 1
        client, upstream = conn._client, conn._upstream
        if upstream is not None:
            upstream.transport.abort()
        if client is not None:
            if self.hard_cut:
                sock = client.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.transport.abort()
            else:
                client.close()  # flushes the allowed prefix, then FIN
        for pump in conn._pumps:
            if pump is not asyncio.current_task():
                pump.cancel()
        self._notify()

    def _on_message(self, messages: list[HttpMessage]) -> Callable[[HttpMessage], None]:
        def on_message(message: HttpMessage) -> None:
            messages.append(message)
            self._notify()

        return on_message


def sse_events_of(messages: Iterable[HttpMessage]) -> list[SseEvent]:
    """All SSE events recorded across ``messages`` (in order)."""
    return [event for message in messages if message.is_sse for event in message.sse_events()]
