"""The window: count, bytes and age limits, oldest-first eviction, per-stream reads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.window import MAX_SEGMENT, Event, Evicted, EvictReason, Segment, Window, WindowLimits

BIG = 10**9


class Feeder:
    """Appends events with increasing seqs, as a session would."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.seq = 0

    def add(self, stream: int, size: int = 10, at: float = 0.0) -> tuple[Event, Evicted]:
        self.seq += 1
        event = Event(self.seq, stream, b"x" * size, at)
        return event, self.window.append(event, at)


def seqs(events: object) -> list[int]:
    return [e.seq for e in events]  # type: ignore[attr-defined]


def test_empty_window() -> None:
    window = Window(WindowLimits(4, 100, 60.0))
    assert len(window) == 0
    assert window.bytes == 0
    assert window.oldest is None and window.newest is None
    assert list(window.after(1, 0)) == []
    assert window.evicted_through(1) == 0
    assert not window.has_events(1)
    assert not window.expire(1000.0)


def test_count_limit_alone() -> None:
    window = Window(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    for _ in range(3):
        _, evicted = feed.add(1, size=5)
        assert not evicted
    _, evicted = feed.add(1, size=7)
    assert evicted.counts == {EvictReason.COUNT: [1, 5]}
    feed.add(1, size=5)
    assert seqs(window) == [3, 4, 5]
    assert len(window) == 3
    assert window.bytes == 17
    assert window.oldest is not None and window.oldest.seq == 3
    assert window.newest is not None and window.newest.seq == 5


def test_bytes_limit_alone() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=10, ttl=BIG))
    feed = Feeder(window)
    feed.add(1, size=4)
    feed.add(1, size=4)
    assert window.bytes == 8 and len(window) == 2
    _, evicted = feed.add(1, size=4)  # 12 > 10: the oldest goes
    assert evicted.counts == {EvictReason.BYTES: [1, 4]}
    assert seqs(window) == [2, 3]
    assert window.bytes == 8
    _, evicted = feed.add(1, size=9)  # 17 -> 13 -> 9
    assert evicted.counts == {EvictReason.BYTES: [2, 8]}
    assert seqs(window) == [4]
    assert window.bytes == 9


def test_bytes_limit_is_inclusive() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=10, ttl=BIG))
    feed = Feeder(window)
    feed.add(1, size=5)
    _, evicted = feed.add(1, size=5)
    assert not evicted
    assert window.bytes == 10 and len(window) == 2


def test_newest_event_is_never_evicted_by_bytes() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=10, ttl=BIG))
    feed = Feeder(window)
    feed.add(1, size=3)
    feed.add(2, size=3)
    huge, evicted = feed.add(1, size=50)
    assert evicted.counts == {EvictReason.BYTES: [2, 6]}
    assert list(window) == [huge]
    assert window.bytes == 50
    # The next small event displaces the oversized one, and is itself kept.
    small, evicted = feed.add(1, size=2)
    assert evicted.counts == {EvictReason.BYTES: [1, 50]}
    assert list(window) == [small]


def test_newest_event_is_never_evicted_by_count() -> None:
    window = Window(WindowLimits(max_events=1, max_bytes=1, ttl=BIG))
    feed = Feeder(window)
    for i in range(1, 5):
        event, _ = feed.add(1 + i % 2, size=5)
        assert list(window) == [event]
        assert window.newest == event


def test_ttl_limit_alone() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=BIG, ttl=10.0))
    feed = Feeder(window)
    feed.add(1, size=1, at=0.0)
    feed.add(1, size=2, at=5.0)
    feed.add(2, size=3, at=9.0)
    assert not window.expire(9.999)
    # Age exactly ttl is expired (at <= now - ttl).
    evicted = window.expire(10.0)
    assert evicted.counts == {EvictReason.TTL: [1, 1]}
    assert seqs(window) == [2, 3]
    # An append expires old events too, and reports it.
    _, evicted = feed.add(1, size=4, at=15.5)
    assert evicted.counts == {EvictReason.TTL: [1, 2]}
    assert seqs(window) == [3, 4]
    assert window.bytes == 7


def test_ttl_evicts_even_the_newest() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=BIG, ttl=10.0))
    feed = Feeder(window)
    feed.add(1, size=4, at=0.0)
    feed.add(2, size=6, at=1.0)
    evicted = window.expire(100.0)
    assert evicted.counts == {EvictReason.TTL: [2, 10]}
    assert len(window) == 0 and window.bytes == 0
    assert window.oldest is None and window.newest is None
    assert window.evicted_through(1) == 1
    assert window.evicted_through(2) == 2
    assert not window.has_events(1) and not window.has_events(2)


