"""``upstream_session_lost = "reinitialize"``: the recording of what it takes to begin a session again
upstream (``core/reinit.py`` decides what a request adds to a session's recipe; this module keeps it in the
store, by compare-and-set, so two requests of one session on two replicas never lose each other's).

Recorded only on an ``initialize`` that began a session and on the session-shaping requests
(``core.reinit.SHAPING``) the upstream answered 2xx, and when a standalone GET opens: under the default
``end`` nothing is parsed and the store is never asked. A shaping request is recorded once the upstream
took it (2xx), before its JSON-RPC answer: one the upstream answers with an error is replayed into the same
error, which leaves the new upstream session as the old one was.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from mcpresume.core.errors import ProxyError, UpstreamSessionLost, UpstreamTimeout, UpstreamUnreachable
from mcpresume.core.headers import PROTOCOL_VERSION_HEADER, SESSION_HEADER
from mcpresume.core.jsonrpc import proxy_request_id
from mcpresume.core.reinit import (
    INITIALIZED,
    SHAPING,
    Outcome,
    Recipe,
    Step,
    begin,
    fold,
    judge,
    list_changed,
    replay,
    told,
    with_standalone,
)
from mcpresume.core.session import NewEvent, SessionAccess
from mcpresume.core.sse import SSEParser, frame_body
from mcpresume.core.window import EventKind
from mcpresume.http.context import ProxyContext
from mcpresume.http.forward import upstream_headers
from mcpresume.process.logs import log_id
from mcpresume.streams.pool import PooledAnswer

log = logging.getLogger("mcpresume.proxy")

FIRST_STREAM: Final = 1  # a session's first stream: its initialize's answer, when it was an SSE stream
ATTEMPTS: Final = 8  # compare-and-set rounds before giving up (each lost round: another writer progressed)


def recording(ctx: ProxyContext) -> bool:
    return ctx.settings.upstream_session_lost == "reinitialize"


def _messages(body: bytes) -> list[Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    return doc if isinstance(doc, list) else [doc]


async def began(ctx: ProxyContext, session_id: str, epoch: str, body: bytes) -> None:
    """An ``initialize`` began the session: its params start the recipe."""
    if not recording(ctx):
        return
    params = next(
        (m.get("params") for m in _messages(body) if isinstance(m, dict) and m.get("method") == "initialize"),
        None,
    )
    recipe = begin(params)
    if recipe is not None:
        await _keep(ctx, session_id, epoch, lambda _: recipe, first=True)


async def shaped(
    ctx: ProxyContext, session_id: str, epoch: str, methods: tuple[str, ...], body: bytes
) -> None:
    """The upstream answered 2xx to a POST of the session: its shaping requests folded into the recipe;
    its ``notifications/initialized``: what the initialize's answer told the client, kept with it."""
    if not recording(ctx):
        return
    if INITIALIZED in methods:
        await _told(ctx, session_id, epoch)
    if SHAPING.isdisjoint(methods):
        return
    requests = [
        (m["method"], m.get("params"))
        for m in _messages(body)
        if isinstance(m, dict) and m.get("method") in SHAPING and "id" in m
    ]

    def change(recipe: Recipe) -> Recipe | None:
        changed = None
        for method, params in requests:
            changed = fold(changed or recipe, method, params) or changed
        return changed

    await _keep(ctx, session_id, epoch, change)


async def _told(ctx: ProxyContext, session_id: str, epoch: str) -> None:
    """The initialize's answer, as its SSE stream (the session's first) kept it: the protocol version and
    the capabilities the client was told, which a new upstream is judged by (``core.reinit.judge``). Once
    per session (the client's ``notifications/initialized``); an answer not kept (a JSON one, evicted)
    leaves the recipe without them."""
    try:
        kept = await ctx.store.read(session_id, [FIRST_STREAM], 0)
    except ProxyError:
        return
    if kept is None:
        return
    parser = SSEParser(ctx.settings.max_event_bytes)
    answer: Any = None
    for event in parser.feed(kept.body()):
        try:
            doc = orjson.loads(event.data) if event.data else None
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
            answer = doc["result"]
            break
    if answer is not None:
        await _keep(ctx, session_id, epoch, lambda recipe: told(recipe, answer))


