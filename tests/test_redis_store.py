"""The Redis store beyond the shared contract (tests/test_store_contract.py runs that against it too): a
differential run against the memory store, a repeated append, the key layout (one slot per session, TTLs),
a flushed Redis, an outage and a restart of a real ``redis-server``, news between processes, Redis
Cluster."""

from __future__ import annotations

import asyncio
import functools
import importlib
import operator
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

import mcpresume.store
from mcpresume.core.cursor import Cursor
from mcpresume.core.errors import CursorOutOfWindow, StoreUnavailable
from mcpresume.core.flow import Guard
from mcpresume.core.resume import decide
from mcpresume.core.session import Claim, ClaimOutcome, NewEvent, Orphan, PumpRecord, ReadResult, StreamOrigin
from mcpresume.core.sse import SSEParser, SSERun, frame_body
from mcpresume.core.window import EventKind, Evicted, EvictReason, WindowLimits
from mcpresume.process.local import News
from mcpresume.process.metrics import Metrics
from mcpresume.store import GONE
from mcpresume.store.calls import CHANNEL, session_keys
from mcpresume.store.memory import MemoryStore
from mcpresume.store.redis import REPLICA_URLS, RedisStore
from mcpresume.store.resp import Link
from tests.support import new_session_id
from tests.support.redis import MakeRedisStore, RedisClusterProcesses, RedisProcess

LIMITS = WindowLimits(max_events=8, max_bytes=1 << 20, ttl=300.0)
SESSION_TTL = 60.0
HANG_GUARD = 30.0

Make = Callable[..., Awaitable[RedisStore]]


@pytest.fixture
def make_store(redis_stores: MakeRedisStore) -> Make:
    """A started store with these tests' window (8 events) and session TTL."""
    return functools.partial(redis_stores, limits=LIMITS, session_ttl=SESSION_TTL)


def msg(size: int = 10) -> NewEvent:
    return NewEvent(frame_body(b"x" * size), EventKind.MESSAGE)


def seqs(result: ReadResult | None) -> list[int]:
    assert result is not None
    return [event.seq for event in result.events]


# -- the same answers as the memory store ----------------------------------------------------------------

LUA = Path(mcpresume.store.__file__).parent / "lua"
TWIN = re.compile(r"^-- Twin: (\S+\.py) (.+)$", re.MULTILINE)


def test_every_lua_script_names_its_python_twin() -> None:
    """Each script (and each rule of ``common.lua`` that re-implements the core's) names the Python it
    mirrors, and the name resolves: a renamed or moved twin fails here, not silently in a comment."""
    named = 0
    for script in sorted(LUA.glob("*.lua")):
        twins = TWIN.findall(script.read_text())
        assert twins or script.name == "common.lua", f"{script.name} names no Python twin"
        for path, qualnames in twins:
            module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
            for qualname in qualnames.split(", "):
                assert operator.attrgetter(qualname)(module), f"{script.name}: {path} {qualname}"
                named += 1
    assert named >= 25  # 17 scripts, some with two twins, and six rules of common.lua


