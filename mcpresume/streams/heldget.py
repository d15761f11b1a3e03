"""Held GETs: the long-lived upstream GET streams, read straight off the socket through h11.

A session's standalone stream is an upstream GET held open for the session's life and mostly idle, and a
resumed upstream stream is a GET too. Held by aiohttp's client, such a response costs about 9.6 KiB (the
response, its stream reader and its deques, the request info, the connection and its parser); a held GET
here, one protocol object, an h11 connection and the transport, about 2.7 KiB (RSS per held stream,
``python -m bench.floor``). The requests whose answers the proxy reads go on its pool
(``streams/pool.py``), those it relays as they are on aiohttp's client.

HTTP/1.1, one request per connection (``Connection: close``): the connection ends with its stream. The
framing (chunked, Content-Length, read until close, 1xx heads before the final one) is h11's, which does no
I/O; this module moves bytes between h11 and the transport; what a reader sees of the answer (its body as it
arrives, flow control, a body compressed anyway inflated as it is read) is ``streams/answer.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import cast

import h11
from multidict import CIMultiDict

from mcpresume.core.headers import IDENTITY
from mcpresume.streams.answer import MAX_HEAD, NO_HEADERS, NotHTTP11, ReadAnswer


class HeldGet(ReadAnswer, asyncio.Protocol):
    """One upstream GET: the request is written on connect; ``head()`` waits for the response head, then
    ``readany()`` returns the body as it arrives (``b""`` at its end)."""

    __slots__ = ("_conn", "_request")

    def __init__(self, host: str, target: str, headers: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        fields = [("Host", host)]
        fields += [(n, v) for n, v in headers if n.lower() not in ("accept-encoding", "connection", "host")]
        fields += [IDENTITY, ("Connection", "close")]
        # Header values as they came to the proxy (aiohttp decodes them as UTF-8, surrogates kept); h11
        # refuses CR, LF and NUL in them (LocalProtocolError).
        request = h11.Request(
            method="GET",
            target=target.encode("utf-8", "surrogateescape"),
            headers=[(n.encode("ascii"), v.encode("utf-8", "surrogateescape")) for n, v in fields],
        )
        self._request: bytes | None = b"".join(
            self._conn.send(event) or b"" for event in (request, h11.EndOfMessage())
        )

    # -- what a reader sees ----------------------------------------------------------------------------------

    @property
    def content(self) -> HeldGet:
        return self

    def readany(self) -> asyncio.Future[bytes]:
        """``ReadAnswer.readany``; reading the body lets go of the head (``headers`` is empty from then on): a
        held stream lives for hours, and its head was read when it began."""
        self.headers = NO_HEADERS
        return super().readany()

    def release(self) -> None:
        """Close the connection (whether or not the body was read)."""
        self._give_up_head()
        if self._transport is not None:
            self._transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance check).
        self._transport = cast(asyncio.Transport, transport)
        if self._request is not None:
            self._transport.write(self._request)
            self._request = None

    def data_received(self, data: bytes) -> None:
        try:
            self._receive(data)
        except (h11.RemoteProtocolError, NotHTTP11) as exc:
            if isinstance(exc, h11.RemoteProtocolError):
                exc = NotHTTP11(f"the upstream's answer is not valid HTTP/1.1: {exc}")
            self._broken(exc)
        self._flow()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close: connection_lost tells h11

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if exc is not None:
            self._fail(ConnectionResetError(f"the upstream connection failed: {type(exc).__name__}: {exc}"))
        elif not self._complete and self._error is None:
            with contextlib.suppress(h11.RemoteProtocolError, NotHTTP11):
                self._receive(b"")  # h11 decides: the end of a read-until-close body, or a cut one
        if self._head is not None and not self._head.done():
            self._head.set_exception(
                ConnectionResetError("the upstream closed the connection before its answer")
            )
        if not self._complete:
            self._fail(
                ConnectionResetError("the upstream closed the connection before the end of its answer")
            )
        self._wake()

    # -- h11 -------------------------------------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        """Feed h11 and take its events. Raises ``h11.RemoteProtocolError``."""
        conn = self._conn
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                self._body(bytes(event.data))  # h11 hands out bytearray slices of its buffer
            elif isinstance(event, h11.Response):
                headers = CIMultiDict(
                    (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
                    for name, value in event.headers.raw_items()
                )
                self._begin(event.status_code, event.reason.decode("latin-1"), headers)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self._complete = self.status != 0  # a close before any head is no end
                self._inflate()
                return
            elif not isinstance(event, h11.InformationalResponse):
                return  # NEED_DATA (or PAUSED, once the answer is complete)
