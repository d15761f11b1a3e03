"""The session inspector, on the admin listener: ``GET /sessions`` (the count, a page of summaries) and
``GET /sessions/<id or hash>`` (one session), read by ``mcpresume sessions``.

Off unless ``inspect_token`` is set (the routes do not exist), and every request must carry
``Authorization: Bearer <inspect_token>`` (401 otherwise): it must not become a window into sessions. What
it shows is a session's shape as the store holds it (``store.Inspection``: owner, epoch, fence, streams and
their phases, the window's counts and its oldest and newest cursors, the request ids by what they hold, the
last activity) and the views open on this replica: never an event's body, a credential, or a session id.
A session is named by its hash (``process.logs.log_id``, the 10 characters of every log line), and looked
up by it or by its id. The look changes nothing: no activity, no expiry, no news.
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Final

from aiohttp import web

from mcpresume.core.cursor import encode_cursor
from mcpresume.http.context import ProxyContext
from mcpresume.process.logs import log_id
from mcpresume.store import SessionSummary

# A page of /sessions: 50 summaries unless asked (?limit=), at most 500 (each is a store call).
PAGE: Final = 50
MAX_PAGE: Final = 500
# Session ids read per store call while looking a hash up (every session's id is hashed).
SCAN_PAGE: Final = 1000
HASH_LEN: Final = 10


def add_inspector(admin: web.Application, ctx: ProxyContext) -> None:
    """The inspector's routes on the admin app, when ``inspect_token`` is set."""
    token = ctx.settings.inspect_token
    if not token:
        return
    expected = f"Bearer {token}".encode()

    def refused(request: web.Request) -> web.Response | None:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, expected):
            return None
        return web.json_response(
            {"error": "the session inspector needs Authorization: Bearer <inspect_token>"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="mcpresume-inspector"'},
        )

    async def sessions(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        try:
            offset = max(0, int(request.query.get("offset", "0")))
            limit = min(MAX_PAGE, max(0, int(request.query.get("limit", str(PAGE)))))
        except ValueError:
            return web.json_response({"error": "offset and limit are whole numbers"}, status=400)
        store = ctx.store
        count = await store.session_count()
        page = []
        for session_id in await store.session_ids(offset, limit):
            summary = await store.summary(session_id)
            if summary is not None:  # ended meanwhile
                page.append(_brief(ctx, session_id, summary))
        return web.json_response({"count": count, "offset": offset, "limit": limit, "sessions": page})

    async def session(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        ref = request.match_info["ref"]
        found = await _find(ctx, ref)
        if found is None:
            return web.json_response({"error": f"no session {ref[:HASH_LEN]}... here"}, status=404)
        session_id, summary = found
        return web.json_response(_detail(ctx, session_id, summary))

    admin.router.add_get("/sessions", sessions)
    admin.router.add_get("/sessions/{ref}", session)


async def _find(ctx: ProxyContext, ref: str) -> tuple[str, SessionSummary] | None:
    """A session by its id, else by its hash (every session's id hashed until one matches)."""
    store = ctx.store
    summary = await store.summary(ref)
    if summary is not None:
        return ref, summary
    if len(ref) != HASH_LEN:
        return None
    offset = 0
    while ids := await store.session_ids(offset, SCAN_PAGE):
        for session_id in ids:
            if log_id(session_id) == ref:
                summary = await store.summary(session_id)
                return None if summary is None else (session_id, summary)
        offset += len(ids)
    return None


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _brief(ctx: ProxyContext, session_id: str, summary: SessionSummary) -> dict[str, Any]:
    return {
        "session": log_id(session_id),
        "owner": summary.owner,
        "epoch": summary.epoch,
        "streams": len(summary.streams),
        "live_streams": sum(1 for s in summary.streams if s.phase.value == "live"),
        "window_events": summary.window_events,
        "window_bytes": summary.window_bytes,
        "views_here": ctx.local.attached(session_id),
        "last_active": _when(summary.last_active),
        "idle_seconds": round(max(0.0, ctx.clock() - summary.last_active), 1),
    }


def _detail(ctx: ProxyContext, session_id: str, summary: SessionSummary) -> dict[str, Any]:
    epoch = summary.epoch
    return {
        "session": log_id(session_id),
        "owner": summary.owner,
        "epoch": epoch,
        "fence": summary.fence,
        "retired": summary.retired,
        "last_active": _when(summary.last_active),
        "idle_seconds": round(max(0.0, ctx.clock() - summary.last_active), 1),
        "views_here": ctx.local.attached(session_id),
        "window": {
            "events": summary.window_events,
            "bytes": summary.window_bytes,
            "oldest": None if summary.oldest is None else encode_cursor(epoch, *summary.oldest).decode(),
            "newest": None if summary.newest is None else encode_cursor(epoch, *summary.newest).decode(),
        },
        "streams": [
            {
                "number": s.number,
                "phase": s.phase.value,
                "origin": None if s.origin is None else s.origin.value,
                "first_seq": s.first_seq,
                "last_seq": s.last_seq,
                "delivered": s.delivered,
            }
            for s in summary.streams
        ],
        "claims": {
            "in_flight": summary.in_flight,
            "answered": summary.answered,
            "on_streams": summary.streamed,
        },
    }


# -- ``mcpresume sessions``: the inspector read from the command line --------------------------------------


async def read(admin_url: str, token: str, ref: str | None, offset: int, limit: int) -> tuple[int, Any]:
    """What the inspector answers: the status and the JSON body (raises ``OSError``/aiohttp's errors when it
    cannot be reached)."""
    import aiohttp

    path = f"/sessions/{ref}" if ref else f"/sessions?offset={offset}&limit={limit}"
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(admin_url.rstrip("/") + path, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        if response.content_type != "application/json":
            return response.status, {"error": f"{response.status} {response.reason} (is the inspector on?)"}
        return response.status, await response.json()


def table(page: dict[str, Any]) -> list[str]:
    """A page of ``/sessions`` as the lines of a table."""
    columns = ("session", "owner", "streams", "live_streams", "window_events", "window_bytes", "views_here")
    heads = ("SESSION", "OWNER", "STREAMS", "LIVE", "EVENTS", "BYTES", "VIEWS", "IDLE")
    rows = [
        [str(s[c]) if s[c] != "" else "-" for c in columns] + [f"{s['idle_seconds']:.0f}s"]
        for s in page["sessions"]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    shown = f"{page['offset'] + 1}-{page['offset'] + len(rows)} of " if rows else ""
    lines = [f"{shown}{page['count']} sessions"]
    for row in (list(heads), *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return lines
