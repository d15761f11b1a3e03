"""Pumps: one task per upstream SSE response, appending its events to the session's window.

A pump's life is tied to the upstream stream, never to a client: a client that drops does not stop it
(spec, handshake era: "disconnection SHOULD NOT be interpreted as the client cancelling its request"), so
the response reaches the window and a re-attaching client gets it.

When a POST stream ends without the JSON-RPC response of every request it carried (the upstream closed
early, the connection dropped, an event was too large), the pump completes the stream with a synthesized
JSON-RPC error for each pending request id, so no client waits forever for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from mcpresume.errors import SERVER_ERROR, EventTooLarge
from mcpresume.jsonrpc import error_response, request_key, response_key
from mcpresume.metrics import Metrics
from mcpresume.session import NewEvent
from mcpresume.sse import SSEParser, frame_body
from mcpresume.store import SessionStore
from mcpresume.window import EventKind

log = logging.getLogger("mcpresume.pump")

# Events appended per store call, at most (and never more than half the window, see ``pump``). An upstream
# read can hold hundreds of small events; appending them in slices lets a pump wait for a reading client
# between slices instead of evicting under it.
APPEND_SLICE = 64


@dataclass(frozen=True, slots=True)
class PumpJob:
    session_id: str
    stream: int
    request_ids: tuple[str | int, ...]  # the requests whose responses complete the stream (none for GET)
    log_id: str  # a short hash of the session id: full session ids never appear in logs


class Pumps:
    """Owns the pump tasks (strong references), per session, so they can be cancelled or drained."""

    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}

    def spawn(self, session_id: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        tasks = self._tasks.setdefault(session_id, set())
        tasks.add(task)
        task.add_done_callback(lambda t: self._forget(session_id, t))
        return task

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks.get(session_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[session_id]

    def cancel_session(self, session_id: str) -> None:
        for task in list(self._tasks.get(session_id, ())):
            task.cancel()

    def __len__(self) -> int:
        return sum(len(t) for t in self._tasks.values())

    async def drain(self, timeout: float) -> None:
        """Let running pumps finish for up to ``timeout`` seconds, then cancel what is left."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def pump(
    job: PumpJob,
    response: aiohttp.ClientResponse,
    store: SessionStore,
    metrics: Metrics,
    clock: Callable[[], float],
    max_event_bytes: int,
    stall_timeout: float,
    window_events: int,
) -> None:
    """Read one upstream SSE response to its end, appending to ``job.stream``.

    Before each slice the pump waits (at most ``stall_timeout``) until appending evicts nothing an attached
    client has yet to receive; a client that stays behind longer loses its place and must re-attach.
    """
    parser = SSEParser(max_event_bytes)
    step = max(1, min(APPEND_SLICE, window_events // 2))  # a slice must fit beside what a reader still needs
    pending = {request_key(i): i for i in job.request_ids}
    failure = "the upstream closed the stream before the response"
    try:
        async for chunk in response.content.iter_any():
            items = []
            for event in parser.feed(chunk):
                if not event.data:
                    continue  # priming, or an id/retry-only event: the proxy sends its own
                key = response_key(event.data) if pending else None
                is_response = key is not None and pending.pop(key, None) is not None
                items.append(
                    NewEvent(
                        frame_body(event.data, event.event),
                        EventKind.RESPONSE if is_response else EventKind.MESSAGE,
                        event.id,
                        key if is_response else None,
                    )
                )
            for start in range(0, len(items), step):
                batch = items[start : start + step]
                size = sum(len(item.body) for item in batch)
                await store.wait_for_room(job.session_id, len(batch), size, stall_timeout)
                metrics.upstream_events.inc(len(batch))
                metrics.evicted(await store.append(job.session_id, job.stream, batch, clock()))
            if job.request_ids and not pending:
                break  # every response is in: the POST stream is complete
        if parser.close():
            failure = "the upstream closed the stream in the middle of an event"
    except EventTooLarge as exc:
        failure = exc.message
        metrics.upstream_errors.labels(exc.reason).inc()
    except (aiohttp.ClientError, OSError) as exc:
        failure = f"the upstream connection failed: {type(exc).__name__}"
        metrics.upstream_errors.labels("stream_dropped").inc()
    except asyncio.CancelledError:
        failure = "the proxy stopped reading the stream (shutdown or session end)"
        await _finish(job, store, metrics, clock, pending, failure)
        raise
    finally:
        response.release()
    await _finish(job, store, metrics, clock, pending, failure)


async def _finish(
    job: PumpJob,
    store: SessionStore,
    metrics: Metrics,
    clock: Callable[[], float],
    pending: dict[str, str | int],
    failure: str,
) -> None:
    if pending:
        log.warning(
            "session %s stream %d: %s; answering %d request(s) with an error",
            job.log_id,
            job.stream,
            failure,
            len(pending),
        )
        items = [
            NewEvent(
                frame_body(
                    error_response(request_id, SERVER_ERROR, failure, {"reason": "upstream_stream_lost"})
                ),
                EventKind.RESPONSE,
                None,
                key,
            )
            for key, request_id in pending.items()
        ]
        metrics.synthesized_errors.labels("upstream_stream_lost").inc(len(items))
        await store.append(job.session_id, job.stream, items, clock())
    await store.end_stream(job.session_id, job.stream, clock())