async def standalone_opened(ctx: ProxyContext, session_id: str, epoch: str, stream: int) -> None:
    """A standalone GET of the session opened upstream (stream ``stream``, its pump not started yet):
    kept with the recipe, and the client told of a re-initialization's list changes first."""
    if recording(ctx):
        await _keep(ctx, session_id, epoch, lambda recipe: with_standalone(recipe, True))
        names = ctx.list_changes.pop(session_id, ())
        if names:
            await _notify(ctx, session_id, stream, names)


async def _notify(ctx: ProxyContext, session_id: str, stream: int, names: tuple[str, ...]) -> None:
    """The ``*/list_changed`` notifications appended to a standalone stream of the session (the new upstream
    may list other tools, prompts, resources: the client lists them again)."""
    events = [
        NewEvent(frame_body(orjson.dumps({"jsonrpc": "2.0", "method": name})), EventKind.MESSAGE)
        for name in names
    ]
    try:
        await ctx.store.append(session_id, stream, events, ctx.clock())
    except ProxyError as error:
        log.warning("session %s: list changes not sent: %s", log_id(session_id), error.message)


async def told_list_changes(ctx: ProxyContext, session_id: str, recipe: Recipe) -> None:
    """After a re-initialization: the notifications the capabilities the client was told allow, on the
    session's live standalone stream, or on the next one opened here (``standalone_opened``)."""
    names = list_changed(recipe)
    if not names:
        return
    try:
        stream = await ctx.store.standalone_stream(session_id)
    except ProxyError:
        stream = None
    if stream is None:
        ctx.list_changes[session_id] = names
    else:
        await _notify(ctx, session_id, stream, names)


async def _keep(
    ctx: ProxyContext,
    session_id: str,
    epoch: str,
    change: Callable[[Recipe], Recipe | None],
    *,
    first: bool = False,
) -> None:
    """Read, change, compare-and-set, again while another writer wins. A session without a recipe (begun
    before the setting, or its initialize unreadable) gets none here: there is nothing to begin again from.
    A store that does not answer costs the recipe, never the request: it is logged."""
    store = ctx.store
    try:
        for _ in range(ATTEMPTS):
            held = None if first else await store.recipe(session_id, epoch)
            if held is None and not first:
                return
            changed = change(Recipe.decode(held) if held is not None else Recipe(params={}))
            if changed is None:
                return
            if await store.keep_recipe(session_id, epoch, held, changed.encode()):
                return
            first = False
    except ProxyError as error:
        log.warning("session %s: its recipe was not kept: %s", log_id(session_id), error.message)
        return
    log.warning(
        "session %s: its recipe was not kept: %d writers in a row came first", log_id(session_id), ATTEMPTS
    )


# -- beginning the session again upstream --------------------------------------------------------------------

_NOT_CARRIED: Final = frozenset(
    {"mcp-session-id", "mcp-protocol-version", "last-event-id", "content-type", "accept", "content-length"}
)


@dataclass(frozen=True, slots=True)
class Begun:
    """A re-initialization's end: its ``outcome``, and the upstream's new session id when it succeeded."""

    outcome: Outcome
    upstream_id: str | None = None
    version: str | None = None


async def begin_again(
    ctx: ProxyContext, path_qs: str, credentials: Sequence[tuple[str, str]], recipe: Recipe
) -> Begun:
    """Begin the session again upstream from its recipe (``core.reinit.replay``): ``initialize`` with the
    recorded params, ``notifications/initialized``, the shaping requests, each with ``credentials`` (the
    triggering request's headers, never stored ones). The new upstream's answer is judged against what the
    client was told (``core.reinit.judge``); a session it began that cannot serve the client is ended there
    (DELETE). Counted (``mcpresume_upstream_reinitializations_total{outcome}``) and logged, one line."""
    base = [(n, v) for n, v in credentials if n.lower() not in _NOT_CARRIED]
    base += [("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")]
    begun = await _handshake(ctx, path_qs, base, recipe)
    if begun.outcome is not Outcome.REINITIALIZED:  # a success is counted once mapped (``recover``)
        ctx.metrics.upstream_reinitializations.labels(begun.outcome.value).inc()
    return begun


