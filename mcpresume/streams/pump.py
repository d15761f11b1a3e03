"""Pumps: one task per upstream SSE stream, appending its events to the session's window (but for a POST
answer that arrived whole with its head, appended and ended at once in the forwarding task: ``Pump.at_once``).

A pump's life is tied to the upstream stream, not to a client: a client that drops does not stop it
(spec, handshake era: "disconnection SHOULD NOT be interpreted as the client cancelling its request"), so
the response reaches the window and a re-attaching client gets it. Two things end it before the upstream
does, each only while no client view reads the stream (``Abandon``; the upstream connection is closed, as
a client leaving would close it): the client cancelled every request the stream waits for
(``notifications/cancelled``, which the spec says is not answered: an upstream may keep such a stream open
until its client leaves) and ``cancel_grace`` passed, the stream then ending without an answer and its
request ids refused from then on (``request_cancelled``); or neither a view nor an upstream event came for
``session_ttl`` (``Pumps.stop_unattended``, each housekeeping round), its requests then answered with an
error: no stream without a client and without traffic keeps its session past ``session_ttl``.

The upstream's connection is as ephemeral as the client's. When it ends before the stream is complete (a
2025-11-25 server closing on purpose to make clients poll, SEP-1699, or a dropped connection) and the
upstream had sent event ids, the pump resumes it itself: GET + ``Last-Event-ID: <last upstream id>`` after
the upstream's ``retry:`` (else ``retry_ms``), backing off, giving up after ``upstream_resume_attempts``
attempts without progress. Upstream replays are deduplicated by upstream id. The client sees one continuous
stream, whatever happened upstream. A resume speaks for the client with the newest credentials the upstream
accepted in the session (``Pumps.refresh_credentials``: a request that presented them), else those of the
request that opened the stream; a resume refused 401 or 403 waits, ``credential_wait`` at most, for a
client of the session to bring fresh ones, and is retried with them at once.

When a POST stream cannot be completed (no ids to resume from, the upstream refuses, attempts exhausted, an
event too large), the pump completes it with a synthesized JSON-RPC error for each pending request id, so no
client waits forever for an answer that cannot come.

What the events mean (what to append, which requests they settle, which are replays, whether to resume and
when) is decided without I/O by ``mcpresume.core.pump.UpstreamEvents``; a ``Pump`` reads, appends,
waits for room, reconnects and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import aiohttp

from mcpresume.core.errors import BadRequest, EventTooLarge, ProxyError, StoreUnavailable, UpstreamStreamLost
from mcpresume.core.flow import Appended, Guard, may_pass
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, SESSION_HEADER
from mcpresume.core.pump import (
    RESUMABLE_ENDS,
    Abandon,
    Batch,
    End,
    UpstreamEvents,
    refuses_resume,
    resume_delay,
    unattended,
    wants_credentials,
)
from mcpresume.core.session import NewEvent, PumpRecord
from mcpresume.core.sse import SSEParser, SSERun
from mcpresume.process.drain import HAND_OVER
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.store import Fenced, Streams
from mcpresume.streams.pool import PooledAnswer
from mcpresume.streams.upstream import Upstream, UpstreamAnswer

log = logging.getLogger("mcpresume.pump")
T = TypeVar("T")

# Events appended per store call, at most (and never more than the window's events, nor, for large events,
# much more than half its bytes: ``Pump._append``). An upstream read can hold hundreds of small events;
# appending them in slices lets a pump wait for a reading client between slices instead of evicting under
# it. A slice of a whole window, not half of one: a store call costs about 20 us whatever it holds, and at
# full speed a reader takes a window per write, so half-window slices made two calls where one does (one
# stream of 256 B events: 8-12% of the proxy's CPU per event, bench.ab). The byte bound keeps what a reader
# in the way must take within stall_timeout at about half the window's bytes when events are large.
APPEND_SLICE: Final = 256
# Retries of an append while the shared store is down: from this many seconds, doubling, to the second.
OUTAGE_RETRY_MIN: Final = 0.05
OUTAGE_RETRY_MAX: Final = 1.0
_SSE: Final = "text/event-stream"
# What ``Pump.heard`` says while an append waits (flow control, overflow = pause, a store outage): the
# upstream sent events the pump could not append yet, so the stream is not unattended, however long it waits.
HOLDING: Final = math.inf


@dataclass(frozen=True, slots=True)
class PumpJob:
    session_id: str
    stream: int
    request_ids: tuple[str | int, ...]  # the requests whose responses complete the stream (none for GET)
    log_id: str  # a short hash of the session id: full session ids never appear in logs
    path_qs: str = "/"  # the MCP endpoint, where a resume GET goes
    # Headers a resume GET carries: Mcp-Session-Id, and the client's MCP-Protocol-Version and credentials.
    resume_headers: tuple[tuple[str, str], ...] = ()
    # The session's fence the pump writes under (``OpenedStream.fence``, ``Orphan.fence``): once another
    # process takes the session over, the store refuses the pump's writes and the pump steps down.
    fence: int | None = None

    @property
    def standalone(self) -> bool:
        """The standalone (GET) stream: no request waits on it, and it never keeps its session."""
        return not self.request_ids

    @classmethod
    def of(
        cls, session_id: str, stream: int, record: PumpRecord, log_id: str, fence: int | None = None
    ) -> PumpJob:
        return cls(
            session_id, stream, record.request_ids, log_id, record.path_qs, record.resume_headers, fence
        )


@dataclass(frozen=True, slots=True)
class Read:
    """What ``Pump.at_once`` read of an answer and did not append: its parser (mid-event, maybe) and the
    batches parsed, or the bytes it did not parse (``unparsed``: an event in them may be too large)."""

    parser: SSEParser
    batches: list[Batch]
    unparsed: bytes = b""


def whole(response: UpstreamAnswer) -> bytes | None:
    """An upstream answer's body, when all of it arrived already (taken off the answer); else None."""
    return response.whole() if isinstance(response, PooledAnswer) else None


