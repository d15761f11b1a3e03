"""Appending to a SessionState and getting the events back, one object each (the session returns only
what it evicted: the hot path builds no per-event objects)."""

from __future__ import annotations

from collections.abc import Sequence

from mcpresume.core.cursor import encode_cursor
from mcpresume.core.session import NewEvent, SessionState
from mcpresume.core.sse import encode_frame
from mcpresume.core.window import Event, Evicted


def append_events(
    session: SessionState, stream: int, items: Sequence[NewEvent], now: float
) -> tuple[list[Event], Evicted]:
    """``session.append``, plus the appended events still in the window, as a client gets them (the
    window keeps each event without its id line; the cursor goes in front when it is sent)."""
    before = session.next_seq
    evicted = session.append(stream, items, now)
    return [
        Event(e.seq, e.stream, encode_frame(encode_cursor(session.epoch, stream, e.seq), e.body), e.at)
        for e in session.window.after(stream, before - 1)
        if e.seq >= before
    ], evicted


def kept(event: Event) -> int:
    """The bytes the window keeps of an event as sent: all but its id line (the cursor goes in front when
    it is sent)."""
    return len(event.body) - event.body.index(b"\n") - 1