class RedisAgainstMemory(RuleBasedStateMachine):
    """The shared operations (streams, appends evicting by count, bytes and age, guarded appends, ends,
    groups, claims, deliveries, activity, expiry) on both stores: every answer of the Redis store, and every
    view and read after each step, equals the memory store's. The memory store's session is checked against
    a reference model by tests/test_session.py's machine; this one carries that over to Redis. The Lua
    scripts are the Python's twins: each names the function it mirrors (``-- Twin:``, checked by
    ``test_every_lua_script_names_its_python_twin``), and this machine is what holds each pair to one
    behaviour."""

    url = ""  # set by the test below (the Redis of the test session, emptied)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis: RedisStore | None = None

    def run(self, call: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(call)

    async def flush(self) -> None:
        """Each run starts from an empty Redis: reap and the counts see only its own session."""
        client = aioredis.Redis.from_url(self.url)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        assert self.redis is not None
        return (
            await getattr(self.memory, method)(*args, **kwargs),
            await getattr(self.redis, method)(*args, **kwargs),
        )

    @initialize(
        max_events=st.integers(2, 6),
        max_bytes=st.integers(60, 400),
        ttl=st.sampled_from([6.0, 25.0, 1e9]),
        retry_ms=st.sampled_from([None, 500]),
    )
    def setup(self, max_events: int, max_bytes: int, ttl: float, retry_ms: int | None) -> None:
        limits = WindowLimits(max_events, max_bytes, ttl)
        self.memory = MemoryStore(limits, session_ttl=SESSION_TTL, max_sessions=1000, retry_ms=retry_ms)
        self.redis = RedisStore(
            self.url, limits, session_ttl=SESSION_TTL, max_sessions=1000, retry_ms=retry_ms
        )
        self.run(self.flush())
        self.run(self.redis.start())
        self.sid = new_session_id()
        self.now = 0.0
        self.requests = 0
        self.epochs = self.run(self.both("create_session", self.sid, 0.0))

    def teardown(self) -> None:
        if self.redis is not None:
            self.run(self.redis.close())
        self.loop.close()

    def top(self) -> int:
        view = self.run(self.memory.view(self.sid, 1))
        return 0 if view is None else int(view.next_stream)

    def pick(self, pick: int) -> int:
        return pick % (self.top() + 1)

    @rule(origin=st.sampled_from(StreamOrigin), priming=st.booleans(), pumped=st.booleans())
    def open_stream(self, origin: StreamOrigin, priming: bool, pumped: bool) -> None:
        keys = [f"n:{self.requests}"] if origin is StreamOrigin.POST else []
        pump = PumpRecord((self.requests,), "/mcp", (("mcp-session-id", "up"),)) if pumped else None
        self.requests += 1
        a, b = self.run(
            self.both("open_stream", self.sid, origin, keys, self.now, priming=priming, pump=pump)
        )
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.number, a.priming_seq) == (b.number, b.priming_seq)

    @rule(
        pick=st.integers(0, 100),
        sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3),
        readers=st.lists(
            st.tuples(st.lists(st.integers(0, 100), max_size=2), st.integers(0, 40)), max_size=2
        ),
        keep=st.booleans(),
        guarded=st.booleans(),
        end=st.booleans(),
    )
    def append(
        self,
        pick: int,
        sizes: list[int],
        readers: list[tuple[list[int], int]],
        keep: bool,
        guarded: bool,
        end: bool,
    ) -> None:
        """An append (a response among its events now and then), guarded (this process's readers, overflow =
        pause) or not, carrying the upstream's last event id or not; with the stream's end in the same call
        (``append_and_end``) or not."""
        items = [msg(size) for size in sizes]
        if keep:
            items.append(NewEvent(frame_body(b'{"id":%d}' % pick), EventKind.RESPONSE, f"n:{pick}"))
        guard = None
        if guarded:
            positions = tuple((tuple(self.pick(n) for n in streams), at) for streams, at in readers)
            guard = Guard(positions, keep)
        cursor = f"up-{pick}" if guarded else None
        op = "append_and_end" if end else "append"
        a, b = self.run(self.both(op, self.sid, self.pick(pick), items, self.now, guard, cursor))
        assert a == b

    @rule(pick=st.integers(0, 100), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=4))
    def append_run(self, pick: int, sizes: list[int]) -> None:
        bodies = [b"event: message\ndata: " + b"r" * size + b"\n\n" for size in sizes]
        (run,) = SSEParser(1 << 20).feed_batched(b"".join(bodies))
        assert isinstance(run, SSERun)
        a, b = self.run(self.both("append_run", self.sid, self.pick(pick), run, self.now))
        assert a == b

    @rule(pick=st.integers(0, 100), seq=st.integers(0, 40))
    def mark_delivered(self, pick: int, seq: int) -> None:
        self.run(self.both("mark_delivered", self.sid, [self.pick(pick)], seq))

    @rule()
    def touch(self) -> None:
        """A view of this process attached or left: client activity."""
        self.run(self.both("touch", [self.sid], self.now))

    @rule(pick=st.integers(0, 100))
    def end_stream(self, pick: int) -> None:
        self.run(self.both("end_stream", self.sid, self.pick(pick), self.now))

    @rule(one=st.integers(0, 100), other=st.integers(0, 100))
    def group_streams(self, one: int, other: int) -> None:
        self.run(self.both("group_streams", self.sid, [self.pick(one), self.pick(other)]))

    @rule(
        request=st.integers(0, 100),
        digest=st.sampled_from([b"", b"\x01" * 8, b"\x02" * 8]),  # not known, a request, another one
        then=st.sampled_from(["keep", "release", "settle", "abandon"]),
    )
    def claim(self, request: int, digest: bytes, then: str) -> None:
        keys = [f"n:{request % (self.requests + 1)}"]
        a, b = self.run(self.both("claim", self.sid, keys, 3, digests=[digest]))
        assert a == b
        if then != "keep":
            self.run(self.both(then, self.sid, keys))

    @rule(seconds=st.sampled_from([1.0, 5.0, 20.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        (dropped_a, a), (dropped_b, b) = self.run(self.both("reap", self.now))
        assert (dropped_a, a) == (dropped_b, b)

    @invariant()
    def same_views_and_reads(self) -> None:
        if self.redis is None:
            return
        a_count, b_count = self.run(self.both("has_session", self.sid))
        assert a_count == b_count
        if not a_count:
            return
        orphans_a, orphans_b = self.run(self.both("orphans", ""))
        assert [(o.stream, o.origin, o.pump, o.upstream_cursor, o.answered) for o in orphans_a] == [
            (o.stream, o.origin, o.pump, o.upstream_cursor, o.answered) for o in orphans_b
        ]
        for number in range(self.top() + 1):
            a, b = self.run(self.both("view", self.sid, number))
            assert (a.next_stream, a.newest_seq, a.oldest, a.newest, a.expires_at) == (
                b.next_stream,
                b.newest_seq,
                b.oldest,
                b.newest,
                b.expires_at,
            )
            assert a.stream == b.stream
            for after in {0, max(0, a.newest_seq - 2), a.newest_seq}:
                ra, rb = self.run(self.both("read", self.sid, [number], after))
                assert (ra.gap, ra.complete, ra.more, ra.version >= 0) == (rb.gap, rb.complete, rb.more, True)
                assert [(e.seq, e.stream, e.at) for e in ra.events] == [
                    (e.seq, e.stream, e.at) for e in rb.events
                ]
                # The same bytes: the cursors differ by the epoch only.
                assert ra.body().replace(self.epochs[0].encode(), b"E") == rb.body().replace(
                    self.epochs[1].encode(), b"E"
                )
        # Routing's read of the session with its access record (one HMGET): the same, the epoch aside.
        (owner_a, access_a), (owner_b, access_b) = self.run(self.both("owner_and_access", self.sid))
        assert owner_a == owner_b and access_a is not None and access_b is not None
        assert (access_a.epoch, access_b.epoch) == self.epochs
        assert replace(access_a, epoch="E") == replace(access_b, epoch="E")
        # The session inspector's look (lua/summary.lua and its twin): the same, the epoch aside.
        sa, sb = self.run(self.both("summary", self.sid))
        assert (sa.epoch, sb.epoch) == self.epochs
        assert replace(sa, epoch="E") == replace(sb, epoch="E")


def test_the_redis_store_answers_as_the_memory_store_does(redis_db: str) -> None:
    RedisAgainstMemory.url = redis_db
    run_state_machine_as_test(
        RedisAgainstMemory,
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None, database=None),
    )


# -- idempotence, layout, TTLs ---------------------------------------------------------------------------


async def test_a_repeated_append_is_a_no_op(redis_db: str, make_store: Make) -> None:
    """The reply to an append is lost (a time-out after Redis applied it) and the call is made again: it
    carries the stream's last seq as seen before the first, so nothing is appended twice."""
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    seen_before = dict(store._tails)
    await store.append(sid, opened.number, [msg(), msg()], now=1.0)
    store._tails.clear()
    store._tails.update(seen_before)  # as if the first call's answer never came
    again = await store.append(sid, opened.number, [msg(), msg()], now=1.0)
    assert not again.evicted and again.blocked is None
    assert seqs(await store.read(sid, [opened.number], 0)) == [1, 2, 3]
    await store.append(sid, opened.number, [msg()], now=2.0)  # the next one appends as usual
    assert seqs(await store.read(sid, [opened.number], 0)) == [1, 2, 3, 4]


async def test_the_client_library_retries_no_call(
    redis_db: str, redis_cluster: RedisClusterProcesses, make_store: Make
) -> None:
    """redis-py retries a timed-out call by default (3 times, on Redis and Redis Cluster), which can apply a
    write twice: the store turns that off on both, and relies on its own deadline and idempotent scripts."""
    plain, cluster = await make_store(redis_db), await make_store(redis_cluster.url)
    assert plain._client.connection_pool.connection_kwargs["retry"].get_retries() == 0
    assert cluster._client.retry.get_retries() == 0
    assert aioredis.Redis().get_retry().get_retries() > 0  # what it would have been


async def test_a_cancelled_call_through_the_client_library_ends_cancelled(
    redis_db: str, make_store: Make
) -> None:
    """A store call cancelled while it runs ends with the cancellation, wherever it is cancelled: redis-py
    sends under ``asyncio.wait_for`` while a socket timeout is set, which on Python 3.11 returns normally
    when cancelled as the send completes (the lease's renewals, cancelled at stop, went on renewing). The
    calls are cancelled after 0, 1, 2, ... turns of the loop, so one lands in each step of the call."""
    store = await make_store(redis_db)
    assert store._client.connection_pool.connection_kwargs["socket_timeout"] is None
    calls = {
        "register_replica": lambda: store.register_replica("pod-a", "http://a/mcp", 10.0, 1.0, "i"),
        "live_replicas": lambda: store.live_replicas(1.0),
    }
    lost: list[tuple[str, int]] = []
    for name, call in calls.items():
        for turns in range(60):
            task = asyncio.ensure_future(call())
            for _ in range(turns):
                await asyncio.sleep(0)
            if task.done():
                break  # answered before it was cancelled: every later turn too
            task.cancel()
            await asyncio.wait([task])
            if not task.cancelled():
                lost.append((name, turns))
    assert lost == []


async def test_a_guarded_append_that_would_evict_unsent_events_appends_nothing(
    redis_db: str, make_store: Make
) -> None:
    store = await make_store(redis_db, limits=WindowLimits(max_events=3, max_bytes=1 << 20, ttl=300.0))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg(), msg()], now=0.0)  # seqs 1..3: full
    lagging, other = ((opened.number,), 0), ((opened.number + 5,), 0)
    blocked = await store.append(sid, opened.number, [msg()], now=0.0, guard=Guard((other, lagging)))
    assert blocked.blocked == (1,)
    assert seqs(await store.read(sid, [opened.number], 0)) == [1, 2, 3]
    kept = await store.append(sid, opened.number, [msg()], now=0.0, guard=Guard((), keep_undelivered=True))
    assert kept.blocked == ()
    await store.mark_delivered(sid, [opened.number], 1)
    fits = await store.append(sid, opened.number, [msg()], now=0.0, guard=Guard(((lagging[0], 1),)))
    assert fits.blocked is None and fits.evicted.counts
    assert seqs(await store.read(sid, [opened.number], 1)) == [2, 3, 4]


