"""What only this process knows about its sessions: the views it serves, their readers, who waits for news.

The store (``mcpresume.store``) holds what every replica must see: sessions, streams, windows, claims. This
module holds the rest, which would make no sense in a shared store and would outlive a replica that died
there: how many client views this process has attached to a session (and the per-session limit), where each
of its readers is (flow control, see ``core/flow.py``), and the futures of views waiting for a session's next
change. It is the same whatever the store: the store tells it of changes through ``News.changed``.

A session with a view attached here must not expire while the view is open: the shell touches it in the
store when a view attaches or leaves and at every housekeeping round (``attached_sessions``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Sequence

from mcpresume.core.flow import Guard, Readers
from mcpresume.store import GONE

TICK = 0.25
"""Parked waiters time out on a shared clock of this many seconds: up to one tick late."""

# Waiter lists are swept of done futures from this length on (see _Waiters).
_SWEEP_FROM = 8


class _Waiters(list["asyncio.Future[bool]"]):
    """Futures parked together. The done ones (woken early, or left by waiters that went away) are swept
    out when the list reaches twice what the last sweep kept, and at least ``_SWEEP_FROM``: amortized O(1)
    per park whatever the mix, and never more than about twice the live ones."""

    __slots__ = ("sweep_at",)

    def __init__(self) -> None:
        super().__init__()
        self.sweep_at = _SWEEP_FROM

    def add(self, future: asyncio.Future[bool]) -> None:
        if len(self) >= self.sweep_at:
            self[:] = [waiter for waiter in self if not waiter.done()]
            self.sweep_at = max(_SWEEP_FROM, 2 * len(self))
        self.append(future)


class Parking:
    """Waiters parked per session, each on a future of its own: a change wakes each one in one hop, and a
    waiter that leaves cancels only its own. Time-outs share one timer per tick (``TICK``): an idle view
    holds a future and two list slots, not a timer handle of its own."""

    def __init__(self) -> None:
        self._parked: dict[str, _Waiters] = {}
        self._due: dict[int, _Waiters] = {}

    def park(self, session_id: str, timeout: float) -> asyncio.Future[bool]:
        """A future that resolves True at the next ``wake(session_id)``, or False after ``timeout``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        parked = self._parked.get(session_id)
        if parked is None:
            parked = self._parked[session_id] = _Waiters()
        parked.add(future)
        tick = math.ceil((loop.time() + max(timeout, 0.0)) / TICK)
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = _Waiters()
            loop.call_at(tick * TICK, self._time_out, tick)
        # Most waiters are woken long before their tick (a busy view parks thousands of times a second):
        # swept as it grows, a tick's list holds about the live ones, not every park of its quarter second.
        due.add(future)
        return future

    def wake(self, session_id: str) -> None:
        for future in self._parked.pop(session_id, ()):
            if not future.done():
                future.set_result(True)

    def _time_out(self, tick: int) -> None:
        for future in self._due.pop(tick, ()):
            if not future.done():
                future.set_result(False)

    def __len__(self) -> int:
        """Sessions with a parked waiter list (for tests)."""
        return len(self._parked)


class News:
    """Wait for a session's next change. ``changed(session_id, version)`` is called by the store after every
    change a reader may wait for, with the session's version after it; ``wait(session_id, version)``
    returns at once when a newer version was heard since (a change during the caller's write is never
    missed), else parks until the next change or the timeout."""

    def __init__(self) -> None:
        self._heard: dict[str, int] = {}
        self._parking = Parking()

    def changed(self, session_id: str, version: int) -> None:
        # Never backwards: news can arrive out of order (a shared store's subscription delivers this
        # process's own changes again, after it was told of them directly), and a view that read a newer
        # version must not park on it as if it were news.
        heard = self._heard.get(session_id)
        if version == GONE or heard is None or version > heard:
            self._heard[session_id] = version
        self._parking.wake(session_id)

    def wake(self, session_id: str) -> None:
        """Wake the session's waiters though nothing changed (the drain, ending a view: it looks again)."""
        self._parking.wake(session_id)

    def forget_gone(self) -> None:
        """Forget the sessions heard dropped (a housekeeping round: their views have read the end)."""
        heard = self._heard
        for session_id in [s for s, version in heard.items() if version == GONE]:
            del heard[session_id]

    def wait(self, session_id: str, version: int, timeout: float) -> Awaitable[bool]:
        """True when the session changed since ``version`` or was dropped, False after ``timeout``. A bare
        future: a parked view holds no coroutine frame here."""
        heard = self._heard.get(session_id)
        # Only a newer version is news: one older than the caller's read (heard before it, when a shared
        # store does not publish every change) must not send it round again and again.
        if heard is not None and (heard == GONE or heard > version):
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            done.set_result(True)
            return done
        return self._parking.park(session_id, timeout)

    def __len__(self) -> int:
        """Sessions with a parked waiter (for tests)."""
        return len(self._parking)


