"""One pipelined connection to a Redis server, for the Redis store's calls on the hot path.

redis-py's asyncio client spends about 90 us of CPU per command on this machine's class (a pool checkout, its
command packing, a reader per connection; measured: a PING through it 116 us, the round trip itself under
30), and a stream through the proxy makes several store calls per upstream read. ``Link`` is the thin
alternative: one connection, commands written as they come (a pump's append and a view's read share it,
each a write), replies matched in order by hiredis's parser (the ``redis`` extra's C reader). A caller that
gives up (its time-out) leaves its slot in the queue, so the replies that follow stay matched; the store
then drops the connection (``close``), failing every call in flight, and the next call connects again.

Used for a single Redis server (``redis://``, ``unix://``); a Cluster, and TLS, go through redis-py.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable, Sequence
from typing import Any, Final

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

_BULK: Final = b"$%d\r\n"
# How long a posted command may wait for a write to go with (a view's delivery mark, then the pump's
# next append): at 1k events/s the marks cost Redis and this process no system call and no wake-up of their
# own.
POST_DELAY: Final = 0.005


def pack(*args: str | bytes | int) -> bytes:
    """A command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + bulks(args)


def bulks(args: Sequence[str | bytes | int]) -> bytes:
    """``args`` as RESP bulk strings, without the array's header: a command's arguments that are the same on
    every call are packed once (``calls.Frames``) and joined to the rest."""
    out = []
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(_BULK % len(data))
        out.append(data)
        out.append(b"\r\n")
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        # per command written: the future of its reply (None: posted, the reply unwanted but for an error,
        # ``on_error``), with how many replies it takes (a MULTI's all), those come so far, and when it was
        # written (the loop's clock)
        self.waiting: collections.deque[tuple[asyncio.Future[list[Any]] | None, int, list[Any], float]] = (
            collections.deque()
        )
        # Replies come in order: when the oldest command waits longer than this, the connection fails (every
        # call on it raises ``TimeoutError``). One timer for them all, where a time-out per call (asyncio's)
        # cost each call a timer of its own. None: no limit.
        self.reply_timeout: float | None = None
        self._watch: asyncio.TimerHandle | None = None
        self.lost: BaseException | None = None
        self.on_error: Callable[[ResponseError], None] | None = None
        self.on_message: Callable[[bytes], None] | None = None  # subscribed: a published message's data
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # posted commands not written yet: they go out in front of the next write, or after POST_DELAY
        self.posted: list[bytes] = []
        self._flush: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        waiting = self.waiting
        on_message = self.on_message
        while (reply := reader.gets()) is not False:
            if on_message is not None and type(reply) is list and reply[0] == b"message":
                on_message(reply[2])
                continue
            if not waiting:
                self.fail(RedisConnectionError("a reply nobody asked for"))
                return
            future, count, replies, _ = waiting[0]
            replies.append(reply)
            if len(replies) == count:
                waiting.popleft()
                if future is None:
                    if isinstance(reply, ResponseError) and self.on_error is not None:
                        self.on_error(reply)
                elif not future.done():  # done: its caller gave up (time-out), the reply is dropped
                    future.set_result(replies)

    def write(self, data: bytes) -> None:
        assert self.transport is not None  # Link._usable
        if self.posted:
            self.posted.append(data)
            data = self._take_posted()
        self.transport.write(data)

    def post(self, data: bytes) -> None:
        """``data`` (one command, its reply unwanted but for an error) written with the next write, or
        after ``POST_DELAY`` if none comes: one system call (and one wake-up of Redis) for both, in order."""
        self.expect(None, 1)
        self.posted.append(data)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(POST_DELAY, self.flush)

    def expect(self, future: asyncio.Future[list[Any]] | None, count: int) -> None:
        """A command's ``count`` replies to come, for ``future`` (None: posted), watched by the reply
        time-out's timer (started if it is not running)."""
        loop = asyncio.get_running_loop()
        self.waiting.append((future, count, [], loop.time()))
        if self._watch is None and self.reply_timeout is not None:
            self._watch = loop.call_later(self.reply_timeout, self._check)

    def _check(self) -> None:
        self._watch = None
        if not self.waiting or self.lost is not None or self.reply_timeout is None:
            return
        loop = asyncio.get_running_loop()
        due = self.waiting[0][3] + self.reply_timeout
        if loop.time() >= due:
            self.fail(TimeoutError(f"no reply from Redis within {self.reply_timeout} s"))
        else:
            self._watch = loop.call_at(due, self._check)

    def flush(self) -> None:
        """The posted commands written now."""
        self._flush = None
        transport = self.transport
        if self.posted and self.lost is None and transport is not None and not transport.is_closing():
            transport.write(self._take_posted())

    def _take_posted(self) -> bytes:
        data = b"".join(self.posted)
        self._unpost()
        return data

    def _unpost(self) -> None:
        self.posted.clear()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(exc or RedisConnectionError("the connection to Redis closed"))

    def fail(self, error: BaseException) -> None:
        self.lost = error
        self._unpost()  # their slots in ``waiting`` go with the others
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if not self.closed.done():
            self.closed.set_result(None)
        while self.waiting:
            future, _, _, _ = self.waiting.popleft()
            if future is not None and not future.done():
                if isinstance(error, TimeoutError):
                    future.set_exception(TimeoutError(str(error)))
                else:
                    future.set_exception(RedisConnectionError(str(error) or type(error).__name__))
        if self.transport is not None:
            self.transport.abort()


