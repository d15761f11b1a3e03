"""Held GETs: the long-lived upstream GET streams, read straight off the socket through h11.

A session's standalone stream is an upstream GET held open for the session's life and mostly idle, and a
resumed upstream stream is a GET too. Held by aiohttp's client, such a response costs about 9.6 KiB (the
response, its stream reader and its deques, the request info, the connection and its parser); a held GET
here, one protocol object, an h11 connection and the transport, about 2.7 KiB (RSS per held stream,
``python -m bench.floor``). Requests with bodies, and the answers the proxy relays whole, stay on aiohttp's
pooled client.

HTTP/1.1, one request per connection (``Connection: close``): the connection ends with its stream. The
framing (chunked, Content-Length, read until close, 1xx heads before the final one) is h11's, which does no
I/O; this module moves bytes between h11 and the transport, and stops reading while more than
``HIGH_WATER`` bytes wait for the reader (the pump), so a slow store pushes back on the upstream. A body
the upstream compresses anyway is inflated at most ``HIGH_WATER`` bytes ahead of the reader too (the rest
waits compressed, reading paused), so a gzip bomb never expands in memory faster than it is read.

The body is asked for as a ``StreamReader`` of aiohttp's is (``content.readany()``, ``content.iter_any()``,
``release()``), so the pump and the relay read either kind of answer (``upstream.UpstreamAnswer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Final, cast

import h11
from multidict import CIMultiDict, CIMultiDictProxy

from mcpresume.core.headers import IDENTITY

# Bytes received and not yet taken by the reader before reading pauses (and TCP backpressure reaches the
# upstream): aiohttp's StreamReader pauses at twice its 64 KiB limit, the same bound.
HIGH_WATER: Final = 128 * 1024
# The largest response head accepted: 64 KiB, above h11's 16 KiB default because aiohttp's client (which
# the proxy's other requests go through) accepts header fields of 8190 bytes, and several of them.
MAX_HEAD: Final = 64 * 1024
_NO_HEADERS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())
# Content codings read anyway when an upstream compresses what it was asked to send as is (zlib's wbits:
# gzip's header, zlib's), as aiohttp's client decodes them.
_DECODERS: Final = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
DECODABLE: Final = frozenset({"identity", "gzip", "deflate"})


class NotHTTP11(ConnectionError):
    """The upstream's answer breaks HTTP/1.1 framing (h11 says how)."""


class UnreadableEncoding(NotHTTP11):
    """The upstream's answer is in a content encoding the proxy did not ask for and cannot decode."""


