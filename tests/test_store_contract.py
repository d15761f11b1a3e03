"""The ``SessionStore`` contract, run against every backend.

To add a backend, add its name to ``BACKENDS`` and a branch to ``_build``; every test below then runs
against it. Tests pass ``now`` explicitly and never sleep: the only real time is ``wait``'s timeout, and
the tests that need it to expire use a tiny one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from mcpresume.core.cursor import EPOCH_LEN, Cursor, encode_cursor, parse_cursor
from mcpresume.core.errors import ForeignCursor, TooManySessions
from mcpresume.core.flow import Guard
from mcpresume.core.resume import ReAttach, StreamView, decide
from mcpresume.core.session import Claim, ClaimOutcome, NewEvent, PumpRecord, SessionAccess, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, EvictReason, WindowLimits
from mcpresume.process.local import News
from mcpresume.store import Fenced, OpenedStream, ReplicaEntry, SessionStore, StoreStats
from mcpresume.store.memory import MemoryStore
from tests.support import new_session_id
from tests.support.events import kept

BACKENDS = ["memory", "redis", "redis-cluster"]  # redis-cluster: a real 3-node Redis Cluster
# The backends whose sessions outlive the store object (another process sees them).
SHARED = {"redis", "redis-cluster"}

LIMITS = WindowLimits(max_events=64, max_bytes=1 << 20, ttl=300.0)
SESSION_TTL = 60.0
LONG = 30.0  # a wait that must be woken, never time out (a safety net against a hung test)

StoreFactory = Callable[..., Awaitable[SessionStore]]

# Each store's news, as the shell wires it (app.build_app): what a view waits on.
NEWS: dict[int, News] = {}


def wait(store: SessionStore, session_id: str, version: int, timeout: float) -> Awaitable[bool]:
    """A view's wait for the session's next change after ``version`` (local.News, fed by the store)."""
    return NEWS[id(store)].wait(session_id, version, timeout)


async def _build(
    backend: str,
    request: pytest.FixtureRequest,
    *,
    limits: WindowLimits,
    session_ttl: float,
    max_sessions: int,
    retry_ms: int | None,
) -> SessionStore:
    if backend == "memory":
        return MemoryStore(limits, session_ttl=session_ttl, max_sessions=max_sessions, retry_ms=retry_ms)
    if backend in ("redis", "redis-cluster"):
        from mcpresume.store.redis import RedisStore  # the redis extra: only where it runs

        # An emptied Redis: counts see only this test's sessions.
        url = request.getfixturevalue("redis_db" if backend == "redis" else "redis_cluster_db")
        return RedisStore(url, limits, session_ttl=session_ttl, max_sessions=max_sessions, retry_ms=retry_ms)
    raise AssertionError(f"unknown store backend {backend!r}")


@pytest.fixture(params=BACKENDS)
async def store_factory(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Builds started stores of the parametrized backend; closes them after the test."""
    stores: list[SessionStore] = []

    async def make(
        *,
        limits: WindowLimits = LIMITS,
        session_ttl: float = SESSION_TTL,
        max_sessions: int = 100,
        retry_ms: int | None = 1000,
    ) -> SessionStore:
        store = await _build(
            request.param,
            request,
            limits=limits,
            session_ttl=session_ttl,
            max_sessions=max_sessions,
            retry_ms=retry_ms,
        )
        news = News()
        store.set_news(news.changed)
        NEWS[id(store)] = news
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
async def store(store_factory: StoreFactory) -> SessionStore:
    return await store_factory()


def msg(data: bytes = b'{"jsonrpc":"2.0","method":"notifications/progress"}') -> NewEvent:
    return NewEvent(frame_body(data), EventKind.MESSAGE)


def response(request_id: int) -> NewEvent:
    data = b'{"jsonrpc":"2.0","id":%d,"result":{}}' % request_id
    return NewEvent(frame_body(data), EventKind.RESPONSE, response_key=f"n:{request_id}")


def cursor_of(body: bytes) -> Cursor:
    first_line = body.split(b"\n", 1)[0]
    assert first_line.startswith(b"id: ")
    parsed = parse_cursor(first_line[4:])
    assert isinstance(parsed, Cursor)
    return parsed


async def yield_to_waiters() -> None:
    """Let started tasks run up to their first real suspension (a scheduling yield, not a timed sleep)."""
    for _ in range(5):
        await asyncio.sleep(0)


# -- lifecycle -------------------------------------------------------------------------------------------


async def test_ready(store: SessionStore) -> None:
    assert await store.ready() is True


async def test_create_has_delete(store: SessionStore) -> None:
    sid = new_session_id()
    assert not await store.has_session(sid)
    epoch = await store.create_session(sid, now=0.0)
    assert len(epoch) == EPOCH_LEN and parse_cursor(encode_cursor(epoch, 1, 1)) == Cursor(epoch, 1, 1)
    assert await store.has_session(sid)
    assert await store.delete_session(sid) is True
    assert not await store.has_session(sid)
    assert await store.delete_session(sid) is False


async def test_unknown_session_answers(store: SessionStore) -> None:
    sid = new_session_id()
    assert await store.claim(sid, ["n:1"]) is None
    assert await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0) is None
    assert await store.view(sid, 1) is None
    assert await store.read(sid, [1], 0) is None
    assert await store.standalone_stream(sid) is None
    appended = await store.append(sid, 1, [msg()], now=0.0)
    assert appended.blocked is None and not appended.evicted
    await store.end_stream(sid, 1, now=0.0)
    await store.release(sid, ["n:1"])
    await store.mark_delivered(sid, [1], 1)
    await store.touch([sid], now=0.0)
    assert await store.owner(sid) is None
    assert not await store.has_session(sid)  # none of these created it


async def test_create_twice_gives_a_new_epoch_and_a_fresh_session(store: SessionStore) -> None:
    sid = new_session_id()
    first = await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg()], now=0.0)
    old_cursor = Cursor(first, opened.number, opened.priming_seq)

    second = await store.create_session(sid, now=1.0)
    assert second != first
    view = await store.view(sid, opened.number)
    assert view is not None
    # Fresh: no events; stream numbers continue after the old incarnation's, so its readers find nothing.
    assert view.epoch == second and view.newest_seq == 0 and view.stream is None
    assert view.next_stream == opened.number + 1
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.NEW)  # request ids start over too
    # The old incarnation's cursors are foreign to the new one (invariant #4).
    decision = decide(view, old_cursor, now=1.0)
    assert isinstance(decision, ForeignCursor)


