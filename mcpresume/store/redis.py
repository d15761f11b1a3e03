"""The Redis session store: sessions shared by every replica (``store = "redis://host:port/db"``).

Layout: every key of a session carries one hash tag, ``mcpresume:{<sha256 of the session id, 32 hex>}:``, so
they share a slot and the store works on Redis Cluster unchanged:

* ``…:meta`` (hash): epoch, next seq, next stream number, version, last activity, the window's event count
  and bytes, live POST streams, request ids in flight, credentials, owner, the streams gone lately. Its
  TTL (``meta_ttl``) is at least ``session_ttl`` and longer than the events', so a session whose window is
  gone is still known (409), and a session whose meta is missing is unknown (404): after a Redis flush or
  restart, old cursors get 404, never a replay.
* ``…:ev`` (stream): the window's events as runs, one entry per append (the window's segments), entry id
  ``<seq of its first event>-0``: the proxy's own sequence numbers, so a read after a position is one
  XRANGE. Two fields (``lua/common.lua``): the stream number, the append time (wall clock), the count, the
  bodies' bytes and the field of ``…:bd`` holding them; and each event's size. The oldest entry may be cut:
  the meta keeps how many of its events are evicted. One entry per run, not per event: an upstream read of
  a hundred events is one XADD.
* ``…:bd`` (hash): field -> the bodies of one entry as appended (SSE events without their id lines;
  ``ReadResult.body`` writes the cursors). Bodies never pass through a script: a 64 KiB string costs a Lua
  script about 90 us to take in or hand out, a plain command about 10 (measured, docs/performance.md). An
  append is ``MULTI; HSET …:bd <field> <bodies>; EVALSHA append …; EXEC``, the script refusing deletes the
  field; a read is the read script (which runs to return, per run, its field and offset) then one HMGET for
  the fields this process holds no copy of (``copies.py``: a field is written once, so a copy is never
  stale). A view of this process at the event before its last append to the session reads that append
  with no round trip at all (``Copies.read``).
* ``…:st`` (hash): stream number -> its state (JSON).
* ``…:rq`` (hash) and ``…:ro`` (sorted set): request id -> claim (what holds it and its request's digest,
  ``lua/common.lua``), and their age order (``MAX_REQUEST_IDS``).

Every mutation is one registered Lua script (``lua/*.lua``, ``lua/common.lua`` prepended; EVALSHA,
``calls.py`` says how it gets to Redis), doing the whole operation atomically: append, the exact
trim by count/bytes/age with the byte accounting, the claim as set-if-absent, the EXPIREs, and a PUBLISH of
the change (session id, version) on ``mcpresume:news``. One subscription per process feeds the
``set_news`` callback for the changes of other processes; changes of this process call it directly when
the script returns.

No call is retried blindly (``calls.py``), and an append carries the stream's last seq as the caller
saw it, so a repeated append is a no-op. Every call is bounded: a failure or time-out raises
``StoreUnavailable`` (503, ``store_unavailable``) within ``op_timeout``.

A global sorted set ``mcpresume:sessions`` (its own slot) lists the session ids for ``reap``,
``session_count`` and ``max_sessions``; it is kept by separate calls, so across replicas ``max_sessions`` is
approximate (a few over when replicas create sessions at the same instant).
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import orjson

from mcpresume.core.credentials import MAX_CREDENTIALS
from mcpresume.core.cursor import new_epoch
from mcpresume.core.errors import TooManySessions
from mcpresume.core.flow import NOT_APPENDED, Appended, Guard
from mcpresume.core.resume import SessionView, StreamView
from mcpresume.core.session import (
    MAX_GONE_STREAMS,
    MAX_REQUEST_IDS,
    READ_MAX_EVENTS,
    Claim,
    ClaimOutcome,
    NewEvent,
    Orphan,
    PumpRecord,
    ReadResult,
    SessionAccess,
    StreamOrigin,
    StreamPhase,
)
from mcpresume.core.sse import SSERun, priming_block
from mcpresume.core.window import Evicted, EvictReason, Segment, WindowLimits
from mcpresume.store import (
    GONE,
    Fenced,
    OpenedStream,
    ReplicaEntry,
    SessionSummary,
    StoreMetrics,
    StoreStats,
    StreamSummary,
)
from mcpresume.store.calls import RedisCalls, session_keys
from mcpresume.store.copies import Copies, LastAppend, split
from mcpresume.store.marks import Marks

log = logging.getLogger(__name__)

T = TypeVar("T")

INDEX: Final = "mcpresume:sessions"
REPLICAS: Final = "mcpresume:{replicas}:leases"
REPLICA_URLS: Final = "mcpresume:{replicas}:urls"
REPLICA_INSTANCES: Final = "mcpresume:{replicas}:instances"


# A read is a round trip here: a view takes up to this much per read (the memory store's reads stop at
# session.READ_MAX_BYTES), so a stream of 4 KiB events is one read per 64 events, not per 16. A client that
# does not read makes its view hold at most the transport's high-water mark plus one such read.
READ_BYTES: Final = 256 << 10

# The calls after which a read of the session answers as before (every other one forgets the last append).
_READS_UNCHANGED: Final = frozenset(
    {
        "read",
        "view",
        "mark_delivered",
        "touch",
        "claim",
        "release",
        "settle",
        "cancel_requests",
        "abandon",
        "accept_credential",
        "keep_recipe",
        "map_upstream",
    }
)

_BIG_ENDIAN: Final = sys.byteorder == "big"
assert array("I").itemsize == 4, "the Redis store's sizes are 4 bytes each"

_OUTCOMES: Final = {outcome.value: outcome for outcome in ClaimOutcome}
_REASONS: Final = (EvictReason.COUNT, EvictReason.BYTES, EvictReason.TTL)


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


# The meta's fields ``access`` reads (``_access``).
_ACCESS_FIELDS: Final = (b"epoch", b"cred", b"pv", b"uid")


def _access(
    epoch: bytes | None, cred: bytes | None, version: bytes | None, upstream_id: bytes | None
) -> SessionAccess | None:
    """The access record of the meta's ``_ACCESS_FIELDS`` (None: the session is unknown)."""
    if epoch is None:
        return None
    text = _text(cred) or ""
    credentials = tuple(bytes.fromhex(d) for d in text.split(",") if d)
    return SessionAccess(_text(epoch) or "", credentials, _text(version) or None, _text(upstream_id))