async def test_events_stored_by_an_earlier_version_one_field_each_read_the_same(
    redis_db: str, make_store: Make
) -> None:
    """Entries written with a field per value (s t c z k n, before the two-field layout) are read, viewed
    and evicted as their two-field copies are: a Redis holding an earlier version's sessions serves them."""
    writer, reader = await make_store(redis_db), await make_store(redis_db)  # reader: no copies, Redis only
    sid = new_session_id()
    await writer.create_session(sid, now=0.0)
    opened = await writer.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await writer.append(sid, opened.number, [msg(5), msg(7)], now=1.0)
    await writer.append(sid, opened.number, [msg(9)], now=2.0)
    before = await reader.read(sid, [opened.number], 1)
    view_before = await reader.view(sid, opened.number)
    client = aioredis.Redis.from_url(redis_db)
    try:
        key = session_keys(sid)[1]
        entries = await client.xrange(key)
        assert all(set(fields) == {b"m", b"z"} for _, fields in entries)
        await client.delete(key)
        for entry_id, fields in entries:
            stream, at, count, size, field = fields[b"m"].split(b" ")
            old = {"s": stream, "t": at, "c": count, "z": fields[b"z"], "k": field, "n": size}
            await client.xadd(key, old, id=entry_id)  # type: ignore[arg-type]
    finally:
        await client.aclose()
    assert (
        _shape(await reader.read(sid, [opened.number], 1)) == _shape(before) == ([2, 3, 4], [1.0, 1.0, 2.0])
    )
    assert await reader.view(sid, opened.number) == view_before
    evicted = await writer.append(sid, opened.number, [msg() for _ in range(7)], now=3.0)
    assert evicted.evicted.counts[EvictReason.COUNT][0] == 3  # the priming event's entry, and seqs 2-3's
    assert seqs(await reader.read(sid, [opened.number], 3)) == list(range(4, 12))