class HeldGet(asyncio.Protocol):
    """One upstream GET: the request is written on connect; ``head()`` waits for the response head, then
    ``readany()`` returns the body as it arrives (``b""`` at its end)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_compressed",
        "_conn",
        "_decoder",
        "_ended",
        "_error",
        "_head",
        "_paused",
        "_request",
        "_transport",
        "_waiter",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, host: str, target: str, headers: Sequence[tuple[str, str]]) -> None:
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
        self._transport: asyncio.Transport | None = None
        self._head: asyncio.Future[None] | None = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[bytes] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._complete = False  # h11 saw the body's end
        self._ended = False  # ... and the reader has been given all of it (inflated)
        self._decoder: zlib._Decompress | None = None  # the body came compressed anyway
        self._compressed = b""  # received, not yet inflated: the reader is HIGH_WATER bytes behind
        self._error: Exception | None = None
        self.status = 0
        self.reason = ""
        self.headers = _NO_HEADERS

    # -- what a reader sees ----------------------------------------------------------------------------------

    async def head(self) -> None:
        """Wait for the final response head; raises what ended the connection before it."""
        assert self._head is not None, "head() is awaited once"
        try:
            await self._head
        finally:
            self._head = None

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (as aiohttp's ``content_type``)."""
        value = self.headers.get("Content-Type", "application/octet-stream")
        return value.partition(";")[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def content(self) -> HeldGet:
        return self

    @property
    def inflates(self) -> bool:
        """The upstream compressed the body anyway: it is read decompressed (its head no longer says so)."""
        return self._decoder is not None

    def readany(self) -> asyncio.Future[bytes]:
        """What arrived since the last call, as a future (a parked reader holds no coroutine frame of ours);
        ``b""`` once the body is complete. Fails with ``ConnectionError`` when the connection failed before
        that (after what did arrive): reset or closed early (``ConnectionResetError``), or framing the
        upstream broke (``NotHTTP11``). Reading the body lets go of the head (``headers`` is empty from then
        on): a held stream lives for hours, and its head was read when it began."""
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("readany() while another read of this body is pending")
        self.headers = _NO_HEADERS
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if not self._settle(future):
            self._waiter = future
        return future

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    def release(self) -> None:
        """Close the connection (whether or not the body was read)."""
        head, self._head = self._head, None
        if head is not None and head.done() and not head.cancelled():
            head.exception()  # retrieved: whoever opened this gave up on it
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
                if self._decoder is None:
                    self._take(bytes(event.data))  # h11 hands out bytearray slices of its buffer
                else:
                    self._compressed += event.data  # inflated as the reader takes it (_inflate)
                    self._inflate()
            elif isinstance(event, h11.Response):
                self._begin(event)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self._complete = self.status != 0  # a close before any head is no end
                self._inflate()
                return
            elif not isinstance(event, h11.InformationalResponse):
                return  # NEED_DATA (or PAUSED, once the answer is complete)

    def _inflate(self) -> None:
        """Decompress what waits, until ``HIGH_WATER`` bytes wait for the reader (never more: a few KiB of a
        gzip bomb expand to GiB); the body ends for the reader once all of it is inflated."""
        decoder = self._decoder
        if decoder is not None and self._error is None:
            try:
                while self._compressed and self._buffered < HIGH_WATER:
                    data = decoder.decompress(self._compressed, HIGH_WATER - self._buffered)
                    self._compressed = decoder.unconsumed_tail
                    if not data:
                        break
                    self._take(data)
                if self._complete and not self._compressed:
                    self._take(decoder.flush())  # all input consumed: at most a match's few bytes
            except zlib.error as exc:
                self._broken(NotHTTP11(f"the upstream's compressed answer cannot be decoded: {exc}"))
                return
        self._ended = self._complete and not self._compressed

    def _broken(self, error: NotHTTP11) -> None:
        """The answer cannot be read on (even one h11 saw complete: its compressed tail is corrupt)."""
        self._compressed = b""
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        if self._transport is not None:
            self._transport.close()

    def _flow(self) -> None:
        """Pause reading while the reader is behind (``HIGH_WATER`` bytes, or input waiting to be inflated);
        resume once it caught up."""
        transport = self._transport
        if transport is None:
            return
        behind = self._buffered > HIGH_WATER or bool(self._compressed)
        if behind and not self._paused:
            self._paused = True
            transport.pause_reading()
        elif not behind and self._paused:
            self._paused = False
            transport.resume_reading()

    def _take(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)

    def _begin(self, response: h11.Response) -> None:
        self.status = response.status_code
        self.reason = response.reason.decode("latin-1")
        headers = CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
            for name, value in response.headers.raw_items()
        )
        encoding = headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in _DECODERS:
            # Asked for identity, compressed anyway: decoded here, so the head describes what is read.
            self._decoder = zlib.decompressobj(_DECODERS[encoding])
            headers.popall("Content-Encoding")
            headers.popall("Content-Length", None)
        elif encoding != "identity":
            raise UnreadableEncoding(
                f"the upstream answered in content encoding {encoding[:40]!r}, which the proxy did not ask "
                "for and cannot read"
            )
        self.headers = CIMultiDictProxy(headers)
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None and not self._complete:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)

    def _settle(self, future: asyncio.Future[bytes]) -> bool:
        """Give ``future`` what there is: data, the error, or the end (``b""``). False: nothing yet."""
        chunks = self._chunks
        if not chunks and self._compressed:
            self._inflate()  # the next HIGH_WATER bytes of a compressed body
        if chunks:
            future.set_result(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            chunks.clear()
            self._buffered = 0
            self._flow()
        elif self._error is not None:
            future.set_exception(self._error)
        elif self._ended:
            future.set_result(b"")
        else:
            return False
        return True

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and (waiter.done() or self._settle(waiter)):
            self._waiter = None  # settled now, or cancelled while it waited
