"""The client side, with errors mapped into our tree: the requests whose answers the proxy reads on its own
pool (``streams/pool.py``), held GETs (``streams/heldget.py``) for the long-lived GET streams, and the
requests whose answers it relays as they are (bytes of any encoding, streamed bodies) on aiohttp's."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, Literal, Protocol, TypeVar, overload

import aiohappyeyeballs
import aiohttp
import h11
from multidict import CIMultiDictProxy
from yarl import URL

from mcpresume.core.errors import (
    BadRequest,
    BodyTimeout,
    UpstreamBadResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mcpresume.core.headers import asking_identity
from mcpresume.process.tracing import NO_TRACING
from mcpresume.streams.answer import UnreadableEncoding
from mcpresume.streams.heldget import HeldGet
from mcpresume.streams.pool import Pool, PooledAnswer

# Seconds before racing the next address of the upstream's name (RFC 8305), as aiohttp's connector does.
HAPPY_EYEBALLS: Final = 0.25
# Headers aiohttp's client adds on its own when a request has none: the proxy adds none the client did not
# send (an Accept-Encoding it never offered would bring it a compressed answer on a path passed through as
# is). A request whose answer the proxy reads asks for identity itself (``request(decoded=True)``).
NO_AUTO_HEADERS: Final = frozenset({"Accept-Encoding", "User-Agent", "Accept"})
E = TypeVar("E", bound=BaseException)
P = TypeVar("P", bound=asyncio.Protocol)
# Upstream URLs kept parsed (``Upstream._target``).
MAX_TARGETS: Final = 64


def caused_by(exc: BaseException, kind: type[E]) -> E | None:
    """The exception of type ``kind`` in ``exc``'s chain of causes (aiohttp wraps what failed)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, kind):
            return cause
        cause = cause.__cause__
    return None


def _unforwardable() -> BadRequest:
    return BadRequest(
        "the request cannot be forwarded: a header value HTTP/1.1 does not allow (a control character, or "
        "surrounding whitespace)"
    )


def bad_encoding(encoding: str | None) -> UpstreamBadResponse:
    named = f" ({encoding[:40]!r})" if encoding else ""
    return UpstreamBadResponse(
        f"the upstream answered in a content encoding{named} the proxy did not ask for and cannot read",
        **({"content_encoding": encoding[:40]} if encoding else {}),
    )


