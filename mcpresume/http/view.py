"""Attachments: one client connection reading a stream of a session from a position.

An attachment is a view, and disposable. It loops: read what follows its position from the store, write
it in one piece, move the position to the last seq written, and wait for news when there is none. Because
it only ever sends events with a seq above its position and moves the position forward, it never sends an
event twice or out of order (invariant #1, #2); because it reads by position rather than by subscription,
the hand-off from history to live events has no gap to fall into (#6).

It stops when the stream is complete (every event sent and the stream ended: a POST stream ends with its
JSON-RPC response), when the client goes away or stalls past ``stall_timeout`` (the events stay in the
window for a re-attach), when its position falls out of the window (it closes; the client's re-attach
then gets an honest 409, never a silent gap), or when the drain ends it (``drain.View``: a flag the view
checks each time it would wait, and the drain wakes that wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, assert_never

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter

from mcpresume.core.errors import StoreUnavailable, TooManyAttachments
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, SESSION_HEADER
from mcpresume.core.resume import REATTACH
from mcpresume.http.context import ARRIVED, DID, Action, ProxyContext
from mcpresume.process.drain import View, end_for_drain
from mcpresume.process.local import LocalSessions
from mcpresume.process.logs import log_id
from mcpresume.process.metrics import Metrics
from mcpresume.store import Streams

log = logging.getLogger("mcpresume.proxy")

# How long an attachment waits for news before writing an SSE comment. The comment keeps idle streams
# alive through load balancers (a 60 s idle timeout is common) and shows a vanished client early.
HEARTBEAT_SECONDS = 15.0
HEARTBEAT = b": keepalive\n\n"


class Stalled(Exception):
    """The client did not take a write within ``stall_timeout``."""


class ViewEnd(enum.Enum):
    """Why a view ended. The value is the word its log line says."""

    COMPLETE = "complete"  # every event of its streams sent, and they ended
    SESSION_GONE = "session_gone"  # the session ended (DELETE, reaped, id re-issued) meanwhile
    FELL_BEHIND_WINDOW = "fell_behind_window"  # an event after its position was evicted
    STALLED = "stalled"  # the client took no write within stall_timeout
    CLIENT_GONE = "client_gone"  # the client's connection closed
    DRAINING = "draining"  # a drain ended it
    STORE_UNAVAILABLE = "store_unavailable"  # the shared store did not answer: its client retries


class Finish(enum.Enum):
    """How ``serve_view`` ends the response of a view that ended."""

    EOF = "eof"  # end the body: the stream is complete
    DRAIN = "drain"  # end the body within DRAIN_GRACE, else cut (``end_for_drain``): its client re-attaches
    CUT = "cut"  # abort the connection: a stalled client's buffer is full, nothing more reaches it
    LEAVE = "leave"  # nothing to end: aiohttp finishes (or finds closed) the response it is handed back


@dataclass(frozen=True, slots=True)
class ViewEnding:
    finish: Finish
    log: bool = True  # one INFO line: a view that ends before its stream did is worth a line
    detach: bool = False  # counted in mcpresume_backpressure_detaches_total


# What ends the response of a view, by why the view ended (tests/test_follow.py checks every ViewEnd has a
# row). A stalled client is detached: its events stay in the window for its re-attach, and the retry hint
# it needs came with the stream's first event.
VIEW_ENDINGS: Final[Mapping[ViewEnd, ViewEnding]] = {
    ViewEnd.COMPLETE: ViewEnding(Finish.EOF, log=False),
    ViewEnd.SESSION_GONE: ViewEnding(Finish.LEAVE),
    ViewEnd.FELL_BEHIND_WINDOW: ViewEnding(Finish.LEAVE),
    ViewEnd.STALLED: ViewEnding(Finish.CUT, detach=True),
    ViewEnd.CLIENT_GONE: ViewEnding(Finish.LEAVE),
    ViewEnd.DRAINING: ViewEnding(Finish.DRAIN),
    # Ended cleanly (not cut): its client re-attaches with its cursor, on this replica or another, and the
    # window (in the store) still holds what it has not read.
    ViewEnd.STORE_UNAVAILABLE: ViewEnding(Finish.DRAIN),
}


@dataclass(slots=True)
class AttachOutcome:
    sent: int = 0  # events written
    replayed: int = 0  # of which were already in the window when the attachment started
    reason: ViewEnd = ViewEnd.COMPLETE

    @property
    def complete(self) -> bool:
        return self.reason is ViewEnd.COMPLETE


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """What one client view serves: the events of ``streams`` after seq ``after``, under these response
    ``headers``, after ``preface`` (a resume's retry hint, say). ``reader``: a reader token already
    registered at ``after``; ``replay_through``: the newest seq when a re-attach was decided (the events up
    to it are counted as replayed)."""

    streams: Sequence[int]
    after: int
    headers: Sequence[tuple[str, str]]
    preface: bytes = b""
    replay_through: int = 0
    reader: int | None = None
    standalone: bool = False  # it follows a standalone stream: may never complete, a drain ends it first


# Bytes aiohttp may add around a write (a chunk-size line and CRLF), when checking that a write fits.
_FRAMING = 32
_CRLF: Final = b"\r\n"
_LAST_CRLF: Final = b"\r\n0\r\n\r\n"  # a chunk's CRLF, then the last (empty) chunk: the body's end


@dataclass(slots=True)
class ClientWriter:
    """Writes to one client's response, bounded: a write the client does not take within ``stall_timeout``
    raises ``Stalled``. What a client that does not read makes the proxy hold is the transport buffer's
    high-water mark plus one write (a read is at most ``session.READ_MAX_BYTES``), not every write the view
    was handed.

    The hot path (a chunked response of aiohttp's server, no compression: every SSE response the proxy
    makes): the write goes to the transport at once, framed as one HTTP/1.1 chunk, and only if the
    transport's buffer is then over its high-water mark (the protocol is paused) does it wait, under the
    time-out, for the buffer to drain under its low-water mark (``drainer.drain()``). The transport is
    only written to while its buffer is at most the high-water mark, so it holds at most that plus one
    write (a read: at most ``session.READ_MAX_BYTES``, through the Redis store ``store.redis.READ_BYTES``).
    A write the client takes at once arms no time-out (an ``asyncio.timeout`` costs ~4 us) and skips
    aiohttp's ``write``, which on Python before 3.12.9 joins the chunk's size line, the data and the CRLF
    into one more copy of every byte; on uvloop the three parts go out in one ``writev``.

    Any other write (no ``drainer``, another response): when the transport's buffer is at or under its
    low-water mark and stays under the high-water mark after the write, it runs without a time-out;
    otherwise it first waits for the buffer to drain under its low-water mark, then writes, under the
    time-out (aiohttp writes to the transport first and waits after)."""

    response: web.StreamResponse
    transport: asyncio.Transport | None  # the client connection (request.transport)
    stall_timeout: float
    drainer: AbstractStreamWriter | None = None  # request.writer: drain() waits while the buffer is full

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """Write ``data``; ``last``: nothing follows it, so on the hot path the body's end goes out in the
        same write (the response's ``write_eof`` then has nothing left to send)."""
        transport, writer = self.transport, self.drainer
        if (
            type(writer) is StreamWriter
            and transport is not None
            and writer.chunked
            and writer.length is None
            and writer.on_body_write is None
            and not self.response.compression
        ):
            await self._write_chunk(writer, transport, data, last)
            return
        if transport is not None and not transport.is_closing():
            buffered = transport.get_write_buffer_size()
            low, high = transport.get_write_buffer_limits()
            if buffered <= low and buffered + len(data) + _FRAMING < high:
                await self.response.write(data)
                return
        try:
            async with asyncio.timeout(self.stall_timeout):
                if writer is not None:
                    await writer.drain()  # returns at once unless the buffer is over its high water
                await self.response.write(data)
        except TimeoutError:
            raise Stalled from None

    def send_head(self) -> None:
        """Send the response's head if aiohttp still holds it (a view's is held for its first write)."""
        if isinstance(self.drainer, StreamWriter):
            self.drainer.send_headers()

    async def _write_chunk(
        self, writer: StreamWriter, transport: asyncio.Transport, data: bytes, last: bool = False
    ) -> None:
        """``data`` as one chunk of the response's body, straight to the transport (the class docstring):
        with the head aiohttp held back at prepare(), if it is not sent yet, and (``last``) the body's end,
        so a short answer is one write."""
        if not data:
            return  # an empty chunk would end the body (RFC 9112 7.1)
        if transport.is_closing():
            raise ConnectionResetError("the client connection is closing")
        parts = [b"%x\r\n" % len(data), data, _LAST_CRLF if last else _CRLF]
        held = getattr(writer, "_headers_buf", None)
        if held and not getattr(writer, "_headers_written", True):
            writer._headers_written = True  # as aiohttp's own send_headers() marks it, in the same write
            writer._headers_buf = None
            parts.insert(0, held)
            writer.output_size += len(held)  # as aiohttp counts a head it sends (the access log subtracts it)
        else:
            writer.send_headers()  # (aiohttp's without a held head: sent at prepare() already)
        writer.output_size += len(data)  # what aiohttp counts as the body sent (its access log)
        if last:
            writer._eof = True  # the end is in this write: aiohttp's write_eof sends nothing more
        if type(transport).__module__.startswith("uvloop"):  # its writelines sends the parts: one writev
            transport.writelines(parts)
        else:  # asyncio's writelines joins them anyway before 3.12 (and is not safe on some later ones)
            transport.write(b"".join(parts))
        if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            try:
                async with asyncio.timeout(self.stall_timeout):
                    await writer.drain()
            except TimeoutError:
                raise Stalled from None


async def follow(
    writer: ClientWriter,
    store: Streams,
    local: LocalSessions,
    session_id: str,
    streams: Sequence[int],
    after: int,
    *,
    replay_through: int,
    reader: int | None = None,
    wait: bool = True,
    view: View | None = None,
    caught_up: Callable[[], None] | None = None,
) -> AttachOutcome:
    """Send the events of ``streams`` after seq ``after`` until the streams complete or the client leaves.

    ``reader``: a reader token already registered at ``after`` (a new stream registers its first reader
    before its pump starts, so not even the first burst can overrun it); registered here otherwise.
    ``wait=False``, or ``view`` ending (the drain ended it): stop (``ViewEnd.DRAINING``) when everything
    retained is sent instead of waiting for more. The drain wakes the wait when it ends the view.
    ``caught_up``: called once, when the first events are written, or when there are none to write yet.
    """
    outcome = AttachOutcome()
    position = after
    if reader is None:
        reader = local.add_reader(session_id, streams, position)
    try:
        while True:
            result = await store.read(session_id, streams, position)
            if result is None:
                outcome.reason = ViewEnd.SESSION_GONE
                return outcome
            if result.gap:
                outcome.reason = ViewEnd.FELL_BEHIND_WINDOW
                return outcome
            if result.segments:
                # The last events of the streams: the body's end goes in the same write (COMPLETE is
                # answered with write_eof, which then has nothing to send).
                await writer.write(result.body(), last=result.complete)
                if caught_up is not None:
                    caught_up()
                    caught_up = None
                position = result.last_seq
                local.move_reader(session_id, reader, position)
                await store.mark_delivered(session_id, streams, position)
                outcome.sent += result.count
                if replay_through > after:
                    outcome.replayed += result.count_through(replay_through)
                if result.complete:  # the last events of an ended stream: done (don't read a forgotten one)
                    return outcome  # reason: COMPLETE
                if result.more:
                    continue
                # No read to find nothing: the wait returns at once if the session changed since this read
                # (during the write, say), else parks until it does.
            elif result.complete:
                return outcome  # reason: COMPLETE
            elif caught_up is not None:  # nothing after the position: caught up at once
                caught_up()
                caught_up = None
            if not wait or (view is not None and view.ending):
                outcome.reason = ViewEnd.DRAINING
                return outcome
            version = result.version
            del result  # a parked view keeps no events alive: the window may evict them meanwhile
            writer.send_head()  # a client waiting for events has its response's head meanwhile
            if not await local.news.wait(session_id, version, HEARTBEAT_SECONDS):
                await writer.write(HEARTBEAT)
    except Stalled:
        outcome.reason = ViewEnd.STALLED
        return outcome
    except asyncio.CancelledError:
        outcome.reason = ViewEnd.CLIENT_GONE
        raise
    except ConnectionError:
        outcome.reason = ViewEnd.CLIENT_GONE
        return outcome
    except StoreUnavailable:
        outcome.reason = ViewEnd.STORE_UNAVAILABLE
        return outcome
    finally:
        local.remove_reader(session_id, reader)


async def reserve_view(
    ctx: ProxyContext,
    request: web.Request,
    session_id: str,
    request_id: str | int | None = None,
    *,
    touched: bool = False,
) -> web.Response | None:
    """Count one client view of the session against max_attached_per_session; the 429 answer if full.
    The one place the limit is checked: a view counted here is uncounted with ``release_view``.
    ``touched``: the session's activity is recorded already (the request's claim, ``store.claim(now=)``)."""
    limit = ctx.settings.max_attached_per_session
    admitted = ctx.local.attach(session_id, limit)
    if resuming(request):  # the re-attach's outcome is known now
        ctx.metrics.resumptions.labels(REATTACH if admitted else TooManyAttachments.reason).inc()
        if admitted:
            request[DID] = Action.REATTACHED
    if admitted:
        if not touched:
            await ctx.store.touch((session_id,), ctx.clock())
        return None
    error = TooManyAttachments(f"the session already has {limit} client views open", limit=limit)
    return ctx.reject(request, error, request_id)


def _resumed(metrics: Metrics, arrived: float) -> None:
    metrics.resume_latency.observe(asyncio.get_running_loop().time() - arrived)


def resuming(request: web.Request) -> bool:
    """Whether the request is a re-attach the resume decision accepted: it has a session and a cursor, and
    a view is being counted for it. Every plan decides a cursor before it counts a view (``core.get.plan_get``
    and ``core.post.plan_post`` ask ``Need.RESUME`` first) and answers a rejection at once."""
    headers = request.headers
    return LAST_EVENT_ID_HEADER in headers and SESSION_HEADER in headers


async def attach_view(
    ctx: ProxyContext, request: web.Request, session_id: str, plan: ViewPlan
) -> web.StreamResponse:
    """Serve a client view, counted against max_attached_per_session here. A caller that counted it
    already (before forwarding the request the view is for) calls ``serve_view`` itself."""
    refused = await reserve_view(ctx, request, session_id)
    if refused is not None:
        if plan.reader is not None:
            ctx.local.remove_reader(session_id, plan.reader)
        return refused
    try:
        return await serve_view(ctx, request, session_id, plan)
    finally:
        await release_view(ctx, session_id)


async def release_view(ctx: ProxyContext, session_id: str) -> None:
    """Uncount a view ``reserve_view`` counted: the client left, which is activity too."""
    ctx.local.detach(session_id)
    await ctx.store.touch((session_id,), ctx.clock())


class HeldHeadResponse(web.StreamResponse):
    """A response whose head is held at ``prepare`` and goes out with the first write (a short answer's
    head, body and end in one write). A view's: sent before it waits for events (``follow``); a relay's:
    for a body of known length only (``forward.relay``)."""

    _send_headers_immediately = False


async def serve_view(
    ctx: ProxyContext, request: web.Request, session_id: str, plan: ViewPlan
) -> web.StreamResponse:
    """The SSE response of one view: headers, the preface, then ``follow`` until the stream completes."""
    response = HeldHeadResponse(status=200)
    for name, value in plan.headers:
        response.headers.add(name, value)
    response.headers[SESSION_HEADER] = session_id
    writer = ClientWriter(response, request.transport, ctx.settings.stall_timeout, request.writer)
    try:
        await response.prepare(request)
        if plan.preface:
            await writer.write(plan.preface)
    except (ConnectionError, Stalled) as exc:
        if plan.reader is not None:
            ctx.local.remove_reader(session_id, plan.reader)
        log.info(
            "session %s: client left before the stream started (%s)", log_id(session_id), type(exc).__name__
        )
        return response
    metrics = ctx.metrics
    # A re-attach's latency: from its request to the moment it sent what the window holds after the cursor.
    arrived: float | None = request.get(ARRIVED) if resuming(request) else None
    caught_up = None if arrived is None else functools.partial(_resumed, metrics, arrived)
    metrics.open_streams.inc()
    # Opened after the drain ended such views, it is ending from the start: it sends what is there now,
    # then ends as they did.
    try:
        with ctx.drain.view(plan.standalone, ctx.local.news, session_id) as view:
            outcome = await follow(
                writer,
                ctx.store,
                ctx.local,
                session_id,
                plan.streams,
                plan.after,
                replay_through=plan.replay_through,
                reader=plan.reader,
                view=view,
                caught_up=caught_up,
            )
    finally:
        metrics.open_streams.dec()
        ctx.pumps.left(session_id, plan.streams, ctx.clock())  # a stream nobody reads may be given up
    metrics.replayed_events.inc(outcome.replayed)
    ending = VIEW_ENDINGS[outcome.reason]
    if ending.detach:
        metrics.backpressure_detaches.inc()
    if ending.log:
        log.info(
            "session %s: client view closed: %s after %d events",
            log_id(session_id),
            outcome.reason.value,
            outcome.sent,
        )
    match ending.finish:
        case Finish.EOF:
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        case Finish.DRAIN:
            await end_for_drain(request, response)
        case Finish.CUT:
            # Abort, so aiohttp does not wait on the client to take the rest of the body.
            if request.transport is not None:
                request.transport.abort()
        case Finish.LEAVE:
            pass
        case _:  # pragma: no cover
            assert_never(ending.finish)
    return response
