"""The era bridge: core/bridge.py's decisions carried out for handshake-era clients of a modern-only upstream.

With ``bridge = "auto"`` the proxy learns the upstream's era (``core/era.py``) by the spec's probe, a
``server/discover`` at 2026-07-28, sent at start (in the background, again while the upstream does not answer
it) and again when the upstream's behaviour changes (``Bridge.refused_handshake``, ``Bridge.took_handshake``).
An upstream that speaks 2026-07-28 and refuses a client's ``initialize`` as a modern-only server does (-32022)
is modern-only: that ``initialize`` and every later one answered by the bridge, never sent upstream again.
A request before the probe's answer learns it the same way: the refusal, then the probe. A dual-era upstream
sees the probe (a modern request, harmless) and otherwise exactly the traffic it would without the bridge.

A bridged session is the proxy's own: the ``initialize`` is answered here (the session id minted here and
kept in the store like any session), and every request of the session goes through ``Posts.serve`` as any
request does (claimed exactly once per id, its SSE answer a stream of the session read by a pump into the
window), only sent upstream as a 2026-07-28 request (``Post.bridged``: its headers; its body with the
envelope in ``_meta``). An ``application/json`` answer becomes a one-event stream of the session
(``retain``), resumable like any. DELETE ends the proxy's session (the upstream has none).

A bridged session's client facts (its ``initialize`` params: the client's info and capabilities; the version
it was answered with, the capabilities it was told; its log level) are kept with the session in the store,
as the session's recipe (``core.reinit.Recipe``, ``bridged``; ``core.bridge.bridged_recipe``): a replica that
serves the session after a takeover or a restart reads them there once, then from its own copy
(``Bridge.sessions``), so a request costs no store call for them. Whether a session is bridged is the same
read: no recipe, or one not bridged, is a session of the upstream's (remembered too, so asked once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from mcpresume.core.bridge import (
    ClientFacts,
    HeldAnswer,
    InputRequired,
    Local,
    Refuse,
    bridged_recipe,
    client_requests,
    discover_request,
    facts_of_initialize,
    facts_of_recipe,
    initialize_result,
    input_required,
    listen_filter,
    listen_request,
    retry_body,
    subscribable,
    treat,
)
from mcpresume.core.era import (
    MODERN_VERSION,
    Era,
    UpstreamEra,
    discover_lists_handshake,
    discover_offers_modern,
    initialize_refused,
    upstream_era,
)
from mcpresume.core.errors import (
    SERVER_ERROR,
    BadRequest,
    ProxyError,
    TooManySessions,
    UnknownSession,
    UpstreamBadResponse,
)
from mcpresume.core.headers import LAST_EVENT_ID_HEADER, PROTOCOL_VERSION_HEADER, SESSION_HEADER
from mcpresume.core.jsonrpc import error_response, proxy_request_id, request_key, response_key
from mcpresume.core.reinit import SET_LEVEL, Recipe, fold
from mcpresume.core.session import NewEvent, SessionAccess, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind
from mcpresume.http import reinit
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.credentials import MODERN_CHECK, authorize, begins_with
from mcpresume.http.forward import relay, upstream_headers
from mcpresume.http.incoming import SSE_HEADERS, Post, pump_record
from mcpresume.http.listen import GeneratedBody, ListenAnswer
from mcpresume.http.view import ViewPlan, attach_view
from mcpresume.process.logs import log_id
from mcpresume.streams.pool import PooledAnswer
from mcpresume.streams.pump import PumpJob
from mcpresume.streams.starter import PumpStarter
from mcpresume.streams.upstream import UpstreamAnswer

log = logging.getLogger("mcpresume.bridge")

JSON: Final = "application/json"
SSE: Final = "text/event-stream"
# The headers a bridged request is not sent with: the session is the proxy's, the version and the
# length are the translated request's, a cursor means nothing to a modern upstream.
_DROPPED: Final = frozenset(
    h.lower() for h in (SESSION_HEADER, PROTOCOL_VERSION_HEADER, LAST_EVENT_ID_HEADER, "content-length")
)


class BatchNotBridged(BadRequest):
    reason = "batch_not_bridged"


# The era probe at start, again while the upstream does not answer it: after 0.5 s, doubling up to 30 s (a
# sidecar's upstream that starts beside it answers within seconds; one down for long is asked twice a minute).
PROBE_RETRY_FIRST: Final = 0.5
PROBE_RETRY_MAX: Final = 30.0

# Input requests (MRTR) awaiting a client's answer, all sessions: a bound on what clients that never answer
# leave behind (each a few hundred bytes plus the request it retries).
MAX_AWAITING: Final = 4096

ServePost = Callable[[Post], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Bridged:
    """A bridged session as this process holds it: what the store keeps of it (its incarnation, its recipe)
    and the facts every request of it carries upstream."""

    epoch: str
    recipe: Recipe
    facts: ClientFacts


@dataclass(frozen=True, slots=True)
class Refused:
    """The client answered one of the input requests with an error: the request's answer is that error."""

    error: Any


