"""Durable long calls carried out: a 2026-07-28 ``tools/call`` made a task the store keeps, and ``tasks/*``.

``core/tasks.py`` decides (which call may become a task, the lifecycle, the wire shapes); this module does
the I/O. ``Tasks.serve`` returns None for everything it leaves as today (``http/proxy.py`` then passes it
through), else its answer:

* An eligible call is forwarded without the extension and its whole answer read in a task of its own
  (``_call``), which hands it to the client as it comes (``Relay``): an event stream event by event (the
  call's progress reaches the client while it runs, as without tasks), a JSON answer as its bytes come
  (it is the response: no task is made of it, and no bound applies that would not without tasks). An
  event stream whose response has not come within ``task_after``, or an answer not begun by then: a
  ``Task`` is stored (``TaskStore.create``, durable before the handle is returned, as the extension
  requires), and the client gets its ``CreateTaskResult`` as the stream's last event (or as a JSON answer
  when none began); the read goes on (``_settle``): the upstream's answer is never closed, which would
  cancel the call. A client that leaves before its handle cancels the call, as today.
* ``tasks/get`` is answered from the store (any replica sharing it); ``tasks/cancel`` marks the task
  cancelled (a compare-and-set: a result that came first wins) and closes the upstream request (the
  revision's cancellation): at once on this replica, within a poll interval from another (``_settle``
  watches the record); ``tasks/update`` answers an ``input_required`` task: the call is retried upstream
  with the input responses and the request state, and the task works again.
* A task is its creating call's credentials' (their digest, as sessions are bound): a ``tasks/*`` with
  others, or for an unknown or expired task the proxy minted, is 404 ``unknown_task``. Ids the proxy did not
  mint (``core.tasks.is_ours``) are the upstream's own: passed through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from mcpresume.core import tasks as plan
from mcpresume.core.credentials import credential_digest, credential_fields
from mcpresume.core.errors import (
    InvalidTaskParams,
    ProxyError,
    TaskFinished,
    TaskNotWaiting,
    UnknownTask,
    UpstreamBadResponse,
    UpstreamUnreachable,
)
from mcpresume.core.headers import SSE_RESPONSE_HEADERS
from mcpresume.core.jsonrpc import DISCOVER, proxy_request_id
from mcpresume.core.sse import SSEParser, encode_event, frame_body
from mcpresume.core.tasks import Event, Status, Task
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.credentials import refused, verify_modern
from mcpresume.http.forward import SSE, client_headers, upstream_headers
from mcpresume.http.incoming import Post
from mcpresume.http.view import ClientWriter, Stalled
from mcpresume.store.tasks import MemoryTasks, RedisTasks, TaskStore

log = logging.getLogger("mcpresume.tasks")

NAME_HEADER: Final = "Mcp-Name"  # a tasks/* request's task id, for intermediaries (2026-07-28)
_FRAMING: Final = frozenset({"content-length", "transfer-encoding", "content-encoding"})
# How long the upstream's answer to server/discover (whether it makes tasks itself) is trusted: one
# round trip a minute at most, and an upstream redeployed with tasks is left to make them within a minute.
DISCOVER_EVERY: Final = 60.0
# How long the upstream's acceptance of a poll's credentials is kept (``_still_accepted``): a credential
# the upstream revokes polls at most this much longer; a client polling every task_after/10 costs one
# upstream check per this many seconds, not one per poll.
ACCEPTED_FOR: Final = 5.0
MAX_ACCEPTED: Final = 10_000  # credentials whose acceptance is kept at once (a few MB at most)
CLOSE_WAIT: Final = 2.0  # seconds the stop waits for the store to take the closed calls' tasks as failed


@dataclass(frozen=True, slots=True)
class Answered:
    """The upstream's answer to a call, as its task needs it: its status, and the JSON-RPC response in it
    (None if none)."""

    status: int
    response: Any


@dataclass(frozen=True, slots=True)
class Head:
    """The upstream answer's status line and headers, as the client gets them (``sse``: an event stream)."""

    status: int
    reason: str | None
    headers: list[tuple[str, str]]
    sse: bool


