"""The requests whose answers the proxy reads (a call's POST, a DELETE, the proxy's own requests): kept-alive
connections to the upstream, one request at a time on each, the answer parsed by llhttp (httptools).

Most MCP traffic is short calls, and each is one such request. aiohttp's client costs about 80 us of CPU per
request in Python around its C parser (the request object, the headers' multidict, a task writing the body,
the stream reader); this one writes the head and the body in one write and hands the parser's pieces to a
``streams/answer.py`` reader: about 22 us (``bench/results/client_ab.md``). What a reader sees is the same as
of a held GET: the body as it arrives, flow control, a body compressed anyway inflated as it is read.

Connections are opened as held GETs' are (``Upstream.connect``: the addresses raced, TLS verified for https)
and kept idle, the warmest first, for ``KEEPALIVE`` seconds. A connection serves the next request only when
its answer ended as HTTP says (Content-Length, chunked) and neither side asked to close; one released before
its end, cancelled while waiting, timed out or broken is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, cast

import httptools
from multidict import CIMultiDict

from mcpresume.streams.answer import MAX_HEAD, NotHTTP11, ReadAnswer

# Seconds an idle connection is kept (aiohttp's connector's ``keepalive_timeout``).
KEEPALIVE: Final = 15.0
# Header fields of the request the pool writes itself (the framing, the authority) or the upstream gets
# from the caller only as the pool sets them.
_OWN_FIELDS: Final = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# Methods whose request carries a body by definition: one sent without any says so (Content-Length: 0).
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


class _Unasked(Exception):
    """The upstream sent an answer no request asked for."""


class PooledAnswer(ReadAnswer):
    """An answer on a pooled connection; ``release()`` gives the connection back once the body ended, or
    closes it."""

    __slots__ = ("_connection",)

    def __init__(self, connection: Connection) -> None:
        super().__init__()
        self._connection = connection
        self._transport = connection.transport

    def release(self) -> None:
        self._give_up_head()
        self._connection.released(self)

    def close(self) -> None:
        """Close the connection now, whatever was read (as aiohttp's ``ClientResponse.close``)."""
        self._connection.abort()


class Connection(asyncio.Protocol):
    """One kept-alive connection: the answer to the request written last is parsed as it arrives.

    llhttp calls back in the order of the answer: ``on_status``, ``on_header`` per field,
    ``on_headers_complete`` (the head), ``on_body`` per piece of the body, ``on_message_complete`` (its end).
    An interim answer (1xx) is parsed as a message of its own and skipped."""

    __slots__ = (
        "_answer",
        "_fields",
        "_head_bytes",
        "_interim",
        "_parser",
        "_pool",
        "_reason",
        "_reusable",
        "_timer",
        "_until_close",
        "closed",
        "idle_since",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._answer: PooledAnswer | None = None
        self._reason = ""
        self._fields: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._interim = False
        self._until_close = False
        self._reusable = False
        self._timer: asyncio.TimerHandle | None = None

    # -- the pool's side -------------------------------------------------------------------------------------

    def send(self, message: bytes, deadline: float) -> PooledAnswer:
        """Write a request; its answer's head must come by ``deadline`` (the loop's time)."""
        assert self.transport is not None and self._answer is None
        answer = self._answer = PooledAnswer(self)
        self._until_close = self._reusable = False
        self._timer = self._pool.loop.call_at(deadline, self._timed_out)
        self.transport.write(message)
        return answer

    def released(self, answer: PooledAnswer) -> None:
        if answer is not self._answer:
            return
        if answer._complete and answer._error is None and self._reusable and not self.closed:
            self._answer = None
            answer._transport = None  # its reads no longer pause this connection
            if answer._paused:
                self.transport.resume_reading()  # type: ignore[union-attr]
            self._pool.rest(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection; an answer still coming fails at once (a pending read wakes to
        ``ConnectionResetError``)."""
        self.closed = True
        self._cancel_timer()
        answer = self._answer
        if answer is not None and not answer._complete:
            answer._fail(ConnectionResetError("the connection was closed before the end of the answer"))
            answer._wake()
        if self.transport is not None:
            self.transport.abort()

    def _timed_out(self) -> None:
        self._timer = None
        if self._answer is not None:
            self._answer._fail(TimeoutError())
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance check).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None or answer._complete:
            self.abort()  # bytes no request asked for: nothing on this connection can be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # What a callback raised (the head too large, an encoding not decodable) is the context.
            cause = exc.__context__
            if isinstance(cause, _Unasked):
                self.abort()  # the answer before them stands: it ended before they came
                return
            answer._broken(cause if isinstance(cause, NotHTTP11) else NotHTTP11(str(cause or exc)))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            answer._broken(NotHTTP11(f"the upstream's answer is not valid HTTP/1.1: {exc}"))
        answer._flow()
        answer._wake()

    def eof_received(self) -> bool:
        return False  # close: connection_lost ends the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._cancel_timer()
        self._pool.lost(self)
        answer = self._answer
        if answer is None:
            return
        answer._transport = None
        if exc is not None:
            answer._fail(ConnectionResetError(f"the upstream connection failed: {type(exc).__name__}: {exc}"))
        elif answer.status and self._until_close and not answer._complete and answer._error is None:
            answer._complete = True  # a body framed by the connection's end (RFC 9112 6.3, its last rule)
            answer._inflate()
        if not answer._complete:
            answer._fail(
                ConnectionResetError(
                    "the upstream closed the connection before "
                    + ("the end of its answer" if answer.status else "its answer")
                )
            )
        answer._wake()

    # -- llhttp's callbacks ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._answer is None or self._answer._complete:
            raise _Unasked  # a second answer to one request: nothing more on this connection is trusted

    def on_status(self, reason: bytes) -> None:
        self._reason = reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD:
            raise NotHTTP11(f"the upstream's answer has a head larger than {MAX_HEAD} bytes")
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        fields, self._fields, self._head_bytes = self._fields, [], 0
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise NotHTTP11("the upstream switched protocols on a request that asked for no upgrade")
            self._interim = True  # 100, 102, 103: the final answer follows
            return
        self._cancel_timer()
        headers = CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape")) for name, value in fields
        )
        self._until_close = (
            "Content-Length" not in headers
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
            and status not in (204, 304)
        )
        assert self._answer is not None
        self._answer._begin(status, self._reason, headers)

    def on_body(self, data: bytes) -> None:
        assert self._answer is not None
        self._answer._body(data)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        # Asked here: once this callback returns, llhttp is at the next message, whose flags are unset.
        self._reusable = self._parser.should_keep_alive()
        answer = self._answer
        assert answer is not None
        answer._complete = True
        answer._inflate()


Connect = Callable[[Callable[[], asyncio.Protocol]], Awaitable[asyncio.Protocol]]


class Pool:
    """Kept-alive connections to one upstream, the idle ones last-in first-out (the warmest first)."""

    def __init__(self, authority: str, connect: Connect) -> None:
        self.loop = asyncio.get_running_loop()
        self.authority = authority
        self.idle: list[Connection] = []
        self._connect = connect
        self._open: set[Connection] = set()

    def message(
        self, method: str, target: str, headers: Sequence[tuple[str, str]], data: bytes | None
    ) -> bytes:
        """The request's bytes: its head, ``Host`` and framing the pool's own, then the body. Raises
        ``ValueError`` for a CR, LF or NUL in the target, a name or a value: it would end a line early
        (request smuggling)."""
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {self.authority}\r\n"]
        for name, value in headers:
            if name.lower() not in _OWN_FIELDS:
                lines.append(f"{name}: {value}\r\n")
        if data or method in _BODY_METHODS:
            lines.append(f"Content-Length: {len(data) if data else 0}\r\n")
        lines.append("\r\n")
        head = "".join(lines)
        # Every line written ends in CRLF, and the first element holds two: any other CR or LF came in.
        breaks = len(lines) + 1
        if head.count("\n") != breaks or head.count("\r") != breaks or "\0" in head:
            raise ValueError("a CR, LF or NUL in the request's target or a header field")
        encoded = head.encode("utf-8", "surrogateescape")
        return encoded + data if data else encoded

    async def send(self, message: bytes, deadline: float) -> PooledAnswer:
        """Send ``message`` on the warmest idle connection or a new one; returns once the answer's head
        arrived. Raises what ``connect`` raises (no connection: the request was not sent); ``TimeoutError``
        past ``deadline``; ``ConnectionError`` when the connection failed or broke HTTP/1.1 first."""
        connection = self._idle()
        if connection is None:
            connection = cast(Connection, await self._connect(lambda: Connection(self)))
            self._open.add(connection)
        answer = connection.send(message, deadline)
        try:
            await answer.head()
        except BaseException:
            # Failed, timed out, or cancelled while waiting: the answer may still come, for no one.
            connection.released(answer)
            raise
        return answer

    def _idle(self) -> Connection | None:
        """The warmest idle connection still open and idle for less than ``KEEPALIVE`` (older ones are
        closed)."""
        idle = self.idle
        while idle:
            connection = idle.pop()
            if connection.closed or connection.transport is None or connection.transport.is_closing():
                continue
            if connection.idle_since < self.loop.time() - KEEPALIVE:
                connection.abort()
                continue
            return connection
        return None

    def rest(self, connection: Connection) -> None:
        """``connection`` is idle from now; the oldest idle one is closed once idle for ``KEEPALIVE`` (one
        looked at per request: idle connections are never left open for long after the load that needed
        them)."""
        now = self.loop.time()
        connection.idle_since = now
        idle = self.idle
        if idle and idle[0].idle_since < now - KEEPALIVE:
            idle.pop(0).abort()
        idle.append(connection)

    def lost(self, connection: Connection) -> None:
        self._open.discard(connection)

    def close(self) -> None:
        """Close every connection, idle or busy."""
        for connection in list(self._open):
            connection.abort()
        self._open.clear()
        self.idle.clear()