def _evicted(flat: Sequence[int]) -> Evicted:
    evicted = Evicted()
    for index, reason in enumerate(_REASONS):
        count, size = int(flat[2 * index]), int(flat[2 * index + 1])
        if count:
            evicted.counts[reason] = [count, size]
    evicted.undelivered = [int(flat[6]), int(flat[7])]
    return evicted


def _pump_arg(pump: PumpRecord | None) -> bytes:
    if pump is None:
        return b""
    return orjson.dumps({"r": pump.request_ids, "p": pump.path_qs, "h": pump.resume_headers})


def _pump_of(raw: str) -> PumpRecord:
    record = orjson.loads(raw)
    return PumpRecord(tuple(record["r"]), record["p"], tuple((k, v) for k, v in record["h"]))


def _wire(sizes: array[int]) -> bytes:
    """Each body's length, 4 bytes little-endian each (``z``: Lua slices it, ``struct.unpack`` reads it)."""
    if not _BIG_ENDIAN:
        return sizes.tobytes()
    swapped = array("I", sizes)
    swapped.byteswap()
    return swapped.tobytes()


def _lengths(z: bytes) -> array[int]:
    sizes = array("I", z)
    if _BIG_ENDIAN:
        sizes.byteswap()
    return sizes


def _now_arg(now: float) -> str:
    return repr(float(now))