class Relay:
    """A call's answer as ``Tasks._call`` reads it: its newest progress (``_settle`` stores it with the task)
    and, until the client has the task's handle (``handed``), the answer on its way to the client
    (``Tasks._tools_call`` writes it): the upstream's head, then each SSE event as it completes (framed
    again, so the handle can follow any of them), or any other body's bytes as they come. At most ``limit``
    bytes (``max_event_bytes``: one event's bound) wait for the client; beyond, the read waits for it, so a
    client slower than the upstream slows the call, as a plain relay does."""

    __slots__ = (
        "_room",
        "answered",
        "deciding",
        "handed",
        "head",
        "limit",
        "message",
        "news",
        "passing",
        "pending",
        "size",
    )

    def __init__(self, limit: int, *, live: bool = True) -> None:
        self.limit = limit
        self.message: str | None = None
        self.handed = not live  # the client has the task's handle (or nobody reads the answer as it comes)
        self.head: Head | None = None
        self.answered = False  # the call's response is on its way to the client: no task is made of it
        self.passing = False  # a JSON answer is on its way to the client: no task is made of it
        # Set while a task is being stored: a JSON answer that begins meanwhile waits for the outcome (it
        # goes to the task if the handle does to the client, else to the client).
        self.deciding: asyncio.Event | None = None
        self.pending: list[bytes] = []
        self.size = 0
        self.news = asyncio.Event()  # a head, bytes to send, or the read's end
        self._room = asyncio.Event()

    @property
    def committed(self) -> bool:
        """The answer reaches the client as it would without tasks: its response went by, or it is not an
        event stream (a JSON answer is relayed as it comes; a handle cannot follow it)."""
        return self.answered or self.passing

    def seen(self, data: bytes) -> None:
        if b"notifications/progress" in data:
            with contextlib.suppress(orjson.JSONDecodeError):
                self.message = plan.progress_message(orjson.loads(data)) or self.message

    def opened(self, head: Head) -> None:
        self.head = head
        self.news.set()

    async def put(self, data: bytes) -> None:
        """Hand ``data`` to the client's writer (nothing once handed); wait while too much waits."""
        if self.handed:
            return
        self.pending.append(data)
        self.size += len(data)
        self.news.set()
        while self.size > self.limit and not self.handed:
            self._room.clear()
            await self._room.wait()

    def take(self) -> list[bytes]:
        taken, self.pending, self.size = self.pending, [], 0
        self._room.set()
        return taken

    def hand(self) -> list[bytes]:
        """The client gets the task's handle after what waits now; the rest of the answer is the task's."""
        self.handed = True
        return self.take()


def find_response(content_type: str, body: bytes, request_id: Any, limit: int) -> Any:
    """The JSON-RPC response to ``request_id`` in an answer (JSON, or an SSE stream's events)."""
    docs: list[Any] = []
    try:
        if content_type == SSE:
            parser = SSEParser(limit)
            events = parser.feed(body)
            parser.close()
            docs = [orjson.loads(e.data) for e in events if e.has_data and e.data.strip()]
        else:
            doc = orjson.loads(body)
            docs = doc if isinstance(doc, list) else [doc]
    except (orjson.JSONDecodeError, ValueError):
        return None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("id") == request_id and ("result" in doc or "error" in doc):
            return doc
    return None


