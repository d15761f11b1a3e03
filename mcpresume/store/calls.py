"""How the Redis store talks to Redis (``store/redis.py`` says what its keys and scripts mean).

One redis-py client (a blocking pool with a bound, or a Cluster client) for the calls off the hot path, and,
for a single server (``redis://``, ``unix://``), a ``Link`` of this module's own (``resp.py``) for the hot
ones: scripts, the append's MULTI, the bodies' HMGET, posted delivery marks, and the housekeeping's
pipelines. One subscription per process to the news channel (on a link where the URL allows). Every call is
bounded (``op_timeout``) and measured (``mcpresume_store_seconds{op}``); a failure is ``StoreUnavailable``
(503, ``store_unavailable``) and is counted (``mcpresume_store_errors_total{op}``).

The client library never retries a call blindly (redis-py retries timeouts by default, which can apply a
write twice): retries are off; the scripts are idempotent where a call may be repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from mcpresume.core.cursor import new_epoch
from mcpresume.core.errors import StoreUnavailable
from mcpresume.store import StoreMetrics
from mcpresume.store.resp import Link, bulks, pack

log = logging.getLogger(__name__)

T = TypeVar("T")

CHANNEL: Final = "mcpresume:news"

SCRIPTS: Final = (
    "accept",
    "append",
    "cancel",
    "claim",
    "create",
    "delete",
    "delivered",
    "end",
    "expire",
    "group",
    "open",
    "orphans",
    "read",
    "recipe",
    "release",
    "retire",
    "summary",
    "takeover",
    "touch",
    "upstream",
    "view",
)


def session_tag(session_id: str) -> str:
    """The hash tag of a session's keys: the same slot for all of them, whatever the id holds."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@functools.lru_cache(maxsize=4096)
def session_keys(session_id: str) -> tuple[str, ...]:
    """The session's six keys (cached: a stream's every call names them, and the tag is a SHA-256)."""
    prefix = "mcpresume:{" + session_tag(session_id) + "}:"
    return tuple(prefix + part for part in ("meta", "ev", "st", "rq", "ro", "bd"))


@functools.lru_cache(maxsize=4096)
def _script_head(sha: str, session_id: str, token: str) -> tuple[int, bytes]:
    """A script's call on a session up to its own arguments (EVALSHA, the script, the session's keys, this
    process's token, the session id), packed once: (how many arguments, their bulk strings)."""
    keys = session_keys(session_id)
    head: tuple[str | int, ...] = ("EVALSHA", sha, len(keys), *keys, token, session_id)
    return len(head), bulks(head)


def script_command(sha: str, session_id: str, token: str, args: Sequence[str | bytes]) -> bytes:
    """The packed EVALSHA of script ``sha`` on the session, with the script's own ``args``."""
    count, head = _script_head(sha, session_id, token)
    return b"*%d\r\n" % (count + len(args)) + head + bulks(args)


@functools.lru_cache(maxsize=4096)
def _bodies_frames(session_id: str, ttl_ms: int) -> tuple[bytes, bytes]:
    """The append's writes of the bodies, packed once per session: HSET of the bodies' hash up to its field
    and value, and its PEXPIRE."""
    key = session_keys(session_id)[5]
    return b"*4\r\n" + bulks(("HSET", key)), pack("PEXPIRE", key, ttl_ms)


_MULTI: Final = pack("MULTI")
_EXEC: Final = pack("EXEC")


def no_script(reply: object) -> bool:
    """Redis does not have the script (restarted, or its scripts flushed): load it and call again."""
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT")
    )


