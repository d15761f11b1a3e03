"""A cursor's re-attach, for GET and POST alike: the resume decision asked on what the store says, and the
preface a resumed view begins with.

``core.resume.decide`` decides (its table is that module's docstring); ``decide_cursor`` reads the store for
it, in the incarnation the request's credentials were checked in, and counts a rejection (a re-attach is
counted once its view is admitted, ``http.view.reserve_view``).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from mcpresume.core.cursor import Cursor, parse_cursor
from mcpresume.core.errors import ProxyError
from mcpresume.core.get import Resumed
from mcpresume.core.resume import decide, outcome_label
from mcpresume.core.session import SessionAccess
from mcpresume.core.sse import encode_comment, encode_retry, frame_body
from mcpresume.http.context import ProxyContext
from mcpresume.http.incoming import primes_of


async def decide_cursor(
    ctx: ProxyContext, session_id: str, cursor_header: str, granted: SessionAccess | None
) -> Resumed | ProxyError:
    """The resume decision: a re-attach with its stream as the decision saw it (retained, or the last
    standalone stream gone) and the session's newest seq then; or the rejection. ``granted``: the
    incarnation the request's credentials were checked in; another one is as good as unknown."""
    cursor = parse_cursor(cursor_header)
    view = await ctx.store.view(session_id, cursor.stream if isinstance(cursor, Cursor) else 0)
    if view is not None and (granted is None or view.epoch != granted.epoch):
        view = None  # begun since the check: nothing of it is served to credentials not checked in it
    decision = decide(view, cursor, ctx.clock())
    if isinstance(decision, ProxyError):
        ctx.metrics.resumptions.labels(outcome_label(decision)).inc()
        return decision
    # A re-attach is counted once its view is admitted or refused (``http.view.reserve_view``).
    assert view is not None and view.stream is not None  # decide re-attaches only to a stream it saw
    return Resumed(decision, view.stream, view.newest_seq)


def resume_preface(ctx: ProxyContext, request: web.Request, epoch_cursor: str, stream: int) -> bytes:
    """What a resumed view sends first: the retry hint, a comment naming the cursor, and (when configured)
    the ``notifications/mcpresume/resumed`` notification."""
    # The retry hint only where a priming event would carry it: a client of an earlier revision may
    # surface a block without data as an empty event.
    settings = ctx.settings
    preface = encode_retry(settings.retry_ms) if primes_of(request) else b""
    preface += encode_comment(f"resumed {epoch_cursor}".encode())
    if settings.resume_notification:
        note = orjson.dumps(
            {
                "jsonrpc": "2.0",
                "method": "notifications/mcpresume/resumed",
                "params": {"cursor": epoch_cursor, "stream": stream},
            }
        )
        preface += frame_body(note)
    return preface