async def test_a_new_incarnation_is_isolated_from_the_old_ones_readers_and_pumps(store: SessionStore) -> None:
    """Invariants #3, #4. The proxy calls create_session for an id it already tracks when the upstream
    answers initialize with it again (a re-issued id). An attachment and a pump of the old incarnation hold
    only (session id, stream number): they must not see or feed the new incarnation's stream that happens
    to get the same number."""
    sid = new_session_id()
    old_epoch = await store.create_session(sid, now=0.0)
    old = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert old is not None
    position = old.priming_seq  # the old attachment has sent the priming event

    new_epoch = await store.create_session(sid, now=1.0)
    new = await store.open_stream(sid, StreamOrigin.POST, ["n:2"], now=1.0)
    assert new is not None
    await store.append(sid, new.number, [msg(b"for the new client only")], now=1.0)
    # The old pump delivers its response to the stream number it was given.
    await store.append(sid, old.number, [response(1)], now=1.0)

    # The old attachment's next read: the session it followed is gone (None) or its position is lost (gap).
    result = await store.read(sid, [old.number], position)
    assert result is None or result.gap or all(cursor_of(e.body).epoch == old_epoch for e in result.events)
    # And the new client's stream carries nothing of the old incarnation's pump.
    fresh = await store.read(sid, [new.number], 0)
    assert fresh is not None
    assert all(cursor_of(e.body).epoch == new_epoch for e in fresh.events)
    assert not any(b'"id":1' in e.body for e in fresh.events)


async def test_calls_of_an_ended_incarnation_do_not_touch_the_new_one(store: SessionStore) -> None:
    """A request forwarded in one incarnation may be answered after the upstream re-issued its session id:
    with the old epoch, its claim, release, settle, stream and drop find no session."""
    sid = new_session_id()
    old = await store.create_session(sid, now=0.0)
    assert await store.claim(sid, ["n:7"], epoch=old) == Claim(ClaimOutcome.NEW)
    new = await store.create_session(sid, now=1.0)
    assert await store.claim(sid, ["n:7"], epoch=new) == Claim(ClaimOutcome.NEW)  # no claims carried over
    assert await store.claim(sid, ["n:8"], epoch=old) is None
    await store.release(sid, ["n:7"], epoch=old)
    await store.settle(sid, ["n:7"], epoch=old)
    assert await store.open_stream(sid, StreamOrigin.POST, ["n:7"], now=1.0, epoch=old) is None
    assert await store.delete_session(sid, epoch=old) is False
    # The new incarnation's claim is as it was: still in flight (not released, not answered, no stream).
    assert await store.claim(sid, ["n:7"], epoch=new) == Claim(ClaimOutcome.IN_FLIGHT)
    assert await store.open_stream(sid, StreamOrigin.POST, ["n:7"], now=1.0, epoch=new) is not None
    assert await store.delete_session(sid, epoch=new) is True


async def test_credentials_are_bound_at_creation_and_remembered_per_incarnation(store: SessionStore) -> None:
    sid, other = new_session_id(), new_session_id()
    assert await store.access(sid) is None
    epoch = await store.create_session(sid, now=0.0, credential=b"a" * 32)
    open_epoch = await store.create_session(other, now=0.0)
    granted = await store.access(sid)
    assert granted is not None and granted.epoch == epoch and granted.credentials == (b"a" * 32,)
    await store.accept_credential(sid, epoch, b"b" * 32, "2025-11-25")
    await store.accept_credential(sid, "x" * EPOCH_LEN, b"c" * 32, None)  # not this incarnation: nothing
    granted = await store.access(sid)
    assert granted is not None
    assert granted.credentials == (b"a" * 32, b"b" * 32) and granted.protocol_version == "2025-11-25"
    await store.accept_credential(other, open_epoch, b"b" * 32, None)  # begun without: stays unbound
    unbound = await store.access(other)
    assert unbound is not None and unbound.credentials == ()