async def test_the_view_of_a_one_event_answer_is_read_from_this_process_copies(
    redis_db: str, make_store: Make
) -> None:
    """A stream opened with its priming event, then its response appended and the stream ended in one call
    (``append_and_end``, the append at once of a short call): the view's read, from before the priming event,
    is answered from this process's copies, no round trip, as Redis answers it (the events, their times, the
    version, the epoch, complete). A change in between, or another stream in the read: Redis."""
    writer, reader = await make_store(redis_db), await make_store(redis_db)  # reader: no copies, Redis only
    sid = new_session_id()
    await writer.create_session(sid, now=0.0)
    asked: list[str] = []
    script = writer._redis.script

    def counted(op: str, *args: Any) -> Awaitable[Any]:
        asked.append(op)
        return script(op, *args)

    writer._redis.script = counted  # type: ignore[method-assign]
    response = NewEvent(frame_body(b'{"jsonrpc":"2.0","id":1,"result":{}}'), EventKind.RESPONSE, "n:1")
    for round_ in range(2):
        opened = await writer.open_stream(sid, StreamOrigin.POST, [f"n:{round_}"], now=1.0 + round_)
        assert opened is not None
        await writer.append_and_end(sid, opened.number, [response], now=2.0 + round_)
        asked.clear()
        mine = await writer.read(sid, [opened.number], opened.priming_seq - 1)
        assert asked == []
        redis_says = await reader.read(sid, [opened.number], opened.priming_seq - 1)
        assert mine is not None and redis_says is not None and mine.complete and redis_says.complete
        assert (
            _shape(mine)
            == _shape(redis_says)
            == ([opened.priming_seq, opened.priming_seq + 1], [1.0 + round_, 2.0 + round_])
        )
        assert mine.body() == redis_says.body()
        assert (mine.version, mine.epoch, mine.more, mine.gap) == (
            redis_says.version,
            redis_says.epoch,
            False,
            False,
        )
        if round_:  # with the stream before, which ended too: Redis says
            with_another = await writer.read(sid, [opened.number - 1, opened.number], opened.priming_seq - 1)
            assert asked == ["read"] and with_another is not None and with_another.complete
            assert _shape(with_another) == _shape(mine)
    # another call's stream opened between the opening and the append: the view's read asks Redis
    opened = await writer.open_stream(sid, StreamOrigin.POST, ["n:7"], now=5.0)
    assert opened is not None
    await writer.open_stream(sid, StreamOrigin.POST, ["n:8"], now=5.0)
    await writer.append_and_end(sid, opened.number, [response], now=6.0)
    asked.clear()
    after_claim = await writer.read(sid, [opened.number], opened.priming_seq - 1)
    assert asked == ["read"] and after_claim is not None and after_claim.complete
    assert _shape(after_claim)[0] == [opened.priming_seq, opened.priming_seq + 2]