@dataclass(frozen=True, slots=True)
class PumpSettings:
    max_event_bytes: int
    stall_timeout: float
    window_events: int
    retry_ms: int
    resume_attempts: int
    pause: bool = False  # overflow = pause: keep what no client received, stop reading instead
    session_ttl: float = 300.0  # how long a paused pump waits before it evicts after all
    store_outage_grace: float = 10.0  # how long a pump holds its upstream connection while the store is down
    window_bytes: int | None = None  # the window's byte limit: a slice holds about half of it at most
    cancel_grace: float = 5.0  # how long a moot stream (every request cancelled) stays open unread
    credential_wait: float = 60.0  # how long a resume refused 401/403 waits for fresh credentials
    # upstream_session_lost = "reinitialize": a standalone stream whose upstream lost the session waits this
    # long for a request of the session to begin it again here, then opens again there (0: it ends).
    reopen_wait: float = 0.0


# Pump task names. A drain waits for the pumps of POST streams (each ends with its response) and cancels
# the standalone ones at once (they end only with the session). A constant name is also less memory than
# asyncio's numbered default, one string per task.
PUMP = "mcpresume-pump"
STANDALONE_PUMP = "mcpresume-standalone-pump"


class Pumps:
    """Owns the pump tasks (strong references), per session, so they can be cancelled or drained."""

    def __init__(self) -> None:
        # A list per session, not a set: most sessions have one pump, and an empty set alone is 216 bytes.
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        # The pumps themselves, per session: what a cancellation, a view leaving, fresh credentials or the
        # housekeeping round (``stop_unattended``) is told to.
        self._pumps: dict[str, list[Pump]] = {}

    def spawn(
        self,
        session_id: str,
        coro: Coroutine[Any, Any, None],
        *,
        standalone: bool = False,
        pump: Pump | None = None,
    ) -> asyncio.Task[None]:
        """Run ``coro`` (``pump``'s run, or a task that awaits it) as a pump task of the session."""
        task = asyncio.get_running_loop().create_task(coro, name=STANDALONE_PUMP if standalone else PUMP)
        tasks = self._tasks.get(session_id)
        if tasks is None:
            self._tasks[session_id] = [task]
        else:
            tasks.append(task)
        task.add_done_callback(functools.partial(self._forget, session_id))
        if pump is not None:
            pump.task = task
            pumps = self._pumps.get(session_id)
            if pumps is None:
                self._pumps[session_id] = [pump]
            else:
                pumps.append(pump)
            task.add_done_callback(functools.partial(self._forget_pump, session_id, pump))
        return task

    def _forget_pump(self, session_id: str, pump: Pump, task: asyncio.Task[None]) -> None:
        pump.ended()
        pumps = self._pumps.get(session_id)
        if pumps is not None and pump in pumps:
            pumps.remove(pump)
            if not pumps:
                del self._pumps[session_id]

    # -- what the pumps of a session are told ------------------------------------------------------------

    def cancel_requests(self, session_id: str, request_keys: Collection[str]) -> None:
        """The client cancelled these requests (its ``notifications/cancelled`` went upstream)."""
        for pump in self._pumps.get(session_id, ()):
            pump.cancel(request_keys)

    def left(self, session_id: str, streams: Sequence[int], now: float) -> None:
        """A client view of these streams ended at ``now``."""
        for pump in self._pumps.get(session_id, ()):
            if pump.job.stream in streams:
                pump.left(now)

    def pumping(self, session_id: str) -> bool:
        """Whether a pump of the session runs here."""
        return session_id in self._pumps

    def refresh_credentials(
        self, session_id: str, path_qs: str, resume_headers: tuple[tuple[str, str], ...]
    ) -> None:
        """A request of the session presented the newest credentials the upstream accepted there: the
        session's streams are resumed upstream with them (``path_qs``, ``resume_headers``: as the request
        would open a stream) from now on."""
        for pump in self._pumps.get(session_id, ()):
            pump.refresh(path_qs, resume_headers)

    def begun_again(self, session_id: str) -> None:
        """The session was begun again upstream here (``upstream_session_lost = "reinitialize"``): its
        standalone stream, if its pump waits for that, opens again in the new upstream session."""
        for pump in self._pumps.get(session_id, ()):
            pump.begun_again()

    def stop_unattended(self, now: float, ttl: float) -> int:
        """Stop every POST stream's pump that no view read and no upstream event fed for ``ttl``
        (``core.pump.unattended``); how many."""
        stopped = 0
        for pumps in list(self._pumps.values()):
            for pump in list(pumps):
                if pump.unattended(now, ttl) and pump.stop(Abandon.UNATTENDED):
                    stopped += 1
        return stopped

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks.get(session_id)
        if tasks is not None and task in tasks:
            tasks.remove(task)
            if not tasks:
                del self._tasks[session_id]

    def cancel_session(self, session_id: str) -> None:
        for task in list(self._tasks.get(session_id, ())):
            task.cancel()

    def __len__(self) -> int:
        return sum(len(t) for t in self._tasks.values())

    async def drain(self, timeout: float, *, hand_over: bool = False) -> None:
        """Let running pumps finish for up to ``timeout`` seconds, then cancel what is left; standalone
        pumps are not waited for (they never finish). ``hand_over``: what is left stops without ending its
        stream, for another replica to take over."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        finite = [t for t in tasks if t.get_name() != STANDALONE_PUMP]
        if finite and timeout > 0:
            await asyncio.wait(finite, timeout=timeout)
        for task in tasks:
            task.cancel(HAND_OVER if hand_over else None)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def _done_within(waiter: asyncio.Future[None], wait: float) -> bool:
    """Whether ``waiter`` is done within ``wait`` seconds (a pump waiting for a client of its session)."""
    try:
        async with asyncio.timeout(wait):
            await waiter
    except TimeoutError:
        return False
    return True


def _holding(events: SSERun | list[NewEvent]) -> str:
    return f"holding {len(events)} event(s) read upstream"


class Pump:
    """Reads one logical upstream stream, over as many upstream connections as it takes."""

    # One per live upstream stream: slots, no instance dict (it would be most of a pump's size).
    __slots__ = (
        "_begun",
        "_begun_early",
        "_connection",
        "_credentials",
        "_cursor_of",
        "_duplicates",
        "_lapse",
        "_paused_out",
        "attempts",
        "attended",
        "clock",
        "events",
        "failure",
        "fresh",
        "heard",
        "job",
        "local",
        "metrics",
        "settings",
        "step",
        "stopping",
        "store",
        "task",
        "upstream",
        "upstream_forgot",
    )

    def __init__(
        self,
        job: PumpJob,
        store: Streams,
        local: LocalSessions,
        metrics: Metrics,
        upstream: Upstream,
        clock: Callable[[], float],
        settings: PumpSettings,
    ) -> None:
        self.job = job
        self.store = store
        self.local = local
        self.metrics = metrics
        self.upstream = upstream
        self.clock = clock
        self.settings = settings
        # What the events mean (the pure part): what to append, what is pending, where to resume from.
        self.events = UpstreamEvents(job.request_ids)
        self.step = max(1, min(APPEND_SLICE, settings.window_events))
        self.attempts = 0  # resume attempts since the last progress
        self._paused_out = False  # overflow = pause already waited session_ttl once
        self._duplicates = 0  # of events.duplicates, those already counted in the metrics
        self._cursor_of: bytes | None = None  # the upstream id last handed to the store
        self._connection: UpstreamAnswer | None = None  # the upstream connection being read
        self.upstream_forgot = False  # a resume GET got 404: the upstream does not know the session
        self.failure = "the upstream closed the stream before the response"
        # When the upstream last sent an event on the stream, and when its last client view left (both: its
        # start, at first): what ``unattended`` decides by (the clock of the store's times).
        self.heard = self.attended = clock()
        # Where and with which headers a resume GET speaks for the client from now on (the newest
        # credentials accepted in the session, ``refresh``); None: the job's own.
        self.fresh: tuple[str, tuple[tuple[str, str], ...]] | None = None
        self.task: asyncio.Task[None] | None = None  # while it may be stopped (``Pumps.spawn`` sets it)
        self.stopping: Abandon | None = None  # why it was stopped, when it was
        self._lapse: asyncio.TimerHandle | None = None  # a moot stream's cancel_grace (``cancel``)
        self._credentials: asyncio.Future[None] | None = None  # a resume waiting for fresh credentials
        # The session was begun again upstream (``begun_again``): a standalone pump that waits for it, or
        # that comes to wait after, opens its stream again there (``_reopen``).
        self._begun: asyncio.Future[None] | None = None
        self._begun_early = False

    @property
    def pending(self) -> dict[str, str | int]:
        """The requests whose responses have not arrived yet (the core's: it settles them)."""
        return self.events.pending

    async def run(self, response: UpstreamAnswer | None, first: Read | None = None) -> None:
        """Read the stream to its end: from ``response``, or (None: a stream taken over from a pump that is
        gone, ``restore``) by resuming it upstream first. ``first``: what ``at_once`` read of ``response``
        already, and did not append."""
        current: UpstreamAnswer | None = response
        try:
            if current is None and not self.events.complete:
                current = await self._resume()
                if current is None and self.job.standalone:  # taken over where the upstream lost it
                    current = await self._reopen()
            while current is not None:
                end = await self._read(current, first)
                first = None
                current = await self._resume() if self.events.resumable(end) else None
                if current is None and self.job.standalone and end in RESUMABLE_ENDS:
                    current = await self._reopen()
        except asyncio.CancelledError as exc:
            self.task = None  # ending: nothing stops it again
            if exc.args == (HAND_OVER,):
                raise  # left live in the store: another replica resumes it upstream
            if self.stopping is None:
                self.failure = "the proxy stopped reading the stream (shutdown or session end)"
            else:
                await self._abandoned(self.stopping)
            with contextlib.suppress(Fenced):
                await self._finish(wait=False)
            raise
        except Fenced as fenced:
            self.task = None
            self._step_down(fenced)
            return
        self.task = None
        try:
            await self._finish()
        except Fenced as fenced:
            self._step_down(fenced)

    def _step_down(self, fenced: Fenced) -> None:
        """Another process took the session over (``Fenced``): this pump writes nothing more and leaves the
        stream live in the store; the new owner resumes it upstream from the last upstream id the store
        holds, so what this pump read and could not append is read again there, never lost. (Its upstream
        connection is released already, unread: closed, as a leaving client's.)"""
        self.metrics.fenced_writes.inc()
        log.warning(
            "session %s stream %d: another replica owns the session now (fence %d, this pump's %d); "
            "stepping down, the new owner resumes the stream",
            self.job.log_id,
            self.job.stream,
            fenced.current,
            fenced.fence,
        )

    # -- one upstream connection -------------------------------------------------------------------------

    async def _read(self, response: UpstreamAnswer, first: Read | None = None) -> End:
        parser = SSEParser(self.settings.max_event_bytes) if first is None else first.parser
        self._connection = response
        try:
            if first is not None:
                batches = self._parse(parser, first.unparsed) if first.unparsed else first.batches
                if await self._took(batches):
                    return End.COMPLETE
                del batches  # not held while the stream idles until its next chunk
            content = response.content
            while chunk := await content.readany():  # not iter_any(): no iterator object per stream
                if await self._took(self._parse(parser, chunk)):
                    return End.COMPLETE
            if parser.close():
                self.failure = "the upstream closed the stream in the middle of an event"
            else:
                self.failure = "the upstream closed the stream before the response"
            return End.CLOSED
        except EventTooLarge as exc:
            self.failure = exc.message
            self.metrics.upstream_errors.labels(exc.reason).inc()
            return End.TOO_LARGE
        except (aiohttp.ClientError, OSError) as exc:
            self.failure = f"the upstream connection failed: {type(exc).__name__}"
            self.metrics.upstream_errors.labels("stream_dropped").inc()
            return End.DROPPED
        finally:
            self._connection = None
            response.release()

    def _parse(self, parser: SSEParser, chunk: bytes) -> list[Batch]:
        """What a read of the upstream brings to append (``core.pump.UpstreamEvents``), replays and answers
        to the proxy's own requests counted and dropped."""
        events = self.events  # (events.feed is not kept on the pump: a bound method held per idle stream)
        batches = events.feed(parser.feed_batched(chunk))
        if events.duplicates != self._duplicates:  # an upstream replay, dropped
            self.metrics.upstream_duplicates.inc(events.duplicates - self._duplicates)
            self._duplicates = events.duplicates
        if events.proxy_answers:  # answers to the proxy's own requests, dropped
            self._dropped_proxy_answers()
        return batches

    async def _took(self, batches: list[Batch]) -> bool:
        """Append what a read brought; whether the stream is complete."""
        if batches:  # events, not a comment or a priming event: the upstream is at work on it
            self.heard = HOLDING  # never unattended while it holds events not appended yet
            await self._append(batches)
            self.heard = self.clock()
        elif self.events.last_id is not self._cursor_of:
            await self._keep_cursor()
        return self.events.complete

    async def _keep_cursor(self) -> None:
        """A read with an upstream id and no event (a priming event, most often: the upstream's first
        resumption point, sent before it runs the request): the id kept in the store now, not with the
        next event, so a replica that takes the stream over meanwhile resumes it upstream from there
        instead of ending it with ``upstream_stream_lost``. The store down: the next append carries it."""
        with contextlib.suppress(StoreUnavailable):
            await self._put_last([], None)

    async def at_once(self, response: UpstreamAnswer) -> Read | None:
        """A POST stream whose answer is all here already (the upstream's first read held all of it: one
        event, or a few): appended and ended now, in the caller's task, when nothing would make that wait,
        so no pump task is made for it. None: done (``response`` released). Else ``run(response, read)``
        must take the stream from here, in a task: what was read and not appended (``read``, possibly
        nothing) waits for room there, or for the store to come back, as every append of a pump does.

        Never waits but on the store's own round trips: at once only when the body ended, holds no event
        too large, completes the stream with no more than one slice, and the append passes the session's
        guard (it evicts nothing an attached client has yet to receive) with the store up."""
        body = whole(response)
        parser = SSEParser(self.settings.max_event_bytes)
        if body is None or len(body) > self.settings.max_event_bytes:  # (no event of it is too large)
            return Read(parser, [], body or b"")
        batches = self._parse(parser, body)
        read = Read(parser, batches)
        if not self.events.complete or len(batches) > 1 or (batches and len(batches[0]) > self.step):
            return read
        job = self.job
        try:
            ended = False
            if batches:
                part = batches[0]
                ended = not isinstance(part, SSERun)  # single events: the end goes with them, one store call
                guard = self.local.guard(job.session_id, keep_undelivered=self.settings.pause)
                appended = await self._put_last(part, guard, end=ended)
                if appended.blocked is not None:
                    return read
                self.metrics.upstream_events.inc(len(part))
                self.metrics.evicted(appended.evicted)
                read = Read(parser, [])
            if not ended:
                await self.store.end_stream(job.session_id, job.stream, self.clock(), job.fence)
        except StoreUnavailable:
            return read
        except Fenced as fenced:
            response.release()
            self._step_down(fenced)
            return None
        response.release()
        return None

    def _dropped_proxy_answers(self) -> None:
        dropped = self.events.take_proxy_answers()
        self.metrics.proxy_answers_dropped.inc(dropped)
        log.warning(
            "session %s stream %d: dropped %d answer(s) to the proxy's own requests (a ping, a probe) the "
            "upstream sent on this stream: never a client's",
            self.job.log_id,
            self.job.stream,
            dropped,
        )

    async def _append(self, batches: list[Batch]) -> None:
        if not batches:
            return
        self.attempts = 0  # progress
        metrics, window_bytes = self.metrics, self.settings.window_bytes
        final = batches[-1]
        for batch in batches:
            step = self.step
            if window_bytes is not None and len(batch) > 1:
                size = batch.size if isinstance(batch, SSERun) else sum(len(event.body) for event in batch)
                if 2 * size > window_bytes:  # large events: slices of about half the window's bytes
                    step = max(1, min(step, len(batch) * window_bytes // (2 * size)))
            for start in range(0, len(batch), step):
                if len(batch) <= step:
                    part = batch
                elif isinstance(batch, SSERun):
                    part = batch.split(start, start + step)
                else:
                    part = batch[start : start + step]
                metrics.upstream_events.inc(len(part))
                # The upstream's last id goes with the read's last slice: a stream taken over after a crash
                # between slices is resumed from before the slices that never reached the store.
                await self._store(part, last=batch is final and start + step >= len(batch))

    async def _store(self, events: SSERun | list[NewEvent], *, last: bool = False) -> None:
        """Append, without evicting what an attached client has yet to receive: wait (bounded) for it to
        read. A client that stays behind longer than stall_timeout is detached and must re-attach. With
        overflow = pause, also wait while appending would evict what no client ever received: the pump
        stops reading, so TCP backpressure reaches the upstream, until a client reads or session_ttl
        passes (then it evicts from now on)."""
        local, sid, settings = self.local, self.job.session_id, self.settings
        pausing = settings.pause and not self._paused_out
        put = self._put_last if last else self._put
        guard = local.guard(sid, keep_undelivered=pausing)
        appended = await self._held(put, events, guard)
        refused_with = seen = guard  # the guard the append was refused with; the readers as last seen
        if appended.blocked is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (settings.session_ttl if pausing else settings.stall_timeout)
            while appended.blocked is not None and (remaining := deadline - loop.time()) > 0:
                # Parked only if no reader moved since the guard was taken: with a shared store the append
                # is a round trip, and a reader that moved meanwhile woke nobody (no lost wake-up).
                before = seen
                if local.guard(sid, keep_undelivered=pausing) == seen:
                    await local.readers_moved(sid, remaining)
                seen = local.guard(sid, keep_undelivered=pausing)
                if seen != before and refused_with is not None and not may_pass(appended, refused_with, seen):
                    continue  # a reader moved, not yet far enough for the append to pass: no round trip
                refused_with = seen
                appended = await self._held(put, events, seen)
            if appended.blocked is not None:
                if pausing:
                    self._paused_out = True  # paused for session_ttl with nobody reading
                    refused_with = local.guard(sid)
                    appended = await self._held(put, events, refused_with)
                if appended.blocked is not None:
                    self._drop_lagging(appended.blocked, refused_with)  # the indexes are into that guard
                    appended = await self._held(put, events, None)
        self.metrics.evicted(appended.evicted)

    async def _held(
        self,
        put: Callable[[SSERun | list[NewEvent], Guard | None], Awaitable[Appended]],
        events: SSERun | list[NewEvent],
        guard: Guard | None,
    ) -> Appended:
        """``put(events, guard)`` (``_put`` or ``_put_last``), held through an outage of the shared store
        (``_outlast``). The first try is a plain call: no closure and no message made for every append."""
        try:
            return await put(events, guard)
        except StoreUnavailable as error:
            return await self._outlast(lambda: put(events, guard), _holding(events), error)

    async def _outlast(
        self, call: Callable[[], Awaitable[T]], what: str, first: StoreUnavailable | None = None
    ) -> T:
        """``call``, through an outage of the shared store: what was read from the upstream is never
        dropped. The pump stops reading meanwhile (TCP backpressure holds the upstream) and retries, backing
        off; after ``store_outage_grace`` it lets go of the upstream connection (the stream is resumed
        upstream from its last id once the events held are in), and after ``session_ttl`` it gives up.
        ``first``: the call failed once already, with that error."""
        if first is None:
            try:
                return await call()
            except StoreUnavailable as error:
                first = error
        loop = asyncio.get_running_loop()
        started, delay = loop.time(), OUTAGE_RETRY_MIN
        job = self.job
        log.warning(
            "session %s stream %d: the store is unavailable (%s); %s",
            job.log_id,
            job.stream,
            first.message,
            what,
        )
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, OUTAGE_RETRY_MAX)
            waited = loop.time() - started
            if self._connection is not None and waited >= self.settings.store_outage_grace:
                log.warning(
                    "session %s stream %d: the store is still down after %.0f s; letting go of the upstream "
                    "connection (resumed upstream from its last id once the store is back)",
                    job.log_id,
                    job.stream,
                    waited,
                )
                self._connection.release()
                self._connection = None
            if waited >= self.settings.session_ttl:
                raise first
            try:
                return await call()
            except StoreUnavailable:
                continue

    def restore(self, upstream_cursor: str | None, answered: tuple[str, ...]) -> None:
        """Take over a stream another pump read (``SessionStore.orphans``): ``run(None)`` then resumes it."""
        self.events.restore(upstream_cursor, answered)
        self._cursor_of = self.events.last_id
        self.failure = "the proxy that read the upstream stream stopped"

    def _put(
        self,
        events: SSERun | list[NewEvent],
        guard: Guard | None,
        cursor: str | None = None,
        *,
        end: bool = False,
    ) -> Awaitable[Appended]:
        """Append ``events`` (``end``: single events, the stream's last: it ends in the same store call)."""
        job, store = self.job, self.store
        if isinstance(events, SSERun):
            return store.append_run(
                job.session_id, job.stream, events, self.clock(), guard, cursor, job.fence
            )
        put = store.append_and_end if end else store.append
        return put(job.session_id, job.stream, events, self.clock(), guard, cursor, job.fence)

    async def _put_last(
        self, events: SSERun | list[NewEvent], guard: Guard | None, *, end: bool = False
    ) -> Appended:
        """``_put`` for the last slice of an upstream read: with the upstream's last id, when it is new."""
        last_id = self.events.last_id
        if last_id is self._cursor_of:
            return await self._put(events, guard, end=end)
        appended = await self._put(events, guard, self.events.resume_cursor, end=end)
        if appended.blocked is None:
            self._cursor_of = last_id
        return appended

    def _drop_lagging(self, blocked: tuple[int, ...], guard: Guard | None) -> None:
        if guard is None:
            return
        dropped = self.local.drop_readers(self.job.session_id, [guard.tokens[i] for i in blocked])
        if dropped:
            self.metrics.backpressure_detaches.inc(dropped)
            log.info(
                "session %s stream %d: %d client view(s) fell behind by stall_timeout",
                self.job.log_id,
                self.job.stream,
                dropped,
            )

    # -- resuming upstream -------------------------------------------------------------------------------

    async def _resume(self) -> UpstreamAnswer | None:
        """Reconnect with the last upstream id; None when the stream cannot be resumed."""
        outcomes = self.metrics.upstream_resumptions
        cursor = self.events.resume_cursor
        if cursor is None:
            self.failure += ", and sent no event ids to resume from"
            outcomes.labels("not_resumable").inc()
            return None
        asks = (("Accept", _SSE), (LAST_EVENT_ID_HEADER, cursor))
        wait = True
        while self.attempts < self.settings.resume_attempts:
            if wait:
                retry_ms = self.events.retry_ms
                await asyncio.sleep(
                    resume_delay(self.settings.retry_ms if retry_ms is None else retry_ms, self.attempts)
                )
            wait = True
            self.attempts += 1
            speaking = self.speaking_for
            path_qs, headers = speaking
            try:
                # Not aliased: a stream resumes in the upstream session it was opened in (a session begun
                # again upstream has new streams; this one's requests end with upstream_stream_lost).
                response = await self.upstream.open_get(path_qs, [*headers, *asks], alias=False)
            except BadRequest as error:  # the upstream's own id cannot be sent back: retrying cannot help
                self.failure = f"resuming the upstream stream failed: {error.message}"
                outcomes.labels("refused").inc()
                return None
            except ProxyError as error:
                self.failure = f"resuming the upstream stream failed: {error.message}"
                continue
            if response.status == 200 and response.content_type == _SSE:
                self.events.resumed()  # from now on, what the upstream replays is dropped
                outcomes.labels("resumed").inc()
                log.info(
                    "session %s stream %d: upstream stream resumed after %s",
                    self.job.log_id,
                    self.job.stream,
                    cursor,
                )
                return response
            status = response.status
            response.release()
            self.upstream_forgot = status == 404
            self.failure = f"the upstream answered {status} to resuming its stream"
            if refuses_resume(status):
                outcomes.labels("refused").inc()
                return None
            if wants_credentials(status):
                if not await self._fresh_credentials(speaking, status):
                    self.failure += (
                        f", and no client of the session brought new credentials within "
                        f"{self.settings.credential_wait:g} s"
                    )
                    outcomes.labels("refused").inc()
                    return None
                self.attempts -= 1  # not an attempt without progress: new credentials, tried at once
                wait = False
        self.failure += f" (gave up after {self.attempts} attempts)"
        outcomes.labels("exhausted").inc()
        return None

    # -- opened again in a session begun again upstream (upstream_session_lost = "reinitialize") -----------

    async def _reopen(self) -> UpstreamAnswer | None:
        """The standalone stream's upstream connection ended and cannot be resumed: under ``reinitialize``,
        when the upstream lost the session (it answers the stream's GET 404), wait up to ``reopen_wait`` for
        a request of the session to begin it again here (``begun_again``; that request carries the client's
        credentials, never this pump), then open the stream in the new upstream session and go on appending
        to the same stream: the client's view of it never ends. None: it ends as it would under ``end``
        (the upstream does not answer, it refuses, or nothing began the session again in time)."""
        wait = self.settings.reopen_wait
        self._begun_early = False  # only a beginning from now on (or while its first GET is on its way)
        if wait <= 0 or self.stopping is not None:
            return None
        path_qs, headers = self.speaking_for
        # The client's session id: ``open_get`` puts the upstream session the session is mapped to now.
        session = SESSION_HEADER.lower()
        asks = [(n, v) for n, v in headers if n.lower() != session]
        asks += [(SESSION_HEADER, self.job.session_id), ("Accept", _SSE)]
        waited, attempts = False, 0
        while True:
            try:
                response = await self.upstream.open_get(path_qs, asks)
            except BadRequest:
                return None
            except ProxyError as error:  # not up again yet (a restart): tried again as a resume is
                attempts += 1
                if attempts >= self.settings.resume_attempts:
                    self.failure = f"opening the standalone stream again failed: {error.message}"
                    return None
                await asyncio.sleep(resume_delay(self.settings.retry_ms, attempts - 1))
                continue
            if response.status == 200 and response.content_type == _SSE:
                self.events.reopened()
                self._begun_early = False
                log.info(
                    "session %s stream %d: the standalone stream opened again in the session begun again "
                    "upstream",
                    self.job.log_id,
                    self.job.stream,
                )
                return response
            status = response.status
            response.release()
            if status != 404 or waited:
                self.failure = f"the upstream answered {status} to opening the standalone stream again"
                return None
            waited = True
            if not await self._begun_again_within(wait):
                self.failure = (
                    f"the upstream lost the session, and no request began it again within {wait:g} s"
                )
                return None

    def begun_again(self) -> None:
        """The session was begun again upstream here: a ``_reopen`` waiting for it goes on (or the next
        one does not wait)."""
        waiter = self._begun
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif self.job.standalone:
            self._begun_early = True

    async def _begun_again_within(self, wait: float) -> bool:
        if self._begun_early:
            self._begun_early = False
            return True
        log.info(
            "session %s stream %d: the upstream lost the session; the standalone stream waits up to %g s for "
            "a request of the session to begin it again",
            self.job.log_id,
            self.job.stream,
            wait,
        )
        waiter = self._begun = asyncio.get_running_loop().create_future()
        try:
            return await _done_within(waiter, wait)
        finally:
            self._begun = None

    @property
    def speaking_for(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Where a resume GET goes and the headers it speaks for the client with: the newest credentials
        accepted in the session (``refresh``), else the job's."""
        return self.fresh or (self.job.path_qs, self.job.resume_headers)

    def refresh(self, path_qs: str, resume_headers: tuple[tuple[str, str], ...]) -> None:
        """A request of the session presented the newest credentials the upstream accepted there (kept
        here, in this process, never in the store): resumes carry them from now on, and a resume waiting
        for fresh credentials is retried with them."""
        fresh = (path_qs, resume_headers)
        if fresh == self.speaking_for:
            return  # the common case: the same credentials again
        self.fresh = fresh
        waiter = self._credentials
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _fresh_credentials(self, used: tuple[str, tuple[tuple[str, str], ...]], status: int) -> bool:
        """The upstream refused the credentials ``used`` (``status``): whether other credentials came,
        waiting ``credential_wait`` at most for a client of the session to present them."""
        if self.speaking_for != used:
            return True  # they came while the refused GET was on its way
        wait = self.settings.credential_wait
        log.info(
            "session %s stream %d: the upstream refused the stream's credentials (%d) on resuming it; "
            "waiting up to %g s for a client of the session to bring new ones",
            self.job.log_id,
            self.job.stream,
            status,
            wait,
        )
        waiter = self._credentials = asyncio.get_running_loop().create_future()
        try:
            return await _done_within(waiter, wait)
        finally:
            self._credentials = None

    # -- given up: cancelled, or unattended --------------------------------------------------------------

    def cancel(self, request_keys: Collection[str]) -> None:
        """The client cancelled these requests (its ``notifications/cancelled`` went upstream): once every
        request the stream waits for is, it is closed after ``cancel_grace`` without a view reading it."""
        if self.task is not None and self.events.cancel(request_keys):
            self._lapse_in(self.settings.cancel_grace)

    def left(self, now: float) -> None:
        """A client view of the stream ended at ``now``: its cancel_grace starts again."""
        self.attended = max(self.attended, now)
        if self.task is not None and self.events.moot:
            self._lapse_in(self.settings.cancel_grace)

    def _lapse_in(self, delay: float) -> None:
        if self._lapse is not None:
            self._lapse.cancel()
        self._lapse = asyncio.get_running_loop().call_later(delay, self._lapsed)

    def _lapsed(self) -> None:
        """A moot stream's cancel_grace passed: stopped, unless a view reads it (looked at again a grace
        later, and when it leaves) or it was answered meanwhile."""
        self._lapse = None
        if not self.events.moot:
            return
        if self.local.reads(self.job.session_id, self.job.stream):
            self._lapse_in(self.settings.cancel_grace)
            return
        self.stop(Abandon.CANCELLED)

    def unattended(self, now: float, ttl: float) -> bool:
        """A POST stream no view read and no upstream event fed for ``ttl`` (``core.pump.unattended``)."""
        if self.job.standalone or self.task is None:
            return False
        reading = self.local.reads(self.job.session_id, self.job.stream)
        return unattended(now, self.heard, self.attended, reading=reading, ttl=ttl)

    def stop(self, reason: Abandon) -> bool:
        """Stop reading the stream (its upstream connection closed) and end it, for ``reason``; False when
        it is ending already."""
        task = self.task
        if task is None or self.stopping is not None:
            return False
        self.stopping = reason
        if reason is Abandon.UNATTENDED:
            self.failure = (
                f"no client read the stream and the upstream sent nothing on it for "
                f"{self.clock() - max(self.heard, self.attended):.0f} s (session_ttl)"
            )
        task.cancel()
        return True

    async def _abandoned(self, reason: Abandon) -> None:
        """Stopped for ``reason``: said (one line, the metric), and a cancelled stream's request ids
        refused from now on (``request_cancelled``)."""
        job = self.job
        self.metrics.abandoned_streams.labels(reason.value).inc()
        if reason is Abandon.CANCELLED:
            log.info(
                "session %s stream %d: every request of it was cancelled (notifications/cancelled) and no "
                "client read it for %g s; closed upstream, ended without an answer (none is expected)",
                job.log_id,
                job.stream,
                self.settings.cancel_grace,
            )
            try:
                await self.store.cancel_requests(job.session_id, job.stream, sorted(self.events.cancelled))
            except StoreUnavailable as error:  # their ids stay claimed by the stream: never sent again
                log.warning("session %s stream %d: %s", job.log_id, job.stream, error.message)

    def ended(self) -> None:
        """The pump's task is done: nothing is waited for any more."""
        self.task = None
        if self._lapse is not None:
            self._lapse.cancel()
            self._lapse = None

    # -- the end -----------------------------------------------------------------------------------------

    async def _finish(self, *, wait: bool = True) -> None:
        """Answer the pending requests with an error, and end the stream. ``wait``: the errors wait for
        room as every append does (overflow = pause: they must not evict what no client was sent either);
        not once the proxy stopped the pump, nor past a cancel of that wait."""
        job = self.job
        items = self.events.unanswered(self.failure) if self.pending else []
        if items:
            log.warning(
                "session %s stream %d: %s; answering %d request(s) with an error",
                job.log_id,
                job.stream,
                self.failure,
                len(items),
            )
            self.metrics.synthesized_errors.labels(UpstreamStreamLost.reason).inc(len(items))
        stored = False
        try:
            if items and wait:
                await self._store(items)
                stored = True
        finally:
            if items and not stored:  # not waiting, or the wait was cancelled: the errors go in anyway
                await self._put(items, None)
            # Unattended, it ends as of when it was last read or fed: it gives its session no time of its own.
            at = max(self.heard, self.attended) if self.stopping is Abandon.UNATTENDED else self.clock()
            end = functools.partial(self.store.end_stream, job.session_id, job.stream, at, job.fence)
            await (self._outlast(end, "ending the stream") if wait else end())