class RedisStore:
    def __init__(
        self,
        url: str,
        limits: WindowLimits,
        *,
        session_ttl: float,
        max_sessions: int,
        retry_ms: int | None,
        metrics: StoreMetrics | None = None,
        op_timeout: float = 0.9,
        max_connections: int = 64,
    ) -> None:
        self.url = url
        self.limits = limits
        self.session_ttl = session_ttl
        self.max_sessions = max_sessions
        self.retry_ms = retry_ms
        self.metrics = metrics
        self.op_timeout = op_timeout
        self.max_connections = max_connections
        # The meta keys outlive the events (a session whose window is gone is still known), and both outlive
        # what the logical expiry (reap, with the callers' clock) keeps: the TTLs are a backstop.
        self.events_ttl_ms = int((limits.ttl + 60) * 1000)
        self.meta_ttl_ms = int((max(session_ttl, limits.ttl + 60) + 60) * 1000)
        # (session id, stream) -> the stream's last seq as this process last saw it (the append guard
        # against a repeated call); bounded by the streams this process pumps.
        self._tails: dict[tuple[str, int], int] = {}
        self._copies = Copies()  # this process's copies of what it appended (store/copies.py)
        self._marks = Marks(self._send_mark)  # delivery marks waiting for their session's append (marks.py)
        self._fields = itertools.count()
        constants = (
            f"local META_TTL, EV_TTL = {self.meta_ttl_ms}, {self.events_ttl_ms}\n"
            f"local MAX_EVENTS, MAX_BYTES = {limits.max_events}, {limits.max_bytes}\n"
            f"local WINDOW_TTL = {min(float(limits.ttl), 1e300)!r}\n"
            f"local MAX_IDS, MAX_GONE = {MAX_REQUEST_IDS}, {MAX_GONE_STREAMS}\n"
        )
        self._redis = RedisCalls(
            url,
            constants,
            op_timeout=op_timeout,
            max_connections=max_connections,
            events_ttl_ms=self.events_ttl_ms,
            metrics=metrics,
        )
        self._redis.on_foreign = self._changed_elsewhere
        self.token = self._redis.token

    # -- connection (store/calls.py) -----------------------------------------------------------------

    async def start(self) -> None:
        await self._redis.start()

    async def close(self) -> None:
        self._marks.flush_all()  # posted: the close waits for Redis to apply them
        await self._redis.close()

    async def ready(self) -> bool:
        return await self._redis.ready()

    def set_news(self, callback: Callable[[str, int], None]) -> None:
        """Each listener set is called (several proxies may share one store in a process)."""
        self._redis.set_news(callback)

    @property
    def _client(self) -> Any:
        """redis-py's client (``RedisCalls.client``), for the plain commands."""
        return self._redis.client

    def _call(self, op: str, call: Awaitable[T]) -> Awaitable[T]:
        return self._redis.call(op, call)

    def _changed_elsewhere(self, session_id: str) -> None:
        self._copies.changed(session_id)  # another process changed it: its reads go to Redis again

    async def _script(self, op: str, name: str, session_id: str, *args: str | bytes) -> Any:
        if op not in _READS_UNCHANGED:
            self._copies.changed(session_id)  # a read's answer may change: ask Redis (``Copies.read``)
        self._marks.flush(session_id)  # the session's delivery mark goes first
        return await self._redis.script(op, name, session_id, *args)

    async def _script_each(self, op: str, name: str, calls: Sequence[tuple[str, Sequence[str]]]) -> list[Any]:
        for session_id, _ in calls:
            if op not in _READS_UNCHANGED:
                self._copies.changed(session_id)
            self._marks.flush(session_id)
        return await self._redis.script_each(op, name, calls)

    async def create_session(
        self, session_id: str, now: float, credential: bytes | None = None, owner: str = ""
    ) -> str:
        client = self._client
        known = await self._call("create_session", client.zscore(INDEX, session_id))
        if known is None and await self.session_count() >= self.max_sessions:
            await self.reap(now)
            if await self.session_count() >= self.max_sessions:
                raise TooManySessions(
                    f"the proxy holds its maximum of {self.max_sessions} sessions",
                    max_sessions=self.max_sessions,
                )
        epoch = new_epoch()
        cred = "" if credential is None else credential.hex()
        version = await self._script(
            "create_session", "create", session_id, epoch, _now_arg(now), cred, owner
        )
        await self._call("create_session", client.zadd(INDEX, {session_id: now}))
        self._forget_tails(session_id)
        self._copies.epochs[session_id] = epoch.encode()
        self._redis.notify(session_id, int(version))
        return epoch

    async def access(self, session_id: str) -> SessionAccess | None:
        # On every request of a session: through the link, as ``owner`` (not redis-py's ~115 us).
        epoch, cred, version, upstream_id = await self._redis.hmget(
            "access", session_keys(session_id)[0], _ACCESS_FIELDS
        )
        return _access(epoch, cred, version, upstream_id)

    async def map_upstream(self, session_id: str, epoch: str, expected: str | None, upstream_id: str) -> bool:
        held = "" if expected is None else "=" + expected
        return bool(await self._script("map_upstream", "upstream", session_id, epoch, held, upstream_id))

    async def accept_credential(
        self, session_id: str, epoch: str, digest: bytes, protocol_version: str | None
    ) -> None:
        await self._script(
            "accept_credential",
            "accept",
            session_id,
            epoch,
            digest.hex(),
            protocol_version or "",
            str(MAX_CREDENTIALS),
        )

    async def has_session(self, session_id: str) -> bool:
        return bool(await self._call("has_session", self._client.exists(session_keys(session_id)[0])))

    async def recipe(self, session_id: str, epoch: str) -> bytes | None:
        held, recipe = await self._call(
            "recipe", self._client.hmget(session_keys(session_id)[0], "epoch", "rcp")
        )
        return recipe if recipe is not None and _text(held) == epoch else None

    async def keep_recipe(self, session_id: str, epoch: str, expected: bytes | None, recipe: bytes) -> bool:
        held = b"" if expected is None else b"=" + expected
        kept = await self._script("keep_recipe", "recipe", session_id, epoch, held, recipe)
        return bool(kept)

    async def delete_session(self, session_id: str, epoch: str | None = None) -> bool:
        deleted = await self._script("delete_session", "delete", session_id, epoch or "")
        if deleted:
            await self._call("delete_session", self._client.zrem(INDEX, session_id))
            self._forget_tails(session_id)
            self._redis.notify(session_id, GONE)
        return bool(deleted)

    def _forget_tails(self, session_id: str) -> None:
        self._copies.forget(session_id)
        for key in [key for key in self._tails if key[0] == session_id]:
            del self._tails[key]

    async def owner(self, session_id: str) -> str | None:
        # On every request routing depends on: through the link (a call through redis-py costs about 115 us
        # of this process's CPU, one on the link about 38).
        (owner,) = await self._redis.hmget("owner", session_keys(session_id)[0], (b"own",))
        return _text(owner)

    async def owner_and_access(self, session_id: str) -> tuple[str | None, SessionAccess | None]:
        # Routing's read of a request's session and its handler's, in one HMGET of the meta.
        owner, epoch, cred, version, upstream_id = await self._redis.hmget(
            "owner_and_access", session_keys(session_id)[0], (b"own", *_ACCESS_FIELDS)
        )
        return _text(owner), _access(epoch, cred, version, upstream_id)

    async def touch(self, session_ids: Sequence[str], now: float) -> None:
        """Each session's delivery mark held here (``marks.py``) rides in its touch's script, as in an
        append's, rather than as a script of its own before it (a view's release touches its session right
        after its last write's mark)."""
        at = _now_arg(now)
        calls: list[tuple[str, Sequence[str]]] = []
        carried: list[tuple[str, tuple[int, tuple[int, ...]]]] = []
        for sid in session_ids:
            mark = self._marks.take(sid)
            if mark is None:
                calls.append((sid, (at,)))
            else:
                carried.append((sid, mark))
                calls.append((sid, (at, str(mark[0]), *map(str, mark[1]))))
        try:
            await self._script_each("touch", "touch", calls)
        except BaseException:
            for sid, (seq, streams) in carried:  # not known to be applied: held again (twice is the same)
                self._marks.add(sid, streams, seq)
            raise

    # -- request ids ---------------------------------------------------------------------------------------

    async def claim(
        self,
        session_id: str,
        request_keys: Sequence[str],
        max_live_streams: int | None = None,
        epoch: str | None = None,
        *,
        digests: Sequence[bytes] = (),
        now: float | None = None,
    ) -> Claim | None:
        limit = "" if max_live_streams is None else str(max_live_streams)
        hexes = [digest.hex() for digest in digests] if digests else [""] * len(request_keys)
        pairs = [part for pair in zip(request_keys, hexes, strict=True) for part in pair]
        at = "" if now is None else _now_arg(now)
        result = await self._script("claim", "claim", session_id, epoch or "", limit, at, *pairs)
        if result is None:
            return None
        outcome, stream = _text(result[0]) or "", _text(result[1]) or ""
        return Claim(_OUTCOMES[outcome], int(stream) if stream else None)

    async def release(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        await self._script("release", "release", session_id, epoch or "", "release", *request_keys)

    async def settle(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        await self._script("settle", "release", session_id, epoch or "", "settle", *request_keys)

    async def abandon(self, session_id: str, request_keys: Sequence[str], epoch: str | None = None) -> None:
        await self._script("abandon", "release", session_id, epoch or "", "abandon", *request_keys)

    # -- streams and events --------------------------------------------------------------------------------

    async def open_stream(
        self,
        session_id: str,
        origin: StreamOrigin,
        request_keys: Sequence[str],
        now: float,
        epoch: str | None = None,
        *,
        priming: bool = True,
        pump: PumpRecord | None = None,
    ) -> OpenedStream | None:
        block = priming_block(self.retry_ms)
        result = await self._script(
            "open_stream",
            "open",
            session_id,
            epoch or "",
            origin.value,
            _now_arg(now),
            "1" if priming else "0",
            block,
            _pump_arg(pump),
            *request_keys,
        )
        if result is None:
            return None
        number, current, seq, version = int(result[0]), _text(result[1]) or "", int(result[2]), int(result[3])
        self._tails[(session_id, number)] = seq if priming else seq - 1
        copies = self._copies
        copies.epochs[session_id] = current.encode()
        if priming:  # its priming event: this process's append too (the view of its answer starts with it)
            field = f"{current}:{seq}".encode()  # open.lua's
            copies.bodies.put(field, block)
            sizes = array("I", (len(block),))
            copies.appended(
                session_id, LastAppend(seq, number, sizes, field, now, len(block), version, int(result[5]))
            )
        else:
            copies.changed(session_id)
        self._redis.notify(session_id, version)
        return OpenedStream(number, current, seq, int(result[4]))

    async def standalone_stream(self, session_id: str) -> int | None:
        value = await self._call("standalone_stream", self._client.hget(session_keys(session_id)[0], "sa"))
        text = _text(value)
        return int(text) if text else None

    async def append(
        self,
        session_id: str,
        stream: int,
        events: Sequence[NewEvent],
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        answered = [e.response_key for e in events if e.response_key is not None]
        bodies = [e.body for e in events]
        return await self._append(session_id, stream, bodies, now, guard, upstream_cursor, answered, fence)

    async def append_and_end(
        self,
        session_id: str,
        stream: int,
        events: Sequence[NewEvent],
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        answered = [e.response_key for e in events if e.response_key is not None]
        bodies = [e.body for e in events]
        return await self._append(
            session_id, stream, bodies, now, guard, upstream_cursor, answered, fence, end=True
        )

    async def append_run(
        self,
        session_id: str,
        stream: int,
        run: SSERun,
        now: float,
        guard: Guard | None = None,
        upstream_cursor: str | None = None,
        fence: int | None = None,
    ) -> Appended:
        return await self._append(
            session_id, stream, list(run.blocks), now, guard, upstream_cursor, [], fence
        )

    async def _append(
        self,
        session_id: str,
        stream: int,
        bodies: list[bytes],
        now: float,
        guard: Guard | None,
        upstream_cursor: str | None,
        answered: list[str],
        fence: int | None,
        *,
        end: bool = False,
    ) -> Appended:
        """``end``: the stream ends in the same call once the events are in (``append_and_end``)."""
        if not bodies and guard is None and upstream_cursor is None and not end:
            return NOT_APPENDED
        key = (session_id, stream)
        expected = self._tails.get(key)
        guard_arg = b""
        if guard is not None:
            guard_arg = orjson.dumps({"r": guard.readers, "k": guard.keep_undelivered})
        blob = b"".join(bodies)
        sizes = array("I", map(len, bodies))
        field = f"{self.token}:{next(self._fields):x}".encode() if bodies else b""
        carried = self._marks.take(session_id)
        args = (
            "" if expected is None else str(expected),
            str(stream),
            _now_arg(now),
            upstream_cursor or "",
            guard_arg,
            orjson.dumps(answered) if answered else b"",
            str(len(bodies)),
            _wire(sizes),
            field,
            str(len(blob)),
            "" if carried is None else " ".join(map(str, (carried[0], *carried[1]))),
            "" if fence is None else str(fence),
            "1" if end else "",
        )
        try:
            appended = self._redis.append(session_id, field, blob, args)
            result = await self._redis.call("append", appended, linked=self._redis.has_link)
        except BaseException:
            if carried is not None:  # not known to be applied: held again (applied twice is the same)
                self._marks.add(session_id, carried[1], carried[0])
            raise
        status = _text(result[0])
        if status == "ok":
            version, last = int(result[1]), int(result[2])
            evicted = _evicted(result[3:11])
            if end:  # as end_stream leaves it: no tail kept
                self._tails.pop(key, None)
            else:
                self._tails[key] = last
            if field:  # (the view of a one-event answer reads it here: its stream ended with it)
                self._copies.bodies.put(field, blob)
                first = last - len(bodies) + 1
                copy = LastAppend(first, stream, sizes, field, now, len(blob), version, int(result[11]), end)
                self._copies.appended(session_id, copy)
            else:
                self._copies.changed(session_id)
            self._redis.notify(session_id, version)
            return Appended(evicted)
        if status == "blocked":
            pairs = [int(i) for i in result[1:]]  # (reader index, the seq it must reach), ...
            return Appended(Evicted(), tuple(pairs[0::2]), tuple(pairs[1::2]))
        self._copies.changed(session_id)
        if status == "fenced":
            self._tails.pop(key, None)
            raise Fenced(session_id, -1 if fence is None else fence, int(result[1]))
        if status == "stale":
            # A repeated call (applied already), or another process appends to the stream: no-op.
            self._tails[key] = int(result[1])
        elif status in ("gone", "noop"):
            self._tails.pop(key, None)
        return NOT_APPENDED

    async def end_stream(self, session_id: str, stream: int, now: float, fence: int | None = None) -> None:
        self._tails.pop((session_id, stream), None)
        fence_arg = "" if fence is None else str(fence)
        result = await self._script("end_stream", "end", session_id, str(stream), _now_arg(now), fence_arg)
        if isinstance(result, list):  # {'fenced', the session's fence}
            raise Fenced(session_id, -1 if fence is None else fence, int(result[1]))
        if result is not None:
            self._redis.notify(session_id, int(result))

    async def cancel_requests(self, session_id: str, stream: int, request_keys: Sequence[str]) -> None:
        await self._script("cancel_requests", "cancel", session_id, str(stream), *request_keys)

    async def group_streams(self, session_id: str, streams: Sequence[int]) -> None:
        await self._script("group_streams", "group", session_id, *map(str, streams))

    async def mark_delivered(self, session_id: str, streams: Sequence[int], seq: int) -> None:
        """Held for the session's next append to apply (``marks.py``), or written ahead of this process's next
        other call on the session, or alone within ``MARK_DELAY``: on the link, without waiting for the reply
        (an error reply is counted and logged, ``_posted_error``), so a view waits for no round trip after
        each write. Without a link (a Cluster), a call of its own."""
        if self._redis.has_link:
            self._marks.add(session_id, streams, seq)
        else:
            await self._script("mark_delivered", "delivered", session_id, str(seq), *map(str, streams))

    def _send_mark(self, session_id: str, seq: int, streams: tuple[int, ...]) -> bool:
        return self._redis.post_script("delivered", session_id, str(seq), *map(str, streams))

    async def view(self, session_id: str, stream: int) -> SessionView | None:
        raw = await self._script("view", "view", session_id, str(stream))
        if raw is None:
            return None
        facts = orjson.loads(raw)
        state = facts.get("st")
        view: StreamView | None = None
        if state is not None:
            group = state.get("g")
            view = StreamView(
                stream,
                bool(state["v"]),
                int(state["f"]),
                int(state["l"]),
                int(state.get("e", 0)),
                state["o"] == StreamOrigin.GET.value,
                tuple(group) if isinstance(group, list) else (),
                int(facts.get("ge", 0)),
                int(state.get("d", 0)),
                bool(state.get("p", 1)),
            )
        else:
            gone = facts.get("gs")  # the newest standalone stream gone, as it was (SessionState._gone_view)
            if gone is not None:
                _, first_seq, last_seq = gone
                view = StreamView(stream, False, first_seq, last_seq, last_seq, standalone=True)
        oldest, newest = facts.get("oldest"), facts.get("newest")
        return SessionView(
            epoch=facts["epoch"],
            expires_at=float(facts["la"]) + self.session_ttl if not facts["lp"] else None,
            next_stream=int(facts["nst"]),
            newest_seq=int(facts["nseq"]) - 1,
            oldest=(oldest[0], oldest[1]) if oldest else None,
            newest=(newest[0], newest[1]) if newest else None,
            stream=view,
        )

    async def read(
        self,
        session_id: str,
        streams: Sequence[int],
        after: int,
        max_events: int = READ_MAX_EVENTS,
        max_bytes: int = READ_BYTES,
    ) -> ReadResult | None:
        fresh = self._copies.read(session_id, streams, after, max_events, max_bytes)
        if fresh is not None:
            return fresh
        result = await self._script(
            "read", "read", session_id, str(after), str(max_events), str(max_bytes), *map(str, streams)
        )
        if result is None:
            return None
        version, epoch, gap, complete, more = result[:5]
        if gap:
            return ReadResult((), complete=False, gap=True, version=int(version))
        items = result[5:]
        runs = range(0, len(items), 6)  # per run: stream, first seq, time, sizes, bodies' field, offset
        bodies = await self._bodies_of(session_id, [items[index + 4] for index in runs])
        if bodies is None:  # evicted since the script ran (a field goes only with its events)
            return ReadResult((), complete=False, gap=True, version=int(version))
        segments: list[Segment] = []
        for index, blob in zip(runs, bodies, strict=True):
            number, seq, at = int(items[index]), int(items[index + 1]), float(items[index + 2])
            blocks, size = split(blob, int(items[index + 5]), _lengths(items[index + 3]))
            segments.append(Segment.of(number, seq, blocks, at, size))
        epoch_bytes = epoch if isinstance(epoch, bytes) else str(epoch).encode()
        self._copies.epochs[session_id] = epoch_bytes
        return ReadResult(segments, bool(complete), False, int(version), bool(more), epoch_bytes)

    async def _bodies_of(self, session_id: str, fields: list[bytes]) -> list[bytes] | None:
        """The bodies under ``fields``: this process's copies, the others in one HMGET (None: one is gone)."""
        cache = self._copies.bodies
        found = [cache.get(field) for field in fields]
        missing = [field for field, body in zip(fields, found, strict=True) if body is None]
        if not missing:
            return found  # type: ignore[return-value]
        by_field: dict[bytes, bytes] = {}
        fetched = await self._redis.hmget("read", session_keys(session_id)[5], missing)
        for field, body in zip(missing, fetched, strict=True):
            if body is None:
                return None
            by_field[field] = body
            cache.put(field, body)
        return [by_field[field] if body is None else body for field, body in zip(fields, found, strict=True)]

    # -- housekeeping --------------------------------------------------------------------------------------

    async def _session_ids(self, op: str) -> list[str]:
        ids = await self._call(op, self._client.zrange(INDEX, 0, -1))
        return [_text(i) or "" for i in ids]

    async def reap(self, now: float) -> tuple[list[str], Evicted]:
        evicted = Evicted()
        dropped: list[str] = []
        gone: list[str] = []
        ids = await self._session_ids("reap")
        args = (_now_arg(now), repr(float(self.session_ttl)))
        results = await self._script_each("reap", "expire", [(sid, args) for sid in ids])
        for sid, result in zip(ids, results, strict=True):
            status = _text(result[0])
            if status == "dropped":
                dropped.append(sid)
                self._forget_tails(sid)
                self._redis.notify(sid, GONE)
            elif status == "gone":
                gone.append(sid)  # its keys expired in Redis (or were flushed)
            elif status == "ok":
                expired = _evicted(result[2:10])
                if expired:
                    evicted.merge(expired)
                    self._redis.notify(sid, int(result[1]))
        if dropped or gone:
            await self._call("reap", self._client.zrem(INDEX, *dropped, *gone))
        return dropped, evicted

    # -- the session inspector (``Inspection``): a look that changes nothing ---------------------------------

    async def session_ids(self, offset: int, limit: int) -> list[str]:
        if limit <= 0:
            return []
        start = max(0, offset)
        ids = await self._call("session_ids", self._client.zrange(INDEX, start, start + limit - 1))
        return [_text(i) or "" for i in ids]

    async def summary(self, session_id: str) -> SessionSummary | None:
        self._marks.flush(session_id)  # this process's delivery marks first: "delivered" as it knows it
        raw = await self._redis.script("summary", "summary", session_id)
        if raw is None:
            return None
        facts = orjson.loads(raw)
        streams = [
            StreamSummary(
                int(number),
                StreamPhase.LIVE if live else StreamPhase.ENDED,
                int(last_seq),
                StreamOrigin(origin),
                int(first_seq),
                int(delivered),
            )
            for number, origin, live, first_seq, last_seq, delivered in facts["st"] or ()  # {}: cjson's []
        ]
        streams += [StreamSummary(int(n), StreamPhase.GONE, int(last)) for n, last in facts["gone"] or ()]
        oldest, newest = facts.get("oldest"), facts.get("newest")
        in_flight, answered, streamed = facts["rq"]
        return SessionSummary(
            epoch=facts["epoch"],
            owner=facts["own"],
            fence=int(facts["fen"]),
            last_active=float(facts["la"]),
            retired=bool(facts["rt"]),
            window_events=int(facts["ne"]),
            window_bytes=int(facts["nb"]),
            oldest=(int(oldest[0]), int(oldest[1])) if oldest else None,
            newest=(int(newest[0]), int(newest[1])) if newest else None,
            streams=tuple(sorted(streams, key=lambda s: s.number)),
            in_flight=int(in_flight),
            answered=int(answered),
            streamed=int(streamed),
        )

    async def session_count(self) -> int:
        return int(await self._call("session_count", self._client.zcard(INDEX)))

    async def stats(self) -> StoreStats:
        ids = await self._session_ids("stats")
        sessions = events = size = 0
        for ne, nb in await self._redis.batch(
            "stats", [("HMGET", session_keys(sid)[0], "ne", "nb") for sid in ids]
        ):
            if ne is None:
                continue  # its keys expired in Redis: reap takes it out of the index
            sessions += 1
            events += int(ne)
            size += int(nb)
        return StoreStats(sessions=sessions, window_events=events, window_bytes=size)

    async def orphans(self, owner: str) -> list[Orphan]:
        return await self._orphans("orphans", "orphans", owner)

    async def take_over(self, owner: str, by: str) -> list[Orphan]:
        return await self._orphans("take_over", "takeover", owner, by)

    async def _orphans(self, op: str, script: str, owner: str, *args: str) -> list[Orphan]:
        """Each session's ``script`` (orphans, takeover: atomic per session) for the sessions of ``owner``."""
        found: list[Orphan] = []
        for sid in await self._session_ids(op):
            raw = await self._script(op, script, sid, owner, *args)
            if raw is None:
                continue
            record = orjson.loads(raw)
            fence = int(record.get("fence", 0))
            for number, origin, pump, cursor, answered in record["streams"]:
                found.append(
                    Orphan(
                        sid,
                        record["epoch"],
                        int(number),
                        StreamOrigin(origin),
                        _pump_of(pump),
                        cursor or None,
                        tuple(answered) if isinstance(answered, list) else (),
                        fence,
                    )
                )
        return found

    async def lost_owners(self, now: float) -> list[str]:
        ids = await self._session_ids("lost_owners")
        owners = await self._redis.batch(
            "lost_owners", [("HGET", session_keys(sid)[0], "own") for sid in ids]
        )
        found = {_text(owner) or "" for owner in owners}
        found.discard("")  # no owner recorded: nobody to take over from
        live = await self._call("lost_owners", self._client.zrangebyscore(REPLICAS, f"({now!r}", "+inf"))
        return sorted(found - {_text(r) or "" for r in live})

    async def retire(self, session_id: str, epoch: str, fence: int | None = None) -> None:
        await self._script("retire", "retire", session_id, epoch, "" if fence is None else str(fence))

    # -- replicas (the owner registry) ---------------------------------------------------------------------

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        async def register() -> None:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(REPLICAS, {replica_id: now + ttl})
                pipe.hset(REPLICA_URLS, replica_id, url)
                pipe.hset(REPLICA_INSTANCES, replica_id, instance)
                await pipe.execute()

        await self._call("register_replica", register())

    async def replica_entry(self, replica_id: str) -> ReplicaEntry | None:
        lease, url, instance = await self._redis.batch(
            "replica_entry",
            [
                ("ZSCORE", REPLICAS, replica_id),
                ("HGET", REPLICA_URLS, replica_id),
                ("HGET", REPLICA_INSTANCES, replica_id),
            ],
            strict=True,
        )
        if lease is None or url is None:
            return None
        return ReplicaEntry(_text(url) or "", _text(instance) or "", float(lease))

    async def prune_replicas(self, before: float) -> list[str]:
        client = self._client
        found = await self._call("prune_replicas", client.zrangebyscore(REPLICAS, "-inf", f"({before!r}"))
        ids = [_text(r) or "" for r in found]
        if ids:
            # Only the members still below ``before`` go; one that renewed in between keeps its lease, and
            # its next renewal (a third of a lease later) writes its URL again.
            await self._call("prune_replicas", client.zremrangebyscore(REPLICAS, "-inf", f"({before!r}"))
            await self._call("prune_replicas", client.hdel(REPLICA_URLS, *ids))
            await self._call("prune_replicas", client.hdel(REPLICA_INSTANCES, *ids))
        return ids

    async def replica_url(self, replica_id: str, now: float) -> str | None:
        # Every request to another replica's session: the lease and the URL in one round trip (both keys
        # share the {replicas} hash tag, so a cluster serves them from one node too).
        lease, url = await self._redis.batch(
            "replica_url", [("ZSCORE", REPLICAS, replica_id), ("HGET", REPLICA_URLS, replica_id)], strict=True
        )
        if lease is None or float(lease) <= now:
            return None
        return _text(url)

    async def release_replica(self, replica_id: str) -> None:
        await self._call("release_replica", self._client.zrem(REPLICAS, replica_id))
        await self._call("release_replica", self._client.hdel(REPLICA_URLS, replica_id))
        await self._call("release_replica", self._client.hdel(REPLICA_INSTANCES, replica_id))

    async def live_replicas(self, now: float) -> int:
        return int(await self._call("live_replicas", self._client.zcount(REPLICAS, f"({now!r}", "+inf")))