def _shape(result: ReadResult | None) -> tuple[list[int], list[float]]:
    assert result is not None
    return [event.seq for event in result.events], [t for segment in result.segments for t in segment.times]


async def test_every_key_of_a_session_is_in_one_slot_and_the_meta_outlives_the_events(
    redis_db: str, make_store: Make
) -> None:
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg()], now=0.0)
    client = aioredis.Redis.from_url(redis_db)
    try:
        keys = [key async for key in client.scan_iter(match="mcpresume:{*")]
        assert sorted(k.decode() for k in keys) == sorted(session_keys(sid))
        assert len({key_slot(key) for key in keys}) == 1
        meta, events = session_keys(sid)[:2]
        meta_ttl, events_ttl = await client.pttl(meta), await client.pttl(events)
        assert meta_ttl >= SESSION_TTL * 1000 and meta_ttl > events_ttl > 0
    finally:
        await client.aclose()


async def test_after_a_flush_the_session_is_unknown(redis_db: str, make_store: Make) -> None:
    """A Redis flushed (or restarted empty): old cursors' session is unknown (404), never a replay."""
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    client = aioredis.Redis.from_url(redis_db)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    # (A flush is not news: for store.copies.FRESH after this process's last append to a session, its
    # opening's priming event included, a read from within them is answered from its copies.)
    store._copies.recent.clear()
    assert await store.view(sid, opened.number) is None
    assert await store.access(sid) is None
    assert await store.read(sid, [opened.number], 0) is None
    assert await store.claim(sid, ["n:1"]) is None
    assert (await store.append(sid, opened.number, [msg()], now=1.0)).evicted == Evicted()
    assert not await store.has_session(sid)


async def test_events_gone_by_their_ttl_read_as_evicted_never_as_nothing_missed(
    redis_db: str, make_store: Make
) -> None:
    """The events key outlives the window's age limit, then expires (no append refreshed it): the session
    stays known, and its events count as evicted (a re-attach gets 409), not as a window that holds nothing
    after the cursor (a silent gap)."""
    store = await make_store(redis_db)
    sid = new_session_id()
    epoch = await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    await store.append(sid, opened.number, [msg(), msg()], now=0.0)
    client = aioredis.Redis.from_url(redis_db)
    try:
        events = session_keys(sid)[1]
        await client.pexpire(events, 1)
        deadline = time.monotonic() + HANG_GUARD
        while await client.exists(events):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)  # Redis expiring a key is polled: nothing to await
    finally:
        await client.aclose()
    # (Redis expires the events key no sooner than the window's age limit + 60 s after the last append:
    # later than this process's own copy of that append is used for a read, store.copies.FRESH.)
    store._copies.recent.clear()
    gap = await store.read(sid, [opened.number], 1)
    assert gap is not None and gap.gap
    view = await store.view(sid, opened.number)
    assert view is not None and view.stream is not None and view.stream.evicted_through == 3
    assert isinstance(decide(view, Cursor(epoch, opened.number, 1), now=0.0), CursorOutOfWindow)


