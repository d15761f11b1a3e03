"""The POST executor: carries out what ``core/post.py`` decides, fetching what the plan needs first.

``Posts.serve`` asks ``core.post.plan_post`` (its table is that module's docstring) until it has a plan:
relay, reject, a view of a re-sent request's stream (not forwarded again: invariant #8), or forward. A
forwarded request is sent by ``http.send.Sender``; what its answer becomes is ``core.post.ANSWER_STEPS``.

POST + ``Last-Event-ID`` (the re-POST case, docs/how-it-works.md): the cursor is checked before anything is
forwarded; then this response carries the old stream's tail and the new request's events (a re-sent request's
stream instead, when it began after the cursor). The streams one view followed are grouped: the client holds
one cursor for them, so a re-attach with it follows them all.
"""

from __future__ import annotations

from typing import assert_never

from aiohttp import web

from mcpresume.core.get import Relay
from mcpresume.core.post import (
    ANSWER_STEPS,
    AttachOriginal,
    FollowResent,
    Forward,
    Need,
    PostFacts,
    Reject,
    Tail,
    Then,
    plan_post,
    tail_kind,
)
from mcpresume.core.session import ClaimOutcome, SessionAccess
from mcpresume.http.bridge import bridged_answer
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.credentials import authorize
from mcpresume.http.forward import passthrough, relay
from mcpresume.http.incoming import SSE_HEADERS, Post
from mcpresume.http.resume import decide_cursor, resume_preface
from mcpresume.http.send import Sender
from mcpresume.http.view import ViewPlan, attach_view, release_view, reserve_view, serve_view


