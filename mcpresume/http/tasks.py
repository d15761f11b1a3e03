"""Durable long calls carried out: a 2026-07-28 ``tools/call`` made a task the store keeps, and ``tasks/*``.

``core/tasks.py`` decides (which call may become a task, the lifecycle, the wire shapes); this module does
the I/O. ``Tasks.serve`` returns None for everything it leaves as today (``http/proxy.py`` then passes it
through), else its answer:

* An eligible call is forwarded without the extension and its whole answer read in a task of its own
  (``_call``). Answered within ``task_after``: the client gets that answer as the upstream gave it (status,
  headers, body; the body whole, not streamed). Not: a ``Task`` is stored (``TaskStore.create``, durable
  before the handle is returned, as the extension requires), the client gets its ``CreateTaskResult``,
  and the read goes on (``_settle``): the upstream's answer is never closed, which would cancel the call.
  A client that leaves before ``task_after`` cancels the call, as today.
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
from asyncio import FIRST_COMPLETED
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from mcpresume.core import tasks as plan
from mcpresume.core.credentials import credential_digest, credential_fields
from mcpresume.core.errors import ProxyError, UnknownTask, UpstreamBadResponse, UpstreamUnreachable
from mcpresume.core.jsonrpc import DISCOVER, proxy_request_id
from mcpresume.core.sse import SSEParser
from mcpresume.core.tasks import Event, Status, Task
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.forward import SSE, client_headers, upstream_headers
from mcpresume.http.incoming import Post, stateless
from mcpresume.store.tasks import MemoryTasks, RedisTasks, TaskStore

log = logging.getLogger("mcpresume.tasks")

NAME_HEADER: Final = "Mcp-Name"  # a tasks/* request's task id, for intermediaries (2026-07-28)
_FRAMING: Final = frozenset({"content-length", "transfer-encoding", "content-encoding"})
# How long the upstream's answer to server/discover (whether it makes tasks itself) is trusted: one
# round trip a minute at most, and an upstream redeployed with tasks is left to make them within a minute.
DISCOVER_EVERY: Final = 60.0
CLOSE_WAIT: Final = 2.0  # seconds the stop waits for the store to take the closed calls' tasks as failed


@dataclass(frozen=True, slots=True)
class Buffered:
    """The upstream's whole answer to a call: as the client gets it if it came within ``task_after``, and
    the JSON-RPC response in it (None if none)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    response: Any


class Progress:
    """A call's newest progress, as its reader saw it (``_settle`` stores it with the task)."""

    __slots__ = ("full", "handed", "message")

    def __init__(self) -> None:
        self.message: str | None = None
        self.handed = False  # the client got the task's handle: the answer's bytes are no longer kept
        self.full = asyncio.Event()  # an SSE answer outgrew max_event_bytes before task_after: a task now

    def seen(self, data: bytes) -> None:
        if b"notifications/progress" in data:
            with contextlib.suppress(orjson.JSONDecodeError):
                self.message = plan.progress_message(orjson.loads(data)) or self.message