class BodyReader(Protocol):
    def readany(self) -> Awaitable[bytes]: ...  # what arrived since the last read; b"" at the end
    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamAnswer(Protocol):
    """What the proxy reads of an upstream answer: an ``aiohttp.ClientResponse``, or a ``HeldGet``."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> BodyReader: ...
    def release(self) -> Any: ...


class Upstream:
    """Where requests go: the upstream's origin, and its MCP endpoint path."""

    def __init__(self, url: str, *, connect_timeout: float, first_byte_timeout: float) -> None:
        self.url = URL(url)
        self.origin = self.url.origin()
        self.origin_url = str(self.origin)
        self.mcp_path = self.url.path or "/"
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self._session: aiohttp.ClientSession | None = None
        self._pool: Pool | None = None
        # Held GETs connect themselves: to the origin's host and port, with TLS verified for https.
        self._host = self.url.raw_host or ""
        self._port = self.url.port or (443 if self.url.scheme == "https" else 80)
        self._authority = self.url.host_port_subcomponent or self._host
        self._ssl = ssl.create_default_context() if self.url.scheme == "https" else None
        # The application's (``process/tracing.py``): every request sent carries the current trace context.
        self.tracing = NO_TRACING
        # Sessions begun again upstream (upstream_session_lost = "reinitialize"): the client's session id
        # -> the upstream's, which every request of the session carries instead (``aliased``). Empty unless
        # the setting is on and an upstream lost a session.
        self.aliases: dict[str, str] = {}
        # The upstream URL of each path (and query) asked lately: nearly every request asks the MCP
        # endpoint's, and a URL parsed and joined costs ~5 us. Bounded: emptied when full.
        self._targets: dict[str, URL] = {}

    def aliased(self, headers: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
        """``headers`` with a re-initialized session's id swapped for the upstream's (as they are else)."""
        if not self.aliases:
            return headers
        return [(n, self.aliases.get(v, v)) if n.lower() == "mcp-session-id" else (n, v) for n, v in headers]

    async def start(self) -> None:
        self._pool = Pool(self._authority, self.connect)
        self._session = aiohttp.ClientSession(
            # No total timeout: SSE streams live as long as their request (handshake era) or session.
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=None),
            # Bodies pass through as bytes (content-encoding is the client's and the upstream's business),
            # except those the proxy reads (request(decoded=True)).
            auto_decompress=False,
            # Upstream cookies belong to the client, not to the proxy's shared session.
            cookie_jar=aiohttp.DummyCookieJar(),
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        )

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @overload
    async def request(
        self,
        method: str,
        path_qs: str,
        headers: Sequence[tuple[str, str]],
        data: bytes | None,
        *,
        decoded: Literal[True],
    ) -> PooledAnswer: ...

    @overload
    async def request(
        self,
        method: str,
        path_qs: str,
        headers: Sequence[tuple[str, str]],
        data: bytes | AsyncIterable[bytes] | None,
        *,
        decoded: Literal[False] = False,
    ) -> aiohttp.ClientResponse: ...

    async def request(
        self,
        method: str,
        path_qs: str,
        headers: Sequence[tuple[str, str]],
        data: bytes | AsyncIterable[bytes] | None,
        *,
        decoded: bool = False,
    ) -> PooledAnswer | aiohttp.ClientResponse:
        """Send a request; returns once the upstream's headers arrived. Raises ``UpstreamUnreachable`` or
        ``UpstreamTimeout``. The caller owns the response and must release it.

        ``decoded``: the answer is read as it is meant, not as bytes to pass on (the proxy re-frames it):
        ``Accept-Encoding: identity`` is asked, and a body the upstream compresses anyway (gzip, deflate)
        is decompressed; its ``Content-Encoding`` and ``Content-Length`` then describe bytes nobody gets.
        Another encoding is ``UpstreamBadResponse``. Such a request's body is bytes, and it goes on the
        proxy's own pool (``streams/pool.py``); a header field with a CR, LF or NUL is ``BadRequest``.
        Otherwise bodies pass through as they came, on aiohttp's client.

        The errors say whether the request is known never to have been sent (``unsent``): only when no
        connection to the upstream was made (refused, failed, not within ``connect_timeout``). Any other
        failure may have come after it was written (a timeout, a connection that broke), so it may have
        run: what it did is unknown (``core.post.CLAIM_ENDS``)."""
        if decoded:
            assert data is None or isinstance(data, bytes), "a decoded request's body is bytes"
            return await self._read(method, path_qs, headers, data)
        assert self._session is not None, "Upstream.start() was not awaited"
        headers = self.tracing.inject(self.aliased(headers))
        try:
            async with asyncio.timeout(self.first_byte_timeout):
                return await self._session.request(
                    method,
                    self._target(path_qs),
                    headers=list(headers),
                    skip_auto_headers=NO_AUTO_HEADERS,
                    data=data,
                    allow_redirects=False,  # redirects are the client's to follow, with its own policy
                )
        except aiohttp.ConnectionTimeoutError:
            raise self._connect_timed_out() from None
        except TimeoutError:
            # Not known unsent: the time may have run out after the request was written (a connection that
            # took longer than the timeout is the rarer case, and a request that may have run is never sent
            # again: the safe side).
            raise self._head_timed_out() from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(
                f"cannot connect to the upstream: {exc.os_error}", unsent=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            timed_out = caused_by(exc, BodyTimeout)  # the client's body, streamed upstream, stopped coming
            if timed_out is not None:
                raise timed_out from None
            # After the connection was made (aiohttp raises a connection's own failures as
            # ClientConnectorError): the request may have been written.
            raise UpstreamUnreachable(f"upstream request failed: {type(exc).__name__}: {exc}") from None

    async def _read(
        self, method: str, path_qs: str, headers: Sequence[tuple[str, str]], data: bytes | None
    ) -> PooledAnswer:
        """``request(decoded=True)``, on the pool."""
        assert self._pool is not None, "Upstream.start() was not awaited"
        try:
            message = self._pool.message(method, path_qs, self._prepared(headers), data)
        except ValueError:
            # Not the value in the message: it may be a credential, and this message reaches logs.
            raise _unforwardable() from None
        try:
            return await self._pool.send(message, self._pool.loop.time() + self.first_byte_timeout)
        except TimeoutError:
            raise self._head_timed_out() from None  # maybe sent, as ``request``'s
        except UnreadableEncoding as exc:
            raise bad_encoding(exc.encoding) from None
        except OSError as exc:  # reset, closed before the head, or not HTTP/1.1 (NotHTTP11)
            raise UpstreamUnreachable(f"upstream request failed: {exc}") from None

    def _prepared(self, headers: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
        """The headers a read answer's request is sent with: ``asking_identity`` (as they are when they are
        that already: ``core.headers.identity_request_headers``), a re-initialized session's id swapped for
        the upstream's, the trace context."""
        return self.tracing.inject(self.aliased(asking_identity(headers)))

    def _target(self, path_qs: str) -> URL:
        """The upstream URL of ``path_qs`` (as the client sent it, encoded)."""
        url = self._targets.get(path_qs)
        if url is None:
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            url = self._targets[path_qs] = self.origin.join(URL(path_qs, encoded=True))
        return url

    async def answers(self, within: float) -> bool:
        """Whether the upstream answers HTTP at its MCP endpoint within ``within`` seconds, any status (an
        MCP endpoint answers a bare GET with 400, 405 or 406): ``/readyz`` with ``ready_on_upstream``."""
        # A connection of its own, from a pool of its own: one kept alive from before (a call's, the era
        # probe's) would answer for a listener that is gone.
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with asyncio.timeout(within), aiohttp.ClientSession(connector=connector) as session:
                headers = {"Accept": "application/json, text/event-stream"}
                response = await session.get(self.url, headers=headers, allow_redirects=False)
                response.close()  # the head is enough: an SSE answer would never end
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return True

    async def open_get(
        self, path_qs: str, headers: Sequence[tuple[str, str]], *, alias: bool = True
    ) -> HeldGet:
        """A GET whose answer may be held for long (the standalone stream, an upstream resume), on a
        connection of its own; returns once the upstream's head arrived. Raises as ``request`` does (an
        answer that is not HTTP/1.1 is ``UpstreamUnreachable``, as aiohttp's parse errors are there), and
        ``BadRequest`` for a header value HTTP/1.1 does not allow. The caller must release it. ``alias``:
        False for a pump's resume, whose headers name the upstream session its stream was opened in."""
        try:
            sent = self.aliased(headers) if alias else headers
            held = HeldGet(self._authority, path_qs, self.tracing.inject(sent))
        except h11.LocalProtocolError:
            # Not the value in the message: it may be a credential, and this message reaches logs.
            raise _unforwardable() from None
        try:
            try:
                async with asyncio.timeout(self.first_byte_timeout):
                    await self.connect(lambda: held)
                    await held.head()
            except TimeoutError:
                raise self._head_timed_out() from None
            except UnreadableEncoding as exc:
                raise UpstreamBadResponse(str(exc)) from None
            except OSError as exc:  # reset, closed before the head, or not HTTP/1.1 (NotHTTP11)
                raise UpstreamUnreachable(f"upstream request failed: {exc}") from None
        except BaseException:
            held.release()
            raise
        return held

    async def connect(self, protocol: Callable[[], P]) -> P:
        """A new connection to the upstream, its protocol made by ``protocol``. Raises ``UpstreamUnreachable``
        (unsent: no connection, so no request written)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                # The addresses raced as aiohttp's connector does (uvloop's create_connection has no
                # happy_eyeballs_delay), then the connected socket handed to the loop.
                addresses = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
                sock = await aiohappyeyeballs.start_connection(
                    addresses, happy_eyeballs_delay=HAPPY_EYEBALLS, interleave=1
                )
                server_hostname = self._host if self._ssl is not None else None
                _, made = await loop.create_connection(
                    protocol, sock=sock, ssl=self._ssl, server_hostname=server_hostname
                )
        except TimeoutError:
            raise self._connect_timed_out() from None
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to the upstream: {exc}", unsent=True) from None
        return made

    def _connect_timed_out(self) -> UpstreamUnreachable:
        return UpstreamUnreachable(
            f"cannot connect to the upstream within {self.connect_timeout} s", unsent=True
        )

    def _head_timed_out(self) -> UpstreamTimeout:
        return UpstreamTimeout(
            f"upstream sent no response headers within {self.first_byte_timeout} s",
            timeout=self.first_byte_timeout,
        )