async def test_the_owner_registry_and_orphans(redis_db: str, make_store: Make) -> None:
    store = await make_store(redis_db)
    mine, theirs = new_session_id(), new_session_id()
    epoch = await store.create_session(mine, now=0.0, owner="pod-a")
    await store.create_session(theirs, now=0.0, owner="pod-b")
    assert (await store.owner(mine), await store.owner(theirs), await store.owner(new_session_id())) == (
        "pod-a",
        "pod-b",
        None,
    )
    pump = PumpRecord((1, "two"), "/mcp?x=1", (("mcp-session-id", "up-1"), ("authorization", "Bearer t")))
    live = await store.open_stream(mine, StreamOrigin.POST, ["n:1", "s:two"], now=0.0, pump=pump)
    ended = await store.open_stream(mine, StreamOrigin.POST, ["n:3"], now=0.0, pump=pump)
    unpumped = await store.open_stream(mine, StreamOrigin.GET, [], now=0.0)
    await store.open_stream(theirs, StreamOrigin.GET, [], now=0.0, pump=pump)
    assert live is not None and ended is not None and unpumped is not None
    answer = NewEvent(frame_body(b'{"jsonrpc":"2.0","id":1,"result":{}}'), EventKind.RESPONSE, "n:1")
    await store.append(mine, live.number, [msg(), answer], now=0.0, upstream_cursor="upstream-7")
    await store.end_stream(mine, ended.number, now=0.0)
    assert await store.orphans("pod-a") == [
        Orphan(mine, epoch, live.number, StreamOrigin.POST, pump, "upstream-7", ("n:1",), fence=1)
    ]  # adopted by the owner's new process: under a new fence
    await store.register_replica("pod-a", "http://10.0.0.1:8080", ttl=10.0, now=100.0)
    assert await store.replica_url("pod-a", now=105.0) == "http://10.0.0.1:8080"
    assert await store.replica_url("pod-a", now=110.0) is None  # the lease ran out
    assert await store.live_replicas(now=105.0) == 1
    await store.release_replica("pod-a")
    assert await store.replica_url("pod-a", now=105.0) is None and await store.live_replicas(now=105.0) == 0


async def test_a_routing_lookup_that_redis_refuses_is_store_unavailable_not_an_answer(
    redis_db: str, make_store: Make
) -> None:
    """The owner (alone or with the access record) and the replica's URL are read in one round trip each, on
    the link: an error reply (here a key of the wrong type, written by something else) fails the lookup as
    an outage does (503), never reads as "no owner" or "no live replica", which would route the request to
    the wrong place."""
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    await store.register_replica("pod-a", "http://10.0.0.1:8080", ttl=10.0, now=100.0)
    client = aioredis.Redis.from_url(redis_db)
    try:
        await client.set(session_keys(sid)[0], "not a hash")  # SET replaces a key of any type
        await client.set(REPLICA_URLS, "not a hash")
        with pytest.raises(StoreUnavailable):
            await store.owner(sid)
        with pytest.raises(StoreUnavailable):
            await store.owner_and_access(sid)
        with pytest.raises(StoreUnavailable):
            await store.replica_url("pod-a", now=105.0)
        await client.delete(session_keys(sid)[0], REPLICA_URLS)
        assert await store.owner(sid) is None and await store.replica_url("pod-a", now=105.0) is None
        assert await store.owner_and_access(sid) == (None, None)
        await store.register_replica("pod-a", "http://10.0.0.1:8080", ttl=10.0, now=100.0)
        assert await store.replica_url("pod-a", now=105.0) == "http://10.0.0.1:8080"
    finally:
        await client.aclose()


# -- news ------------------------------------------------------------------------------------------------