class LocalSessions:
    """This process's views and readers, per session."""

    def __init__(self) -> None:
        self.news = News()
        self._attached: dict[str, int] = {}
        self._readers: dict[str, Readers] = {}
        self._moved = Parking()  # pumps waiting for a reader to move (flow control)
        # Reader tokens: monotonic for the process, never reused, so a view whose reader was dropped for
        # lagging cannot move or remove the reader of the view that replaced it.
        self._tokens = itertools.count(1)

    # -- views -------------------------------------------------------------------------------------------

    def attach(self, session_id: str, limit: int | None = None) -> bool:
        """Count a client view of the session; False (nothing counted) when ``limit`` are open here."""
        count = self._attached.get(session_id, 0)
        if limit is not None and count >= limit:
            return False
        self._attached[session_id] = count + 1
        return True

    def detach(self, session_id: str) -> None:
        count = self._attached.get(session_id, 0) - 1
        if count > 0:
            self._attached[session_id] = count
        else:
            self._attached.pop(session_id, None)

    def attached(self, session_id: str) -> int:
        return self._attached.get(session_id, 0)

    def attached_sessions(self) -> list[str]:
        """The sessions with a view open here (to touch in the store: they must not expire)."""
        return list(self._attached)

    def attached_total(self) -> int:
        return sum(self._attached.values())

    # -- readers -----------------------------------------------------------------------------------------

    def add_reader(self, session_id: str, streams: Sequence[int], position: int) -> int:
        """Register an attached reader at ``position`` (the last seq it sent); returns its token."""
        readers = self._readers.get(session_id)
        if readers is None:
            readers = self._readers[session_id] = Readers()
        token = next(self._tokens)
        readers.add(token, streams, position)
        return token

    def move_reader(self, session_id: str, token: int, position: int) -> None:
        readers = self._readers.get(session_id)
        if readers is not None and readers.move(token, position):
            self._moved.wake(session_id)

    def remove_reader(self, session_id: str, token: int) -> None:
        readers = self._readers.get(session_id)
        if readers is None:
            return
        readers.remove(token)
        if not readers:
            del self._readers[session_id]
        self._moved.wake(session_id)

    def readers(self, session_id: str) -> int:
        """How many readers of the session are registered here."""
        readers = self._readers.get(session_id)
        return 0 if readers is None else len(readers)

    def reads(self, session_id: str, stream: int) -> bool:
        """Whether a reader registered here follows stream ``stream`` of the session."""
        readers = self._readers.get(session_id)
        return readers is not None and readers.reads(stream)

    def guard(self, session_id: str, *, keep_undelivered: bool = False) -> Guard | None:
        """What an append to the session must not evict (None: nothing, the usual case)."""
        readers = self._readers.get(session_id)
        if readers is None:
            return Guard(keep_undelivered=True) if keep_undelivered else None
        return readers.guard(keep_undelivered=keep_undelivered)

    def drop_readers(self, session_id: str, tokens: Sequence[int]) -> int:
        """Forget readers that lag (their views end at their next read, which finds the gap)."""
        readers = self._readers.get(session_id)
        return 0 if readers is None else readers.drop(tokens)

    def waiting_pumps(self) -> int:
        """How many pumps wait for a reader to move (``readers_moved``), over every session."""
        return len(self._moved)

    def readers_moved(self, session_id: str, timeout: float) -> Awaitable[bool]:
        """Resolves at the next move or removal of a reader of the session (True), or after ``timeout``."""
        return self._moved.park(session_id, timeout)

    def changed(self, session_id: str, version: int) -> None:
        """The store's news (``SessionStore.set_news``): views waiting on the session are woken, and when it
        was dropped (``GONE``) so are its pumps waiting for a reader to move (nothing will move)."""
        self.news.changed(session_id, version)
        if version == GONE:
            self._moved.wake(session_id)
