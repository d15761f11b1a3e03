"""Delivery marks on their way to Redis (the Redis store's, process-local).

A view marks what its client was sent after every write (``mark_delivered``). Sent as a call of its own,
each mark was one more script for Redis to run (about 16 us, in front of whatever call it rode with: at 1k
events/s, in front of nearly every append). Here a mark waits for the session's next append instead, which
applies it in the same script call (a touch of the session too: a view's release touches it right after its
last write's mark); any other call of this process on the session sends the session's mark first (so a
later call of this process never finds the session without it, as before); and a mark no append took
within ``MARK_DELAY`` is sent alone. What a mark sets (a stream's delivered seq) only moves
forward, so a mark applied late, or twice, is the same as one applied once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Final

# How long a mark may wait for its session's next append: a stream of 20 events/s or more carries its
# marks in its appends. A mark only lets the window count an evicted event as sent, and lets a paused
# append (``keep_undelivered``) pass: neither waits on it, and this process's own appends apply it first.
MARK_DELAY: Final = 0.05


class Marks:
    """Per session, the mark not sent yet: (the seq sent, the streams it is of), since when."""

    __slots__ = ("_pending", "_send", "_timer")

    def __init__(self, send: Callable[[str, int, tuple[int, ...]], bool]) -> None:
        # ``send(session_id, seq, streams)``: the mark written (True), or not now (False: it stays here).
        self._send = send
        self._pending: dict[str, tuple[int, tuple[int, ...], float]] = {}  # the oldest first
        self._timer: asyncio.TimerHandle | None = None

    def add(self, session_id: str, streams: Sequence[int], seq: int) -> None:
        numbers = tuple(streams)
        held = self._pending.get(session_id)
        loop = asyncio.get_running_loop()
        if held is None:
            self._pending[session_id] = (seq, numbers, loop.time())
        elif held[1] == numbers:
            if seq > held[0]:
                self._pending[session_id] = (seq, numbers, held[2])
        else:  # another view of the session (other streams): the one held goes first
            self.flush(session_id)
            self._pending[session_id] = (seq, numbers, loop.time())
        if self._timer is None:
            self._timer = loop.call_later(MARK_DELAY, self._due)

    def take(self, session_id: str) -> tuple[int, tuple[int, ...]] | None:
        """The session's mark for its append to apply (seq, streams), no longer held (None: none)."""
        held = self._pending.pop(session_id, None)
        return None if held is None else (held[0], held[1])

    def flush(self, session_id: str) -> None:
        """The session's mark sent now, ahead of another call on the session."""
        held = self._pending.get(session_id)
        if held is not None and self._send(session_id, held[0], held[1]):
            del self._pending[session_id]

    def flush_all(self) -> None:
        for session_id in list(self._pending):
            self.flush(session_id)
        self._cancel()

    def _due(self) -> None:
        self._timer = None
        deadline = asyncio.get_running_loop().time() - MARK_DELAY
        for session_id, (seq, streams, since) in list(self._pending.items()):
            if since > deadline:
                break  # and every later one is younger
            if self._send(session_id, seq, streams):
                del self._pending[session_id]
        if self._pending:
            loop = asyncio.get_running_loop()
            wait = next(iter(self._pending.values()))[2] + MARK_DELAY - loop.time()
            # (due already: its send failed, not connected; tried again a delay later, not in a loop)
            self._timer = loop.call_later(wait if wait > 0 else MARK_DELAY, self._due)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