async def test_news_of_a_change_goes_out_only_when_another_process_reads_the_session(
    redis_db: str, make_store: Make
) -> None:
    """Each process hears, by the one subscription, the changes other processes make to sessions it read in
    the last minute; a change no other process listens for is not published at all (one replica alone,
    or the pumping replica's own views: no PUBLISH, no message of its own to drop). Creating and deleting a
    session are always published."""
    writer, reader = await make_store(redis_db), await make_store(redis_db)
    own: list[tuple[str, int]] = []
    writer.set_news(lambda sid, version: own.append((sid, version)))
    heard: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    reader.set_news(lambda sid, version: heard.put_nowait((sid, version)))
    published: asyncio.Queue[bytes] = asyncio.Queue()
    watcher = Link(redis_db, connect_timeout=5.0)
    await watcher.subscribe(CHANNEL, published.put_nowait)
    sid = new_session_id()
    try:
        await writer.create_session(sid, now=0.0)
        created = own[-1][1]
        opened = await writer.open_stream(sid, StreamOrigin.GET, [], now=0.0)
        assert opened is not None
        await writer.append(sid, opened.number, [msg()], now=0.0)  # nobody else listens: not published
        await writer.read(sid, [opened.number], 0)  # its own read: still nobody else
        await writer.append(sid, opened.number, [msg()], now=0.0)
        assert await reader.read(sid, [opened.number], 0) is not None  # now the reader listens
        await writer.append(sid, opened.number, [msg()], now=0.0)
        version = (await writer.read(sid, [opened.number], 0)).version  # type: ignore[union-attr]
        # Its own changes: called at once, in order, the last one at the version a read sees.
        assert own[-1] == (sid, version) and [v for _, v in own] == sorted(v for _, v in own)
        while (await asyncio.wait_for(heard.get(), HANG_GUARD)) != (sid, version):
            pass
        versions: list[int] = []
        while not versions or versions[-1] != version:
            message = await asyncio.wait_for(published.get(), HANG_GUARD)
            _, number, about = message.decode().split(" ")
            if about == sid:
                versions.append(int(number))
        assert versions == [created, version]  # the stream's opening and the first two appends: unheard
        await writer.delete_session(sid)
        while (await asyncio.wait_for(heard.get(), HANG_GUARD)) != (sid, -1):
            pass
    finally:
        watcher.close()


@pytest.mark.parametrize("appends_at", ["before_the_read", "between_the_read_and_the_wait", "after_the_wait"])
async def test_a_view_on_another_process_misses_no_append_racing_its_history_read(
    redis_db: str, make_store: Make, appends_at: str
) -> None:
    """The replay-to-live race, across processes: a view on one replica reads the history (by position,
    at a version), then waits for news; the owner's pump appends on another replica before the read,
    between the read and the wait, or after the wait began. In each case the view's next read has the
    append: no gap, no duplicate, no reorder, and the wait never sleeps through it."""
    owner, other = await make_store(redis_db), await make_store(redis_db)
    news = News()
    other.set_news(news.changed)
    sid = new_session_id()
    await owner.create_session(sid, now=0.0)
    opened = await owner.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    stream = opened.number
    sent = [opened.priming_seq]  # the view has sent the priming event
    if appends_at == "before_the_read":
        await owner.append(sid, stream, [msg()], now=0.0)
    history = await other.read(sid, [stream], sent[-1])
    assert history is not None
    sent += [e.seq for e in history.events]
    if appends_at == "between_the_read_and_the_wait":
        await owner.append(sid, stream, [msg()], now=0.0)
    if appends_at == "after_the_wait":
        waiting = asyncio.ensure_future(news.wait(sid, history.version, HANG_GUARD))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await owner.append(sid, stream, [msg()], now=0.0)
        assert await asyncio.wait_for(waiting, HANG_GUARD) is True
    elif not history.events:  # nothing read yet: the wait must return once the append's news arrives
        assert await asyncio.wait_for(news.wait(sid, history.version, HANG_GUARD), HANG_GUARD) is True
    live = await other.read(sid, [stream], sent[-1])
    assert live is not None
    sent += [e.seq for e in live.events]
    assert sent == list(range(opened.priming_seq, opened.priming_seq + 2))  # the priming event, the append


# -- outage ----------------------------------------------------------------------------------------------


async def test_a_stopped_redis_is_store_unavailable_within_a_second_then_recovers(
    own_redis: RedisProcess, make_store: Make
) -> None:
    """SIGSTOP the real redis-server: every call raises StoreUnavailable (503 store_unavailable) within the
    store's deadline, ready() is False, and the errors are counted; SIGCONT: it works again."""
    metrics = Metrics(CollectorRegistry())
    store = await make_store(own_redis.url, metrics=metrics)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    own_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            await store.view(sid, 1)
        elapsed = time.monotonic() - started
        assert info.value.status == 503 and info.value.reason == "store_unavailable"
        assert elapsed < 1.0 + 0.5  # the deadline is 0.9 s; the rest is a loaded machine's slack
        assert await store.ready() is False
        with pytest.raises(StoreUnavailable):
            await store.append(sid, 1, [msg()], now=1.0)
    finally:
        own_redis.resume()
    assert metrics.registry.get_sample_value("mcpresume_store_errors_total", {"op": "view"}) == 1.0
    assert metrics.registry.get_sample_value("mcpresume_store_seconds_count", {"op": "view"}) == 1.0
    await _until_ready(store)
    assert await store.has_session(sid)


