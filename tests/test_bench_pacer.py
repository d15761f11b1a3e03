"""The benchmark upstream's pacer wakes each waiter at its deadline, never before, without spinning.

Under uvloop, ``asyncio.sleep`` to a deadline under a millisecond away rounds to nothing, so the paced
upstream looped several times per event and took a quarter of a core at 1,000 events/s (see bench/pacer.py):
these tests count the pacer's timer wake-ups, not time, so they hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from bench.pacer import Pacer

# Deadlines start this far ahead, so a stalled test process still registers its waiters in time (the
# ordering checks need them registered before the first deadline), and every wait is bounded: a lost
# wake-up fails the test instead of hanging the suite.
AHEAD = 0.2
BOUND = 10.0


@pytest.fixture
def pacer() -> Iterator[Pacer]:
    pacer = Pacer()
    yield pacer
    pacer.close()


async def _wake_times(pacer: Pacer, deadlines: list[float]) -> list[tuple[float, float]]:
    woke: list[tuple[float, float]] = []

    async def waiter(deadline: float) -> None:
        await pacer.until(deadline)
        woke.append((deadline, time.monotonic()))

    async with asyncio.timeout(BOUND):
        await asyncio.gather(*(waiter(deadline) for deadline in deadlines))
    return woke


async def test_waiters_wake_in_deadline_order_never_early_with_one_wakeup_per_deadline(pacer: Pacer) -> None:
    start = time.monotonic() + AHEAD
    # 0.3 ms apart (under uvloop's 1 ms timer resolution), registered out of order
    deadlines = [start + k * 0.0003 for k in (5, 0, 9, 3, 1, 8, 2, 7, 4, 6)]
    woke = await _wake_times(pacer, deadlines)
    assert [deadline for deadline, _ in woke] == sorted(deadlines)
    assert all(at >= deadline for deadline, at in woke)
    # A timer never fires early, so every wake-up wakes at least one waiter; on a loaded machine several
    # deadlines may have passed by one wake-up, so fewer is fine. asyncio.sleep under uvloop: 6-7 per event.
    assert 1 <= pacer.wakeups <= len(deadlines)


async def test_a_deadline_already_passed_returns_without_arming_the_timer(pacer: Pacer) -> None:
    await pacer.until(time.monotonic() - 1.0)
    await pacer.until(0.0)
    assert pacer.wakeups == 0


async def test_a_cancelled_waiter_leaves_the_others_on_time(pacer: Pacer) -> None:
    start = time.monotonic() + AHEAD
    cancelled = asyncio.ensure_future(pacer.until(start))  # the earliest: the timer is armed for it
    later = asyncio.ensure_future(_wake_times(pacer, [start + 0.001, start + 0.002]))
    await asyncio.sleep(0)
    cancelled.cancel()
    woke = await later
    assert [deadline for deadline, _ in woke] == [start + 0.001, start + 0.002]
    assert all(at >= deadline for deadline, at in woke)
    assert cancelled.cancelled()


async def test_one_pacer_serves_many_streams_each_paced_on_its_own_schedule(pacer: Pacer) -> None:
    # the upstream's use: streams staggered so the aggregate is evenly spaced
    start = time.monotonic() + AHEAD
    streams, per_stream, interval = 4, 5, 0.002

    async def stream(i: int) -> list[float]:
        sent: list[float] = []
        for k in range(per_stream):
            deadline = start + i * interval / streams + k * interval
            await pacer.until(deadline)
            assert time.monotonic() >= deadline
            sent.append(deadline)
        return sent

    async with asyncio.timeout(BOUND):
        schedules = await asyncio.gather(*(stream(i) for i in range(streams)))
    assert all(len(sent) == per_stream for sent in schedules)
    assert pacer.wakeups <= streams * per_stream


def test_a_pacer_refuses_a_second_event_loop(pacer: Pacer) -> None:
    # its timer is registered with the first loop's reader: another loop's waiters would never wake

    async def wait(delay: float) -> None:
        await pacer.until(time.monotonic() + delay)  # the deadline taken once the loop runs

    asyncio.run(wait(0.001))
    with pytest.raises(RuntimeError, match="serves the event loop it was first used on"):
        asyncio.run(wait(1.0))