def _dumps(doc: Any) -> str:
    return orjson.dumps(doc).decode()


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
        self._running: dict[str, asyncio.Task[Buffered]] = {}  # task id -> its upstream call read here
        self._settling: set[asyncio.Task[None]] = set()
        self._expired_seen = 0
        self._closing = False
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
        fields = credential_fields(request.headers.items(), self.ctx.settings.credential_headers)
        return credential_digest(fields).hex()

    def _count_expired(self) -> None:
        if isinstance(self.store, MemoryTasks) and self.store.expired != self._expired_seen:
            self.ctx.metrics.tasks.labels("expired").inc(self.store.expired - self._expired_seen)
            self._expired_seen = self.store.expired

    async def serve(self, post: Post) -> web.StreamResponse | None:
        """The answer, or None: the request goes as today."""
        request, message = post.request, post.message
        if not stateless(request, message) or len(message.methods) != 1:
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
        task_id = plan.task_id_of(doc.get("params"), request.headers.get(NAME_HEADER))
        if task_id is None or not plan.is_ours(task_id):
            return None  # the upstream's own task (or a malformed request): its answer, as today
        request[DID] = Action.TASK
        try:
            task = await self.store.get(task_id, self.ctx.clock())
            self._count_expired()
            if task is None or not secrets.compare_digest(task.owner, self._owner(request)):
                raise UnknownTask()
            if method == plan.TASKS_GET:
                self.ctx.metrics.task_polls.inc()
                return answer(doc["id"], plan.get_result(task, self.poll_ms))
            if method == plan.TASKS_CANCEL:
                return answer(doc["id"], await self._cancel(task))
            return await self._update(request, doc, task)
        except ProxyError as error:
            return self.ctx.reject(request, error, doc["id"])

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
        ctx = self.ctx
        request[DID] = Action.RELAYED
        call = orjson.dumps({**doc, "params": plan.upstream_params(doc["params"])})
        progress = Progress()
        reader = asyncio.get_running_loop().create_task(
            self._call(request.path_qs, upstream_headers(request), call, doc["id"], progress)
        )
        full = asyncio.get_running_loop().create_task(progress.full.wait())
        try:
            # A task at task_after, or sooner when the answer outgrows what may be held for the client.
            await asyncio.wait({reader, full}, timeout=ctx.settings.task_after, return_when=FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left before task_after: the call is cancelled, as today
            reader.cancel()
            raise
        finally:
            full.cancel()
        if not reader.done():
            now = ctx.clock()
            task_id = plan.TASK_ID_PREFIX + secrets.token_urlsafe(plan.TASK_ID_BYTES)
            task = plan.new_task(task_id, self._owner(request), call, now, ctx.settings.task_ttl)
            try:
                await self.store.create(task, now)
            except Exception as exc:  # the store cannot keep it: no handle; the client waits, as today
                log.warning("a task could not be stored (%s); the call is answered when it ends", exc)
            else:
                ctx.metrics.tasks.labels("created").inc()
                progress.handed = True
                self._start_settling(task, reader, progress)
                request[DID] = Action.TASK
                return answer(doc["id"], plan.created_result(task, self.poll_ms))
        try:
            buffered = await reader
        except ProxyError as error:
            return ctx.reject(request, error, doc["id"])
        if progress.handed:  # outgrew the buffer (and no task was made of it): the response alone
            if buffered.response is None:
                return ctx.reject(
                    request, UpstreamBadResponse("the call's answer ended without one"), doc["id"]
                )
            return web.json_response(buffered.response, status=buffered.status, dumps=_dumps)
        return web.Response(status=buffered.status, headers=buffered.headers, body=buffered.body)

    async def _call(
        self,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        request_id: Any,
        progress: Progress | None = None,
    ) -> Buffered:
        """Send the call and read its whole answer (a cancellation closes it: the upstream's cancel). An
        SSE answer is parsed as it comes (its progress, its response); once the task's handle was answered
        (``Progress.handed``) its bytes are no longer kept (nobody gets them as they came), only the
        response: a long call's many notifications do not add up against ``max_event_bytes``."""
        ctx = self.ctx
        limit = ctx.settings.max_event_bytes
        upstream = await ctx.upstream.request("POST", path_qs, headers, body, decoded=True)
        try:
            raw = bytearray()
            events = SSEParser(limit) if upstream.content_type == SSE else None
            found: Any = None
            try:
                async for chunk in upstream.content.iter_any():
                    if events is None or progress is None or not progress.handed:
                        raw += chunk  # a JSON answer is its response: kept whole
                        if events is not None and progress is not None and len(raw) > limit:
                            progress.handed = True  # an SSE answer too long to hold: a task now
                            progress.full.set()
                            raw.clear()
                    elif raw:
                        raw.clear()
                    if events is not None:
                        for event in events.feed(chunk):
                            if progress is not None:
                                progress.seen(event.data)
                            found = found or find_response("application/json", event.data, request_id, limit)
                    if len(raw) > limit:
                        raise UpstreamBadResponse(f"the call's answer is over {limit} bytes", limit=limit)
            except OSError as exc:
                raise UpstreamUnreachable(f"the call's answer was lost: {type(exc).__name__}") from None
            except Exception as exc:
                if isinstance(exc, ProxyError):
                    raise
                raise UpstreamUnreachable(f"the call's answer was lost: {type(exc).__name__}") from None
            kept = [(n, v) for n, v in client_headers(ctx, upstream) if n.lower() not in _FRAMING]
            body_bytes = bytes(raw)
            if events is None:
                found = find_response(upstream.content_type, body_bytes, request_id, limit)
            return Buffered(upstream.status, kept, body_bytes, found)
        except asyncio.CancelledError:
            upstream.close()  # closing the answer cancels the call upstream (2026-07-28)
            raise
        finally:
            upstream.release()

    def _start_settling(self, task: Task, reader: asyncio.Task[Buffered], progress: Progress) -> None:
        self._running[task.task_id] = reader
        settle = asyncio.get_running_loop().create_task(self._settle(task, reader, progress))
        self._settling.add(settle)
        settle.add_done_callback(self._settling.discard)

    async def _settle(self, task: Task, reader: asyncio.Task[Buffered], progress: Progress) -> None:
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
                    if progress.message is not None and progress.message != told:
                        told = progress.message
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

    def _outcome(self, task: Task, reader: asyncio.Task[Buffered]) -> Task | plan.Refused | plan.Gone:
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
        current = await self.store.get(task.task_id, now)  # finished first (or expired): as it stands
        if current is None:
            raise UnknownTask()
        return plan.get_result(current, self.poll_ms)

    async def _update(self, request: web.Request, doc: dict[str, Any], task: Task) -> web.StreamResponse:
        params = doc.get("params") or {}
        responses = params.get("inputResponses")
        now = self.ctx.clock()
        nxt = plan.advance(task, Event.UPDATE, now)
        if not isinstance(responses, dict) or not isinstance(nxt, Task):
            return self.ctx.reject(request, TaskNotWaiting(task.status.value), doc["id"])
        if not await self.store.advance(nxt, task.status, now):
            return self.ctx.reject(request, TaskNotWaiting("changed"), doc["id"])
        call = orjson.loads(task.call)
        retry = dict(call["params"])
        retry["inputResponses"] = responses
        if task.request_state is not None:
            retry["requestState"] = task.request_state
        body = orjson.dumps({**call, "params": retry})
        progress = Progress()
        progress.handed = True  # a retry's answer goes to the task only
        reader = asyncio.get_running_loop().create_task(
            self._call(request.path_qs, retry_headers(request, retry.get("name")), body, call["id"], progress)
        )
        self._start_settling(nxt, reader, progress)
        return answer(doc["id"], {"resultType": "complete"})


class TaskNotWaiting(ProxyError):
    """400: a ``tasks/update`` for a task that is not waiting for input (or without ``inputResponses``)."""

    status = 400
    reason = "task_not_waiting"

    def __init__(self, status: str) -> None:
        super().__init__("the task is not waiting for input", status=status)


def retry_headers(request: web.Request, tool: Any) -> list[tuple[str, str]]:
    """A tasks/update's headers, as the retried call's: it is a ``tools/call`` of its tool again."""
    drop = {"mcp-method", "mcp-name"}
    kept = [(n, v) for n, v in upstream_headers(request) if n.lower() not in drop]
    return [*kept, ("Mcp-Method", plan.TOOLS_CALL), *([("Mcp-Name", tool)] if isinstance(tool, str) else [])]


def answer(request_id: Any, result: dict[str, Any]) -> web.Response:
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "result": result})
    return web.Response(body=body, content_type="application/json")