async def _handshake(ctx: ProxyContext, path_qs: str, base: list[tuple[str, str]], recipe: Recipe) -> Begun:
    steps = replay(recipe)
    try:
        status, upstream_id, result = await _send(ctx, path_qs, base, steps[0], "initialize")
    except ProxyError as error:
        log.warning("re-initialization failed: the upstream's initialize: %s", error.message)
        return Begun(Outcome.REFUSED)
    if not 200 <= status < 300 or upstream_id is None:
        log.warning("re-initialization refused: the upstream answered initialize with %d", status)
        return Begun(Outcome.REFUSED)
    in_session = [*base, (SESSION_HEADER, upstream_id)]
    outcome = judge(recipe, result)
    if outcome is not Outcome.REINITIALIZED:
        log.warning(
            "re-initialization refused: %s (upstream session %s ended)", outcome.value, log_id(upstream_id)
        )
        await _end(ctx, path_qs, in_session)
        return Begun(outcome)
    version = result["protocolVersion"]
    in_session.append((PROTOCOL_VERSION_HEADER, version))
    for step in steps[1:]:
        try:
            status, _, _ = await _send(ctx, path_qs, in_session, step, step.method)
        except ProxyError as error:
            status = 0
            log.warning("re-initialization: %s failed: %s", step.method, error.message)
        if not 200 <= status < 300:
            await _end(ctx, path_qs, in_session)
            return Begun(Outcome.REFUSED)
    return Begun(Outcome.REINITIALIZED, upstream_id, version)