async def test_a_view_of_the_old_incarnation_is_not_parked_on_the_new_one(store: SessionStore) -> None:
    """A view waits on the version of its last read. If the session id is re-created meanwhile and the new
    incarnation happens to reach the same number of changes, that wait must still return at once (the
    view then reads, and finds the gap), not park until the new incarnation's next change."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    old = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert old is not None
    version = await _version(store, sid, old.number)
    await store.create_session(sid, now=1.0)  # a new incarnation, with as many changes as the old
    new = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=1.0)
    assert new is not None
    assert await asyncio.wait_for(wait(store, sid, version, timeout=LONG), 1.0) is True


async def test_max_sessions(store_factory: StoreFactory) -> None:
    store = await store_factory(max_sessions=2)
    a, b, c = new_session_id(), new_session_id(), new_session_id()
    await store.create_session(a, now=0.0)
    await store.create_session(b, now=0.0)
    with pytest.raises(TooManySessions) as info:
        await store.create_session(c, now=1.0)
    assert info.value.status == 503 and info.value.reason == "too_many_sessions"
    assert not await store.has_session(c)
    assert await store.has_session(a) and await store.has_session(b)  # nobody was evicted to make room
    assert await store.session_count() == 2 == (await store.stats()).sessions
    # Re-initializing a tracked id takes no extra room.
    await store.create_session(a, now=1.0)
    assert (await store.stats()).sessions == 2
    await store.delete_session(b)
    await store.create_session(c, now=1.0)
    assert await store.has_session(c)


async def test_max_sessions_counts_only_live_sessions(store_factory: StoreFactory) -> None:
    """At the limit, an expired idle session makes room; one with client activity does not."""
    store = await store_factory(max_sessions=2)
    idle, busy, newcomer = new_session_id(), new_session_id(), new_session_id()
    await store.create_session(idle, now=0.0)
    await store.create_session(busy, now=0.0)
    await store.touch([busy], now=SESSION_TTL)  # a view is open on it (the shell touches it)
    await store.create_session(newcomer, now=SESSION_TTL + 1)
    assert not await store.has_session(idle)
    assert await store.has_session(busy) and await store.has_session(newcomer)
    with pytest.raises(TooManySessions):
        await store.create_session(
            new_session_id(), now=SESSION_TTL + 2
        )  # busy was touched; newcomer is fresh


# -- streams, appends, reads --------------------------------------------------------------------------------


async def test_open_append_read_end(store: SessionStore) -> None:
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened == OpenedStream(number=1, epoch=epoch, priming_seq=1)

    first = await store.read(sid, [opened.number], 0)
    assert first is not None and not first.complete and not first.gap
    (priming,) = first.events
    assert priming.body == b"id: " + encode_cursor(epoch, 1, 1) + b"\nretry: 1000\ndata: \n\n"

    appended = await store.append(sid, opened.number, [msg(b"a"), msg(b"b"), response(1)], now=1.0)
    evicted = appended.evicted
    assert not evicted
    await store.end_stream(sid, opened.number, now=1.0)
    result = await store.read(sid, [opened.number], priming.seq)
    assert result is not None
    assert [e.seq for e in result.events] == [2, 3, 4]
    for event in result.events:
        assert cursor_of(event.body) == Cursor(epoch, opened.number, event.seq)
    assert result.events[2].body.endswith(frame_body(b'{"jsonrpc":"2.0","id":1,"result":{}}'))
    assert result.complete and not result.gap
    # Appending to an ended stream is dropped.
    await store.append(sid, opened.number, [msg()], now=2.0)
    again = await store.read(sid, [opened.number], 0)
    assert again is not None and [e.seq for e in again.events] == [1, 2, 3, 4]


async def test_the_last_events_and_the_end_go_in_one_call_or_neither_when_refused(
    store_factory: StoreFactory,
) -> None:
    """``append_and_end`` (a POST stream's whole answer): as ``append`` then ``end_stream``; refused by the
    guard, nothing is appended and the stream stays live, for the pump to try again."""
    store = await store_factory(limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)  # its priming: seq 1
    assert opened is not None
    other = await store.open_stream(sid, StreamOrigin.POST, ["n:2"], now=0.0)  # seq 2
    assert other is not None
    await store.append(sid, other.number, [msg()], now=0.0)  # seq 3: the window is full
    # A reader of the other stream at 0: the append evicts seq 1 only, not the reader's: it passes.
    behind = Guard(readers=(((other.number,), 0),))
    appended = await store.append_and_end(sid, opened.number, [response(1)], now=1.0, guard=behind)
    assert appended.blocked is None and appended.evicted
    read = await store.read(sid, [opened.number], 1)
    assert read is not None and [e.seq for e in read.events] == [4] and read.complete
    # Refused: another reader of the other stream is behind what the append would evict (seqs 2, 3).
    third = await store.open_stream(sid, StreamOrigin.POST, ["n:3"], now=1.0)  # seq 5, evicting seq 2
    assert third is not None
    refused = await store.append_and_end(
        sid, third.number, [response(3)], now=2.0, guard=Guard(readers=(((other.number,), 2),))
    )
    assert refused.blocked == (0,)
    read = await store.read(sid, [third.number], 0)
    assert read is not None and [e.seq for e in read.events] == [5] and not read.complete
    await store.append_and_end(sid, third.number, [msg(), response(3)], now=2.0)  # unguarded: in, ended
    read = await store.read(sid, [third.number], 5)
    assert read is not None and [e.seq for e in read.events] == [6, 7] and read.complete


async def test_read_merges_streams_and_isolates_them(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    a = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    b = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert a is not None and b is not None and a.number != b.number
    for target in (a, b, a, b):
        await store.append(sid, target.number, [msg()], now=0.0)
    only_a = await store.read(sid, [a.number], 0)
    both = await store.read(sid, [a.number, b.number], 0)
    assert only_a is not None and both is not None
    assert [e.seq for e in only_a.events] == [1, 3, 5]
    assert all(e.stream == a.number for e in only_a.events)
    assert [e.seq for e in both.events] == [1, 2, 3, 4, 5, 6]


async def test_append_reports_evictions_and_read_reports_the_gap(store_factory: StoreFactory) -> None:
    store = await store_factory(limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    evicted = (await store.append(sid, opened.number, [msg(), msg(), msg()], now=0.0)).evicted
    assert evicted.counts[EvictReason.COUNT][0] == 1
    gap = await store.read(sid, [opened.number], 0)
    assert gap is not None and gap.gap and list(gap.events) == []
    ok = await store.read(sid, [opened.number], 1)
    assert ok is not None and not ok.gap and [e.seq for e in ok.events] == [2, 3, 4]


async def test_standalone_stream(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    assert await store.standalone_stream(sid) is None
    await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert await store.standalone_stream(sid) is None
    get = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert get is not None
    assert await store.standalone_stream(sid) == get.number
    for number, standalone in ((get.number, True), (get.number - 1, False)):
        view = await store.view(sid, number)
        assert view is not None and view.stream is not None and view.stream.standalone is standalone
    await store.end_stream(sid, get.number, now=0.0)
    assert await store.standalone_stream(sid) is None


async def test_grouped_streams_name_each_other_in_their_views(store_factory: StoreFactory) -> None:
    store = await store_factory(limits=WindowLimits(max_events=6, max_bytes=1 << 20, ttl=300.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    numbers = []
    for key in ("n:1", "n:2", "n:3", "n:4"):
        opened = await store.open_stream(sid, StreamOrigin.POST, [key], now=1.0)
        assert opened is not None
        numbers.append(opened.number)
    one, two, three, four = numbers

    async def group(stream: int) -> set[int]:
        view = await store.view(sid, stream)
        assert view is not None and view.stream is not None
        assert view.stream.number not in view.stream.group
        return set(view.stream.group)

    assert await group(one) == set()  # not grouped: alone
    await store.group_streams(sid, [one, two])
    await store.group_streams(sid, [two, three])  # joins the group two is in
    assert (await group(one), await group(two), await group(three)) == (
        {two, three},
        {one, three},
        {one, two},
    )
    assert await group(four) == set()
    # A member that is gone (ended, its events evicted) is no longer named.
    await store.end_stream(sid, one, now=2.0)
    await store.append(sid, four, [msg() for _ in range(6)], now=3.0)  # the window of 6 evicts stream one's
    assert await group(two) == {three}


async def test_view(store: SessionStore) -> None:
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    empty = await store.view(sid, 1)
    assert empty is not None
    assert (empty.epoch, empty.next_stream, empty.newest_seq, empty.oldest, empty.newest, empty.stream) == (
        epoch,
        1,
        0,
        None,
        None,
        None,
    )
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=5.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg()], now=6.0)
    view = await store.view(sid, opened.number)
    assert view is not None
    assert view.expires_at is None  # a POST stream is being pumped
    assert (view.next_stream, view.newest_seq, view.oldest, view.newest) == (2, 2, (1, 1), (1, 2))
    assert view.stream == StreamView(number=1, live=True, first_seq=1, last_seq=2, evicted_through=0)
    assert decide(view, Cursor(epoch, 1, 1), now=6.0) == ReAttach(1, 1)
    await store.end_stream(sid, opened.number, now=7.0)
    idle = await store.view(sid, opened.number)
    assert idle is not None and idle.expires_at == 7.0 + SESSION_TTL
    assert idle.stream is not None and not idle.stream.live


# -- request ids -----------------------------------------------------------------------------------------


async def test_claim_and_release(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.NEW)
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.IN_FLIGHT)
    assert await store.claim(sid, ["n:1", "n:2"]) == Claim(ClaimOutcome.CONFLICT)
    await store.release(sid, ["n:1"])
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.NEW)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.ATTACH, opened.number)
    await store.release(sid, ["n:1"])  # forwarded already: not forgotten
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.ATTACH, opened.number)


async def test_cancelled_requests_of_a_stream_are_refused(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    assert await store.claim(sid, ["n:1", "s:a"]) == Claim(ClaimOutcome.NEW)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1", "s:a"], now=0.0)
    assert opened is not None
    assert await store.claim(sid, ["n:2"], max_live_streams=2) == Claim(ClaimOutcome.NEW)  # in flight
    await store.cancel_requests(sid, opened.number, ["n:1", "s:a", "n:2", "n:3"])
    await store.end_stream(sid, opened.number, now=1.0)
    assert await store.claim(sid, ["n:1", "s:a"]) == Claim(ClaimOutcome.CANCELLED)
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.CANCELLED)
    assert await store.claim(sid, ["n:2"]) == Claim(ClaimOutcome.IN_FLIGHT)  # not the stream's: left alone
    assert await store.claim(sid, ["n:3"], max_live_streams=2) == Claim(ClaimOutcome.NEW)  # one in flight
    await store.release(sid, ["n:1"])  # it ran upstream: never forgotten
    assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.CANCELLED)
    await store.cancel_requests(new_session_id(), 1, ["n:1"])  # an unknown session: no error
    # Cancelled is over: the same request again is refused, another request may take its id (a client
    # numbering from 0 again), forwarded.
    assert await store.claim(sid, ["n:5"], digests=[b"\x05" * 8]) == Claim(ClaimOutcome.NEW)
    fifth = await store.open_stream(sid, StreamOrigin.POST, ["n:5"], now=2.0)
    assert fifth is not None
    await store.cancel_requests(sid, fifth.number, ["n:5"])
    await store.end_stream(sid, fifth.number, now=3.0)
    assert await store.claim(sid, ["n:5"], digests=[b"\x05" * 8]) == Claim(ClaimOutcome.CANCELLED)
    assert await store.claim(sid, ["n:5"], digests=[b"\x09" * 8]) == Claim(ClaimOutcome.NEW)


SAME, OTHER = b"\x01" * 8, b"\x02" * 8  # two requests' digests (jsonrpc.request_digest)

# (what holds n:1, claimed for request SAME) -> what SAME again gets, what OTHER under n:1 gets
# (SessionState.claim; tests/test_session.py's table, here through both stores).
REUSED_IDS = {
    "pending": (ClaimOutcome.IN_FLIGHT, ClaimOutcome.IN_USE),
    "answered": (ClaimOutcome.ANSWERED, ClaimOutcome.NEW),
    "abandoned": (ClaimOutcome.UNKNOWN, ClaimOutcome.IN_USE),
    "live": (ClaimOutcome.ATTACH, ClaimOutcome.IN_USE),
    "ended": (ClaimOutcome.ATTACH, ClaimOutcome.NEW),
}


@pytest.mark.parametrize("holder", list(REUSED_IDS))
async def test_a_claimed_id_is_a_resend_only_for_the_same_request(store: SessionStore, holder: str) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    assert await store.claim(sid, ["n:1"], digests=[SAME]) == Claim(ClaimOutcome.NEW)
    stream = None
    if holder == "answered":
        await store.settle(sid, ["n:1"])
    elif holder == "abandoned":
        await store.abandon(sid, ["n:1"])
        await store.release(sid, ["n:1"])  # it may have run: never forgotten
    elif holder in ("live", "ended"):
        opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
        assert opened is not None
        stream = opened.number
        await store.abandon(sid, ["n:1"])  # held by its stream: nothing to abandon
        if holder == "ended":
            await store.end_stream(sid, stream, now=1.0)
    same, other = REUSED_IDS[holder]
    resent = Claim(same, stream if same is ClaimOutcome.ATTACH else None)
    assert await store.claim(sid, ["n:1"], digests=[SAME]) == resent
    assert await store.claim(sid, ["n:1"]) == resent  # a claim that does not say its request: a re-send
    assert await store.claim(sid, ["n:1"], digests=[OTHER]) == Claim(other)
    if other is ClaimOutcome.NEW:  # the id is OTHER's now, in flight (its digest kept with its stream)
        assert await store.claim(sid, ["n:1"], digests=[OTHER]) == Claim(ClaimOutcome.IN_FLIGHT)
        assert await store.claim(sid, ["n:1"], digests=[SAME]) == Claim(ClaimOutcome.IN_USE)
        opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=2.0)
        assert opened is not None
        assert await store.claim(sid, ["n:1"], digests=[OTHER]) == Claim(ClaimOutcome.ATTACH, opened.number)
        assert await store.claim(sid, ["n:1"], digests=[SAME]) == Claim(ClaimOutcome.IN_USE)


async def test_a_batch_reusing_ids_is_forwarded_only_when_each_reused_id_is_free(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    await store.claim(sid, ["n:1"], digests=[SAME])
    await store.settle(sid, ["n:1"])  # over
    await store.claim(sid, ["n:2"], digests=[SAME])  # in flight
    assert await store.claim(sid, ["n:1", "n:3"], digests=[SAME, OTHER]) == Claim(ClaimOutcome.CONFLICT)
    assert await store.claim(sid, ["n:2", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.IN_USE)
    assert await store.claim(sid, ["n:1", "n:3"], digests=[OTHER, OTHER], max_live_streams=1) == Claim(
        ClaimOutcome.LIMITED  # n:2 is in flight
    )
    assert await store.claim(sid, ["n:1", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.NEW)
    assert await store.claim(sid, ["n:1", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.IN_FLIGHT)
    await store.abandon(sid, ["n:1", "n:3"])
    assert await store.claim(sid, ["n:1", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.UNKNOWN)
    # The stream limit counts the requests in flight only: an abandoned request holds no room.
    assert await store.claim(sid, ["n:4"], max_live_streams=2, digests=[SAME]) == Claim(ClaimOutcome.NEW)


# -- wait ------------------------------------------------------------------------------------------------


async def _version(store: SessionStore, sid: str, stream: int) -> int:
    result = await store.read(sid, [stream], 0)
    assert result is not None
    return result.version


async def _session_with_stream(store: SessionStore) -> tuple[str, int]:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    return sid, opened.number


async def test_wait_returns_at_once_when_the_version_is_stale(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    await store.append(sid, stream, [msg()], now=0.0)
    assert await wait(store, sid, version, timeout=LONG) is True


async def test_wait_times_out_without_news(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    assert await wait(store, sid, version, timeout=0.01) is False


@pytest.mark.parametrize("change", ["append", "end_stream", "open_stream", "delete_session"])
async def test_wait_is_woken_by_a_change(store: SessionStore, change: str) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    waiter = asyncio.ensure_future(wait(store, sid, version, timeout=LONG))
    await yield_to_waiters()
    assert not waiter.done()  # it is parked, waiting for news
    actions: dict[str, Callable[[], Awaitable[Any]]] = {
        "append": lambda: store.append(sid, stream, [msg()], now=1.0),
        "end_stream": lambda: store.end_stream(sid, stream, now=1.0),
        "open_stream": lambda: store.open_stream(sid, StreamOrigin.POST, ["n:9"], now=1.0),
        "delete_session": lambda: store.delete_session(sid),
    }
    await actions[change]()
    assert await asyncio.wait_for(waiter, LONG) is True


async def test_wait_after_the_session_was_dropped_returns_at_once(store: SessionStore) -> None:
    """A view that read, then wrote while the session was deleted, must not park on it."""
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    await store.delete_session(sid)
    assert await asyncio.wait_for(wait(store, sid, version, timeout=LONG), 1.0) is True


async def test_one_waiter_timing_out_does_not_strand_another(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    patient = asyncio.ensure_future(wait(store, sid, version, timeout=LONG))
    await yield_to_waiters()
    assert await wait(store, sid, version, timeout=0.01) is False
    assert not patient.done()
    await store.append(sid, stream, [msg()], now=1.0)
    assert await asyncio.wait_for(patient, LONG) is True


async def test_every_waiter_is_woken(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    waiters = [asyncio.ensure_future(wait(store, sid, version, timeout=LONG)) for _ in range(3)]
    await yield_to_waiters()
    await store.append(sid, stream, [msg()], now=1.0)
    assert await asyncio.wait_for(asyncio.gather(*waiters), LONG) == [True, True, True]


async def test_wait_is_woken_when_reap_drops_the_session(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)
    version = await _version(store, sid, stream)
    waiter = asyncio.ensure_future(wait(store, sid, version, timeout=LONG))
    await yield_to_waiters()
    dropped, _ = await store.reap(now=SESSION_TTL + 1)
    assert sid in dropped
    assert await asyncio.wait_for(waiter, LONG) is True


# -- attach / detach / reap ------------------------------------------------------------------------------


async def test_reap_drops_a_session_only_when_idle_and_past_its_ttl(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    dropped, _ = await store.reap(now=SESSION_TTL - 0.1)
    assert sid not in dropped and await store.has_session(sid)
    dropped, _ = await store.reap(now=SESSION_TTL + 0.1)
    assert dropped == [sid]
    assert not await store.has_session(sid)


async def test_a_touched_session_expires_a_ttl_after_its_last_touch(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    await store.touch([sid], now=500.0)  # a view attached, or still open at a housekeeping round
    dropped, _ = await store.reap(now=500.0 + SESSION_TTL - 0.1)
    assert sid not in dropped and await store.has_session(sid)
    await store.touch([sid], now=400.0)  # a late touch (another replica's clock) never moves it back
    dropped, _ = await store.reap(now=500.0 + SESSION_TTL - 0.1)
    assert sid not in dropped
    await store.touch([sid, new_session_id()], now=600.0)  # the view left; an unknown id is no error
    dropped, _ = await store.reap(now=600.0 + SESSION_TTL - 0.1)
    assert sid not in dropped  # the ttl counts from the last touch
    dropped, _ = await store.reap(now=600.0 + SESSION_TTL + 0.1)
    assert dropped == [sid]


async def test_a_new_claim_with_now_is_activity_and_a_refused_one_is_not(store: SessionStore) -> None:
    """``claim(now=)``: the request's activity recorded with its claim (one round trip for both), as
    ``touch`` would; a claim refused records none."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    assert await store.claim(sid, ["n:1"], now=500.0) == Claim(ClaimOutcome.NEW)
    await store.release(sid, ["n:1"])
    dropped, _ = await store.reap(now=500.0 + SESSION_TTL - 0.1)
    assert sid not in dropped and await store.has_session(sid)
    assert await store.claim(sid, ["n:2"], now=400.0) == Claim(ClaimOutcome.NEW)  # never moved back
    assert await store.claim(sid, ["n:2"], now=900.0) == Claim(ClaimOutcome.IN_FLIGHT)  # refused
    await store.release(sid, ["n:2"])
    dropped, _ = await store.reap(now=500.0 + SESSION_TTL + 0.1)
    assert dropped == [sid]


async def test_a_pumping_post_stream_keeps_the_session(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    dropped, _ = await store.reap(now=10 * SESSION_TTL)
    assert sid not in dropped
    await store.end_stream(sid, opened.number, now=1000.0)
    dropped, _ = await store.reap(now=1000.0 + SESSION_TTL + 0.1)
    assert dropped == [sid]


async def test_a_stream_ended_as_of_an_earlier_instant_does_not_touch_its_session_later(
    store: SessionStore,
) -> None:
    """A pump gives up a stream nobody read or fed for session_ttl as of its last activity: the session
    then expires as idle as of that instant, not a session_ttl after the pump noticed."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    await store.touch([sid], now=100.0)
    first = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=100.0)
    assert first is not None
    await store.end_stream(sid, first.number, now=50.0)  # never backwards
    dropped, _ = await store.reap(now=100.0 + SESSION_TTL + 0.1)
    assert dropped == [sid]


async def test_client_activity_postpones_expiry_upstream_traffic_does_not(store: SessionStore) -> None:
    sid, stream = await _session_with_stream(store)  # a GET stream does not keep a session
    await store.touch([sid], now=50.0)  # a client comes and goes: that is activity
    await store.append(sid, stream, [msg()], now=55.0)  # the server talking to nobody is not
    dropped, _ = await store.reap(now=50.0 + SESSION_TTL - 0.1)
    assert sid not in dropped
    view = await store.view(sid, stream)
    assert view is not None and view.expires_at == 50.0 + SESSION_TTL


async def test_reap_reports_expired_window_events(store_factory: StoreFactory) -> None:
    store = await store_factory(limits=WindowLimits(max_events=64, max_bytes=1 << 20, ttl=10.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)  # keeps the session alive
    assert opened is not None
    await store.append(sid, opened.number, [msg(b"old"), msg(b"old")], now=1.0)
    await store.append(sid, opened.number, [msg(b"new")], now=9.0)
    before = await store.read(sid, [opened.number], 0)
    assert before is not None and [e.seq for e in before.events] == [1, 2, 3, 4]
    expiring = [e for e in before.events if e.at <= 12.0 - 10.0]
    assert [e.seq for e in expiring] == [1, 2, 3]
    dropped, evicted = await store.reap(now=12.0)
    assert dropped == []
    assert evicted.counts == {EvictReason.TTL: [3, sum(kept(e) for e in expiring)]}
    after = await store.read(sid, [opened.number], 3)
    assert after is not None and [e.seq for e in after.events] == [4]
    gap = await store.read(sid, [opened.number], 0)
    assert gap is not None and gap.gap
    dropped, evicted = await store.reap(now=12.0)
    assert dropped == [] and not evicted  # nothing more to expire


# -- readers (flow control) ------------------------------------------------------------------------------


async def test_an_append_that_would_evict_what_a_reader_has_not_sent_is_blocked(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid, stream = await _session_with_stream(store)  # priming: seq 1
    await store.append(sid, stream, [msg(), msg()], now=0.0)  # seqs 2, 3: the window is full
    # Reader 0 is behind; reader 1 follows another stream; reader 2 sent everything.
    behind = Guard(readers=(((stream,), 0), ((stream + 1,), 0), ((stream,), 3)))
    blocked = await store.append(sid, stream, [msg()], now=0.0, guard=behind)
    assert blocked.blocked == (0,) and not blocked.evicted  # seq 1 is unsent by reader 0: nothing appended
    read = await store.read(sid, [stream], 0)
    assert read is not None and [e.seq for e in read.events] == [1, 2, 3]
    moved = Guard(readers=(((stream,), 1),))  # the reader sent seq 1
    appended = await store.append(sid, stream, [msg()], now=0.0, guard=moved)
    assert appended.blocked is None
    assert appended.evicted.counts == {EvictReason.COUNT: [1, kept(read.events[0])]}
    assert (await store.append(sid, stream, [msg(), msg()], now=0.0, guard=moved)).blocked == (0,)
    forced = await store.append(sid, stream, [msg(), msg()], now=0.0)  # no guard: it evicts
    assert forced.blocked is None and forced.evicted
    after = await store.read(sid, [stream], 1)
    assert after is not None and after.gap


async def test_pause_blocks_an_append_that_would_evict_what_no_client_was_sent(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid, stream = await _session_with_stream(store)
    await store.append(sid, stream, [msg(), msg()], now=0.0)
    pause = Guard(keep_undelivered=True)
    assert (await store.append(sid, stream, [msg()], now=0.0, guard=pause)).blocked == ()
    await store.mark_delivered(sid, [stream], 1)  # a client (of any replica) was sent seq 1
    await store.mark_delivered(sid, [stream], 0)  # never moves back
    view = await store.view(sid, stream)
    assert view is not None and view.stream is not None and view.stream.delivered == 1
    assert (await store.append(sid, stream, [msg()], now=0.0, guard=pause)).blocked is None


async def test_an_append_to_an_unknown_session_is_not_blocked(store: SessionStore) -> None:
    appended = await store.append(new_session_id(), 1, [msg()], now=0.0, guard=Guard(keep_undelivered=True))
    assert appended.blocked is None and not appended.evicted


async def test_a_gone_stream_reads_complete_to_a_reader_that_sent_it_all(store_factory: StoreFactory) -> None:
    store = await store_factory(limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    old = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert old is not None
    await store.append(sid, old.number, [response(1)], now=0.0)  # seq 2
    await store.end_stream(sid, old.number, now=0.0)
    new = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert new is not None
    await store.append(sid, new.number, [msg(), msg()], now=0.0)  # the old stream leaves the window
    done = await store.read(sid, [old.number, new.number], 2)
    assert done is not None and not done.gap and {e.stream for e in done.events} == {new.number}
    missed = await store.read(sid, [old.number, new.number], 1)
    assert missed is not None and missed.gap


# -- replicas --------------------------------------------------------------------------------------------


async def test_owner_and_replica_registry(store: SessionStore) -> None:
    sid = new_session_id()
    await store.create_session(sid, now=0.0, owner="pod-a")
    assert await store.owner(sid) == "pod-a"
    assert await store.replica_url("pod-a", now=0.0) is None
    await store.register_replica("pod-a", "http://10.0.0.1:8080/mcp", ttl=10.0, now=0.0)
    await store.register_replica("pod-b", "http://10.0.0.2:8080/mcp", ttl=10.0, now=5.0)
    assert await store.replica_url("pod-a", now=9.0) == "http://10.0.0.1:8080/mcp"
    assert await store.live_replicas(now=9.0) == 2
    assert await store.replica_url("pod-a", now=10.0) is None  # the lease ran out
    assert await store.live_replicas(now=10.0) == 1
    await store.register_replica("pod-a", "http://10.0.0.1:8080/mcp", ttl=10.0, now=10.0)  # renewed
    assert await store.replica_url("pod-a", now=19.0) == "http://10.0.0.1:8080/mcp"
    await store.release_replica("pod-a")
    assert await store.replica_url("pod-a", now=11.0) is None
    await store.delete_session(sid)
    assert await store.owner(sid) is None


async def test_owner_and_access_reads_the_owner_and_the_access_record_together(store: SessionStore) -> None:
    """``owner_and_access`` says what ``owner`` and ``access`` say, read at one instant (routing's read and
    the handler's in one call): unknown, as created (with an owner or none), after the credentials, the
    protocol version, the upstream's id and the owner changed, and once deleted."""

    async def both() -> tuple[str | None, SessionAccess | None]:
        return await store.owner(sid), await store.access(sid)

    sid, unowned = new_session_id(), new_session_id()
    assert await store.owner_and_access(sid) == (None, None)
    epoch = await store.create_session(sid, now=0.0, credential=b"a" * 32, owner="pod-a")
    await store.create_session(unowned, now=0.0)
    owner, granted = await store.owner_and_access(sid)
    assert (owner, granted) == await both()
    assert owner == "pod-a" and granted is not None and granted.epoch == epoch
    assert granted.credentials == (b"a" * 32,) and granted.upstream_id is None
    assert await store.owner_and_access(unowned) == ("", await store.access(unowned))
    await store.accept_credential(sid, epoch, b"b" * 32, "2025-11-25")
    assert await store.map_upstream(sid, epoch, None, "up-1")
    await store.take_over("pod-a", by="pod-b")
    owner, granted = await store.owner_and_access(sid)
    assert (owner, granted) == await both()
    assert owner == "pod-b" and granted is not None and granted.upstream_id == "up-1"
    assert set(granted.credentials) == {b"a" * 32, b"b" * 32} and granted.protocol_version == "2025-11-25"
    await store.delete_session(sid)
    assert await store.owner_and_access(sid) == (None, None)


async def test_a_registration_is_kept_past_its_lease_until_pruned(store: SessionStore) -> None:
    """A lapsed lease keeps the replica's URL and process token (a takeover checks whether it still
    answers there); ``prune_replicas`` forgets the ones whose lease ended before a time, and only those."""
    await store.register_replica("pod-a", "http://10.0.0.1:8080/mcp", ttl=10.0, now=0.0, instance="p1")
    await store.register_replica("pod-b", "http://10.0.0.2:8080/mcp", ttl=10.0, now=50.0, instance="p2")
    assert await store.replica_url("pod-a", now=30.0) is None  # lapsed
    assert await store.replica_entry("pod-a") == ReplicaEntry("http://10.0.0.1:8080/mcp", "p1", 10.0)
    assert await store.prune_replicas(before=10.0) == []  # its lease ended at 10.0, not before
    assert await store.prune_replicas(before=59.0) == ["pod-a"]
    assert await store.replica_entry("pod-a") is None
    assert await store.replica_entry("pod-b") == ReplicaEntry("http://10.0.0.2:8080/mcp", "p2", 60.0)
    assert await store.live_replicas(now=55.0) == 1
    await store.release_replica("pod-b")
    assert await store.replica_entry("pod-b") is None


# -- stats -----------------------------------------------------------------------------------------------


async def test_stats(store: SessionStore) -> None:
    assert await store.stats() == StoreStats(sessions=0, window_events=0, window_bytes=0)
    a, b = new_session_id(), new_session_id()
    await store.create_session(a, now=0.0)
    await store.create_session(b, now=0.0)
    opened = await store.open_stream(a, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await store.append(a, opened.number, [msg(), response(1)], now=0.0)
    await store.open_stream(b, StreamOrigin.GET, [], now=0.0)
    read_a = await store.read(a, [1], 0)
    read_b = await store.read(b, [1], 0)
    assert read_a is not None and read_b is not None
    size = sum(kept(e) for e in [*read_a.events, *read_b.events])
    assert await store.stats() == StoreStats(sessions=2, window_events=4, window_bytes=size)
    await store.delete_session(a)
    stats = await store.stats()
    assert stats.sessions == 1 and stats.window_events == 1
    assert stats.window_bytes == sum(kept(e) for e in read_b.events)


async def test_close_drops_everything_and_wakes_waiters(
    store_factory: StoreFactory, request: pytest.FixtureRequest
) -> None:
    """The memory store's sessions end with its process; a shared store's outlive it (a restarted proxy
    finds them: another store on the same backend still has the session after this one closed)."""
    store = await store_factory()
    sid, stream = await _session_with_stream(store)
    if request.node.callspec.params["store_factory"] in SHARED:
        await store.close()
        after = await store_factory()
        assert await after.has_session(sid)
        result = await after.read(sid, [stream], 0)
        assert result is not None and [e.seq for e in result.events] == [1]
        return
    version = await _version(store, sid, stream)
    waiter = asyncio.ensure_future(wait(store, sid, version, timeout=LONG))
    await yield_to_waiters()
    await store.close()
    assert await asyncio.wait_for(waiter, LONG) is True
    assert not await store.has_session(sid)


# -- takeover -----------------------------------------------------------------------------------------------


async def test_the_sessions_of_a_lost_owner_are_taken_over_once(store: SessionStore) -> None:
    """A replica whose lease is gone owns sessions: ``lost_owners`` names it, and of two replicas taking it
    over, the first gets its sessions (and their orphans to pump), the second nothing."""
    pumped, quiet, others = new_session_id(), new_session_id(), new_session_id()
    epoch = await store.create_session(pumped, now=0.0, owner="a")
    await store.create_session(quiet, now=0.0, owner="a")
    await store.create_session(others, now=0.0, owner="b")
    pump = PumpRecord((7,), "/mcp", (("mcp-session-id", "up-7"),))
    opened = await store.open_stream(pumped, StreamOrigin.POST, ["n:7"], now=0.0, pump=pump)
    assert opened is not None
    await store.register_replica("b", "http://127.0.0.1:1/mcp", ttl=10.0, now=0.0)
    assert await store.lost_owners(now=1.0) == ["a"]
    taken = await store.take_over("a", by="c")
    assert [(o.session_id, o.epoch, o.stream, o.pump) for o in taken] == [
        (pumped, epoch, opened.number, pump)
    ]
    assert (await store.owner(pumped), await store.owner(quiet), await store.owner(others)) == ("c", "c", "b")
    assert await store.take_over("a", by="d") == []  # the race's loser: nothing left
    await store.register_replica("c", "http://127.0.0.1:2/mcp", ttl=10.0, now=0.0)
    assert await store.lost_owners(now=1.0) == []
    assert await store.lost_owners(now=11.0) == ["b", "c"]  # both leases ran out


async def test_an_append_of_no_events_keeps_the_upstream_cursor_alone(store: SessionStore) -> None:
    """A priming event's id (the upstream's first resumption point) kept before the stream's first event:
    the stream's cursor is the id, its events unchanged; a stale owner's is refused as any append is."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0, owner="a")
    pump = PumpRecord((7,), "/mcp", (("mcp-session-id", "up-7"),))
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:7"], now=0.0, priming=True, pump=pump)
    assert opened is not None
    before = await store.read(sid, [opened.number], 0)
    await store.append(sid, opened.number, [], now=1.0, upstream_cursor="p-1", fence=opened.fence)
    (taken,) = await store.take_over("a", by="b")
    assert taken.upstream_cursor == "p-1" and taken.stream == opened.number
    after = await store.read(sid, [opened.number], 0)
    assert before is not None and after is not None and after.events == before.events
    with pytest.raises(Fenced):
        await store.append(sid, opened.number, [], now=1.0, upstream_cursor="p-2", fence=opened.fence)
    (orphan,) = await store.orphans("b")
    assert orphan.upstream_cursor == "p-1"


async def test_a_takeover_fences_off_the_old_owners_writes(store: SessionStore) -> None:
    """Ownership carries a fence that grows with every change of owner; a pump writes under the fence it
    was given, and once the session changed hands its appends and its end of the stream are refused
    (``Fenced``), nothing written, while the new owner's pass. So a paused owner that wakes after a takeover
    can neither add events (a gap or a double beside the new owner's) nor end the stream under it."""
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0, owner="a")
    pump = PumpRecord((7,), "/mcp", (("mcp-session-id", "up-7"),))
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:7"], now=0.0, pump=pump)
    assert opened is not None and opened.fence == 0
    await store.append(sid, opened.number, [msg()], now=0.0, fence=opened.fence)
    (taken,) = await store.take_over("a", by="b")
    assert taken.fence == 1
    with pytest.raises(Fenced) as refused:
        await store.append(sid, opened.number, [msg()], now=0.0, fence=opened.fence)
    assert (refused.value.fence, refused.value.current) == (0, 1)
    with pytest.raises(Fenced):
        await store.append(sid, opened.number, [msg()], now=0.0, upstream_cursor="u-9", fence=opened.fence)
    with pytest.raises(Fenced):
        await store.end_stream(sid, opened.number, now=0.0, fence=opened.fence)
    await store.retire(sid, epoch, fence=opened.fence)  # a stale owner's retire: nothing
    assert await store.claim(sid, ["n:8"]) == Claim(ClaimOutcome.NEW)
    (orphan,) = await store.orphans("b")  # nothing the old owner tried reached the store
    assert orphan.upstream_cursor is None and orphan.fence == 2  # adopted again: a new fence once more
    result = await store.read(sid, [opened.number], 0)
    assert result is not None and [e.seq for e in result.events] == [1, 2]  # priming, the one append
    with pytest.raises(Fenced):
        await store.append(sid, opened.number, [msg()], now=0.0, fence=taken.fence)  # superseded too
    await store.append(sid, opened.number, [response(7)], now=0.0, fence=orphan.fence)
    await store.end_stream(sid, opened.number, now=0.0, fence=orphan.fence)
    result = await store.read(sid, [opened.number], 0)
    assert result is not None and [e.seq for e in result.events] == [1, 2, 3] and result.complete
    opened_later = await store.open_stream(sid, StreamOrigin.POST, ["n:9"], now=0.0, pump=pump)
    assert opened_later is not None and opened_later.fence == 2  # a new stream: under the current fence


async def test_an_unfenced_writer_is_never_refused(store: SessionStore) -> None:
    """A session without owners (one replica) has fence 0, and a writer that names none is not checked."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None and opened.fence == 0
    await store.append(sid, opened.number, [msg()], now=0.0)
    await store.append(sid, opened.number, [response(1)], now=0.0, fence=0)
    await store.end_stream(sid, opened.number, now=0.0)


async def test_a_retired_session_takes_no_new_request_and_still_reads(store: SessionStore) -> None:
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg()], now=0.0)
    await store.retire(sid, "x" * EPOCH_LEN)  # not this incarnation: nothing
    assert await store.claim(sid, ["n:2"]) == Claim(ClaimOutcome.NEW)
    await store.retire(sid, epoch)
    assert await store.claim(sid, ["n:3"]) is None  # answered 404 unknown_session
    result = await store.read(sid, [opened.number], 0)
    assert result is not None and [e.seq for e in result.events] == [1, 2]
    view = await store.view(sid, opened.number)
    assert view is not None and view.epoch == epoch


# -- the session inspector's look ------------------------------------------------------------------------


async def test_a_session_summary_shows_its_shape_and_changes_nothing(store: SessionStore) -> None:
    from mcpresume.core.session import StreamPhase
    from mcpresume.store import StreamSummary

    sid = new_session_id()
    assert await store.summary(sid) is None
    epoch = await store.create_session(sid, now=5.0, owner="pod-a")
    assert await store.claim(sid, ["n:1", "n:2", "n:3"]) is not None
    post = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=6.0)
    get = await store.open_stream(sid, StreamOrigin.GET, [], now=6.0)
    assert post is not None and get is not None
    await store.append(sid, post.number, [msg(), msg(), response(1)], now=7.0)
    await store.end_stream(sid, post.number, now=7.0)
    await store.settle(sid, ["n:2"])  # answered with JSON; n:3 still in flight
    await store.mark_delivered(sid, [post.number], post.priming_seq + 1)
    before = await store.view(sid, post.number)
    summary = await store.summary(sid)
    assert summary is not None
    assert (summary.epoch, summary.owner, summary.fence, summary.last_active) == (epoch, "pod-a", 0, 7.0)
    assert not summary.retired
    assert (summary.in_flight, summary.answered, summary.streamed) == (1, 1, 1)
    last = get.priming_seq + 3  # the GET's priming event came between the POST's and its three
    assert summary.streams == (
        StreamSummary(
            post.number, StreamPhase.ENDED, last, StreamOrigin.POST, post.priming_seq, post.priming_seq + 1
        ),
        StreamSummary(get.number, StreamPhase.LIVE, get.priming_seq, StreamOrigin.GET, get.priming_seq, 0),
    )
    # The window: both priming events and the three of the POST stream.
    assert summary.window_events == 5 and summary.window_bytes > 0
    assert summary.oldest == (post.number, post.priming_seq)
    assert summary.newest == (post.number, last)
    assert await store.view(sid, post.number) == before  # the look changed nothing


async def test_session_ids_come_in_pages(store: SessionStore) -> None:
    ids = [new_session_id() for _ in range(5)]
    for index, sid in enumerate(ids):
        await store.create_session(sid, now=float(index))
    pages = [await store.session_ids(offset, 2) for offset in (0, 2, 4, 6)]
    assert [len(page) for page in pages] == [2, 2, 1, 0]
    assert [sid for page in pages for sid in page] == ids  # oldest first, each once
    assert await store.session_ids(0, 0) == []


# -- recipes (upstream_session_lost = "reinitialize") --------------------------------------------------------


async def test_a_recipe_is_kept_by_compare_and_set_per_incarnation_and_dropped_with_the_session(
    store: SessionStore,
) -> None:
    """Only the writer that read the recipe kept now wins (two replicas folding at once: one wins, the other
    reads again); another incarnation neither sees nor writes it; it goes with the session."""
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    assert await store.recipe(sid, epoch) is None
    assert await store.keep_recipe(sid, epoch, None, b'{"a":1}')
    assert await store.recipe(sid, epoch) == b'{"a":1}'
    assert not await store.keep_recipe(sid, epoch, None, b'{"b":2}')  # it read none: another wrote first
    assert not await store.keep_recipe(sid, epoch, b'{"x":0}', b'{"b":2}')
    assert await store.keep_recipe(sid, epoch, b'{"a":1}', b'{"b":2}')
    assert await store.recipe(sid, epoch) == b'{"b":2}'
    stale = "x" * EPOCH_LEN
    assert await store.recipe(sid, stale) is None
    assert not await store.keep_recipe(sid, stale, b'{"b":2}', b'{"c":3}')
    again = await store.create_session(sid, now=1.0)  # the id re-issued: a fresh incarnation, no recipe
    assert await store.recipe(sid, again) is None and await store.recipe(sid, epoch) is None
    assert await store.keep_recipe(sid, again, None, b'{"d":4}')
    assert await store.delete_session(sid)
    assert await store.recipe(sid, again) is None
    assert not await store.keep_recipe(sid, again, b'{"d":4}', b'{"e":5}')  # gone: nothing written
    assert not await store.has_session(sid)


async def test_the_upstreams_id_is_mapped_once_by_compare_and_set_and_read_with_the_access(
    store: SessionStore,
) -> None:
    """One replica wins a re-initialization: the mapping moves only from what the caller saw; the access
    record (read on every request anyway) carries it; another incarnation has none."""
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    granted = await store.access(sid)
    assert granted is not None and granted.upstream_id is None
    assert await store.map_upstream(sid, epoch, None, "up-1")
    assert not await store.map_upstream(sid, epoch, None, "up-2")  # another replica won first
    granted = await store.access(sid)
    assert granted is not None and granted.upstream_id == "up-1"
    assert await store.map_upstream(sid, epoch, "up-1", "up-3")  # lost again later: from what it saw
    assert not await store.map_upstream(sid, "x" * EPOCH_LEN, "up-3", "up-4")
    again = await store.create_session(sid, now=1.0)
    granted = await store.access(sid)
    assert granted is not None and granted.epoch == again and granted.upstream_id is None
