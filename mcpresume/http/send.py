"""A POST sent upstream, and its answer made what the session needs: a stream read by a pump, an answer to
relay, or an error; the claim of its request ids released (it was never sent: it may be sent again),
settled (it ran) or abandoned (it may have run, no answer came).

``Sender.forward`` sends it in a task of its own: a client that disconnects meanwhile does not cancel the
upstream request (the handshake-era revisions: disconnection is not cancellation), and its answer still
reaches the window. The claim's end is recorded in that task, so it happens even when the client left:
``core.post.CLAIM_ENDS`` says which, by the upstream's outcome (released: it may be sent again; settled:
it ran, never forward it again; abandoned: it may have run, never forward it again, what it did unknown;
dropped with the session the upstream forgot; or held by the stream its
SSE answer became, its pump started, the client's reader registered first: the first burst waits for it).

Everything is recorded in the request's own incarnation (``epoch``): if the upstream re-issued the session
id meanwhile, the new incarnation gets nothing of it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from mcpresume.core.errors import (
    SERVER_ERROR,
    ProxyError,
    SessionGone,
    ShuttingDown,
    UnknownSession,
    UpstreamBadResponse,
    UpstreamBadSessionId,
    UpstreamSessionLost,
)
from mcpresume.core.headers import MAX_SESSION_ID_LEN, SESSION_HEADER, valid_session_id, visible_ascii
from mcpresume.core.jsonrpc import error_response
from mcpresume.core.post import (
    CLAIM_ENDS,
    Answer,
    ClaimEnd,
    Upstream,
    answer_of,
    failed_outcome,
    upstream_outcome,
)
from mcpresume.core.session import NewEvent, SessionAccess, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind
from mcpresume.http import reinit
from mcpresume.http.bridge import bridged_stream, modern_headers
from mcpresume.http.context import ProxyContext
from mcpresume.http.credentials import begins_with, remember_version, trusted
from mcpresume.http.forward import identity_upstream_headers, upstream_headers
from mcpresume.http.get import Openings
from mcpresume.http.incoming import Post, client_sse_headers, pump_record
from mcpresume.process.logs import log_id
from mcpresume.streams.pool import PooledAnswer
from mcpresume.streams.pump import PumpJob
from mcpresume.streams.starter import PumpStarter

log = logging.getLogger("mcpresume.proxy")


@dataclass(frozen=True, slots=True)
class Opened:
    """A POST whose SSE answer became stream ``stream`` of ``session_id``, a reader of it registered."""

    session_id: str
    stream: int
    priming_seq: int
    headers: list[tuple[str, str]]
    reader: int


@dataclass(frozen=True, slots=True)
class Forwarded:
    """The upstream's answer to a forwarded POST, tagged (``core.post.Answer``): ``OPENED`` carries
    ``opened``, ``FAILED`` its ``error``, the others the ``upstream`` answer (the caller releases it)."""

    answer: Answer
    opened: Opened | None = None
    upstream: PooledAnswer | None = None
    error: ProxyError | None = None

    @classmethod
    def of(cls, upstream: PooledAnswer) -> Forwarded:
        return cls(answer_of(upstream.status, upstream.content_type), upstream=upstream)

    @classmethod
    def failed(cls, error: ProxyError) -> Forwarded:
        return cls(Answer.FAILED, error=error)


class Sender:
    def __init__(self, ctx: ProxyContext, pumps: PumpStarter, openings: Openings) -> None:
        self.ctx = ctx
        self.pumps = pumps
        self.openings = openings

    async def has_room(self) -> bool:
        """Whether one more session can be tracked (expired sessions are reaped before saying no)."""
        store, limit = self.ctx.store, self.ctx.settings.max_sessions
        if await store.session_count() < limit:
            return True
        await store.reap(self.ctx.clock())  # expired sessions make room before anyone is refused
        return await store.session_count() < limit

    async def forward(self, post: Post, granted: SessionAccess | None) -> Forwarded:
        """Forward in a task of its own (see the module docstring). A drain's deadline ends the wait (503
        shutting_down) but not the forward."""
        forward = asyncio.ensure_future(self._forward_and_open(post, granted))
        try:
            with self.ctx.drain.upstream_wait():
                return await asyncio.shield(forward)
        except ShuttingDown as refusal:
            forward.add_done_callback(self._abandoned)
            return Forwarded.failed(refusal)
        except asyncio.CancelledError:
            forward.add_done_callback(self._abandoned)
            raise

    def _abandoned(self, forward: asyncio.Future[Forwarded]) -> None:
        """The client left while its request was forwarded: release what was kept for its view."""
        if forward.cancelled() or forward.exception() is not None:
            return
        forwarded = forward.result()
        if forwarded.opened is not None:
            self.ctx.local.remove_reader(forwarded.opened.session_id, forwarded.opened.reader)
        elif forwarded.upstream is not None:
            forwarded.upstream.release()

    async def _forward_and_open(
        self, post: Post, granted: SessionAccess | None, *, recovered: bool = False
    ) -> Forwarded:
        """``post.session_id`` None: an ``initialize``, whose 2xx answer with ``Mcp-Session-Id`` begins a
        session; else a request of the tracked session, ``granted`` its access. What becomes of the claim is
        ``core.post.CLAIM_ENDS``."""
        ctx, request, message, session_id = self.ctx, post.request, post.message, post.session_id
        # The request ids claimed in the session. An initialize's are none: it came before its session,
        # whose requests may then use its id (a client reconnecting to a session numbers its requests from
        # 0 again, without an initialize).
        keys = message.request_keys if session_id is not None else ()
        epoch = None if granted is None else granted.epoch
        if session_id is not None:
            await self.openings.after_gets(session_id)
            reinit.learn(ctx, session_id, granted)
        try:
            headers = identity_upstream_headers(request) if post.bridged is None else modern_headers(post)
            upstream = await ctx.upstream.request("POST", request.path_qs, headers, post.body, decoded=True)
        except ProxyError as error:
            # Here, in the shielded task, so it happens even when the client left.
            await self._end_claim(CLAIM_ENDS[failed_outcome(error)], session_id, keys, epoch)
            return Forwarded.failed(error)
        if message.cancelled and session_id is not None and 200 <= upstream.status < 300:
            # The upstream took the client's notifications/cancelled: a stream of the requests it names may
            # never be answered now (the spec: it SHOULD NOT be), so its pump closes it once nobody reads it.
            ctx.pumps.cancel_requests(session_id, message.cancelled)
        sid = upstream.headers.get(SESSION_HEADER) if session_id is None else session_id
        in_session = session_id is not None
        # Not another user's 404 (see trusted): only then does it end the session for everyone.
        # A bridged session's upstream has no sessions: its 404 is an unknown method's, not a session's end.
        accepted = (
            upstream.status == 404
            and granted is not None
            and post.bridged is None
            and trusted(ctx, request, granted)
        )
        outcome = upstream_outcome(
            in_session=in_session,
            trusted=in_session and accepted,
            status=upstream.status,
            session_id=sid is not None,
            requests=bool(message.request_ids),
            content_type=upstream.content_type,
        )
        claim_end = CLAIM_ENDS[outcome]
        if claim_end is ClaimEnd.DROP:  # the upstream forgot the session: the client must re-initialize
            assert session_id is not None and granted is not None
            upstream.release()
            lost = UpstreamSessionLost()
            if reinit.recording(ctx) and not recovered:  # begun again upstream, the request sent again
                again = await reinit.recover(ctx, request, session_id, granted)
                if isinstance(again, SessionAccess):
                    return await self._forward_and_open(post, again, recovered=True)
                lost = again
            await ctx.drop_session(session_id, epoch)
            reinit.forget(ctx, session_id)
            # The proxy's own 404, with its reason (not the upstream's body): it ended the session here.
            return Forwarded.failed(lost)
        if claim_end is ClaimEnd.RELEASE:  # refused: the same id may be sent again
            await self._end_claim(claim_end, session_id, keys, epoch)
            return Forwarded.of(upstream)
        assert sid is not None  # upstream_outcome: the rest are 2xx answers in a session
        if session_id is None:
            if not valid_session_id(sid):  # its every request would be 400 bad_session_id: begin none
                return self._uncarried(post, upstream, sid)
            begun = await self._begin_session(sid, begins_with(ctx, request))
            if isinstance(begun, ProxyError):  # untracked, its every request would be 404 unknown_session
                upstream.release()
                return Forwarded.failed(begun)
            epoch = begun
            await reinit.began(ctx, sid, epoch, post.body)
        elif granted is not None:
            await remember_version(ctx, request, sid, granted, post.version)
            await reinit.shaped(ctx, sid, granted.epoch, message.methods, post.body)
        if outcome is Upstream.WRONG_TYPE:
            content_type = upstream.content_type
            upstream.release()
            await self._end_claim(claim_end, session_id, keys, epoch)  # it ran upstream: never again
            return Forwarded.failed(
                UpstreamBadResponse(
                    f"the upstream answered a request with {content_type!r}", content_type=content_type
                )
            )
        if claim_end is ClaimEnd.SETTLE:  # answered: a re-send is refused (an initialize's, in its session)
            await self._end_claim(claim_end, sid, keys, epoch)
            return Forwarded.of(upstream)
        now = ctx.clock()
        record = pump_record(ctx, request, sid, message.request_ids, post.version)
        stream = await ctx.store.open_stream(
            sid, StreamOrigin.POST, keys, now, epoch, priming=post.primes, pump=record
        )
        if stream is None:
            # The session ended while its request was forwarded (DELETE, reaped, its id re-issued): answered
            # as a request of an ended session is, never relayed raw (nor its event ids).
            upstream.release()
            return Forwarded.failed(UnknownSession(SessionGone.ENDED_WHILE_FORWARDED))
        # The client's reader is registered before the pump starts: the first burst waits for it.
        reader = ctx.local.add_reader(sid, [stream.number], stream.priming_seq - 1)
        # A bridged request's answer is read through the bridge: an input-required result held back (MRTR).
        answer = bridged_stream(post, upstream)
        await self.pumps.start_post(PumpJob.of(sid, stream.number, record, log_id(sid), stream.fence), answer)
        opened = Opened(sid, stream.number, stream.priming_seq, client_sse_headers(ctx, upstream), reader)
        return Forwarded(Answer.OPENED, opened=opened)

    async def _end_claim(
        self, claim_end: ClaimEnd, session_id: str | None, keys: tuple[str, ...], epoch: str | None
    ) -> None:
        """Release, settle or abandon the request ids claimed in ``session_id`` (none: nothing was
        claimed)."""
        if session_id is None or not keys:
            return
        store = self.ctx.store
        if claim_end is ClaimEnd.SETTLE:
            await store.settle(session_id, keys, epoch)
        elif claim_end is ClaimEnd.ABANDON:
            await store.abandon(session_id, keys, epoch)
        else:
            await store.release(session_id, keys, epoch)

    def _uncarried(self, post: Post, upstream: PooledAnswer, sid: str) -> Forwarded:
        """An ``initialize`` answered with a session id the proxy cannot carry: 502, and no session begun.
        The upstream's own is ended with a DELETE, on its own (the 502 does not wait), when the id can be
        sent back (too long, but visible ASCII); else the upstream's own expiry ends it."""
        upstream.release()
        if visible_ascii(sid):
            headers = [*upstream_headers(post.request), (SESSION_HEADER, sid)]
            self.ctx.drain.spawn(self._end_upstream_session(post.request.path_qs, headers), "mcpresume-end")
        return Forwarded.failed(
            UpstreamBadSessionId(
                f"the upstream began a session whose Mcp-Session-Id the proxy cannot carry ({len(sid)} "
                f"characters; it takes 1-{MAX_SESSION_ID_LEN} visible ASCII characters)",
                length=len(sid),
                limit=MAX_SESSION_ID_LEN,
            )
        )

    async def _end_upstream_session(self, path_qs: str, headers: list[tuple[str, str]]) -> None:
        try:
            ended = await self.ctx.upstream.request("DELETE", path_qs, headers, None, decoded=True)
            ended.release()
        except ProxyError as error:
            log.warning("the upstream's session with an id too long was not ended: %s", error.message)

    async def _begin_session(self, session_id: str, credential: bytes | None) -> str | ProxyError:
        """Track a session the upstream began; its epoch, or why it cannot be tracked (``max_sessions``
        reached, or the store unavailable: each its own error, a full Redis no session limit)."""
        ctx = self.ctx
        try:
            # The owner is recorded where sessions are routed (several replicas); one replica owns all.
            owner = ctx.settings.replica if ctx.hop is not None else ""
            epoch = await ctx.store.create_session(session_id, ctx.clock(), credential, owner)
        except ProxyError as error:
            log.warning("session %s cannot be tracked: %s", log_id(session_id), error.message)
            return error
        log.info("session %s begins", log_id(session_id))
        return epoch

    async def retain_answer(self, post: Post, upstream: PooledAnswer, epoch: str) -> int:
        """An application/json answer on a response that is an SSE view: kept as a one-event stream, so it
        reaches this client in the view and stays resumable like any response."""
        ctx, message = self.ctx, post.message
        assert post.session_id is not None  # a tail is a session's
        limit = ctx.settings.max_event_bytes
        answer = bytearray()
        try:
            async for chunk in upstream.content.iter_any():  # the whole body, but never more than the limit
                answer += chunk
                if len(answer) > limit:
                    break
        finally:
            upstream.release()
        now = ctx.clock()
        opened = await ctx.store.open_stream(
            post.session_id, StreamOrigin.POST, message.request_keys, now, epoch, priming=post.primes
        )
        if opened is None:
            raise UnknownSession(SessionGone.ENDED_WHILE_FORWARDED)
        if len(answer) <= limit:
            # JSON allows raw CR/LF only as whitespace between tokens: drop them, one data line.
            body = frame_body(bytes(answer).replace(b"\r", b"").replace(b"\n", b""))
        else:  # not deliverable as one SSE event: say so rather than truncate it
            data = {"reason": "event_too_large"}
            body = frame_body(error_response(message.first_id, SERVER_ERROR, "the answer is too large", data))
        await ctx.store.append(post.session_id, opened.number, [NewEvent(body, EventKind.RESPONSE)], now)
        await ctx.store.end_stream(post.session_id, opened.number, now)
        return opened.number