async def _heard(heard: asyncio.Queue[tuple[str, int]], news: tuple[str, int]) -> None:
    while await heard.get() != news:
        pass


async def _until_ready(store: RedisStore) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not await store.ready():
        assert time.monotonic() < deadline, "the store did not recover"
        await asyncio.sleep(0.05)  # reconnecting is polled: there is no event to await


async def test_a_killed_redis_is_unavailable_and_after_its_restart_the_session_is_unknown(
    own_redis: RedisProcess, make_store: Make
) -> None:
    store = await make_store(own_redis.url)
    heard: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    store.set_news(lambda sid, version: heard.put_nowait((sid, version)))
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    own_redis.stop()
    with pytest.raises(StoreUnavailable):
        await store.has_session(sid)
    assert await store.ready() is False
    own_redis.restart()  # empty: no persistence
    await _until_ready(store)
    assert await store.view(sid, 1) is None and await store.access(sid) is None
    again = new_session_id()
    await store.create_session(again, now=1.0)
    assert await store.claim(again, ["n:1"]) == Claim(ClaimOutcome.NEW)
    # The news subscription reconnected: another process's change is heard again.
    other = await make_store(own_redis.url)
    deadline = time.monotonic() + HANG_GUARD
    while True:
        assert time.monotonic() < deadline, "the news subscription did not come back"
        await other.touch([again], now=2.0)
        await other.delete_session(again)
        try:
            await asyncio.wait_for(_heard(heard, (again, GONE)), 0.5)
            break
        except TimeoutError:
            await store.create_session(again, now=3.0)  # not subscribed yet: once more


# -- Redis Cluster ---------------------------------------------------------------------------------------


async def test_the_store_works_on_redis_cluster(
    redis_cluster: RedisClusterProcesses, make_store: Make
) -> None:
    """The core operations on a real 3-node cluster, for sessions whose keys land on different nodes."""
    store, listener = await make_store(redis_cluster.url), await make_store(redis_cluster.url)
    heard: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    listener.set_news(lambda sid, version: heard.put_nowait((sid, version)))
    sids = [new_session_id() for _ in range(6)]
    assert len({key_slot(session_keys(sid)[0].encode()) // 5462 for sid in sids}) > 1  # several nodes
    for sid in sids:
        epoch = await store.create_session(sid, now=0.0)
        assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.NEW)
        opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
        assert opened is not None and opened.epoch == epoch
        assert await listener.read(sid, [opened.number], 0) is not None  # it listens from now on
        await store.append(sid, opened.number, [msg(), msg()], now=1.0)
        await store.end_stream(sid, opened.number, now=2.0)
        result = await store.read(sid, [opened.number], 0)
        assert seqs(result) == [1, 2, 3] and result is not None and result.complete
        view = await store.view(sid, opened.number)
        assert view is not None and view.stream is not None and not view.stream.live
        assert await store.claim(sid, ["n:1"]) == Claim(ClaimOutcome.ATTACH, opened.number)
        # The news of a session on any node reaches the other process's one subscription.
        version = (await store.read(sid, [opened.number], 0)).version  # type: ignore[union-attr]
        await asyncio.wait_for(_heard(heard, (sid, version)), HANG_GUARD)
    dropped, _ = await store.reap(now=2.0 + SESSION_TTL + 1)
    assert set(sids) <= set(dropped)
    assert not any([await store.has_session(sid) for sid in sids])


async def test_an_ended_stream_keeps_no_pump_record_in_redis(redis_db: str, make_store: Make) -> None:
    """The pump record (with the client's credentials), the upstream's cursor and the answered keys are what
    a takeover of a live stream needs; an ended stream keeps none of them in Redis."""
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    record = PumpRecord((1,), "/mcp", (("Authorization", "Bearer secret"),))
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0, pump=record)
    assert opened is not None
    await store.append(sid, opened.number, [msg()], now=0.0, upstream_cursor="up-1")
    client = aioredis.Redis.from_url(redis_db)
    try:
        live = await client.hget(session_keys(sid)[2], str(opened.number))
        assert live is not None and b"secret" in live and b"up-1" in live
        await store.end_stream(sid, opened.number, now=1.0)
        ended = await client.hget(session_keys(sid)[2], str(opened.number))
        assert ended is not None and b"secret" not in ended and b"up-1" not in ended
    finally:
        await client.aclose()
