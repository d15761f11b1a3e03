"""The client listener's connection cap: at most ``max_connections`` client connections open at once, and
never more than the process's descriptors can hold.

Connections that never send a request are closed by the HTTP server after ``header_timeout`` (its
keep-alive timeout, which runs from a connection's opening and from each answer's end until a complete
request head arrives); the cap bounds how many of them can be open meanwhile, below the descriptor limit,
so they cannot starve the proxy of descriptors for its own work (the upstream connections). At the cap, a
new connection takes the place of the oldest one still waiting for its first request head (a real client
sends its head at once: the longest-waiting is the likeliest slowloris; empty lines before a request line
are no head), so a flood of such connections cannot lock out a fresh client; only when every open
connection has sent a request is a new one refused, with a clean 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final, cast

import orjson
from aiohttp import web

from mcpresume.core.errors import TooManyConnections, jsonrpc_error_body

log = logging.getLogger("mcpresume")

# Descriptors left for everything but client connections and their upstream connections: listeners, the
# store, logs, held upstream streams of sessions whose clients have gone.
FD_RESERVE: Final = 256
# Descriptors a client connection may need: its own, and the upstream connection it is answered over.
FDS_PER_CONNECTION: Final = 2
# A refused connection gets a moment to take its answer before it is closed (closing with its request
# unread would reset it, and the answer could be lost); at most this many linger at once, the rest are
# closed right after the answer.
LINGER: Final = 1.0
MAX_LINGERING: Final = 64
# Refusals are logged at most once per this many seconds (a flood is one line per interval).
LOG_INTERVAL: Final = 1.0
# Connections closed to make room whose descriptors are not released yet (they are on the loop's next
# turn): beyond this many, a new connection is refused instead, so the cap overshoots by at most this.
MAX_EVICTING: Final = 64
# A request head ends at an empty line; before its request line, CR and LF are skipped (RFC 9112 section 2.2
# lets a server ignore empty lines there; aiohttp's parser skips any CR and LF), so `\r\n\r\n` alone is no
# head: a connection that sends only empty lines is still waiting for its first request.
_HEAD_END: Final = b"\r\n\r\n"
_EMPTY_LINES: Final = b"\r\n"


def connection_budget(max_connections: int) -> tuple[int, int | None]:
    """The connection cap the descriptor limit allows, raising the soft limit toward the hard one as far
    as ``max_connections`` needs; and the soft limit then (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return max_connections, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    want = max_connections * FDS_PER_CONNECTION + FD_RESERVE
    if soft != unlimited and soft < want:
        target = want if hard == unlimited else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # macOS caps the soft limit below an unlimited hard one
            pass
    if soft == unlimited:
        return max_connections, None
    return max(1, min(max_connections, (soft - FD_RESERVE) // FDS_PER_CONNECTION)), soft


class ConnectionCap:
    """Counts the listener's open connections; beyond ``limit`` a new one gets 503 and is closed."""

    def __init__(
        self,
        limit: int,
        on_change: Callable[[int], None] = lambda _: None,
        on_refuse: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0
        self.evicted = 0
        self.lingering = 0
        self.evicting = 0
        # Open connections without a complete first request head, oldest first.
        self.waiting: dict[_Counted, None] = {}
        self._on_change = on_change
        self._on_refuse = on_refuse
        self._unlogged = {"refused": 0, "evicted": 0}
        self._logged_at = -LOG_INTERVAL
        error = TooManyConnections(
            f"the proxy holds its maximum of {limit} client connections; retry shortly", limit=limit
        )
        body = orjson.dumps(jsonrpc_error_body(error))
        self.refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            if self.open >= self.limit:
                if not self.waiting or self.evicting >= MAX_EVICTING:
                    self.refused += 1
                    self._turned_away("refused")
                    return _Refused(self)
                next(iter(self.waiting)).evict()
                self.evicted += 1
                self._turned_away("evicted")
            self.open += 1
            self._on_change(self.open)
            return _Counted(inner(), self)

        return make

    def closed(self) -> None:
        self.open -= 1
        self._on_change(self.open)

    def _turned_away(self, how: str) -> None:
        self._on_refuse(how)
        self._unlogged[how] += 1
        now = asyncio.get_running_loop().time()
        if now - self._logged_at >= LOG_INTERVAL:
            log.warning(
                "max_connections %d reached: since the last report %d connections refused (503 "
                "too_many_connections), %d without a request head closed for new ones",
                self.limit,
                self._unlogged["refused"],
                self._unlogged["evicted"],
            )
            self._logged_at = now
            self._unlogged = {"refused": 0, "evicted": 0}


class _Counted(asyncio.Protocol):
    """The HTTP server's protocol for one connection, counted while it is open, and known as waiting until
    its first request head is complete."""

    __slots__ = ("_cap", "_evicted", "_inner", "_tail", "_transport")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        # The last bytes of a head in progress (empty: no request line yet); None: a head arrived.
        self._tail: bytes | None = b""
        self._transport: asyncio.BaseTransport | None = None
        self._evicted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._cap.waiting[self] = None
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._tail is not None:
            seen = self._tail + data
            if not self._tail:  # no request line begun: empty lines before it are ignored (RFC 9112 2.2)
                seen = seen.lstrip(_EMPTY_LINES)
            if _HEAD_END in seen:
                self._tail = None
                self._cap.waiting.pop(self, None)
            else:
                self._tail = seen[-3:]  # never empty once a request line began
        self._inner.data_received(data)

    def evict(self) -> None:
        """Close this connection (it never completed a request head) to make room for a new one."""
        self._cap.waiting.pop(self, None)
        self._evicted = True
        self._cap.evicting += 1
        if self._transport is not None:
            cast(asyncio.Transport, self._transport).abort()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cap.waiting.pop(self, None)
        if self._evicted:
            self._cap.evicting -= 1
        self._cap.closed()
        self._inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection over the cap: the 503 is written at once and the connection closed."""

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap
        self._timer: asyncio.TimerHandle | None = None
        self._lingers = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        stream.write(self._cap.refusal)
        if self._cap.lingering >= MAX_LINGERING or not stream.can_write_eof():
            stream.close()
            return
        # Half-closed: the client reads the answer and the end; what it sends meanwhile is discarded.
        stream.write_eof()
        self._lingers = True
        self._cap.lingering += 1
        self._timer = asyncio.get_running_loop().call_later(LINGER, stream.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._lingers:
            self._cap.lingering -= 1


class CappedSite(web.BaseSite):
    """A listening socket served by ``runner``, through ``cap``: aiohttp's ``SockSite`` with the
    connection cap around its protocol factory."""

    __slots__ = ("_cap", "_sock")

    def __init__(self, runner: web.BaseRunner, sock: Any, cap: ConnectionCap, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self._sock = sock
        self._cap = cap

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._cap.protocol_factory(server), sock=self._sock, backlog=self._backlog
        )
