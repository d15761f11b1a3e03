"""The client side: one pooled aiohttp session to the upstream, with errors mapped into our tree."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Sequence

import aiohttp
from yarl import URL

from mcpresume.errors import UpstreamTimeout, UpstreamUnreachable


class Upstream:
    """Where requests go: the upstream's origin, and its MCP endpoint path."""

    def __init__(self, url: str, *, connect_timeout: float, first_byte_timeout: float) -> None:
        self.url = URL(url)
        self.origin = self.url.origin()
        self.mcp_path = self.url.path or "/"
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # No total timeout: SSE streams live as long as their request (handshake era) or session.
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=None),
            # Bodies pass through as bytes: content-encoding is the client's and the upstream's business.
            auto_decompress=False,
            # Upstream cookies belong to the client, not to the proxy's shared session.
            cookie_jar=aiohttp.DummyCookieJar(),
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path_qs: str,
        headers: Sequence[tuple[str, str]],
        data: bytes | AsyncIterable[bytes] | None,
    ) -> aiohttp.ClientResponse:
        """Send a request; returns once the upstream's headers arrived. Raises ``UpstreamUnreachable`` or
        ``UpstreamTimeout``. The caller owns the response and must release it."""
        assert self._session is not None, "Upstream.start() was not awaited"
        try:
            async with asyncio.timeout(self.first_byte_timeout):
                return await self._session.request(
                    method,
                    self.origin.join(URL(path_qs, encoded=True)),
                    headers=list(headers),
                    data=data,
                    allow_redirects=False,  # redirects are the client's to follow, with its own policy
                )
        except aiohttp.ConnectionTimeoutError:
            raise UpstreamUnreachable(
                f"cannot connect to the upstream within {self.connect_timeout} s"
            ) from None
        except TimeoutError:
            raise UpstreamTimeout(
                f"upstream sent no response headers within {self.first_byte_timeout} s",
                timeout=self.first_byte_timeout,
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(f"cannot connect to the upstream: {exc.os_error}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"upstream request failed: {type(exc).__name__}: {exc}") from None
