"""Waking tasks at exact deadlines, for the paced upstream, without spinning.

``asyncio.sleep(due - now)`` cannot pace events 0.1-1 ms apart under uvloop: its timers have a resolution
of 1 ms and its ``loop.time()`` is the time cached at the start of the loop iteration, so a sleep to a
deadline under a millisecond away rounds to nothing and the caller loops. Measured on the benchmark
machine (2026-11-30), 10 streams staggered to an aggregate 1,000 events/s: 6.7 sleeps per event, and the
upstream took 22-27% of a core at 1,000 events/s and 95% at 10,000, competing for the two cores with the
proxy it was meant to measure. ``Pacer`` arms one Linux ``timerfd`` (a high-resolution kernel timer, absolute
``CLOCK_MONOTONIC``) for the earliest deadline and wakes every waiter whose deadline has passed: one wake-up
per deadline, none early. Without ``timerfd`` (not Linux) it falls back to ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import heapq
import itertools
import math
import os
import time
from collections.abc import Callable


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_TFD_TIMER_ABSTIME = 1


def _timerfd_api() -> tuple[Callable[..., int], Callable[..., int]] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None


class Pacer:
    """``await pacer.until(deadline)``: return once ``time.monotonic() >= deadline``."""

    def __init__(self) -> None:
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()  # ties in deadline wake in arrival order, futures are not compared
        self._armed: float | None = None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self.wakeups = 0  # times the timer fired (for tests)
        api = _timerfd_api()
        if api is not None:
            create, self._settime = api
            fd = create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                self._fd = fd

    async def until(self, deadline: float) -> None:
        if deadline <= time.monotonic():
            return
        if self._fd < 0:
            # uvloop's sleeps may end early (see above): sleep again until the deadline has passed
            while (delay := deadline - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            return
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._fd, self._fire)
        elif loop is not self._loop:
            raise RuntimeError("a Pacer serves the event loop it was first used on")
        future: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._waiters, (deadline, next(self._order), future))
        if self._armed is None or deadline < self._armed:
            self._arm(deadline)
        await future

    def _arm(self, deadline: float | None) -> None:
        spec = _Itimerspec()
        if deadline is not None:  # all zero disarms
            nanoseconds = max(1, math.ceil(deadline * 1e9))
            spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(nanoseconds, 1_000_000_000)
        if self._settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = deadline

    def _fire(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed after it fired: the expiry was cleared
            return
        self.wakeups += 1
        self._armed = None
        now = time.monotonic()
        waiters = self._waiters
        while waiters and waiters[0][0] <= now:
            future = heapq.heappop(waiters)[2]
            if not future.done():
                future.set_result(None)
        if waiters:
            self._arm(waiters[0][0])

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