@dataclass(slots=True)
class Awaiting:
    """A bridged request whose upstream asked for input (MRTR): the client's answers being collected.
    ``outcome`` is set once: every answer by its key, ``Refused``, or None (the request was cancelled, its
    session ended: no answer)."""

    session_id: str
    request_key: str | None
    keys: dict[str, str]  # the proxy's request id -> the input request's key
    outcome: asyncio.Future[dict[str, Any] | Refused | None]
    answers: dict[str, Any] = field(default_factory=dict)  # key -> the client's result

    def settle(self, outcome: dict[str, Any] | Refused | None) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)


class Bridge:
    def __init__(self, ctx: ProxyContext, starter: PumpStarter) -> None:
        self.ctx = ctx
        self.starter = starter  # a JSON answer asking for input is pumped as an SSE one (``retain``)
        self.era = UpstreamEra.UNKNOWN
        self.discover: dict[str, Any] | None = None  # the upstream's server/discover result
        # What the era is learnt of (core/era.py's table): the probe's last answer, and what the upstream
        # last did with the handshake era (refused, took it; None: not seen yet).
        self._discover_modern: bool | None = None
        self._lists_handshake = False
        self._refused: bool | None = None
        self._prober: asyncio.Task[None] | None = None
        self._unanswered = ""  # why the last probe got no answer
        # The sessions this process served: bridged (their facts), or None (the upstream's own). A copy of
        # what the store keeps, bounded as the store is (max_sessions).
        self.sessions: dict[str, Bridged | None] = {}
        self._probe_lock = asyncio.Lock()
        self._told_modern = False  # the one log line on modern traffic passed through
        self.awaiting: dict[str, Awaiting] = {}  # the proxy's input request ids -> their request
        self.listens: dict[str, set[ListenAnswer]] = {}  # the open standalone GETs, by session
        self._counters: dict[tuple[Era, str], Any] = {}

    @property
    def on(self) -> bool:
        return self.ctx.settings.bridge == "auto"

    # -- the era ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """At start (``bridge = "auto"``): the era probe, in the background until the upstream answers it
        (an upstream not up yet delays nothing: a request before its answer learns the era the old way, on
        a refused ``initialize``)."""
        if self.on:
            loop = asyncio.get_running_loop()
            self._prober = loop.create_task(self._probe_at_start(), name="mcpresume-era")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober

    async def _probe_at_start(self) -> None:
        wait = PROBE_RETRY_FIRST
        while self._discover_modern is None and await self.probe(quiet=True) is UpstreamEra.UNKNOWN:
            if wait == PROBE_RETRY_FIRST:  # one line, not one per round
                log.info(
                    "the era probe is not answered (%s): asked again in the background; meanwhile a client's "
                    "initialize the upstream refuses is probed for",
                    self._unanswered,
                )
            await asyncio.sleep(wait)
            wait = min(wait * 2, PROBE_RETRY_MAX)

    async def probe(self, *, quiet: bool = False) -> UpstreamEra:
        """The spec's era probe, ``server/discover`` at 2026-07-28 (once at a time): the era again, of its
        answer and of what the upstream last did with the handshake era (``core.era``'s table)."""
        async with self._probe_lock:
            headers = [
                ("Content-Type", JSON),
                ("Accept", f"{JSON}, text/event-stream"),
                (PROTOCOL_VERSION_HEADER, MODERN_VERSION),
                ("Mcp-Method", "server/discover"),
            ]
            status, body = await self._ask(headers, discover_request(0))
            if status >= 500 and not quiet:
                log.warning("the era probe (server/discover) is not answered: %s", self._unanswered)
            self._discover_modern = discover_offers_modern(status, body)
            self._lists_handshake = discover_lists_handshake(body)
            if self._discover_modern:
                assert isinstance(body, dict)
                self.discover = body["result"]
            return self._learnt()

    async def refused_handshake(self) -> UpstreamEra:
        """The upstream refused a client's ``initialize`` as a modern-only server does: the era learnt of
        it; probed again first when that is news (an upstream believed dual-era or handshake-era, or whose
        probe has not answered yet): the upstream changed, its discover may have too."""
        news = self.era in (UpstreamEra.UNKNOWN, UpstreamEra.HANDSHAKE, UpstreamEra.DUAL)
        self._refused = True
        return await self.probe() if news else self._learnt()

    def took_handshake(self) -> None:
        """The upstream took a handshake-era request (an ``initialize`` answered 2xx, say): the era learnt of
        it; probed again when that is news (an upstream believed modern-only)."""
        if self._refused is False:
            return  # known already: the common case, nothing to do
        self._refused = False
        if self.era is UpstreamEra.MODERN_ONLY:
            self.ctx.drain.spawn(self._probe_again(), "mcpresume-era")
        else:
            self._learnt()

    async def _probe_again(self) -> None:
        await self.probe()

    def _learnt(self) -> UpstreamEra:
        era = upstream_era(self._discover_modern, self._refused, self._lists_handshake)
        if era is not self.era:  # one line when the era is learnt, or changes
            was = "" if self.era is UpstreamEra.UNKNOWN else f" (was {self.era.value})"
            self.era = era
            log.info("the upstream's era: %s%s%s", era.value, was, self._era_note())
        return era

    def _era_note(self) -> str:
        if self.era is UpstreamEra.MODERN:
            return " (it speaks 2026-07-28; a client's initialize tells whether it takes the handshake era)"
        if self.era is UpstreamEra.MODERN_ONLY:
            return (
                " (it refuses the handshake era: handshake-era clients get the proxy's own sessions, bridged)"
                if self.on
                else " (it refuses the handshake era and bridge = off: handshake-era clients get its refusal)"
            )
        return ""

    async def _ask(self, headers: list[tuple[str, str]], message: dict[str, Any]) -> tuple[int, object]:
        """One probe: the status and the JSON-RPC answer (of a JSON body, or an SSE one's last message)."""
        path = self.ctx.upstream.mcp_path
        try:
            answer = await self.ctx.upstream.request(
                "POST", path, headers, orjson.dumps(message), decoded=True
            )
        except ProxyError as error:
            self._unanswered = error.message
            return 599, None
        try:
            text = await answer.read()
        except (aiohttp.ClientError, OSError) as error:
            self._unanswered = f"its answer broke off: {error}"
            return 599, None
        finally:
            answer.release()
        self._unanswered = f"HTTP {answer.status}"
        return answer.status, _last_message(text)

    # -- requests ---------------------------------------------------------------------------------------

    async def serve(self, post: Post, serve_post: ServePost) -> web.StreamResponse | None:
        """The answer of a bridged POST; None for one served as without the bridge (counted either way)."""
        request, message, session_id = post.request, post.message, post.session_id
        if post.stateless:
            self._count(Era.MODERN, "passed_through")
            if not self._told_modern:
                self._told_modern = True
                log.info(
                    "a 2026-07-28 request is passed through as is: that revision has no sessions and no "
                    "resumption (closing its stream cancels it), so the proxy keeps nothing for it and "
                    "resumes nothing; handshake-era clients get sessions and resumption"
                )
            return None
        if not self.on:
            self._count(
                Era.HANDSHAKE, "resumable" if session_id or message.is_initialize else "passed_through"
            )
            return None
        if message.is_initialize and session_id is None:
            if self.era is UpstreamEra.MODERN_ONLY:
                self._count(Era.HANDSHAKE, "bridged")
                return await self._initialize(post)
            request[BRIDGE] = self  # a refusal of it is bridged (``bridged_answer``); counted once served
            return None
        if session_id is None:
            bridged = None
        elif session_id in self.sessions:  # the common case: no coroutine, no store call
            bridged = self.sessions[session_id]
        else:
            bridged = await self.bridged(session_id)
        if session_id is None or bridged is None:
            self._count(Era.HANDSHAKE, "resumable" if session_id else "passed_through")
            return None
        self._count(Era.HANDSHAKE, "bridged")
        return await self._in_session(post, session_id, bridged, serve_post)

    async def bridged(self, session_id: str) -> Bridged | None:
        """The session when it is bridged (None: the upstream's own, or unknown): this process's copy, else
        what the store keeps (a session begun on another replica, before a restart)."""
        if session_id in self.sessions:
            return self.sessions[session_id]
        store = self.ctx.store
        granted = await store.access(session_id)
        if granted is None:
            return None  # unknown: not remembered (the request's own path answers 404)
        kept = await store.recipe(session_id, granted.epoch)
        recipe = Recipe.decode(kept) if kept is not None else None
        facts = facts_of_recipe(recipe) if recipe is not None else None
        found = Bridged(granted.epoch, recipe, facts) if recipe is not None and facts is not None else None
        self._remember(session_id, found)
        return found

    def _remember(self, session_id: str, session: Bridged | None) -> None:
        self.sessions[session_id] = session
        # Bounded: the store never holds more than max_sessions sessions, so the oldest beyond are gone
        # (reaped, or deleted on another replica).
        while len(self.sessions) > self.ctx.settings.max_sessions:
            del self.sessions[next(iter(self.sessions))]

    def served(self, post: Post, response: web.StreamResponse) -> None:
        """An ``initialize`` served as without the bridge, counted now that it is known whether the bridge
        answered it after the upstream refused it; a session the upstream began remembered as not bridged
        (its requests ask the store nothing more)."""
        if self.on and post.message.is_initialize and post.session_id is None:
            bridged = post.request.get(DID) is Action.ANSWERED
            self._count(Era.HANDSHAKE, "bridged" if bridged else "resumable")
            began = response.headers.get(SESSION_HEADER)
            if not bridged and began is not None and 200 <= response.status < 300:
                self._remember(began, None)
                self.took_handshake()
        elif (
            self.era is UpstreamEra.MODERN_ONLY
            and post.request.get(DID, Action.FORWARDED) is Action.FORWARDED  # marked nothing: forwarded
            and 200 <= response.status < 300
        ):  # a handshake-era request of a session of the upstream's own, taken: not modern-only after all
            self.took_handshake()

    def tasked(self) -> None:
        """A 2026-07-28 request served by the tasks path (``http/tasks.py``): a long call it watched or made
        a task, a ``tasks/*`` it answered."""
        self._count(Era.MODERN, "task")

    def _count(self, era: Era, treatment: str) -> None:
        child = self._counters.get((era, treatment))
        if child is None:  # once per label pair: every POST is counted, the lookup stays off its path
            child = self._counters[(era, treatment)] = self.ctx.metrics.era_requests.labels(
                era.value, treatment
            )
        child.inc()

    async def after_refusal(self, post: Post, upstream: PooledAnswer) -> web.StreamResponse:
        """A client's ``initialize`` the upstream refused (4xx): when it refuses the handshake era (and
        `server/discover` says it speaks 2026-07-28), answered by the bridge; else its refusal as it came."""
        try:
            body = await upstream.read()
        finally:
            upstream.release()
        refused = initialize_refused(upstream.status, _last_message(body))
        if refused and await self.refused_handshake() is UpstreamEra.MODERN_ONLY:
            return await self._initialize(post)
        return web.Response(status=upstream.status, body=body, content_type=JSON)

    async def _initialize(self, post: Post) -> web.StreamResponse:
        ctx, request = self.ctx, post.request
        doc = orjson.loads(post.body)
        if isinstance(doc, list):
            return ctx.reject(request, BatchNotBridged("an initialize in a batch is not bridged"), None)
        request_id = doc.get("id")
        if self.discover is None:
            return ctx.reject(
                request, UpstreamBadResponse("the upstream's server/discover is unknown"), request_id
            )
        limit = ctx.settings.max_sessions
        if await ctx.store.session_count() >= limit:
            await ctx.store.reap(ctx.clock())  # expired sessions make room before anyone is refused
            if await ctx.store.session_count() >= limit:
                refusal = TooManySessions(
                    f"the proxy holds its maximum of {limit} sessions", max_sessions=limit
                )
                return ctx.reject(request, refusal)
        facts = facts_of_initialize(doc.get("params"))
        session_id = secrets.token_urlsafe(32)  # visible ASCII, cryptographically random (the spec's SHOULD)
        owner = ctx.settings.replica if ctx.hop is not None else ""
        result = initialize_result(facts, self.discover)
        recipe = bridged_recipe(doc.get("params"), result)
        try:
            epoch = await ctx.store.create_session(session_id, ctx.clock(), begins_with(ctx, request), owner)
            # Kept before the client learns the session id: any replica it sends a request to finds them.
            await ctx.store.keep_recipe(session_id, epoch, None, recipe.encode())
        except ProxyError as error:
            return ctx.reject(request, error, request_id)
        self._remember(session_id, Bridged(epoch, recipe, facts))
        log.info(
            "session %s begins, bridged: a %s client in front of a 2026-07-28-only upstream",
            log_id(session_id),
            facts.version,
        )
        answer = {"jsonrpc": "2.0", "id": request_id, "result": result}
        request[DID] = Action.ANSWERED
        return web.Response(
            body=orjson.dumps(answer), content_type=JSON, headers={SESSION_HEADER: session_id}
        )

    async def _in_session(
        self, post: Post, session_id: str, bridged: Bridged, serve_post: ServePost
    ) -> web.StreamResponse:
        ctx, request = self.ctx, post.request
        doc = orjson.loads(post.body)
        facts = bridged.facts
        if self._answers_input(session_id, doc):
            request[DID] = Action.ANSWERED
            return web.Response(status=202)
        request[BRIDGE] = self
        request[MODERN_CHECK] = True
        treated = treat(doc, facts, subscribable(bridged.recipe.capabilities))
        match treated:
            case Refuse():
                return ctx.reject(request, BatchNotBridged("a batch is not bridged: send one message a POST"))
            case Local(result=result, log_level=level, cancelled=cancelled, error=error, subscription=taken):
                granted = await ctx.store.access(session_id)
                if granted is None:
                    return ctx.reject(request, UnknownSession(), post.request_id)
                refused = await authorize(ctx, request, session_id, granted, post.request_id)
                if refused is not None:
                    return refused
                if level is not None:
                    await self._set_level(session_id, bridged, level)
                if taken is not None:
                    await self._subscribe(session_id, bridged, *taken)
                if cancelled and post.message.cancelled:
                    # Its upstream stream is closed once no client reads it (cancel_grace): closing is the
                    # 2026-07-28 cancellation. One awaiting the client's input ends here, unanswered.
                    ctx.pumps.cancel_requests(session_id, post.message.cancelled)
                    self._cancel_awaiting(session_id, post.message.cancelled)
                request[DID] = Action.ANSWERED
                if error is not None:
                    log.info(
                        "session %s: %s refused by the proxy: %s",
                        log_id(session_id),
                        doc.get("method"),
                        error,
                    )
                    answer = {"jsonrpc": "2.0", "id": doc.get("id"), "error": error}
                    return web.Response(body=orjson.dumps(answer), content_type=JSON)
                if result is None:
                    return web.Response(status=202)
                answer = {"jsonrpc": "2.0", "id": doc.get("id"), "result": result}
                return web.Response(body=orjson.dumps(answer), content_type=JSON)
            case _:
                body = orjson.dumps(treated.body)
                return await serve_post(replace(post, body=body, bridged=treated.headers))

    async def _set_level(self, session_id: str, bridged: Bridged, level: str) -> None:
        """A ``logging/setLevel``: the level every later request of the session carries, kept with the
        session's recipe (another replica that serves it reads it there)."""
        facts = bridged.facts
        recipe = fold(bridged.recipe, SET_LEVEL, {"level": level}) or bridged.recipe
        self._remember(
            session_id,
            Bridged(bridged.epoch, recipe, ClientFacts(facts.version, facts.capabilities, facts.info, level)),
        )
        await reinit.keep(
            self.ctx, session_id, bridged.epoch, lambda kept: fold(kept, SET_LEVEL, {"level": level})
        )

    async def _subscribe(self, session_id: str, bridged: Bridged, method: str, uri: str) -> None:
        """A ``resources/subscribe`` or ``unsubscribe``: the URI set kept with the session's recipe (the
        store's, for any replica that serves it next; this process's copy), and the session's open listen
        streams re-opened upstream with it, answered once they listen (a client that subscribes, then
        changes the resource, gets its update)."""
        recipe = fold(bridged.recipe, method, {"uri": uri})
        if recipe is None:
            return  # the set is the same: nothing to keep, nothing to re-open
        self._remember(session_id, Bridged(bridged.epoch, recipe, bridged.facts))
        await reinit.keep(self.ctx, session_id, bridged.epoch, lambda kept: fold(kept, method, {"uri": uri}))
        wanted = listen_filter(recipe.capabilities, recipe.subscriptions)
        listens = list(self.listens.get(session_id, ()))
        if listens:
            await asyncio.gather(*(listen.reopen(wanted) for listen in listens))

    # -- MRTR -------------------------------------------------------------------------------------------

    def ask(self, session_id: str, request_key: str | None, asked: InputRequired) -> tuple[Awaiting, bytes]:
        """The input requests of ``asked`` awaiting the client's answers (``_answers_input`` collects them),
        and the events that ask the client: handshake-era requests under the proxy's ids."""
        ids = {proxy_request_id("input", secrets.token_hex(8)): key for key in asked.requests}
        awaiting = Awaiting(session_id, request_key, ids, asyncio.get_running_loop().create_future())
        for request_id in ids:
            self.awaiting[request_id] = awaiting
        while len(self.awaiting) > MAX_AWAITING:  # a client that never answers: the oldest given up
            oldest = self.awaiting[next(iter(self.awaiting))]
            self.forget(oldest)
            error = {"code": SERVER_ERROR, "message": "too many input requests await a client's answer"}
            oldest.settle(Refused(error))
        by_key = {key: request_id for request_id, key in ids.items()}
        return awaiting, b"".join(frame_body(orjson.dumps(m)) for m in client_requests(asked, by_key))

    def forget(self, awaiting: Awaiting) -> None:
        for request_id in awaiting.keys:
            self.awaiting.pop(request_id, None)

    def _cancel_awaiting(self, session_id: str, keys: tuple[str, ...]) -> None:
        """The client cancelled these requests: one awaiting its input ends, unanswered (the handshake
        era's SHOULD NOT answer)."""
        for awaiting in [a for a in self.awaiting.values() if a.session_id == session_id]:
            if awaiting.request_key in keys:
                self.forget(awaiting)
                awaiting.settle(None)

    def _answers_input(self, session_id: str, doc: object) -> bool:
        """Whether ``doc`` answers the proxy's input requests (kept; the outcome set once all are, or one
        is refused: its stream's ``BridgedAnswer`` goes on)."""
        messages = doc if isinstance(doc, list) else [doc]
        mine = [
            m
            for m in messages
            if isinstance(m, dict)
            and "method" not in m
            and m.get("id") in self.awaiting
            and self.awaiting[m["id"]].session_id == session_id
        ]
        if not mine or len(mine) != len(messages):
            return False
        for message in mine:
            awaiting = self.awaiting.pop(message["id"], None)
            if awaiting is None:  # a batch answering one request twice: the first answer counts
                continue
            if "error" in message:  # the client refused: the request's answer is that error
                self.forget(awaiting)
                awaiting.settle(Refused(message["error"]))
                continue
            awaiting.answers[awaiting.keys[message["id"]]] = message.get("result")
            if len(awaiting.answers) == len(awaiting.keys):
                awaiting.settle(awaiting.answers)
        return True

    async def standalone(self, request: web.Request) -> web.StreamResponse | None:
        """A bridged session's standalone GET (no ``Last-Event-ID``: a re-attach is the window's): the
        upstream's ``subscriptions/listen`` stream for the list-changed notifications it offers, relayed as
        it comes (not resumable: a client that loses it opens another GET); 405, as the handshake revisions
        allow, when it offers none. None for a GET of another session."""
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is None or LAST_EVENT_ID_HEADER in request.headers or not self.on:
            return None
        bridged = await self.bridged(session_id)
        if bridged is None:
            return None
        ctx = self.ctx
        # What the client was told the upstream offers, and what it subscribed to.
        offered = bridged.recipe.capabilities
        wanted = listen_filter(offered, bridged.recipe.subscriptions)
        granted = await ctx.store.access(session_id)
        if granted is None:
            return ctx.reject(request, UnknownSession())
        refused = await authorize(ctx, request, session_id, granted)
        if refused is not None:
            return refused
        if not wanted and not subscribable(offered):
            request[DID] = Action.ANSWERED
            return web.Response(status=405, headers={"Allow": "POST, DELETE"})
        kept = [(n, v) for n, v in upstream_headers(request) if n.lower() not in _DROPPED]
        headers = [
            *kept,
            ("Content-Type", JSON),
            ("Accept", f"{JSON}, text/event-stream"),
            (PROTOCOL_VERSION_HEADER, MODERN_VERSION),
            ("Mcp-Method", "subscriptions/listen"),
        ]
        path_qs = request.path_qs

        async def open_(notifications: Mapping[str, Any]) -> PooledAnswer:
            listen = listen_request(
                proxy_request_id("listen", secrets.token_hex(8)), notifications, bridged.facts
            )
            return await ctx.upstream.request("POST", path_qs, headers, orjson.dumps(listen), decoded=True)

        with ctx.drain.upstream_wait():
            upstream = await open_(wanted)
        if upstream.status != 200 or upstream.content_type != SSE:
            return await relay(ctx, request, upstream)
        listens = self.listens.setdefault(session_id, set())
        answer = ListenAnswer(
            upstream,
            wanted,
            open_,
            ctx.settings.max_event_bytes,
            lambda a: self._closed_listen(session_id, a),
        )
        listens.add(answer)
        now = self.sessions.get(session_id)
        if now is not None and now.recipe.subscriptions != bridged.recipe.subscriptions:
            # A subscription taken while the listen was being opened: re-opened with it.
            ctx.drain.spawn(
                self._reopen(answer, listen_filter(offered, now.recipe.subscriptions)), "mcpresume-listen"
            )
        return await relay(ctx, request, answer)

    @staticmethod
    async def _reopen(answer: ListenAnswer, wanted: Mapping[str, Any]) -> None:
        await answer.reopen(wanted)

    def _closed_listen(self, session_id: str, answer: ListenAnswer) -> None:
        listens = self.listens.get(session_id)
        if listens is not None:
            listens.discard(answer)
            if not listens:
                del self.listens[session_id]

    async def delete(self, request: web.Request) -> web.StreamResponse | None:
        """DELETE of a bridged session: the proxy's session ends (the upstream has none); None otherwise."""
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is None or not self.on or await self.bridged(session_id) is None:
            return None
        ctx = self.ctx
        request[MODERN_CHECK] = True
        granted = await ctx.store.access(session_id)
        if granted is None:
            return ctx.reject(request, UnknownSession())
        refused = await authorize(ctx, request, session_id, granted)
        if refused is not None:
            return refused
        await ctx.drop_session(session_id, granted.epoch)
        self.sessions.pop(session_id, None)
        for listen in self.listens.pop(session_id, set()):
            listen.release()  # its client's GET ends with the session
        for awaiting in [a for a in self.awaiting.values() if a.session_id == session_id]:
            self.forget(awaiting)
            awaiting.settle(None)
        log.info("session %s ends (DELETE), bridged", log_id(session_id))
        request[DID] = Action.ANSWERED
        return web.Response(status=200)


# The request key under which a bridged request carries its ``Bridge`` to where its answer is made.
BRIDGE: Final = web.RequestKey("mcpresume_bridge", Bridge)


def modern_headers(post: Post) -> list[tuple[str, str]]:
    """The headers a bridged request is sent upstream with: the client's end-to-end ones but the session's
    and version's, and the 2026-07-28 ones ``core.bridge.to_modern`` chose."""
    assert post.bridged is not None
    kept = [(n, v) for n, v in upstream_headers(post.request) if n.lower() not in _DROPPED]
    return [*kept, *post.bridged]


async def retain(
    ctx: ProxyContext, post: Post, upstream: PooledAnswer, granted: SessionAccess
) -> web.StreamResponse:
    """A bridged request's ``application/json`` answer: kept as a one-event stream of the session (its
    claim was settled), the client attached to it: resumable like an SSE answer. An input-required one
    (MRTR) makes a stream pumped as an SSE answer is (``BridgedAnswer``): its input requests, then the
    retry's answer."""
    message, session_id = post.message, post.session_id
    assert session_id is not None
    limit = ctx.settings.max_event_bytes
    answer = await read_within(upstream, limit)
    bridge: Bridge | None = post.request.get(BRIDGE)
    asked = input_required(_last_message(answer)) if bridge is not None and len(answer) <= limit else None
    asking = bridge is not None and asked is not None and bool(asked.requests)
    record = pump_record(ctx, post.request, session_id, message.request_ids, post.version) if asking else None
    now = ctx.clock()
    opened = await ctx.store.open_stream(
        session_id,
        StreamOrigin.POST,
        message.request_keys,
        now,
        granted.epoch,
        priming=post.primes,
        pump=record,
    )
    if opened is None:
        return ctx.reject(post.request, UnknownSession(), post.request_id)
    view = ViewPlan((opened.number,), opened.priming_seq - 1, SSE_HEADERS)
    if asking:
        assert bridge is not None and asked is not None and record is not None
        # The client's reader first: the pump's first burst (the input requests) waits for it.
        reader = ctx.local.add_reader(session_id, [opened.number], opened.priming_seq - 1)
        job = PumpJob.of(session_id, opened.number, record, log_id(session_id), opened.fence)
        bridge.starter.start(job, BridgedAnswer(bridge, post, None, asked))
        view = ViewPlan(view.streams, view.after, view.headers, reader=reader)
    else:
        body = json_event(answer, message.first_id, limit)
        await ctx.store.append(session_id, opened.number, [NewEvent(body, EventKind.RESPONSE)], now)
        await ctx.store.end_stream(session_id, opened.number, now)
    return await attach_view(ctx, post.request, session_id, view)


async def read_within(upstream: PooledAnswer, limit: int) -> bytes:
    """An answer's body, read to its end but never more than past ``limit`` (then released)."""
    answer = bytearray()
    try:
        async for chunk in upstream.content.iter_any():
            answer += chunk
            if len(answer) > limit:
                break
    finally:
        upstream.release()
    return bytes(answer)


def json_event(answer: bytes, request_id: str | int | None, limit: int) -> bytes:
    """A JSON answer as one SSE event (JSON allows raw CR/LF only as whitespace between tokens: dropped, one
    data line); over ``limit``, an error saying so rather than the answer truncated."""
    if len(answer) <= limit:
        return frame_body(answer.replace(b"\r", b"").replace(b"\n", b""))
    data = {"reason": "event_too_large"}
    return frame_body(error_response(request_id, SERVER_ERROR, "the answer is too large", data))


def bridged_stream(post: Post, upstream: PooledAnswer) -> UpstreamAnswer:
    """What the pump of a bridged request's SSE answer reads: ``BridgedAnswer`` (the input-required result
    held back, the request retried); any other answer as it is."""
    if post.bridged is None:  # (most requests: not a bridged session's)
        return upstream
    bridge: Bridge | None = post.request.get(BRIDGE)
    if bridge is None or len(post.message.request_ids) != 1:
        return upstream
    return BridgedAnswer(bridge, post, upstream, None)


class BridgedAnswer(GeneratedBody):
    """A bridged request's answer as its pump reads it: an SSE body, over as many upstream requests as the
    input it asks for takes (MRTR, the table in ``core/bridge.py``).

    The first upstream answer's events pass as they come (``core.bridge.HeldAnswer``) but an input-required
    result answering the request: held back, its input requests (``Bridge.ask``) come next in the body, and
    the body waits for the client's answers (POSTed responses, ``Bridge._answers_input``); then the request
    is sent upstream again with them and the request state, and that answer continues the body: an SSE one
    the same way (progress as it comes, input required again, or the result), a JSON one as one event. So
    the pump appends everything to the request's stream as it does for any answer (the window, cursors,
    re-attach, backpressure, fencing), the result settles the request once, and a client that left and
    re-attaches finds the input requests or the result there. The pump's life ends it: stopped (the
    request cancelled, no client for ``session_ttl``), its ``release`` closes the upstream request being
    read and gives up the input awaited. Not resumed upstream: a 2026-07-28 upstream has no resumption
    (a broken upstream stream ends the request with the pump's error, as for any answer without ids)."""

    status: Final = 200
    reason: Final = "OK"
    content_type: Final = "text/event-stream"
    content_length: Final = None

    def __init__(
        self,
        bridge: Bridge,
        post: Post,
        upstream: PooledAnswer | None,
        asked: InputRequired | None,
    ) -> None:
        assert post.session_id is not None and len(post.message.request_ids) == 1
        self._bridge = bridge
        self._session_id = post.session_id
        self._request_id = post.message.request_ids[0]
        self._original: dict[str, Any] = orjson.loads(post.body)  # the 2026-07-28 request as first sent
        self._headers = modern_headers(post)
        self._path_qs = post.request.path_qs
        self.headers = upstream.headers if upstream is not None else CIMultiDictProxy(CIMultiDict[str]())
        self._reading = upstream  # the upstream answer being read, released with this one
        self._awaiting: Awaiting | None = None
        self._body = self._events(upstream, asked)

    def release(self) -> None:
        if self._reading is not None:
            self._reading.release()
            self._reading = None
        if self._awaiting is not None:
            self._bridge.forget(self._awaiting)
            self._awaiting.settle(None)
            self._awaiting = None

    async def _events(
        self, upstream: PooledAnswer | None, asked: InputRequired | None
    ) -> AsyncIterator[bytes]:
        bridge = self._bridge
        limit = bridge.ctx.settings.max_event_bytes
        key = request_key(self._request_id)
        while True:
            if upstream is not None:  # an SSE answer: passed as it comes, an input-required result held
                held = HeldAnswer(key, limit)
                self._reading = upstream
                try:
                    while chunk := await upstream.content.readany():
                        if passed := held.feed(chunk):
                            yield passed
                        if held.asked is not None:
                            break
                finally:
                    self._reading = None
                    upstream.release()
                if held.asked is None:
                    return  # its end: whether the result came, the pump knows
                asked = held.asked
            assert asked is not None
            awaiting, asking = bridge.ask(self._session_id, key, asked)
            self._awaiting = awaiting
            yield asking
            outcome = await awaiting.outcome
            self._awaiting = None
            if outcome is None:
                return  # cancelled: no answer (a cancelled request SHOULD NOT be answered)
            if isinstance(outcome, Refused):
                refused = {"jsonrpc": "2.0", "id": self._request_id, "error": outcome.error}
                yield frame_body(orjson.dumps(refused))
                return
            retry = retry_body(self._original, outcome, asked.state)
            upstream, asked = None, None
            try:
                answer = await bridge.ctx.upstream.request(
                    "POST", self._path_qs, self._headers, orjson.dumps(retry), decoded=True
                )
            except ProxyError as error:
                yield self._failed(f"the retry failed: {error.message}")
                return
            if 200 <= answer.status < 300 and answer.content_type == SSE:
                upstream = answer
                continue
            self._reading = answer
            try:
                raw = await read_within(answer, limit) if answer.content_type == JSON else b""
            except (aiohttp.ClientError, OSError) as error:
                yield self._failed(f"the retry's answer broke off: {error}")
                return
            finally:
                self._reading = None
            if not raw:
                yield self._failed(f"the upstream answered the retry with HTTP {answer.status}")
                return
            again = input_required(_last_message(raw)) if len(raw) <= limit else None
            if again is not None and again.requests:
                asked = again
                continue
            if len(raw) <= limit and response_key(raw.replace(b"\r", b"").replace(b"\n", b"")) != key:
                # Not the request's answer (a gateway's error page in JSON, say): said as the answer.
                yield self._failed(f"the upstream answered the retry with HTTP {answer.status}, no response")
                return
            yield json_event(raw, self._request_id, limit)
            return

    def _failed(self, message: str) -> bytes:
        return frame_body(error_response(self._request_id, SERVER_ERROR, message, {}))


def _last_message(body: bytes) -> object:
    """A JSON body, or the last ``data:`` of an SSE one, parsed (None when neither)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    found: object = None
    for line in body.splitlines():
        if line.startswith(b"data:"):
            try:
                found = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
    return found


async def bridged_answer(
    ctx: ProxyContext, post: Post, upstream: PooledAnswer, granted: SessionAccess | None
) -> web.StreamResponse | None:
    """What a bridged request's answer the proxy would relay becomes: a 2xx JSON answer a one-event stream
    (``retain``); a 4xx JSON one (a JSON-RPC error: a 2026-07-28 server maps codes to statuses, 404 for an
    unknown method) the same error with 200, as a handshake-era client expects it (to such a client a 404
    ends its session); None for the rest (relayed)."""
    if upstream.content_type != JSON:
        return None
    bridge: Bridge | None = post.request.get(BRIDGE)
    if post.bridged is None:
        if bridge is None or post.session_id is not None or not 400 <= upstream.status < 500:
            return None
        return await bridge.after_refusal(post, upstream)
    if 200 <= upstream.status < 300 and granted is not None and post.message.request_ids:
        return await retain(ctx, post, upstream, granted)
    if 400 <= upstream.status < 500:
        try:
            body = await upstream.read()
        finally:
            upstream.release()
        return web.Response(body=body, content_type=JSON)
    return None