class RedisCalls:
    def __init__(
        self,
        url: str,
        constants: str,
        *,
        op_timeout: float,
        max_connections: int,
        events_ttl_ms: int,
        metrics: StoreMetrics | None,
    ) -> None:
        self.url = url
        self.op_timeout = op_timeout
        self.max_connections = max_connections
        self.events_ttl_ms = events_ttl_ms
        self.metrics = metrics
        self.token = new_epoch()  # this process, in its news messages: its own are not delivered twice
        self._token_bytes = self.token.encode()
        self._constants = constants  # the settings every script needs, as Lua constants in front of it
        self.client: Any = None
        self._link: Link | None = None  # a single server: the hot calls bypass redis-py (store/resp.py)
        self.reloading: asyncio.Future[Any] | None = None
        self._pubsub_client: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._news: Callable[[str, int], None] | None = None
        self._listeners: list[Callable[[str, int], None]] = []
        self._listener: asyncio.Task[None] | None = None
        self._up = False
        self.on_foreign: Callable[[str], None] | None = None  # news of another process's change

    def _options(self) -> dict[str, Any]:
        return {
            # No socket timeout: every call is bounded by ``call``'s own (``asyncio.timeout``). With one,
            # redis-py sends each command under ``asyncio.wait_for``, which on Python 3.11 returns normally
            # when its caller is cancelled as the send completes: the cancellation is lost (a lease's
            # renewals, cancelled at stop, went on renewing).
            "socket_timeout": None,
            "socket_connect_timeout": self.op_timeout,
            # No blind retries: a timed-out write may have been applied (scripts are idempotent anyway).
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }

    async def start(self) -> None:
        options = self._options()
        probe = aioredis.Redis.from_url(self.url, **options)
        try:
            async with asyncio.timeout(self.op_timeout * 3):
                info = await probe.info("cluster")
            cluster = bool(info.get("cluster_enabled"))
        except (RedisError, OSError, TimeoutError):
            cluster = False  # unreachable now: a plain client, which reconnects when Redis is back
        if cluster:
            await probe.aclose()
            self.client = RedisCluster.from_url(self.url, max_connections=self.max_connections, **options)
        else:
            await probe.aclose()
            pool = aioredis.BlockingConnectionPool.from_url(
                self.url, max_connections=self.max_connections, timeout=self.op_timeout, **options
            )
            self.client = aioredis.Redis(connection_pool=pool)
            if Link.supports(self.url):
                self._link = Link(
                    self.url, self.op_timeout, on_error=self._posted_error, reply_timeout=self.op_timeout
                )
        self._pubsub_client = aioredis.Redis.from_url(self.url, **options)
        lua = resources.files("mcpresume.store") / "lua"
        common = (lua / "common.lua").read_text()
        for name in SCRIPTS:
            source = self._constants + common + (lua / f"{name}.lua").read_text()
            self._scripts[name] = self.client.register_script(source)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            # Loaded now, not at each script's first call: a delivery mark is posted (``mark_delivered``)
            # and cannot load its script on NOSCRIPT. Redis unreachable: they load as they are called.
            async with asyncio.timeout(self.op_timeout * 3):
                for script in self._scripts.values():
                    await self.client.script_load(script.script)
        self._listener = asyncio.create_task(self._listen())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        if self._link is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.op_timeout):
                    await self._link.settle()  # the posted delivery marks applied, not dropped
            self._link.close()
            self._link = None
        for client in (self.client, self._pubsub_client):
            if client is not None:
                await client.aclose()
        self.client = self._pubsub_client = None

    async def ready(self) -> bool:
        """Whether Redis takes writes: a small key of this process's, written with a minute's expiry. A
        PING would pass where every write fails (Redis at ``maxmemory`` with ``noeviction`` refuses them:
        "OOM command not allowed"), and a store full is an outage like any other."""
        try:
            await self.call("ready", self.client.set(f"mcpresume:ready:{self.token}", b"1", px=60_000))
        except StoreUnavailable:
            return False
        return True

    def set_news(self, callback: Callable[[str, int], None]) -> None:
        """Each listener set is called (several proxies may share one store in a process)."""
        self._listeners.append(callback)
        listeners = self._listeners
        if len(listeners) == 1:
            self._news = callback  # the usual case: one listener, called directly
            return

        def every(session_id: str, version: int) -> None:
            for listener in listeners:
                listener(session_id, version)

        self._news = every

    async def _listen(self) -> None:
        """The one subscription of this process: other processes' changes, to the news callback. Reconnects
        with backoff; a message lost meanwhile costs latency only (views read by position). On a link of
        its own where the URL allows (every change of every process arrives here, this process's own too:
        hiredis parses them, redis-py's pub/sub took 8% of the proxy's CPU under load), else redis-py's."""
        backoff = 0.05
        while True:
            subscribed = False
            try:
                if Link.supports(self.url):
                    link = Link(self.url, self.op_timeout)
                    try:
                        await link.subscribe(CHANNEL, self._on_message)
                        subscribed, backoff = True, 0.05
                        await link.lost()
                    finally:
                        link.close()
                else:
                    subscribed = True
                    await self._listen_by_redis_py()
                    backoff = 0.05
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as error:
                log.debug("store news subscription lost (%s); reconnecting", error)
            if subscribed:
                await self._drop_idle_connections()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _drop_idle_connections(self) -> None:
        """The subscription's connection was lost: Redis went away (restarted, failed over, the network).
        Every idle pooled connection is to the Redis that went away: each would fail its next call (a write
        to a closed socket, the reply an EOF), however much later, with a 503 while Redis answers again.
        Closed now, so the calls after it connect afresh (a call in flight fails as it would anyway)."""
        if self._link is not None:
            self._link.close()  # it connects again at its next call
        pool = getattr(self.client, "connection_pool", None)  # a Cluster client manages its nodes itself
        if pool is not None:
            with contextlib.suppress(RedisError, OSError):
                await pool.disconnect(inuse_connections=False)

    async def _listen_by_redis_py(self) -> None:
        assert self._pubsub_client is not None
        pubsub = self._pubsub_client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(CHANNEL)
            async for message in pubsub.listen():
                self._on_message(message.get("data"))
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8

    def _on_message(self, data: object) -> None:
        if not isinstance(data, bytes) or self._news is None:
            return
        token, _, rest = data.partition(b" ")
        if token == self._token_bytes:
            return  # ours: the callback was called when the script returned
        version, _, session_id = rest.partition(b" ")
        sid = session_id.decode("utf-8", "surrogateescape")
        if self.on_foreign is not None:
            self.on_foreign(sid)
        try:
            self._news(sid, int(version))
        except ValueError:
            return

    def notify(self, session_id: str, version: int) -> None:
        if self._news is not None:
            self._news(session_id, version)

    async def call(self, op: str, call: Awaitable[T], *, linked: bool = False) -> T:
        """Run one store call: bounded, measured, every failure a ``StoreUnavailable``. ``linked``: a call on
        the link, which bounds its own replies (``reply_timeout``) and connects (``connect_timeout``)."""
        started = time.perf_counter()
        try:
            if linked:
                result = await call
            else:
                async with asyncio.timeout(self.op_timeout):
                    result = await call
        except (RedisError, OSError, TimeoutError) as error:
            if isinstance(error, TimeoutError) and self._link is not None:
                self._link.close()  # replies may still come, behind the next calls': start afresh
            if self.metrics is not None:
                self.metrics.store_error(op)
            if self._up:
                log.warning("store unavailable (%s: %s)", op, type(error).__name__)
            self._up = False
            raise StoreUnavailable(f"the session store did not answer ({op})") from error
        finally:
            if self.metrics is not None:
                self.metrics.store_call(op, time.perf_counter() - started)
        self._up = True
        return result

    async def script(self, op: str, name: str, session_id: str, *args: str | bytes) -> Any:
        """One script of one session (``lua/<name>.lua``), bounded and measured (``call``)."""
        return await self.call(op, self._run(name, session_id, args), linked=self.has_link)

    async def _run(self, name: str, session_id: str, args: Sequence[str | bytes]) -> Any:
        """EVALSHA through the link (loaded first if Redis does not have it: restarted, flushed), or through
        redis-py's script object, which does the same; ``args``: the script's own."""
        if self._link is None:
            keys, all_args = list(session_keys(session_id)), [self.token, session_id, *args]
            return await self._scripts[name](keys=keys, args=all_args)
        command = script_command(self._scripts[name].sha, session_id, self.token, args)
        reply = (await self._link.send(command, 1))[0]
        if no_script(reply):
            await self._load(name)
            reply = (await self._link.send(command, 1))[0]
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def _load(self, name: str) -> None:
        """Load a script Redis lost (on the link where there is one: the calls after it come after)."""
        source = self._scripts[name].script
        if self._link is not None:
            await self._link.call("SCRIPT", "LOAD", source)
        else:
            await self.client.script_load(source)

    async def batch(
        self, op: str, commands: Sequence[Sequence[str | bytes | int]], *, strict: bool = False
    ) -> list[Any]:
        """Many commands, pipelined: 256 per write (the link) or per pipeline (redis-py), replies in order,
        an error reply as a ``ResponseError`` in its place (``strict``: the call's failure, as any other).
        Housekeeping visits every session: one command each, not one call each (a call through redis-py
        costs ~90 us of this process's CPU); routing asks a few keys per request, in one round trip."""
        replies: list[Any] = []
        for start in range(0, len(commands), 256):
            chunk = commands[start : start + 256]
            if self._link is not None:
                data = b"".join(pack(*command) for command in chunk)
                sent: Awaitable[list[Any]] = self._link.send(data, len(chunk))
            else:
                sent = self._pipelined(chunk)
            replies += await self.call(op, _raising(sent) if strict else sent, linked=self._link is not None)
        return replies

    async def _pipelined(self, commands: Sequence[Sequence[str | bytes | int]]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))

    async def script_each(self, op: str, name: str, calls: Sequence[tuple[str, Sequence[str]]]) -> list[Any]:
        """``script`` for each of many sessions, pipelined (``batch``): (session id, the op's args) each."""
        sha = self._scripts[name].sha

        def command(session_id: str, args: Sequence[str]) -> tuple[str | bytes | int, ...]:
            keys = session_keys(session_id)
            return ("EVALSHA", sha, len(keys), *keys, self.token, session_id, *args)  # packed by ``batch``

        replies = await self.batch(op, [command(sid, args) for sid, args in calls])
        if any(no_script(reply) for reply in replies):
            await self.call(op, self._load(name))
            again = [i for i, reply in enumerate(replies) if no_script(reply)]
            for i, reply in zip(
                again, await self.batch(op, [command(*calls[i]) for i in again]), strict=True
            ):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, ResponseError):  # a refusal (Redis full: OOM) is a failure like any other
                if self.metrics is not None:
                    self.metrics.store_error(op)
                raise StoreUnavailable(f"the session store refused a call ({op}): {reply}")
        return replies

    async def append(self, session_id: str, field: bytes, blob: bytes, args: tuple[str | bytes, ...]) -> Any:
        """The append script, after the bodies are written under ``field``, in one MULTI (one round trip);
        ``args``: the script's own."""
        if not field:
            return await self._run("append", session_id, args)
        script = self._scripts["append"]
        for attempt in (1, 2):
            if self._link is not None:
                hset, pexpire = _bodies_frames(session_id, self.events_ttl_ms)
                evalsha = script_command(script.sha, session_id, self.token, args)
                data = b"".join((_MULTI, hset, bulks((field, blob)), pexpire, evalsha, _EXEC))
                replies = await self._link.send(data, 5)
                results = replies[-1]
                if isinstance(results, ResponseError):
                    raise results
            else:
                keys = session_keys(session_id)
                async with self.client.pipeline(transaction=True) as pipe:
                    pipe.hset(keys[5], field, blob)
                    pipe.pexpire(keys[5], self.events_ttl_ms)  # the script refreshes it; this, if it failed
                    own = (self.token, session_id, *args)
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *own)
                    results = await pipe.execute(raise_on_error=False)
            result = results[-1]
            if no_script(result) and attempt == 1:
                await self._load("append")  # a Redis restarted, or flushed its scripts
                continue
            if isinstance(result, Exception):
                raise result
            return result
        raise AssertionError("unreachable")

    def _posted_error(self, error: ResponseError) -> None:
        if self.metrics is not None:
            self.metrics.store_error("mark_delivered")
        log.warning("the session store refused a delivery mark: %s", error)
        if no_script(error) and self._link is not None and self.reloading is None:
            # Redis restarted or flushed its scripts: load it again (the marks meanwhile are lost, as when a
            # view's client leaves before its mark; the awaited calls reload their own scripts, ``_run``).
            self.reloading = asyncio.ensure_future(self._load("delivered"))
            self.reloading.add_done_callback(self._reloaded)

    def _reloaded(self, task: asyncio.Future[Any]) -> None:
        self.reloading = None
        if not task.cancelled():
            task.exception()  # retrieved: a failure here shows again at the next call

    @property
    def has_link(self) -> bool:
        """Whether the hot calls go on the link (``resp.Link``, connected or not yet), which also takes posted
        calls (``post_script``)."""
        return self._link is not None

    def post_script(self, name: str, session_id: str, *args: str) -> bool:
        """A script's call written on the link without waiting for its reply (an error reply is counted and
        logged, ``_posted_error``): every later call of this process on the link comes after it. False
        (nothing sent) where there is no link, or it is not connected."""
        if self._link is None:
            return False
        return self._link.post(script_command(self._scripts[name].sha, session_id, self.token, args))

    async def hmget(self, op: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        if self._link is None:
            return list(await self.call(op, self.client.hmget(key, fields)))
        fetched = await self.call(op, self._link.call("HMGET", key, *fields), linked=True)
        if isinstance(fetched, ResponseError):
            raise StoreUnavailable(f"the session store refused a read ({op}): {fetched}")
        return list(fetched)


def _raise_refusal(replies: Sequence[Any]) -> None:
    """The first error reply among ``replies`` raised, if any."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply


async def _raising(replies: Awaitable[list[Any]]) -> list[Any]:
    """``replies``, or the first error reply among them raised (inside the call: a failure like any other)."""
    done = await replies
    _raise_refusal(done)
    return done
