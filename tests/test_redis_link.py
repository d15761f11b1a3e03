"""The Redis store's hot path against a real ``redis-server``: its own pipelined connection (store/resp.py),
the bodies kept out of the scripts (written by the append's MULTI, read by HMGET unless this process holds a
copy), and how far a reader must get before a refused append can pass (``Appended.needs``)."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from mcpresume.core.errors import StoreUnavailable
from mcpresume.core.flow import Appended, Guard, may_pass
from mcpresume.core.session import READ_MAX_EVENTS, NewEvent, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, Evicted, WindowLimits
from mcpresume.process.metrics import Metrics
from mcpresume.store.calls import session_keys
from mcpresume.store.marks import MARK_DELAY
from mcpresume.store.redis import RedisStore
from mcpresume.store.resp import POST_DELAY, Link, pack
from tests.support import new_session_id
from tests.support.redis import MakeRedisStore, RedisProcess

LIMITS = WindowLimits(max_events=4, max_bytes=1 << 20, ttl=300.0)

Make = Callable[..., Awaitable[RedisStore]]


@pytest.fixture
def make_store(redis_stores: MakeRedisStore) -> Make:
    """A started store with these tests' window (4 events), 100 sessions at most and no priming retry."""
    return functools.partial(redis_stores, limits=LIMITS, max_sessions=100, retry_ms=None)


def msg(text: bytes) -> NewEvent:
    return NewEvent(frame_body(text), EventKind.MESSAGE)


def _raw(port: int, *command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%s\r\n" % (len(c), c) for c in command))
        return sock.recv(1024)


async def _new_stream(store: RedisStore) -> tuple[str, int]:
    """A new session with one POST stream open (its priming event: seq 1): (session id, stream number)."""
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.POST, ["n:1"], now=0.0)
    assert opened is not None
    return sid, opened.number


# -- the connection ------------------------------------------------------------------------------------------


async def test_each_call_gets_its_own_reply_when_calls_interleave_and_one_gives_up(redis_db: str) -> None:
    """Concurrent calls share one connection; a caller that gives up (a time-out) before its reply leaves
    its slot, so the calls after it still get their own replies, not the late one."""
    link = Link(redis_db, connect_timeout=5.0)
    try:
        slow = asyncio.ensure_future(link.call("BLPOP", "mcpresume-test:nothing", "0.3"))
        await asyncio.sleep(0.05)
        slow.cancel()  # its reply (nil, 0.3 s later) is still to come
        answers = await asyncio.gather(*(link.call("ECHO", f"call {i}") for i in range(50)))
        assert answers == [f"call {i}".encode() for i in range(50)]
        assert await link.call("PING") == b"PONG"
        error = await link.call("HGET", "only-one-argument")
        assert "wrong number of arguments" in str(error)  # an error reply is a value, not a raise
        assert await link.call("ECHO", "after the error") == b"after the error"
    finally:
        link.close()


async def test_a_reply_later_than_the_reply_timeout_fails_the_connection_and_the_next_call_reconnects(
    own_redis: RedisProcess,
) -> None:
    """One timer watches the oldest command (replies come in order): past ``reply_timeout`` every call in
    flight raises ``TimeoutError``; once Redis answers again, the next call gets a new connection."""
    link = Link(f"redis://127.0.0.1:{own_redis.port}/0", connect_timeout=5.0, reply_timeout=0.2)
    try:
        assert await link.call("PING") == b"PONG"
        own_redis.pause()
        try:
            calls = [asyncio.ensure_future(link.call("ECHO", f"call {i}")) for i in range(3)]
            async with asyncio.timeout(10):  # (a hang, not a pass, if nothing watched the replies)
                for call in calls:
                    with pytest.raises(TimeoutError, match=r"no reply from Redis within 0\.2 s"):
                        await call
        finally:
            own_redis.resume()
        assert await link.call("ECHO", "again") == b"again"
    finally:
        link.close()


