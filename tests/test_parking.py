"""Parked waiters (process/local.py): one future each, time-outs on a shared clock (no timer per waiter)."""

from __future__ import annotations

import asyncio

from mcpresume.process.local import GONE, TICK, News, Parking, _Waiters


async def test_waiters_parked_together_share_one_timer_and_all_time_out() -> None:
    parking = Parking()
    loop = asyncio.get_running_loop()
    started = loop.time()
    futures = [parking.park(f"s{i % 10}", 0.05) for i in range(200)]
    assert len(parking._due) <= 2  # one timer per tick (two if the parks straddled a tick), not 200
    assert await asyncio.gather(*futures) == [False] * 200
    assert loop.time() - started >= 0.05 - 0.002  # never early (uvloop timers have ms resolution)
    assert not parking._due  # the fired ticks are forgotten


async def test_wake_resolves_the_sessions_waiters_only() -> None:
    parking = Parking()
    mine = [parking.park("a", 30.0) for _ in range(3)]
    other = parking.park("b", 30.0)
    parking.wake("a")
    assert [future.result() for future in mine] == [True, True, True]
    assert not other.done()
    assert len(parking) == 1  # "a" has no list left
    parking.wake("b")
    assert other.result() is True


async def test_a_woken_waiter_is_not_timed_out_later() -> None:
    parking = Parking()
    future = parking.park("a", 0.0)
    parking.wake("a")
    await asyncio.sleep(TICK + 0.05)  # past its tick: the timer finds it done and leaves it
    assert future.result() is True


async def test_waiters_that_left_are_swept_from_a_quiet_session() -> None:
    """Views that come and go on a session with no change leave cancelled futures behind: the list is swept
    as it grows, so it stays short however many came and went."""
    parking = Parking()
    for _ in range(1000):
        parking.park("quiet", 30.0).cancel()
    assert len(parking._parked["quiet"]) <= 8


async def test_waiters_woken_early_do_not_pile_up_until_their_tick() -> None:
    """A busy view parks and is woken thousands of times within one time-out: the tick lists hold about
    the live waiters (here one), not every future parked in the last ``timeout`` seconds."""
    parking = Parking()
    for _ in range(10_000):
        future = parking.park("busy", 15.0)
        parking.wake("busy")
        assert future.result() is True
    assert max(len(due) for due in parking._due.values()) <= 8


async def test_a_list_of_mostly_live_waiters_is_not_swept_at_every_park() -> None:
    """Regression (found in review): sweeping at every power-of-two length rescanned a list holding just
    under one (1,023 live idle views in a tick) at each further park. The next sweep now waits until the
    list doubles what the last one kept."""
    loop = asyncio.get_running_loop()
    waiters = _Waiters()
    for _ in range(1023):
        waiters.add(loop.create_future())  # live: idle views
    for _ in range(1000):
        done = loop.create_future()
        done.set_result(True)
        waiters.add(done)  # a busy view, woken at once each time
    assert waiters.sweep_at == 2 * 1023  # swept once, at 1,024 (taking the one done future then held)
    assert len(waiters) == 1023 + 999  # and not since: not until 2,046


async def test_news_never_goes_backwards() -> None:
    """A shared store's subscription may deliver this process's own change after a newer one it was told of
    directly: a view that read the newer version must not then park as if nothing had changed (it parks
    until the next change, which is right), nor return at once forever."""
    news = News()
    news.changed("s", 7)
    news.changed("s", 6)  # late, out of order
    parked = news.wait("s", 7, 30.0)
    assert not parked.done()  # 7 is current: it parks
    assert news.wait("s", 6, 30.0).done()  # a view that read 6 has news
    news.changed("s", GONE)
    assert parked.done() and news.wait("s", 7, 30.0).done()  # dropped: every wait returns


async def test_news_older_than_the_caller_s_read_is_not_news() -> None:
    """A shared store publishes a change only where another process listens, so the last version heard
    may be older than what a view then read (the session's creation, say): that view parks until a newer
    change, rather than reading again at once, every time."""
    news = News()
    news.changed("s", 0)
    parked = news.wait("s", 5, 30.0)
    assert not parked.done()
    news.changed("s", 6)
    assert parked.done() and parked.result() is True
