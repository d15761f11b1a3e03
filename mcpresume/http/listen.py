"""A bridged session's standalone GET: the upstream's ``subscriptions/listen`` stream, re-opened when the
session's resource subscriptions change (issue 34; ``core.bridge.listen_filter``, ``listen_event``).

A 2026-07-28 listen stream's filter is fixed when it is opened, so a ``resources/subscribe`` or
``unsubscribe`` of the session while its GET is open opens another listen upstream with the new set
(``ListenAnswer.reopen``) and, once the upstream acknowledged it (its first event: the server is listening
from then on), hands the client's stream over to it and closes the old one. The client's GET goes on as the
same response: no acknowledgement, no listen result, no end reaches it. The handover is at the new stream's
acknowledgement: from then on only the new stream's events are passed. An update published before the
upstream subscribed the new listen comes by the old one only, after it by both: one the proxy read off the
old stream before the acknowledgement is passed, and again by the new one if published after the
subscription; one still in flight on the old stream at the handover is not passed (the events carry no id
to tell them apart: the window is the instant around the acknowledgement, docs/known-limits.md).

What ``relay`` reads (``UpstreamAnswer``): the events re-framed without the upstream's ids (the stream is
not resumed: a client that loses it opens another GET, as with any listen stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import aiohttp

from mcpresume.core.bridge import listen_event
from mcpresume.core.errors import ProxyError
from mcpresume.core.sse import SSEParser, frame_body
from mcpresume.streams.pool import PooledAnswer

log = logging.getLogger("mcpresume.bridge")

SSE: Final = "text/event-stream"
# How long a re-opened listen's acknowledgement is awaited before the old stream is kept instead.
ACK_WAIT: Final = 30.0

Open = Callable[[Mapping[str, Any]], Awaitable[PooledAnswer]]


class GeneratedBody:
    """An answer whose body an async generator makes (``_body``), read as ``relay`` and the pump read an
    upstream answer's (``content.readany``, ``content.iter_any``)."""

    _body: AsyncIterator[bytes]

    @property
    def content(self) -> GeneratedBody:
        return self

    async def readany(self) -> bytes:
        """What came since the last read; b"" at the end."""
        return await anext(self._body, b"")

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk


class ListenAnswer(GeneratedBody):
    """The client's standalone stream over one upstream listen at a time (the module docstring)."""

    status: Final = 200
    reason: Final = "OK"
    content_type: Final = SSE
    content_length: Final = None

    def __init__(
        self,
        first: PooledAnswer,
        notifications: Mapping[str, Any],
        open_: Open,
        limit: int,
        on_release: Callable[[ListenAnswer], None],
    ) -> None:
        self.headers = first.headers
        self.notifications = dict(notifications)  # the filter of the listen being read
        self._open = open_
        self._limit = limit
        self._on_release = on_release
        self._current = first
        self._next: tuple[PooledAnswer, SSEParser, list[bytes]] | None = None
        self._opening: PooledAnswer | None = None
        self._handover = asyncio.Event()
        self._lock = asyncio.Lock()
        self._released = False
        self._body = self._events()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._on_release(self)
        self._current.release()
        for response in (self._opening, self._next[0] if self._next is not None else None):
            if response is not None:
                response.release()
        self._next = None

    async def reopen(self, notifications: Mapping[str, Any]) -> bool:
        """The stream again upstream with ``notifications``; True once the client's stream reads the new
        listen (acknowledged), or when it already had that filter; False when it could not be opened (the
        old one read on)."""
        async with self._lock:
            if self._released:
                return False
            if dict(notifications) == self.notifications:
                return True
            try:
                self._opening = await self._open(notifications)
                async with asyncio.timeout(ACK_WAIT):  # not wait_for: on 3.11 it can lose a cancellation
                    parser, passed = await self._acknowledged(self._opening)
            except (ProxyError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                log.warning(
                    "the listen stream could not be re-opened upstream: %s", error or type(error).__name__
                )
                if self._opening is not None:
                    self._opening.release()
                    self._opening = None
                return False
            if self._released:
                self._opening.release()
                self._opening = None
                return False
            self._next = (self._opening, parser, passed)
            self._opening = None
            self.notifications = dict(notifications)
            self._handover.set()
            return True

    async def _acknowledged(self, answer: PooledAnswer) -> tuple[SSEParser, list[bytes]]:
        """Read ``answer`` up to its acknowledgement: its parser and what came after it in the same chunk."""
        if answer.status != 200 or answer.content_type != SSE:
            raise ValueError(f"the upstream answered it with HTTP {answer.status}")
        parser = SSEParser(self._limit)
        while chunk := await answer.content.readany():
            acked, passed = False, []
            for event in parser.feed(chunk):
                if not event.data:
                    continue
                passes, ack = listen_event(event.data)
                if acked and passes:
                    passed.append(frame_body(event.data, event.event))
                acked = acked or ack
            if acked:
                return parser, passed
        raise ValueError("it ended before its acknowledgement")

    async def _events(self) -> AsyncIterator[bytes]:
        parser = SSEParser(self._limit)
        wake = asyncio.ensure_future(self._handover.wait())
        read: asyncio.Future[bytes] | None = None
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(self._current.content.readany())
                await asyncio.wait((read, wake), return_when=asyncio.FIRST_COMPLETED)
                if read.done():
                    chunk = read.result()
                    read = None
                    if not chunk:
                        return  # the upstream ended the listen: the client's stream ends
                    if passed := self._passed(parser, chunk):
                        yield passed
                    continue
                if self._next is not None:  # the handover: the new listen from here on
                    read.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
                        await read
                    read = None
                    old = self._current
                    self._current, parser, pending = self._next
                    self._next = None
                    old.release()
                    if pending:
                        yield b"".join(pending)
                self._handover.clear()
                wake = asyncio.ensure_future(self._handover.wait())
        finally:
            wake.cancel()
            if read is not None:
                read.cancel()

    @staticmethod
    def _passed(parser: SSEParser, chunk: bytes) -> bytes:
        passed = []
        for event in parser.feed(chunk):
            if event.data and listen_event(event.data)[0]:
                passed.append(frame_body(event.data, event.event))
        return b"".join(passed)