async def test_the_url_s_password_and_database_are_used(own_redis: RedisProcess, make_store: Make) -> None:
    assert _raw(own_redis.port, b"CONFIG", b"SET", b"requirepass", b"s3cret") == b"+OK\r\n"
    url = f"redis://:s3cret@127.0.0.1:{own_redis.port}/3"
    store = await make_store(url)
    sid, number = await _new_stream(store)
    await store.append(sid, number, [msg(b"in db 3")], now=0.0)
    client = aioredis.Redis.from_url(url)
    try:
        assert await client.exists(session_keys(sid)[5]) == 1  # the bodies, written through the link
        other = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{own_redis.port}/0")
        assert await other.exists(session_keys(sid)[5]) == 0
        await other.aclose()
    finally:
        await client.aclose()
    wrong = await make_store(f"redis://:wrong@127.0.0.1:{own_redis.port}/3")
    with pytest.raises(StoreUnavailable):
        await wrong.read(sid, [number], 0)


async def test_scripts_flushed_from_redis_are_loaded_again(redis_db: str, make_store: Make) -> None:
    """After SCRIPT FLUSH (or a Redis restart) every EVALSHA gets NOSCRIPT: the store loads the script and
    calls again, also for the append inside its MULTI."""
    store = await make_store(redis_db)
    sid, number = await _new_stream(store)
    client = aioredis.Redis.from_url(redis_db)
    try:
        await client.script_flush()
        appended = await store.append(sid, number, [msg(b"one")], now=0.0)
        assert appended.blocked is None
        await client.script_flush()
        result = await store.read(sid, [number], 1)
        assert result is not None and [e.seq for e in result.events] == [2]
    finally:
        await client.aclose()


# -- the bodies ----------------------------------------------------------------------------------------------


async def test_another_process_reads_the_bodies_by_hmget_and_gets_the_same_bytes(
    redis_db: str, make_store: Make
) -> None:
    writer, reader = await make_store(redis_db), await make_store(redis_db)
    sid, number = await _new_stream(writer)
    await writer.append(sid, number, [msg(b"a" * 300), msg(b"b")], now=0.0)
    await writer.append(sid, number, [msg(b"c" * 70_000)], now=0.0)
    mine = await writer.read(sid, [number], 0)
    theirs = await reader.read(sid, [number], 0)
    assert mine is not None and theirs is not None
    assert [(e.seq, e.body) for e in theirs.events] == [(e.seq, e.body) for e in mine.events]
    sent = [e.body.split(b"\n", 1)[1] for e in theirs.events]  # each as appended, its cursor line aside
    assert sent[1:] == [msg(b"a" * 300).body, msg(b"b").body, msg(b"c" * 70_000).body]
    assert len(reader._copies.bodies) == 3  # the priming event's and both appends': copies for its next reads
    cut = await reader.read(sid, [number], 2)  # from inside the first append's run
    assert cut is not None
    assert [e.body.split(b"\n", 1)[1] for e in cut.events] == [msg(b"b").body, msg(b"c" * 70_000).body]