class Posts:
    def __init__(self, ctx: ProxyContext, sender: Sender) -> None:
        self.ctx = ctx
        self.sender = sender

    async def serve(self, post: Post) -> web.StreamResponse:
        """Decided by ``core.post.plan_post``, carried out here: fetch what it needs, then do it."""
        ctx, request, message, session_id = self.ctx, post.request, post.message, post.session_id
        settings, store = ctx.settings, ctx.store
        limits = {"max_sessions": settings.max_sessions, "max_streams": settings.max_streams_per_session}
        cursor_header = post.cursor
        facts = PostFacts(
            stateless=post.stateless,
            has_session=session_id is not None,
            initialize=message.is_initialize,
            has_cursor=cursor_header is not None,
            requests=bool(message.request_keys),
        )
        granted: SessionAccess | None = None
        while isinstance(step := plan_post(facts, **limits), Need):
            if step is Need.ROOM:
                facts.room = await self.sender.has_room()
                continue
            assert session_id is not None  # the other needs are a session's
            match step:
                case Need.ACCESS:  # read with the session's owner when routing asked it (``Post.asked``)
                    granted = post.access if post.asked else await store.access(session_id)
                    facts.asked, facts.known = True, granted is not None
                case Need.CREDENTIALS:
                    # Credentials the upstream has not accepted in the session claim nothing in it (not a
                    # request id the owner is about to send, not a view), and get nothing of its window.
                    assert granted is not None
                    refused = await authorize(ctx, request, session_id, granted, post.request_id)
                    if refused is not None:
                        return refused
                    facts.authorized = True
                case Need.RESUME:
                    assert cursor_header is not None
                    resumed = await decide_cursor(ctx, session_id, cursor_header, granted)
                    facts.resumed = resumed
                case Need.CLAIM:
                    assert granted is not None  # the claim is made in the incarnation checked only
                    keys, digests = message.request_keys, message.request_digests
                    limit = settings.max_streams_per_session
                    # A new claim is the request's client activity too (the view's reserve_view then
                    # touches nothing: one store round trip less).
                    claim = await store.claim(
                        session_id, keys, limit, granted.epoch, digests=digests, now=ctx.clock()
                    )
                    facts.claimed, facts.claim = True, claim
                case Need.ORIGINAL:
                    assert facts.claim is not None and facts.claim.stream is not None
                    view = await store.view(session_id, facts.claim.stream)
                    facts.looked, facts.original = True, None if view is None else view.stream
                case _:  # pragma: no cover
                    assert_never(step)
        match step:
            case Relay():
                return await passthrough(ctx, request, post.body)
            case Reject(error=error, with_id=with_id, duplicate=duplicate):
                if duplicate:
                    ctx.metrics.duplicate_requests.inc()
                return ctx.reject(request, error, post.request_id if with_id else None)
            case AttachOriginal(stream=stream, after=after):  # a re-sent request id: never forwarded twice
                assert session_id is not None
                ctx.metrics.duplicate_requests.inc()
                request[DID] = Action.REATTACHED
                return await attach_view(ctx, request, session_id, ViewPlan((stream,), after, SSE_HEADERS))
            case FollowResent(tail=tail, streams=streams):
                assert session_id is not None
                ctx.metrics.duplicate_requests.inc()
                refused = await reserve_view(ctx, request, session_id, post.request_id)
                if refused is not None:
                    return refused
                try:
                    plan = await self._tail_plan(post, tail, streams, None)
                    return await serve_view(ctx, request, session_id, plan)
                finally:
                    await release_view(ctx, session_id)
            case Forward():
                touched = facts.claim is not None and facts.claim.outcome is ClaimOutcome.NEW
                return await self._forward(post, granted, step, touched=touched)
            case _:  # pragma: no cover
                assert_never(step)

    async def _forward(
        self, post: Post, granted: SessionAccess | None, plan: Forward, *, touched: bool = False
    ) -> web.StreamResponse:
        """Forward the request, its view counted first when ``plan.reserve`` (a request refused for too
        many views must not run upstream); then what ``ANSWER_STEPS`` says its answer becomes.
        ``touched``: its claim recorded the session's activity already."""
        ctx, request, session_id, tail = self.ctx, post.request, post.session_id, plan.tail
        if plan.reserve:
            assert session_id is not None and granted is not None
            refused = await reserve_view(ctx, request, session_id, post.request_id, touched=touched)
            if refused is not None:
                if post.message.request_keys:  # claimed: the same id may come back
                    await ctx.store.release(session_id, post.message.request_keys, granted.epoch)
                return refused
        try:
            forwarded = await self.sender.forward(post, granted)
            then = ANSWER_STEPS[(forwarded.answer, tail_kind(tail))]
            opened, upstream = forwarded.opened, forwarded.upstream
            match then:
                case Then.REJECT:
                    assert forwarded.error is not None
                    return ctx.reject(request, forwarded.error, post.request_id)
                case Then.RELAY:
                    assert upstream is not None
                    bridged = await bridged_answer(ctx, post, upstream, granted)
                    if bridged is not None:
                        return bridged
                    return await relay(ctx, request, upstream, request_id=post.request_id)
                case Then.EMPTY:
                    assert upstream is not None
                    upstream.release()  # notifications only, and no tail to carry
                    return web.Response(status=202)
                case Then.VIEW if tail is None:
                    assert opened is not None
                    view = ViewPlan(
                        (opened.stream,), opened.priming_seq - 1, opened.headers, reader=opened.reader
                    )
                    serve = serve_view if plan.reserve else attach_view  # a reserved view is counted already
                    return await serve(ctx, request, opened.session_id, view)
                case Then.VIEW | Then.RETAIN | Then.TAIL:
                    assert tail is not None and session_id is not None and granted is not None
                    streams = list(tail.followed)
                    if then is Then.VIEW:
                        assert opened is not None
                        streams.append(opened.stream)
                    elif then is Then.RETAIN:
                        assert upstream is not None
                        streams.append(await self.sender.retain_answer(post, upstream, granted.epoch))
                    else:
                        assert upstream is not None
                        upstream.release()  # notifications only: the view carries the old stream's tail alone
                    # This view's reader covers every stream, registered before anything is written, so
                    # no burst of the new stream can be evicted under it; the new stream's first reader goes.
                    reader = ctx.local.add_reader(session_id, streams, tail.after)
                    if opened is not None:
                        ctx.local.remove_reader(session_id, opened.reader)
                    view = await self._tail_plan(post, tail, streams, reader)
                    return await serve_view(ctx, request, session_id, view)
                case _:  # pragma: no cover
                    assert_never(then)
        finally:
            if plan.reserve and session_id is not None:
                await release_view(ctx, session_id)

    async def _tail_plan(
        self, post: Post, tail: Tail, streams: list[int] | tuple[int, ...], reader: int | None
    ) -> ViewPlan:
        """The view of POST + ``Last-Event-ID``: the tail's streams (grouped, when more than one: one cursor
        re-attaches to them all), then the new ones, after the cursor's seq."""
        ctx, session_id = self.ctx, post.session_id
        assert session_id is not None
        if len(streams) > 1:
            await ctx.store.group_streams(session_id, list(streams))
        cursor = post.cursor or ""
        preface = resume_preface(ctx, post.request, cursor, tail.stream) if tail.followed else b""
        return ViewPlan(streams, tail.after, SSE_HEADERS, preface, tail.newest, reader)