async def _send(
    ctx: ProxyContext, path_qs: str, headers: list[tuple[str, str]], step: Step, purpose: str
) -> tuple[int, str | None, Any]:
    """One step sent; (status, the answer's session id, the JSON-RPC result of a request: None for a
    notification or an error answer). A request's answer is read to its response (JSON, or an SSE stream),
    within ``first_byte_timeout``, never more than ``max_event_bytes`` of it."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": step.method}
    request_id = None
    if not step.notification:
        request_id = proxy_request_id(purpose.replace("/", "-"), secrets.token_hex(8))
        message["id"] = request_id
    if step.params is not None:
        message["params"] = step.params
    answer = await ctx.upstream.request("POST", path_qs, headers, orjson.dumps(message), decoded=True)
    try:
        session_id = answer.headers.get(SESSION_HEADER)
        if request_id is None or not 200 <= answer.status < 300:
            return answer.status, session_id, None
        limit = ctx.settings.max_event_bytes
        try:
            async with asyncio.timeout(ctx.settings.first_byte_timeout):
                result = await _result(answer, request_id, limit)
        except TimeoutError:
            raise UpstreamTimeout(f"the upstream did not answer {step.method} in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(
                f"the upstream's answer to {step.method} failed: {type(exc).__name__}"
            ) from None
        return answer.status, session_id, result
    finally:
        answer.release()


async def _result(answer: PooledAnswer, request_id: str, limit: int) -> Any:
    """The ``result`` of the response to ``request_id`` in a JSON or SSE answer (None: an error, or none)."""

    def of(doc: Any) -> tuple[bool, Any]:
        if isinstance(doc, dict) and doc.get("id") == request_id and "method" not in doc:
            return True, doc.get("result")
        return False, None

    if answer.content_type == "text/event-stream":
        parser = SSEParser(limit)
        async for chunk in answer.content.iter_any():
            for event in parser.feed(chunk):
                if not event.data:
                    continue
                try:
                    found, result = of(orjson.loads(event.data))
                except orjson.JSONDecodeError:
                    continue
                if found:
                    return result
        return None
    body = await answer.content.read(limit + 1)
    if len(body) > limit:
        return None
    try:
        return of(orjson.loads(body))[1]
    except orjson.JSONDecodeError:
        return None


async def _end(ctx: ProxyContext, path_qs: str, headers: list[tuple[str, str]]) -> None:
    """End an upstream session the client will not use (a judged-out or half-replayed re-initialization)."""
    try:
        ended = await ctx.upstream.request("DELETE", path_qs, headers, None, decoded=True)
        ended.release()
    except ProxyError as error:
        log.warning("a re-initialized upstream session was not ended: %s", error.message)


# -- the recovery of a POST that met the upstream's 404 ------------------------------------------------------


def learn(ctx: ProxyContext, session_id: str, granted: SessionAccess | None) -> None:
    """A session begun again upstream (by any replica, as its access read from the store says): its
    requests from here carry the upstream's id, and its standalone stream, if its pump here waits for that,
    opens again there."""
    if granted is not None and granted.upstream_id is not None:
        _mapped(ctx, session_id, granted.upstream_id)


def _mapped(ctx: ProxyContext, session_id: str, upstream_id: str) -> None:
    if ctx.upstream.aliases.get(session_id) != upstream_id:
        ctx.upstream.aliases[session_id] = upstream_id
        ctx.pumps.begun_again(session_id)


def forget(ctx: ProxyContext, session_id: str) -> None:
    ctx.upstream.aliases.pop(session_id, None)


async def recover(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess
) -> SessionAccess | UpstreamSessionLost:
    """The upstream answered 404 to a request of a session it served (it lost it): begin it again there
    from its recipe with this request's credentials, and map the client's id to the upstream's new one by
    compare-and-set (the replica that loses ends the upstream session it began, and uses the winner's).
    The access the request is forwarded again with, or why the session ends instead. Requests of one
    session that meet the 404 together here share one re-initialization."""
    running = ctx.reinitializing.get(session_id)
    if running is None:
        running = asyncio.ensure_future(_recover(ctx, request, session_id, granted))
        ctx.reinitializing[session_id] = running
        running.add_done_callback(lambda _: ctx.reinitializing.pop(session_id, None))
    again: SessionAccess | UpstreamSessionLost = await asyncio.shield(running)
    return again


async def _recover(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess
) -> SessionAccess | UpstreamSessionLost:
    store = ctx.store
    try:
        fresh = await store.access(session_id)
        if fresh is None or fresh.epoch != granted.epoch:
            return UpstreamSessionLost(outcome="ended_meanwhile")
        if fresh.upstream_id != granted.upstream_id:  # begun again since this request was read: use it
            learn(ctx, session_id, fresh)
            return fresh
        kept = await store.recipe(session_id, granted.epoch)
    except ProxyError as error:
        log.warning("session %s: its recipe could not be read: %s", log_id(session_id), error.message)
        return UpstreamSessionLost(outcome=Outcome.REFUSED.value)
    if kept is None:  # begun before the setting, or its initialize was unreadable: nothing to begin from
        return UpstreamSessionLost(outcome="no_recipe")
    recipe = Recipe.decode(kept)
    begun = await begin_again(ctx, request.path_qs, upstream_headers(request), recipe)
    if begun.upstream_id is None:
        log.warning("session %s: not begun again upstream: %s", log_id(session_id), begun.outcome.value)
        return UpstreamSessionLost(outcome=begun.outcome.value)
    upstream_id = begun.upstream_id
    try:
        won = await store.map_upstream(session_id, granted.epoch, granted.upstream_id, upstream_id)
        if not won:  # another replica began it again first: its upstream session is the session's
            await _end(ctx, request.path_qs, [*upstream_headers(request), (SESSION_HEADER, upstream_id)])
            fresh = await store.access(session_id)
            if fresh is None or fresh.epoch != granted.epoch or fresh.upstream_id is None:
                return UpstreamSessionLost(outcome="ended_meanwhile")
            upstream_id = fresh.upstream_id
    except ProxyError as error:
        log.warning(
            "session %s: not mapped to its new upstream session: %s", log_id(session_id), error.message
        )
        return UpstreamSessionLost(outcome=Outcome.REFUSED.value)
    _mapped(ctx, session_id, upstream_id)  # and its standalone stream, waiting here, opens again there
    outcome = Outcome.REINITIALIZED if won else Outcome.SUPERSEDED
    ctx.metrics.upstream_reinitializations.labels(outcome.value).inc()
    if won:
        await told_list_changes(ctx, session_id, recipe)
        log.info(
            "session %s: begun again upstream (its upstream lost it): upstream session %s; the client's id, "
            "cursors and window unchanged",
            log_id(session_id),
            log_id(upstream_id),
        )
    return replace(
        granted, upstream_id=upstream_id, protocol_version=begun.version or granted.protocol_version
    )


async def keep(
    ctx: ProxyContext, session_id: str, epoch: str, change: Callable[[Recipe], Recipe | None]
) -> None:
    """A change to a session's kept recipe by compare-and-set, whatever the setting: the era bridge's
    sessions keep their client's facts in it (``http/bridge.py``)."""
    await _keep(ctx, session_id, epoch, change)
