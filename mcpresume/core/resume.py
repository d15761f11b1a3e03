"""Deciding a resume: re-attach, or reject with an honest reason (pure).

Theory of operation
-------------------
A client reconnects with ``Mcp-Session-Id`` and ``Last-Event-ID``. The store answers with a
``SessionView`` (what it knows of the session and of the cursor's stream); ``decide`` turns that, the parsed
cursor and ``now`` into exactly one outcome. The rows are checked in this order; the first that matches wins:

=====  ============================================  ======  ========================
row    condition                                     status  reason
=====  ============================================  ======  ========================
1      session unknown, deleted or expired           404     unknown_session
2      cursor not one the proxy issued               400     malformed_cursor
3      cursor of another session or epoch            409     foreign_cursor
4      cursor beyond the session's newest event      409     cursor_ahead
5      stream or seq 0 (numbering starts at 1)       400     malformed_cursor
6      cursor's stream no longer retained            409     cursor_out_of_window
7      seq outside its stream's issued range         400     malformed_cursor
8      an event of the stream (or of its group)      409     cursor_out_of_window
       after it was evicted
9      otherwise                                     200     re-attach after seq
=====  ============================================  ======  ========================

404 means "the session is gone" and nothing else: conformant clients drop the session on 404
(spec: "the client MUST start a new session"), so every cursor problem is a 400 or a 409 (invariant #10).
There is no row that falls back to "from the start" (invariant #5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from mcpresume.core.cursor import Cursor, CursorParseError, encode_cursor
from mcpresume.core.errors import (
    CursorAhead,
    CursorOutOfWindow,
    ForeignCursor,
    MalformedCursor,
    ProxyError,
    UnknownSession,
)


@dataclass(frozen=True, slots=True)
class StreamView:
    number: int
    live: bool
    first_seq: int
    last_seq: int
    evicted_through: int
    standalone: bool = False  # a GET stream (server-initiated messages), not the answer to a POST
    # The retained streams one client view followed with this one (a re-attach follows them all), and the
    # highest seq evicted of any of them, gone ones included: past the cursor, events of the group were lost.
    group: tuple[int, ...] = ()
    group_evicted_through: int = 0
    delivered: int = 0  # the highest seq of the stream some client was sent
    primed: bool = True  # it began with a priming event (first_seq is that event's seq)


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the store says of a session, as of one instant."""

    epoch: str
    expires_at: float | None  # None while the session is active (a client attached or a POST pumping)
    next_stream: int
    newest_seq: int  # 0 when nothing was ever appended
    oldest: tuple[int, int] | None  # (stream, seq) of the oldest retained event
    newest: tuple[int, int] | None  # (stream, seq) of the newest retained event
    stream: StreamView | None  # the cursor's stream, if retained (or the last standalone stream gone)


@dataclass(frozen=True, slots=True)
class ReAttach:
    stream: int
    after: int


Decision = ReAttach | ProxyError

REATTACH: Final = "reattach"
# Every outcome of ``decide`` as the resumptions metric labels it: a re-attach, or a rejection's reason.
OUTCOMES: Final = (
    REATTACH,
    UnknownSession.reason,
    MalformedCursor.reason,
    ForeignCursor.reason,
    CursorAhead.reason,
    CursorOutOfWindow.reason,
)


def outcome_label(decision: Decision) -> str:
    """The decision's label in ``OUTCOMES``."""
    return REATTACH if isinstance(decision, ReAttach) else decision.reason


def decide(view: SessionView | None, cursor: Cursor | CursorParseError, now: float) -> Decision:
    """The resume decision table (see the module docstring). Never raises: rejections are returned."""
    if view is None or (view.expires_at is not None and view.expires_at <= now):
        return UnknownSession()
    if isinstance(cursor, CursorParseError):
        return MalformedCursor(f"Last-Event-ID is not a cursor this proxy issued: {cursor.detail}")
    facts = _facts(view, cursor)
    if cursor.epoch != view.epoch:
        return ForeignCursor("cursor belongs to another session or an earlier incarnation of it", **facts)
    if cursor.seq > view.newest_seq or cursor.stream >= view.next_stream:
        return CursorAhead("cursor is beyond the newest event of the session", **facts)
    stream = view.stream
    if cursor.stream == 0 or cursor.seq == 0:  # numbering starts at 1: never issued
        return MalformedCursor("cursor names a position the proxy never issues", **facts)
    if stream is None:
        return CursorOutOfWindow("the cursor's stream is no longer retained", **facts)
    if not stream.first_seq <= cursor.seq <= stream.last_seq:
        return MalformedCursor("cursor's position is not an event of its stream", **facts)
    if max(stream.evicted_through, stream.group_evicted_through) > cursor.seq:
        return CursorOutOfWindow("events after the cursor were evicted from the window", **facts)
    return ReAttach(stream.number, cursor.seq)


def _facts(view: SessionView, cursor: Cursor) -> dict[str, Any]:
    """The facts every cursor rejection carries: the cursor and the retained range, as cursors."""
    return {
        "cursor": cursor.encode(),
        "oldest": encode_cursor(view.epoch, *view.oldest).decode() if view.oldest else None,
        "newest": encode_cursor(view.epoch, *view.newest).decode() if view.newest else None,
    }