def test_combined_limits_report_each_reason() -> None:
    window = Window(WindowLimits(max_events=3, max_bytes=20, ttl=10.0))
    feed = Feeder(window)
    feed.add(1, size=2, at=0.0)  # 1: will expire
    feed.add(1, size=2, at=8.0)  # 2
    feed.add(2, size=2, at=8.0)  # 3
    # At t=12: seq 1 expires (TTL); then 4 events -> 3 would fit the count, but 2+2+2+18=24 > 20 (BYTES).
    _, evicted = feed.add(2, size=18, at=12.0)
    assert evicted.counts == {EvictReason.TTL: [1, 2], EvictReason.BYTES: [1, 2]}
    assert seqs(window) == [3, 4]
    # Count: two small ones push past 3 events.
    feed.add(1, size=0, at=12.0)
    _, evicted = feed.add(1, size=0, at=12.0)
    assert evicted.counts == {EvictReason.COUNT: [1, 2]}
    assert seqs(window) == [4, 5, 6]
    # Everything left expires together.
    evicted = window.expire(22.0)
    assert evicted.counts == {EvictReason.TTL: [3, 18]}
    assert len(window) == 0


def test_evicted_through_per_stream() -> None:
    window = Window(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    for stream in (1, 2, 1, 3, 2, 1):  # seqs 1..6
        feed.add(stream)
    # Evicted: seq 1 (stream 1), 2 (stream 2), 3 (stream 1).
    assert seqs(window) == [4, 5, 6]
    assert window.evicted_through(1) == 3
    assert window.evicted_through(2) == 2
    assert window.evicted_through(3) == 0
    assert window.evicted_through(99) == 0
    assert window.has_events(1) and window.has_events(2) and window.has_events(3)


def test_after_returns_the_streams_events_above_seq_in_order() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    for stream in (1, 2, 1, 1, 2, 3, 1):  # seqs 1..7
        feed.add(stream)
    assert seqs(window.after(1, 0)) == [1, 3, 4, 7]
    assert seqs(window.after(1, 1)) == [3, 4, 7]
    assert seqs(window.after(1, 2)) == [3, 4, 7]  # a seq of another stream works as a position
    assert seqs(window.after(1, 3)) == [4, 7]
    assert seqs(window.after(1, 6)) == [7]
    assert seqs(window.after(1, 7)) == []
    assert seqs(window.after(1, 100)) == []
    assert seqs(window.after(2, 0)) == [2, 5]
    assert seqs(window.after(2, 2)) == [5]
    assert seqs(window.after(3, 5)) == [6]
    assert seqs(window.after(4, 0)) == []
    assert all(e.stream == 1 for e in window.after(1, 0))


def test_after_skips_evicted_events() -> None:
    window = Window(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    for stream in (1, 1, 2, 1, 1):  # seqs 1..5; 1 and 2 evicted
        feed.add(stream)
    assert seqs(window.after(1, 0)) == [4, 5]
    assert seqs(window.after(2, 0)) == [3]


def test_forget_stream_only_when_it_holds_no_events() -> None:
    window = Window(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    feed.add(1)
    feed.add(2)
    feed.add(2)  # evicts seq 1 of stream 1
    assert window.evicted_through(1) == 1
    window.forget_stream(2)  # still holds events: nothing forgotten
    feed.add(3)  # evicts seq 2 of stream 2
    assert window.evicted_through(2) == 2
    window.forget_stream(1)
    assert window.evicted_through(1) == 0
    window.forget_stream(2)
    assert window.evicted_through(2) == 2
    assert seqs(window.after(2, 0)) == [3]


def test_forget_emptied_drops_a_stream_whose_last_event_left() -> None:
    window = Window(WindowLimits(max_events=1, max_bytes=BIG, ttl=BIG))
    feed = Feeder(window)
    feed.add(1)
    feed.add(2)  # evicts stream 1's only event
    assert window.evicted_through(1) == 1
    window.forget_emptied(1)
    assert window.evicted_through(1) == 0
    assert window.evicted_through(2) == 0


def test_evicted_merge_and_truth() -> None:
    evicted = Evicted()
    assert not evicted
    evicted.counts[EvictReason.COUNT] = [2, 12]
    evicted.undelivered = [1, 7]
    assert evicted
    other = Evicted({EvictReason.TTL: [1, 3], EvictReason.COUNT: [1, 1]}, [1, 1])
    evicted.merge(other)
    assert evicted.counts == {EvictReason.COUNT: [3, 13], EvictReason.TTL: [1, 3]}
    assert evicted.undelivered == [2, 8]
    assert other.counts == {EvictReason.TTL: [1, 3], EvictReason.COUNT: [1, 1]}  # merge left it alone


# -- property: invariants after every step ------------------------------------------------------------


@dataclass
class Sent:
    delivered: int


@dataclass
class Op:
    stream: int | None  # None: expire only
    sizes: list[int]  # one segment: an event per size (one event: the single-event path)
    dt: int
    delivered: int  # stream 1's delivery record moves up to this seq


ops_strategy = st.lists(
    st.builds(
        Op,
        stream=st.one_of(st.none(), st.integers(1, 4), st.integers(1, 4)),
        sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
        dt=st.sampled_from([0, 0, 0, 1, 2, 5, 11]),
        delivered=st.integers(0, 100),
    ),
    min_size=10,
    max_size=80,
)


@settings(deadline=None, max_examples=150)
@given(
    max_events=st.integers(1, 8),
    max_bytes=st.integers(0, 100),
    ttl=st.integers(1, 30),
    ops=ops_strategy,
)
def test_invariants_hold_after_every_step(max_events: int, max_bytes: int, ttl: int, ops: list[Op]) -> None:
    mark = Sent(0)  # stream 1's delivery record; no other stream was sent anything
    window = Window(WindowLimits(max_events, max_bytes, float(ttl)), {1: mark})
    history: list[Event] = []  # every event ever appended, in seq order
    evicted_count = 0  # eviction is oldest-first, so the evicted events are history[:evicted_count]
    now = 0
    for op in ops:
        now += op.dt
        mark.delivered = max(mark.delivered, min(op.delivered, len(history)))
        if op.stream is None:
            evicted = window.expire(float(now))
        else:
            seq = len(history) + 1
            events = [Event(seq + i, op.stream, b"e" * size, float(now)) for i, size in enumerate(op.sizes)]
            history.extend(events)
            if len(events) == 1:
                evicted = window.append(events[0], float(now))
            else:
                segment = Segment.of(op.stream, seq, [e.body for e in events], float(now))
                evicted = window.add(segment, float(now))
        removed = sum(count for count, _ in evicted.counts.values())
        removed_bytes = sum(size for _, size in evicted.counts.values())
        out = history[evicted_count : evicted_count + removed]
        assert removed_bytes == sum(len(e.body) for e in out)
        lost = [e for e in out if e.stream != 1 or e.seq > mark.delivered]
        assert evicted.undelivered == [len(lost), sum(len(e.body) for e in lost)]
        evicted_count += removed
        retained = history[evicted_count:]

        # The window holds exactly the unevicted suffix, in seq order.
        assert list(window) == retained
        assert all(a.seq < b.seq for a, b in itertools.pairwise(retained))
        assert len(window) == len(retained) <= max_events
        assert window.bytes == sum(len(e.body) for e in retained)
        if retained:
            assert window.bytes <= max(max_bytes, len(retained[-1].body))
            assert window.oldest == retained[0] and window.newest == retained[-1]
        assert all(e.at > now - ttl for e in retained)

        # Not over-eager: the last event evicted in this step had to go.
        if removed:
            last_out = history[evicted_count - 1]
            with_it = [last_out, *retained]
            assert (
                last_out.at <= now - ttl
                or len(with_it) > max_events
                or sum(len(e.body) for e in with_it) > max_bytes
            )
        # An append never evicts its newest event (count and bytes spare the newest; it is not old yet).
        if op.stream is not None:
            assert retained and retained[-1] == history[-1]

        # Per stream: after() is a brute-force filter of the retained events; evicted_through is exact.
        positions = sorted({0, *(e.seq for e in history), len(history) + 1})
        for stream in range(1, 5):
            gone = [e.seq for e in history[:evicted_count] if e.stream == stream]
            assert window.evicted_through(stream) == max(gone, default=0)
            assert window.has_events(stream) == any(e.stream == stream for e in retained)
            for position in positions:
                expected = [e for e in retained if e.stream == stream and e.seq > position]
                assert list(window.after(stream, position)) == expected


def test_appends_of_the_stream_that_appended_last_join_its_segment_up_to_a_bound() -> None:
    window = Window(WindowLimits(max_events=BIG, max_bytes=BIG, ttl=10.0))
    seq = 0
    for stream, count in ((1, MAX_SEGMENT + 2), (2, 1), (1, 1)):
        for _ in range(count):
            seq += 1
            window.append(Event(seq, stream, b"e", seq / 100), 0.0)
    # Stream 1's first run fills one segment and starts another; stream 2 and stream 1 again get their own.
    assert [(s.stream, len(s.blocks)) for s in window.segments] == [(1, MAX_SEGMENT), (1, 2), (2, 1), (1, 1)]
    assert [e.at for e in window] == [k / 100 for k in range(1, seq + 1)]  # each event keeps its time
    evicted = window.expire(15.005)  # exactly the events stamped up to 5.00 are older than ttl
    assert evicted.counts == {EvictReason.TTL: [500, 500]}
    assert window.oldest == Event(501, 1, b"e", 5.01) and len(window) == seq - 500


def test_a_large_append_is_a_segment_of_its_own_and_is_evicted_whole() -> None:
    window = Window(WindowLimits(max_events=256, max_bytes=BIG, ttl=10.0))
    seq = 1
    for _ in range(4):  # reads of 128 events each, as a pump appends a 64 KiB read of 256 B events
        window.add(Segment.of(1, seq, [b"e%d" % k for k in range(seq, seq + 128)], 0.0), 0.0)
        seq += 128
    window.add(Segment.of(1, seq, [b"small"], 0.0), 0.0)  # a small append joins the newest segment
    assert [(s.seq, len(s.blocks)) for s in window.segments] == [(258, 127), (385, 129)]
    assert [e.body for e in window] == [b"e%d" % k for k in range(258, 513)] + [b"small"]
    assert window.bytes == sum(len(e.body) for e in window)
