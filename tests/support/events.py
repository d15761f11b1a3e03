"""Appending to a SessionState and getting the events back, one object each (the session returns only
what it evicted: the hot path builds no per-event objects)."""

from __future__ import annotations

from collections.abc import Sequence

from mcpresume.session import NewEvent, SessionState
from mcpresume.window import Event, Evicted


def append_events(
    session: SessionState, stream: int, items: Sequence[NewEvent], now: float
) -> tuple[list[Event], Evicted]:
    """``session.append``, plus the appended events still in the window."""
    before = session.next_seq
    evicted = session.append(stream, items, now)
    return [e for e in session.window.after(stream, before - 1) if e.seq >= before], evicted
