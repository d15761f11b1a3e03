"""The DELETE executor: forwarded, its answer relayed, and the session dropped here when
``core.delete.plan_delete`` says so (its table is that module's docstring)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import assert_never

from aiohttp import web

from mcpresume.core.delete import DeleteFacts, Drop, Keep, Need, plan_delete
from mcpresume.core.errors import ProxyError
from mcpresume.core.headers import SESSION_HEADER
from mcpresume.core.session import SessionAccess
from mcpresume.http import reinit
from mcpresume.http.context import ProxyContext
from mcpresume.http.credentials import trusted
from mcpresume.http.forward import identity_upstream_headers, relay
from mcpresume.process.logs import log_id

log = logging.getLogger("mcpresume.proxy")


async def serve_delete(ctx: ProxyContext, request: web.Request) -> web.StreamResponse:
    session_id = request.headers.get(SESSION_HEADER)
    granted: SessionAccess | None = None
    asked = False
    if session_id is not None and reinit.recording(ctx):
        # A session begun again upstream (by any replica, or by this one before a restart): the DELETE goes
        # to the upstream session the store maps it to now. One read, only under reinitialize; it answers
        # the plan's Need.ACCESS too. A store that does not answer leaves the mapping this process knows.
        with contextlib.suppress(ProxyError):
            granted, asked = await ctx.store.access(session_id), True
        reinit.learn(ctx, session_id, granted)
    with ctx.drain.upstream_wait():
        upstream = await ctx.upstream.request(
            "DELETE", request.path_qs, identity_upstream_headers(request), None, decoded=True
        )
    facts = DeleteFacts(session_id is not None, upstream.status)
    while isinstance(step := plan_delete(facts), Need):
        assert session_id is not None  # plan_delete keeps a request without one
        if not asked:
            granted = await ctx.store.access(session_id)
        # Not another user's 404 (see trusted): credentials accepted in the session.
        accepted = granted is not None and trusted(ctx, request, granted)
        facts = replace(facts, asked=True, known=granted is not None, trusted=accepted)
    match step:
        case Keep():
            pass
        case Drop(checked_only=checked_only):
            assert session_id is not None
            if not checked_only:
                await ctx.drop_session(session_id)
                log.info("session %s ends (DELETE)", log_id(session_id))
            else:
                assert granted is not None
                await ctx.drop_session(session_id, granted.epoch)
                log.info("session %s ends (DELETE: the upstream does not know it)", log_id(session_id))
        case _:  # pragma: no cover
            assert_never(step)
    return await relay(ctx, request, upstream)