class Tasks:
    def __init__(self, ctx: ProxyContext, store: TaskStore | None = None) -> None:
        self.ctx = ctx
        settings = ctx.settings
        self.store: TaskStore = store or (
            MemoryTasks() if settings.store == "memory" else RedisTasks.from_url(settings.store)
        )
        self.poll_ms = plan.poll_interval_ms(settings.task_after)
        self._running: dict[str, asyncio.Task[Answered]] = {}  # task id -> its upstream call read here
        self._settling: set[asyncio.Task[None]] = set()
        self._closing = False
        self._accepted: dict[str, float] = {}  # credential digest -> until when the upstream's yes holds
        self._discovered: tuple[bool, float] | None = None  # the upstream makes tasks; until when known

    async def close(self) -> None:
        """The process stops: the calls read here are closed (nothing else can read them) and their tasks
        fail with ``proxy_shutdown``, so their clients learn it at their next poll, not at the TTL."""
        self._closing = True
        for reader in list(self._running.values()):
            reader.cancel()
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=CLOSE_WAIT)
        for settle in list(self._settling):
            settle.cancel()
        await self.store.close()

    def _owner(self, request: web.Request) -> str:
        fields = credential_fields(request.headers, self.ctx.settings.credential_headers)
        return credential_digest(fields).hex()

    async def sweep(self) -> None:
        """The housekeeping round's part: count the tasks that expired since the last round
        (``mcpresume_tasks_total{event="expired"}``), once across the replicas sharing the store."""
        try:
            swept = await self.store.sweep(self.ctx.clock())
        except Exception as exc:  # the store is down: the next round counts them
            log.warning("the expired tasks could not be counted this round (%s)", exc)
            return
        if swept:
            self.ctx.metrics.tasks.labels("expired").inc(swept)

    async def serve(self, post: Post) -> web.StreamResponse | None:
        """The answer, or None: the request goes as today."""
        request, message = post.request, post.message
        if not post.stateless or len(message.methods) != 1:
            return None
        method = message.methods[0]
        if method != plan.TOOLS_CALL and method not in plan.TASK_METHODS:
            return None
        try:
            doc = orjson.loads(post.body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(doc, dict) or "id" not in doc:
            return None
        if method == plan.TOOLS_CALL:
            if plan.plan_call(doc, enabled=True, modern=True) is plan.Eligibility.AS_TODAY:
                return None
            if await self._upstream_makes_tasks(request, doc):
                return None  # the upstream's own tasks, as today
            return await self._tools_call(request, doc)
        params, header = doc.get("params"), request.headers.get(NAME_HEADER)
        task_id = plan.task_id_of(params, header)
        if task_id is None:  # malformed, whoever's task it names: said so (the tasks extension: -32602)
            problem = plan.task_id_problem(params, header) or "taskId"
            return self.ctx.reject(request, InvalidTaskParams(problem), doc["id"])
        if not plan.is_ours(task_id):
            return None  # the upstream's own task: its answer, as today
        request[DID] = Action.TASK
        try:
            task = await self.store.get(task_id, self.ctx.clock())
            if task is None or not secrets.compare_digest(task.owner, self._owner(request)):
                raise UnknownTask()
            await self._still_accepted(request, task)
            if method == plan.TASKS_GET:
                self.ctx.metrics.task_polls.inc()
                return answer(doc["id"], plan.get_result(task, self.poll_ms))
            if method == plan.TASKS_CANCEL:
                return answer(doc["id"], await self._cancel(task))
            return await self._update(request, doc, task)
        except ProxyError as error:
            return refused(self.ctx, request, error, doc["id"])

    async def _still_accepted(self, request: web.Request, task: Task) -> None:
        """A ``tasks/*`` never reaches the upstream, so the upstream's check of its credentials is asked
        for it (``verify_modern``: a ``server/discover`` with them): a credential revoked since the call
        polls no more. An acceptance is kept ``ACCEPTED_FOR`` seconds per credential in this process (a
        client polling many tasks costs one check); a task made without credentials has none to check."""
        if not credential_fields(request.headers, self.ctx.settings.credential_headers):
            return
        now = self.ctx.clock()
        if self._accepted.get(task.owner, now) > now:
            return
        await verify_modern(self.ctx, request)
        if len(self._accepted) >= MAX_ACCEPTED:
            self._accepted = {k: v for k, v in self._accepted.items() if v > now}
            if len(self._accepted) >= MAX_ACCEPTED:
                self._accepted.clear()
        self._accepted[task.owner] = now + ACCEPTED_FOR

    async def _upstream_makes_tasks(self, request: web.Request, doc: dict[str, Any]) -> bool:
        """Ask the upstream's ``server/discover`` (with the call's credentials and envelope) whether it
        declares the tasks extension; the answer is kept ``DISCOVER_EVERY`` seconds. An upstream that does
        not answer it is taken to have none (and asked again next time)."""
        loop = asyncio.get_running_loop()
        if self._discovered is not None and loop.time() < self._discovered[1]:
            return self._discovered[0]
        probe_id = proxy_request_id("discover", secrets.token_hex(8))
        meta = plan.upstream_params(doc["params"])["_meta"]
        body = orjson.dumps({"jsonrpc": "2.0", "id": probe_id, "method": DISCOVER, "params": {"_meta": meta}})
        drop = {"mcp-method", "mcp-name"}
        headers = [(n, v) for n, v in upstream_headers(request) if n.lower() not in drop]
        try:
            buffered = await self._call(request.path_qs, [*headers, ("Mcp-Method", DISCOVER)], body, probe_id)
        except ProxyError as error:
            log.info("server/discover of the upstream failed (%s): taken to make no tasks", error.reason)
            return False
        makes = plan.upstream_makes_tasks(buffered.response)
        if buffered.response is not None:
            self._discovered = (makes, loop.time() + DISCOVER_EVERY)
        return makes

    # -- a call ------------------------------------------------------------------------------------------

    async def _tools_call(self, request: web.Request, doc: dict[str, Any]) -> web.StreamResponse:
        """The call sent upstream without the extension; its answer relayed to the client as it comes until
        ``task_after`` (progress as it happens, as without tasks); then, unless its response went by or it
        is JSON, the task stored and its handle the answer's last event (or the answer, if none began)."""
        ctx = self.ctx
        request[DID] = Action.RELAYED
        call = orjson.dumps({**doc, "params": plan.upstream_params(doc["params"])})
        relay = Relay(ctx.settings.max_event_bytes)
        loop = asyncio.get_running_loop()
        reader = loop.create_task(
            self._call(request.path_qs, upstream_headers(request), call, doc["id"], relay)
        )
        reader.add_done_callback(lambda _: relay.news.set())
        deadline: float | None = loop.time() + ctx.settings.task_after  # None: no task any more
        response: web.StreamResponse | None = None
        writer: ClientWriter | None = None
        try:
            while True:
                relay.news.clear()  # before looking: whatever comes while this round writes wakes the next
                if writer is None and relay.head is not None:
                    response = await self._open(request, relay.head)
                    writer = ClientWriter(
                        response, request.transport, ctx.settings.stall_timeout, request.writer
                    )
                if writer is not None:
                    for data in relay.take():
                        await writer.write(data)
                if reader.done():
                    break
                if deadline is not None and not relay.committed and loop.time() >= deadline:
                    deadline = None
                    relay.deciding = asyncio.Event()
                    try:
                        task = await self._create(request, call)
                        if task is not None and not relay.committed:
                            return await self._handed(request, doc["id"], task, reader, relay, writer)
                    finally:
                        relay.deciding.set()
                    if task is not None:  # the response went by while the task was stored: the client
                        self._start_settling(task, reader, relay)  # has it; the task, never handed, too
                wait = None if deadline is None or relay.committed else max(0.0, deadline - loop.time())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await relay.news.wait()
        except Stalled:  # the client took nothing for stall_timeout: cut, the call with it (as a relay does)
            ctx.metrics.backpressure_detaches.inc()
            reader.cancel()
            if request.transport is not None:
                request.transport.abort()
            return response or web.Response(status=499)
        except (aiohttp.ClientError, OSError) as exc:  # the client left: the call is cancelled, as today
            log.info("tools/call relay ended early: %s", type(exc).__name__)
            reader.cancel()
            return response or web.Response(status=499)
        except BaseException:  # the client left (the handler cancelled) before the handle: as today
            if not relay.handed:
                reader.cancel()
            raise
        if response is None:  # no answer began: the call failed before it
            return ctx.reject(request, _failure(reader), doc["id"])
        if reader.cancelled() or reader.exception() is not None:  # cut mid-answer: ended as a relay ends
            log.info("tools/call: the upstream's answer ended early (%s)", _failure(reader).reason)
            return response
        await response.write_eof()
        return response

    async def _open(self, request: web.Request, head: Head) -> web.StreamResponse:
        response = web.StreamResponse(status=head.status, reason=head.reason)
        for name, value in head.headers:
            response.headers.add(name, value)
        if head.sse:
            for name, value in SSE_RESPONSE_HEADERS[1:]:
                response.headers[name] = value
        await response.prepare(request)
        return response

    async def _create(self, request: web.Request, call: bytes) -> Task | None:
        """A task for the call, durably stored (the extension: not handed before); None if the store could
        not keep it (the client then gets the answer as it comes, as without tasks)."""
        now = self.ctx.clock()
        task_id = plan.TASK_ID_PREFIX + secrets.token_urlsafe(plan.TASK_ID_BYTES)
        task = plan.new_task(task_id, self._owner(request), call, now, self.ctx.settings.task_ttl)
        try:
            await self.store.create(task, now)
        except Exception as exc:
            log.warning("a task could not be stored (%s); the call is answered when it ends", exc)
            return None
        self.ctx.metrics.tasks.labels("created").inc()
        return task

    async def _handed(
        self,
        request: web.Request,
        request_id: Any,
        task: Task,
        reader: asyncio.Task[Answered],
        relay: Relay,
        writer: ClientWriter | None,
    ) -> web.StreamResponse:
        """The client gets the task's handle: the answer's last event after what was read before it (an
        event stream begun), or the answer (none began). The call goes on, the task's."""
        pending = relay.hand()
        if relay.deciding is not None:
            relay.deciding.set()  # a JSON answer that began meanwhile is the task's
        self._start_settling(task, reader, relay)
        request[DID] = Action.TASK
        handle = {"jsonrpc": "2.0", "id": request_id, "result": plan.created_result(task, self.poll_ms)}
        if writer is None:
            return web.Response(body=orjson.dumps(handle), content_type="application/json")
        with contextlib.suppress(Stalled, aiohttp.ClientError, OSError):  # the client left: the task goes on
            for data in pending:
                await writer.write(data)
            await writer.write(frame_body(orjson.dumps(handle)))
            await writer.response.write_eof()
        return writer.response

    async def _call(
        self,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        request_id: Any,
        relay: Relay | None = None,
    ) -> Answered:
        """Send the call and read its whole answer (a cancellation closes it: the upstream's cancel).
        ``relay``: the answer goes to the client as it comes until the task's handle (``Relay``); an event
        stream is parsed as it comes (its progress, its response), so a long call's many notifications
        never add up against ``max_event_bytes``; a JSON answer is read whole (at most that) unless it goes
        to the client."""
        ctx = self.ctx
        limit = ctx.settings.max_event_bytes
        upstream = await ctx.upstream.request("POST", path_qs, headers, body, decoded=True)
        try:
            sse = upstream.content_type == SSE
            passing: Relay | None = None
            if relay is not None:
                kept = [(n, v) for n, v in client_headers(ctx, upstream) if n.lower() not in _FRAMING]
                if not sse and relay.deciding is not None:  # a task is being stored: the client's, or this
                    await relay.deciding.wait()
                if not sse and not relay.handed:
                    passing = relay
                    relay.passing = True
                relay.opened(Head(upstream.status, upstream.reason, kept, sse))
            raw = bytearray()
            events = SSEParser(limit) if sse else None
            found: Any = None
            try:
                async for chunk in upstream.content.iter_any():
                    if passing is not None:  # JSON on its way to the client: no task, nothing kept
                        await passing.put(chunk)
                    elif events is None:
                        raw += chunk
                        if len(raw) > limit:
                            raise UpstreamBadResponse(f"the call's answer is over {limit} bytes", limit=limit)
                    else:
                        for event in events.feed(chunk):
                            if relay is not None:
                                relay.seen(event.data)
                            if found is None:
                                found = find_response("application/json", event.data, request_id, limit)
                                if found is not None and relay is not None and not relay.handed:
                                    relay.answered = True
                            if relay is not None and not relay.handed:
                                await relay.put(encode_event(event))
            except OSError as exc:
                raise UpstreamUnreachable(f"the call's answer was lost: {type(exc).__name__}") from None
            except Exception as exc:
                if isinstance(exc, ProxyError):
                    raise
                raise UpstreamUnreachable(f"the call's answer was lost: {type(exc).__name__}") from None
            if events is None and passing is None:
                found = find_response(upstream.content_type, bytes(raw), request_id, limit)
            return Answered(upstream.status, found)
        except asyncio.CancelledError:
            upstream.close()  # closing the answer cancels the call upstream (2026-07-28)
            raise
        finally:
            upstream.release()

    def _start_settling(self, task: Task, reader: asyncio.Task[Answered], relay: Relay) -> None:
        self._running[task.task_id] = reader
        settle = asyncio.get_running_loop().create_task(self._settle(task, reader, relay))
        self._settling.add(settle)
        settle.add_done_callback(self._settling.discard)

    async def _settle(self, task: Task, reader: asyncio.Task[Answered], relay: Relay) -> None:
        """Wait for the call's answer and move the task on with it; meanwhile, every poll interval, look
        whether another replica cancelled it (then close the call here), and store the call's newest
        progress with it (its ``statusMessage``)."""
        ctx = self.ctx
        told = task.message
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=self.poll_ms / 1000)
                if done:
                    break
                with contextlib.suppress(Exception):
                    stored = await self.store.get(task.task_id, ctx.clock())
                    if stored is None or stored.status is Status.CANCELLED:
                        reader.cancel()
                        with contextlib.suppress(BaseException):
                            await reader
                        return
                    if relay.message is not None and relay.message != told:
                        told = relay.message
                        news = plan.progressed(stored, told, ctx.clock())
                        if isinstance(news, Task):
                            await self.store.advance(news, Status.WORKING, ctx.clock())
            if reader.cancelled() and not self._closing:
                return  # tasks/cancel here: the task says so already
            nxt = self._outcome(task, reader)
            moved = isinstance(nxt, Task) and await self.store.advance(nxt, task.status, ctx.clock())
            if isinstance(nxt, Task) and moved and nxt.status in plan.TERMINAL:
                ctx.metrics.tasks.labels(nxt.status.value).inc()
        except Exception:  # a store that failed: the task stays as it was until it expires
            log.exception("task %s: its outcome could not be stored", task.task_id[:12])
        finally:
            if self._running.get(task.task_id) is reader:
                del self._running[task.task_id]

    def _outcome(self, task: Task, reader: asyncio.Task[Answered]) -> Task | plan.Refused | plan.Gone:
        now = self.ctx.clock()
        if reader.cancelled():  # the proxy stops: the call is closed with it
            error = {"code": -32603, "message": "the proxy stopped", "data": {"reason": "proxy_shutdown"}}
            return plan.advance(task, Event.FAILED, now, error=error, message="proxy_shutdown")
        exc = reader.exception()
        if exc is not None:
            reason = exc.reason if isinstance(exc, ProxyError) else "upstream_stream_lost"
            message = exc.message if isinstance(exc, ProxyError) else str(exc)
            error = {"code": -32603, "message": message, "data": {"reason": reason}}
            return plan.advance(task, Event.FAILED, now, error=error, message=reason)
        buffered = reader.result()
        response = buffered.response
        kind = plan.classify(response)
        if buffered.status != 200 or kind in (plan.Answer.MALFORMED, plan.Answer.UPSTREAM_TASK):
            error = {
                "code": -32603,
                "message": f"the upstream answered {buffered.status} without a result",
                "data": {"reason": "upstream_bad_response", "status": buffered.status},
            }
            return plan.advance(task, Event.FAILED, now, error=error, message="upstream_bad_response")
        if kind is plan.Answer.ERROR:
            return plan.advance(task, Event.FAILED, now, error=response["error"], message="upstream_error")
        result = response["result"]
        if kind is plan.Answer.INPUT_REQUIRED:
            return plan.advance(
                task,
                Event.INPUT_REQUIRED,
                now,
                input_requests=result.get("inputRequests"),
                request_state=result.get("requestState"),
            )
        return plan.advance(task, Event.ANSWERED, now, result=result)

    # -- tasks/cancel, tasks/update ----------------------------------------------------------------------

    async def _cancel(self, task: Task) -> dict[str, Any]:
        now = self.ctx.clock()
        nxt = plan.advance(task, Event.CANCEL, now, message="cancelled by the client")
        if isinstance(nxt, Task) and await self.store.advance(nxt, task.status, now):
            self.ctx.metrics.tasks.labels("cancelled").inc()
            reader = self._running.get(task.task_id)
            if reader is not None:
                reader.cancel()  # closes the upstream request: the call is cancelled there
            return plan.get_result(nxt, self.poll_ms)
        current = await self.store.get(task.task_id, now)  # finished first (or expired)
        if current is None:
            raise UnknownTask()
        if current.status in plan.TERMINAL:
            raise TaskFinished(current.status.value)
        return await self._cancel(current)  # moved on meanwhile (an update, an input request): again

    async def _update(self, request: web.Request, doc: dict[str, Any], task: Task) -> web.StreamResponse:
        responses = doc["params"].get("inputResponses")
        if not isinstance(responses, dict):
            raise InvalidTaskParams("inputResponses is not an object")
        now = self.ctx.clock()
        nxt = plan.advance(task, Event.UPDATE, now)
        if not isinstance(nxt, Task):
            raise TaskNotWaiting(task.status.value)
        if not await self.store.advance(nxt, task.status, now):
            raise TaskNotWaiting("changed")
        call = orjson.loads(task.call)
        retry = dict(call["params"])
        retry["inputResponses"] = responses
        if task.request_state is not None:
            retry["requestState"] = task.request_state
        body = orjson.dumps({**call, "params": retry})
        relay = Relay(self.ctx.settings.max_event_bytes, live=False)  # a retry's answer is the task's only
        reader = asyncio.get_running_loop().create_task(
            self._call(request.path_qs, retry_headers(request, retry.get("name")), body, call["id"], relay)
        )
        self._start_settling(nxt, reader, relay)
        return answer(doc["id"], {"resultType": "complete"})


def _failure(reader: asyncio.Task[Answered]) -> ProxyError:
    """Why a call's read ended without an answer."""
    if reader.cancelled():
        return UpstreamUnreachable("the call's answer was closed")
    exc = reader.exception()
    if isinstance(exc, ProxyError):
        return exc
    return UpstreamUnreachable(f"the call's answer was lost: {type(exc).__name__}")


def retry_headers(request: web.Request, tool: Any) -> list[tuple[str, str]]:
    """A tasks/update's headers, as the retried call's: it is a ``tools/call`` of its tool again."""
    drop = {"mcp-method", "mcp-name"}
    kept = [(n, v) for n, v in upstream_headers(request) if n.lower() not in drop]
    return [*kept, ("Mcp-Method", plan.TOOLS_CALL), *([("Mcp-Name", tool)] if isinstance(tool, str) else [])]


def answer(request_id: Any, result: dict[str, Any]) -> web.Response:
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "result": result})
    return web.Response(body=body, content_type="application/json")