async def test_bodies_go_with_their_events_and_a_refused_append_leaves_none(
    redis_db: str, make_store: Make
) -> None:
    store = await make_store(redis_db)
    sid = new_session_id()
    await store.create_session(sid, now=0.0)
    opened = await store.open_stream(sid, StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    for i in range(10):
        await store.append(sid, opened.number, [msg(b"%d" % i)], now=0.0)
    client = aioredis.Redis.from_url(redis_db)
    try:
        _, events, *_, bodies = session_keys(sid)
        assert await client.xlen(events) == await client.hlen(bodies) == 4  # the window: 4 events, 4 runs
        for key in session_keys(sid):  # TTLs set (an append refreshes them at most every 2 s)
            assert await client.pttl(key) != -1, key  # (-2: a key it never needed)
        reader = ((opened.number,), 7)  # has yet to send seq 8..11
        refused = await store.append(
            sid, opened.number, [msg(b"x")], now=0.0, guard=Guard((reader,), False, (9,))
        )
        assert refused.blocked == (0,) and refused.needs == (8,)
        assert await client.hlen(bodies) == 4  # the refused append's bodies are not kept
    finally:
        await client.aclose()
    result = await store.read(sid, [opened.number], 7)
    assert result is not None and [e.seq for e in result.events] == [8, 9, 10, 11]


# -- how far a reader must get -------------------------------------------------------------------------------


def test_a_refused_append_may_pass_once_every_reader_in_the_way_got_as_far_as_needed() -> None:
    taken = Guard((((1,), 3), ((2,), 5), ((1, 2), 9)), False, (10, 11, 12))
    refused = Appended(Evicted(), (0, 1), (6, 7))
    assert not may_pass(refused, taken, Guard((((1,), 6), ((2,), 6), ((1, 2), 9)), False, (10, 11, 12)))
    assert not may_pass(refused, taken, Guard((((1,), 4), ((2,), 7), ((1, 2), 9)), False, (10, 11, 12)))
    assert may_pass(refused, taken, Guard((((1,), 6), ((2,), 7), ((1, 2), 9)), False, (10, 11, 12)))
    assert may_pass(refused, taken, Guard((((1,), 6),), False, (10,)))  # reader 11 is gone: not in the way
    assert may_pass(refused, taken, None)  # every reader gone
    assert may_pass(Appended(Evicted(), (0,)), taken, taken)  # the store said nothing: any move may do


class _CountedWrites:
    """The real transport, its writes recorded (uvloop's transport takes no attribute of ours)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(data)
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_posted_commands_go_out_with_the_next_call_in_order_or_on_their_own_soon_after(
    redis_db: str,
) -> None:
    """A posted command is not written at once: it rides in front of the next call (one write for both,
    executed before it), or goes alone after ``POST_DELAY``; ``settle`` waits until Redis has run it."""
    link = Link(redis_db, connect_timeout=5.0)
    client = aioredis.Redis.from_url(redis_db)
    key = f"mcpresume-test:{uuid.uuid4().hex}"
    try:
        assert await link.call("PING") == b"PONG"  # connected
        protocol = link._protocol
        assert protocol is not None and protocol.transport is not None
        writes: list[bytes] = []
        protocol.transport = _CountedWrites(protocol.transport, writes)  # type: ignore[assignment]
        for _ in range(3):
            assert link.post(pack("INCR", key))
        assert writes == []  # held back
        assert await link.call("GET", key) == b"3"  # after all three
        assert len(writes) == 1 and writes[0].count(b"INCR") == 3
        assert link.post(pack("INCR", key))
        deadline = asyncio.get_running_loop().time() + 10
        while await client.get(key) != b"4":  # no call follows: it went on its own
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(POST_DELAY)
        assert len(writes) == 2
        assert link.post(pack("INCR", key))
        await link.settle()
        assert await client.get(key) == b"5" and len(writes) == 3
    finally:
        link.close()
        await client.delete(key)
        await client.aclose()


async def test_a_delivery_mark_is_not_waited_for_yet_every_later_call_sees_it(
    redis_db: str, make_store: Make
) -> None:
    """The mark is written without waiting for its reply; the next call on the connection comes after it.
    After SCRIPT FLUSH the posted mark's NOSCRIPT reply is counted, and the script is loaded again."""
    metrics = Metrics(CollectorRegistry())
    store = await make_store(redis_db, metrics=metrics)
    sid, number = await _new_stream(store)
    await store.append(sid, number, [msg(b"one"), msg(b"two")], now=0.0)
    for seq in (1, 2):
        await store.mark_delivered(sid, [number], seq)
        view = await store.view(sid, number)
        assert view is not None and view.stream is not None and view.stream.delivered == seq
    client = aioredis.Redis.from_url(redis_db)
    try:
        await client.script_flush()
    finally:
        await client.aclose()
    await store.mark_delivered(sid, [number], 3)  # lost: Redis no longer has the script
    await store.view(sid, number)  # (loads the view script again; the mark's reply came before)
    assert metrics.registry.get_sample_value("mcpresume_store_errors_total", {"op": "mark_delivered"}) == 1.0
    deadline = asyncio.get_running_loop().time() + 30
    while store._redis.reloading is not None:  # the reload's reply, on the same connection
        assert asyncio.get_running_loop().time() < deadline
        await store.view(sid, number)
    await store.mark_delivered(sid, [number], 3)
    view = await store.view(sid, number)
    assert view is not None and view.stream is not None and view.stream.delivered == 3


async def _delivered_in_redis(redis_url: str, sid: str, stream: int) -> int:
    """The stream's delivered seq as Redis holds it (no call of the store's, which would send a held mark)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        raw = await client.hget(session_keys(sid)[2], str(stream))
    finally:
        await client.aclose()
    assert raw is not None
    delivered: int = json.loads(raw).get("d", 0)
    return delivered


async def _script_calls(redis_url: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    calls: int = stats.get("cmdstat_evalsha", {}).get("calls", 0)
    return calls


async def test_a_delivery_mark_rides_in_the_session_s_next_append_even_one_refused(
    redis_db: str, make_store: Make
) -> None:
    """Held, not sent: the session's next append applies it in its own script call (no call of its own);
    an append refused as stale (another process appended meanwhile) applies it too."""
    store = await make_store(redis_db)
    sid, number = await _new_stream(store)
    await store.append(sid, number, [msg(b"one")], now=0.0)
    calls = await _script_calls(redis_db)
    await store.mark_delivered(sid, [number], 1)
    assert await _delivered_in_redis(redis_db, sid, number) == 0  # held
    await store.append(sid, number, [msg(b"two")], now=0.0)
    assert await _delivered_in_redis(redis_db, sid, number) == 1
    assert await _script_calls(redis_db) == calls + 1  # the append's alone
    other = await make_store(redis_db)
    await other.append(sid, number, [msg(b"three, by another process")], now=0.0)
    await store.mark_delivered(sid, [number], 3)
    refused = await store.append(sid, number, [msg(b"four")], now=0.0)
    assert not refused.evicted and refused.blocked is None  # stale: not appended
    assert await _delivered_in_redis(redis_db, sid, number) == 3


async def test_a_delivery_mark_rides_in_the_session_s_touch(redis_db: str, make_store: Make) -> None:
    """A view's release touches its session right after its last write's mark: the touch's script applies
    the held mark (one script call, not the mark's and the touch's), each session its own in a touch of
    several; a session without a mark is touched as before."""
    store = await make_store(redis_db)
    sid, number = await _new_stream(store)
    other, other_number = await _new_stream(store)
    await store.append(sid, number, [msg(b"one"), msg(b"two")], now=0.0)
    await store.append(other, other_number, [msg(b"one")], now=0.0)
    calls = await _script_calls(redis_db)
    await store.mark_delivered(sid, [number], 2)
    assert await _delivered_in_redis(redis_db, sid, number) == 0  # held
    await store.touch([sid], now=5.0)
    assert await _delivered_in_redis(redis_db, sid, number) == 2
    assert await _script_calls(redis_db) == calls + 1  # the touch's alone
    summary = await store.summary(sid)
    assert summary is not None and summary.last_active == 5.0
    await store.mark_delivered(sid, [number], 3)
    await store.mark_delivered(other, [other_number], 2)
    calls = await _script_calls(redis_db)
    await store.touch([sid, other], now=6.0)
    assert await _script_calls(redis_db) == calls + 2  # one per session
    assert await _delivered_in_redis(redis_db, sid, number) == 3
    assert await _delivered_in_redis(redis_db, other, other_number) == 2
    for session in (sid, other):
        summary = await store.summary(session)
        assert summary is not None and summary.last_active == 6.0


async def test_a_delivery_mark_no_append_takes_goes_alone_and_one_whose_append_failed_is_held_again(
    own_redis: RedisProcess, make_store: Make
) -> None:
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    store = await make_store(url, op_timeout=0.3)
    sid, number = await _new_stream(store)
    await store.append(sid, number, [msg(b"one"), msg(b"two")], now=0.0)
    await store.mark_delivered(sid, [number], 1)
    deadline = asyncio.get_running_loop().time() + 10
    while await _delivered_in_redis(url, sid, number) != 1:  # within MARK_DELAY, and a write's
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(MARK_DELAY)
    await store.mark_delivered(sid, [number], 2)
    own_redis.pause()
    try:
        with pytest.raises(StoreUnavailable):
            await store.append(sid, number, [msg(b"three")], now=0.0)
    finally:
        own_redis.resume()
    while await _delivered_in_redis(url, sid, number) != 2:  # held again, then sent alone
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(MARK_DELAY)
    await store.mark_delivered(sid, [number], 3)
    own_redis.pause()
    try:
        with pytest.raises(StoreUnavailable):
            await store.touch([sid], now=1.0)  # a touch that failed: its mark held again too
    finally:
        own_redis.resume()
    while await _delivered_in_redis(url, sid, number) != 3:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(MARK_DELAY)


async def test_a_subscribed_link_hands_over_each_message_and_says_when_it_is_lost(redis_db: str) -> None:
    link = Link(redis_db, connect_timeout=5.0)
    heard: asyncio.Queue[bytes] = asyncio.Queue()
    client = aioredis.Redis.from_url(redis_db)
    try:
        await link.subscribe("mcpresume-test:news", heard.put_nowait)
        for i in range(3):
            assert await client.publish("mcpresume-test:news", f"message {i}") == 1
        assert [await asyncio.wait_for(heard.get(), 10) for _ in range(3)] == [
            b"message 0",
            b"message 1",
            b"message 2",
        ]
        lost = asyncio.ensure_future(link.lost())
        await asyncio.sleep(0)
        assert not lost.done()
        assert await client.client_kill_filter(_type="pubsub") == 1
        await asyncio.wait_for(lost, 10)  # the store's listener then subscribes again
    finally:
        link.close()
        await client.aclose()


# -- a view at the event before this process's last append ---------------------------------------------------


async def test_a_read_of_this_process_s_last_append_needs_no_round_trip(
    own_redis: RedisProcess, make_store: Make
) -> None:
    """Paused Redis: a read from within this process's last appends (one after the other, nothing else in
    between) is answered here, as Redis would; any other read, and any read once another process changed
    the session, waits for Redis."""
    store, other = await make_store(own_redis.url), await make_store(own_redis.url)
    heard: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    store.set_news(lambda sid, version: heard.put_nowait((sid, version)))
    sid, number = await _new_stream(store)
    await store.append(sid, number, [msg(b"one")], now=0.0)
    await store.append(sid, number, [msg(b"two"), msg(b"three")], now=0.0)
    # a process that made no append reads from Redis: at the event before the last append, before the one
    # before it, before the stream's priming event (seq 1: its opening's, this process's too), and within
    # the last one, one event at most
    reads = [(2, READ_MAX_EVENTS), (1, READ_MAX_EVENTS), (0, READ_MAX_EVENTS), (3, READ_MAX_EVENTS), (1, 1)]
    from_redis = [await other.read(sid, [number], after, most) for after, most in reads]
    own_redis.pause()
    try:
        for (after, most), expected in zip(reads, from_redis, strict=True):
            local = await store.read(sid, [number], after, most)
            assert local is not None and expected is not None
            assert (local.body(), local.version, local.complete, local.gap, local.more) == (
                expected.body(),
                expected.version,
                expected.complete,
                expected.gap,
                expected.more,
            )
        assert [e.seq for e in local.events] == [2] and local.more
        with pytest.raises(StoreUnavailable):
            await store.read(sid, [number + 1], 2)  # another stream
    finally:
        own_redis.resume()
    await other.open_stream(sid, StreamOrigin.GET, [], now=0.0)  # a change by another process
    while (await asyncio.wait_for(heard.get(), 30))[1] <= local.version:  # type: ignore[union-attr]
        pass
    own_redis.pause()
    try:
        with pytest.raises(StoreUnavailable):
            await store.read(sid, [number], 2)
    finally:
        own_redis.resume()


async def test_a_read_of_events_evicted_from_this_process_s_last_appends_asks_redis(
    own_redis: RedisProcess, make_store: Make
) -> None:
    """The window (4 events) evicts the first of three appends as the last is made: a reader still before
    it asks Redis, which says it fell behind (a gap); a reader past it is answered here."""
    store = await make_store(own_redis.url)
    sid, number = await _new_stream(store)  # its priming event: seq 1
    for texts in ([b"two"], [b"three", b"four"], [b"five", b"six"]):
        await store.append(sid, number, [msg(t) for t in texts], now=0.0)
    own_redis.pause()
    try:
        local = await store.read(sid, [number], 2)
        assert local is not None and [e.seq for e in local.events] == [3, 4, 5, 6]
        with pytest.raises(StoreUnavailable):
            await store.read(sid, [number], 1)  # seq 2 is evicted: not answered here
    finally:
        own_redis.resume()
    behind = await store.read(sid, [number], 1)
    assert behind is not None and behind.gap
