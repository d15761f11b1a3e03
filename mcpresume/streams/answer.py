"""An upstream answer read off the socket as it arrives: what a held GET (``streams/heldget.py``, h11) and a
pooled request (``streams/pool.py``, llhttp) share once their parser found the head and the body's pieces.

The body is asked for as a ``StreamReader`` of aiohttp's is (``content.readany()``, ``content.iter_any()``,
``release()``), so the pump and the relay read any kind of answer (``upstream.UpstreamAnswer``). Reading stops
while more than ``HIGH_WATER`` bytes wait for the reader (the pump), so a slow store pushes back on the
upstream. A body the upstream compresses though it was asked for identity is inflated at most ``HIGH_WATER``
bytes ahead of the reader too (the rest waits compressed, reading paused), so a gzip bomb never expands in
memory faster than it is read.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

# Bytes received and not yet taken by the reader before reading pauses (and TCP backpressure reaches the
# upstream): aiohttp's StreamReader pauses at twice its 64 KiB limit, the same bound.
HIGH_WATER: Final = 128 * 1024
# The largest response head accepted: 64 KiB, above h11's 16 KiB default because aiohttp's client (which
# the proxy's passed-through requests go through) accepts header fields of 8190 bytes, and several of them.
MAX_HEAD: Final = 64 * 1024
NO_HEADERS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())
# Content codings read anyway when an upstream compresses what it was asked to send as is (zlib's wbits:
# gzip's header, zlib's), as aiohttp's client decodes them.
_DECODERS: Final = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class NotHTTP11(ConnectionError):
    """The upstream's answer breaks HTTP/1.1 framing (the parser says how)."""


class UnreadableEncoding(NotHTTP11):
    """The upstream's answer is in a content encoding the proxy did not ask for and cannot decode."""

    def __init__(self, encoding: str) -> None:
        super().__init__(
            f"the upstream answered in content encoding {encoding[:40]!r}, which the proxy did not ask for "
            "and cannot read"
        )
        self.encoding = encoding


class ReadAnswer:
    """One answer: ``head()`` waits for its head, then ``readany()`` returns the body as it arrives (``b""``
    at its end). The parser's side calls ``_begin`` with the head, ``_body`` with each piece of the body,
    sets ``_complete`` at its end and ``_fail``s it when the connection fails first; ``_flow`` and ``_wake``
    after each batch of bytes received."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_compressed",
        "_decoder",
        "_ended",
        "_error",
        "_head",
        "_paused",
        "_transport",
        "_waiter",
        "headers",
        "reason",
        "status",
    )

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._head: asyncio.Future[None] | None = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[bytes] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._complete = False  # the parser saw the body's end
        self._ended = False  # ... and the reader has been given all of it (inflated)
        self._decoder: zlib._Decompress | None = None  # the body came compressed anyway
        self._compressed = b""  # received, not yet inflated: the reader is HIGH_WATER bytes behind
        self._error: Exception | None = None
        self.status = 0
        self.reason = ""
        self.headers = NO_HEADERS

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
    def content(self) -> ReadAnswer:
        return self

    @property
    def inflates(self) -> bool:
        """The upstream compressed the body anyway: it is read decompressed (its head no longer says so)."""
        return self._decoder is not None

    @property
    def arrived(self) -> bool:
        """The whole body arrived (and none of it failed): ``whole()`` takes it."""
        return self._ended and self._error is None

    def whole(self) -> bytes | None:
        """The body, when all of it arrived already (taken off the answer: reads return ``b""`` then);
        else None."""
        if not self.arrived:
            return None
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return body

    def readany(self) -> asyncio.Future[bytes]:
        """What arrived since the last call, as a future (a parked reader holds no coroutine frame of ours);
        ``b""`` once the body is complete. Fails with ``ConnectionError`` when the connection failed before
        that (after what did arrive): reset or closed early (``ConnectionResetError``), or framing the
        upstream broke (``NotHTTP11``)."""
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("readany() while another read of this body is pending")
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if not self._settle(future):
            self._waiter = future
        return future

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    async def read(self, n: int = -1) -> bytes:
        """The whole body, or its first ``n`` bytes when ``n`` is not negative (the rest left unread)."""
        chunks: list[bytes] = []
        size = 0
        while (n < 0 or size < n) and (chunk := await self.readany()):
            chunks.append(chunk)
            size += len(chunk)
        body = b"".join(chunks)
        return body if n < 0 else body[:n]

    def _give_up_head(self) -> None:
        """Drop the head's future, its failure retrieved: whoever asked for this answer gave up on it."""
        head, self._head = self._head, None
        if head is not None and head.done() and not head.cancelled():
            head.exception()

    # -- the parser's side -----------------------------------------------------------------------------------

    def _begin(self, status: int, reason: str, headers: CIMultiDict[str]) -> None:
        """The final head arrived. Raises ``UnreadableEncoding`` for a body in an encoding not decodable."""
        self.status = status
        self.reason = reason
        encoding = headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in _DECODERS:
            # Asked for identity, compressed anyway: decoded here, so the head describes what is read.
            self._decoder = zlib.decompressobj(_DECODERS[encoding])
            headers.popall("Content-Encoding")
            headers.popall("Content-Length", None)
        elif encoding != "identity":
            raise UnreadableEncoding(encoding)
        self.headers = CIMultiDictProxy(headers)
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def _body(self, data: bytes) -> None:
        if self._decoder is None:
            self._take(data)
        else:
            self._compressed += data  # inflated as the reader takes it (_inflate)
            self._inflate()

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
        """The answer cannot be read on (even one the parser saw complete: its compressed tail is corrupt)."""
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