class Link:
    """Commands to one Redis server over one connection (connected on first use, again after a failure)."""

    def __init__(
        self,
        url: str,
        connect_timeout: float,
        on_error: Callable[[ResponseError], None] | None = None,
        reply_timeout: float | None = None,
    ) -> None:
        self.options = parse_url(url)
        self.connect_timeout = connect_timeout
        self.on_error = on_error  # the error reply to a command posted (``post``)
        self.reply_timeout = reply_timeout  # (``_Protocol.reply_timeout``)
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://"))

    async def call(self, *args: str | bytes | int) -> Any:
        """One command's reply (an error reply comes back as a ``ResponseError`` instance, not raised)."""
        return (await self.send(pack(*args), 1))[0]

    async def send(self, data: bytes, count: int) -> list[Any]:
        """``data`` (``count`` packed commands), and their replies in order."""
        future = self.submit(data, count)
        if future is None:
            await self._connect()
            future = self.submit(data, count)
            assert future is not None
        return await future

    def submit(self, data: bytes, count: int) -> asyncio.Future[list[Any]] | None:
        """``data`` written now; the future of its replies. None (nothing written) when not connected."""
        protocol = self._usable()
        if protocol is None:
            return None
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        protocol.expect(future, count)
        protocol.write(data)
        return future

    def post(self, command: bytes) -> bool:
        """Send one packed command without waiting for its reply (an error reply goes to ``on_error``): it is
        written with the next command, or within ``POST_DELAY``, and every later command on this connection
        is executed after it. False (nothing sent) when not connected."""
        protocol = self._usable()
        if protocol is None:
            return False
        protocol.post(command)
        return True

    async def subscribe(self, channel: str, on_message: Callable[[bytes], None]) -> None:
        """Subscribe this connection to ``channel``: each message's data to ``on_message``. Returns once
        subscribed; ``lost`` then waits for the connection to end."""
        protocol = await self._connect()
        protocol.on_message = on_message
        reply = (await self.send(pack("SUBSCRIBE", channel), 1))[0]
        if isinstance(reply, ResponseError):
            raise reply

    async def lost(self) -> None:
        """Until the connection ends (at once if there is none)."""
        if self._protocol is not None:
            await asyncio.shield(self._protocol.closed)

    def _usable(self) -> _Protocol | None:
        """The connection, if it can take a write now (not lost, not closing)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None or protocol.transport is None:
            return None
        if protocol.transport.is_closing():
            protocol.fail(RedisConnectionError("the connection to Redis is closing"))
            return None
        return protocol

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if (protocol := self._usable()) is not None:
                return protocol  # another call connected meanwhile
            loop = asyncio.get_running_loop()
            options = self.options
            async with asyncio.timeout(self.connect_timeout):
                if "path" in options:
                    _, protocol = await loop.create_unix_connection(_Protocol, options["path"])
                else:
                    _, protocol = await loop.create_connection(
                        _Protocol, options.get("host", "localhost"), options.get("port", 6379)
                    )
                protocol.on_error = self.on_error
                protocol.reply_timeout = self.reply_timeout
                self._protocol = protocol
                setup = []
                if options.get("password"):
                    setup.append(
                        pack("AUTH", *[v for v in (options.get("username"), options["password"]) if v])
                    )
                if options.get("db"):
                    setup.append(pack("SELECT", options["db"]))
                if setup:
                    replies = await self.send(b"".join(setup), len(setup))
                    for reply in replies:
                        if isinstance(reply, ResponseError):
                            protocol.fail(reply)
                            raise RedisConnectionError(f"Redis refused the connection's set-up: {reply}")
            return protocol

    async def settle(self) -> None:
        """Until Redis has executed every command sent so far (posted ones too), if connected."""
        if self._usable() is not None:
            await self.call("PING")

    def close(self) -> None:
        """Drop the connection: every call in flight fails; the next call connects again."""
        if self._protocol is not None:
            self._protocol.fail(RedisConnectionError("the connection to Redis was dropped"))
            self._protocol = None
