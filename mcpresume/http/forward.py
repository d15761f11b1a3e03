"""Plain forwarding: requests the proxy passes through as they are, and answers it relays as they come.

Used for every path other than the MCP endpoint (OAuth discovery, authorization endpoints), for the
2026-07-28 era (no sessions: a client disconnect cancels the upstream request, as that revision says),
and for answers the proxy does not keep (JSON, 202, upstream errors). Bodies stream both ways; an SSE
answer is relayed chunk by chunk with the no-buffering headers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web

from mcpresume.core.errors import (
    BodyTimeout,
    BodyTooLarge,
    ProxyError,
    UpstreamBadResponse,
    UpstreamUnreachable,
)
from mcpresume.core.headers import (
    SSE_RESPONSE_HEADERS,
    AskingIdentity,
    answer_headers,
    identity_request_headers,
    request_headers,
)
from mcpresume.http.context import DID, Action, ProxyContext
from mcpresume.http.view import ClientWriter, HeldHeadResponse, Stalled
from mcpresume.process.drain import Interrupted, end_for_drain
from mcpresume.streams.answer import NotHTTP11, ReadAnswer
from mcpresume.streams.upstream import UpstreamAnswer

log = logging.getLogger("mcpresume.proxy")

SSE = "text/event-stream"


def upstream_headers(request: web.Request) -> list[tuple[str, str]]:
    """The client's end-to-end headers, plus ``X-Forwarded-*`` for this hop."""
    return request_headers(
        request.headers.items(), client_ip=_client_ip(request), proto=request.scheme, host=request.host
    )


def identity_upstream_headers(request: web.Request) -> AskingIdentity:
    """``upstream_headers`` of a request whose answer the proxy reads (``Upstream.request(decoded=True)``):
    ``Accept-Encoding: identity`` instead of the client's."""
    return identity_request_headers(
        request.headers.items(), client_ip=_client_ip(request), proto=request.scheme, host=request.host
    )


def _client_ip(request: web.Request) -> str | None:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return peer[0] if isinstance(peer, tuple) else None


def client_headers(
    ctx: ProxyContext, upstream: UpstreamAnswer, *, decoded: bool = True
) -> list[tuple[str, str]]:
    """The upstream's end-to-end response headers as the client gets them: a ``Location`` or
    ``Content-Location`` at the upstream's own address points at the proxy instead. ``decoded``: the body
    was read uncompressed (``Upstream.request(decoded=True)``, a held GET): a ``Content-Encoding`` the
    proxy did not apply never reaches the client."""
    return answer_headers(upstream.headers.items(), ctx.upstream.origin_url, decoded=decoded)


class StreamedBody:
    """A request body streamed upstream as it arrives (never read whole). All of it must arrive within
    ``timeout`` seconds of the request, as on the MCP endpoint (``read_body``): a read past that raises
    ``BodyTimeout``, which fails the upstream request (``Upstream.request`` raises it again: 408). If the
    upstream's answer already began (``answer``), no 408 can be sent: both connections are cut instead,
    so neither side takes a part for the whole."""

    __slots__ = ("_deadline", "_request", "_timeout", "answer")

    def __init__(self, request: web.Request, timeout: float) -> None:
        self._request = request
        self._timeout = timeout
        self._deadline = asyncio.get_running_loop().time() + timeout
        self.answer: aiohttp.ClientResponse | None = None

    def __aiter__(self) -> StreamedBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            async with asyncio.timeout_at(self._deadline):  # one deadline for the whole body
                chunk = await self._request.content.readany()
        except TimeoutError:
            request = self._request
            if self.answer is not None:
                log.warning(
                    "%s %s: the request body did not arrive in time; cut", request.method, request.path
                )
                if request.transport is not None:
                    request.transport.abort()
                self.answer.close()
            raise BodyTimeout(f"the request body did not arrive within {self._timeout} s") from None
        if not chunk:
            raise StopAsyncIteration
        return chunk


def body_stream(request: web.Request, timeout: float) -> StreamedBody | None:
    """The request body as it arrives, within ``timeout`` seconds (``StreamedBody``), or None without one."""
    return StreamedBody(request, timeout) if request.body_exists else None


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """A bounded request body: over ``limit`` bytes is 413, slower than ``timeout`` seconds is 408."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body over {limit} bytes", limit=limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise BodyTooLarge(f"request body over {limit} bytes", limit=limit)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout} s") from None
    return bytes(body)


async def passthrough(
    ctx: ProxyContext, request: web.Request, body: bytes | StreamedBody | None
) -> web.StreamResponse:
    """Forward as is and stream the answer back; a client disconnect cancels the upstream request."""
    request[DID] = Action.RELAYED
    headers = upstream_headers(request)
    if isinstance(body, StreamedBody) and request.content_length is not None:
        headers.append(("Content-Length", str(request.content_length)))
    # A GET on the MCP endpoint opens a stream that may never end: the drain's start ends the wait for it.
    stream_get = request.method == "GET" and request.path == ctx.upstream.mcp_path
    with ctx.drain.upstream_wait(standalone=stream_get):
        upstream = await ctx.upstream.request(request.method, request.path_qs, headers, body)
    if isinstance(body, StreamedBody):
        body.answer = upstream
    return await relay(ctx, request, upstream, decoded=False)  # the bytes as they came, encoded or not


def inflated(upstream: UpstreamAnswer) -> bool:
    """The upstream compressed this answer though the proxy asked for it as is, and it is read
    decompressed (``Upstream.request(decoded=True)``, a held GET)."""
    return isinstance(upstream, ReadAnswer) and upstream.inflates


async def read_inflated(upstream: UpstreamAnswer, limit: int) -> bytes:
    """A decompressed answer whole, at most ``limit`` bytes of it (a few KiB of a gzip bomb expand to
    GiB). Raises ``UpstreamBadResponse`` beyond, or when it cannot be decoded; ``UpstreamUnreachable``
    when the connection fails."""
    body = bytearray()
    try:
        async for chunk in upstream.content.iter_any():  # bounded chunks: the decoders inflate on demand
            body += chunk
            if len(body) > limit:
                raise UpstreamBadResponse(
                    f"the upstream's compressed answer expands beyond {limit} bytes", limit=limit
                )
    except NotHTTP11 as exc:  # framing broken, or compressed data that cannot be decoded
        raise UpstreamBadResponse(str(exc)) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamUnreachable(f"the upstream's answer failed: {type(exc).__name__}: {exc}") from None
    return bytes(body)


async def relay(
    ctx: ProxyContext,
    request: web.Request,
    upstream: UpstreamAnswer,
    *,
    decoded: bool = True,
    request_id: Any = None,
) -> web.StreamResponse:
    """Stream an upstream answer to the client as it arrives, end-to-end headers only. ``decoded``: the
    body is read uncompressed (``client_headers``); a compressed one's length is then the proxy's framing.
    A compressed answer other than SSE is read whole first, up to ``max_event_bytes`` (it is one JSON-RPC
    message, which an SSE event could carry; no more expands in memory): beyond, the client gets 502
    ``upstream_bad_response`` (``request_id`` the id in its body)."""
    try:
        is_sse = upstream.content_type == SSE
        whole: bytes | None = None
        if decoded and not is_sse and inflated(upstream):
            try:
                whole = await read_inflated(upstream, ctx.settings.max_event_bytes)
            except ProxyError as error:
                return ctx.reject(request, error, request_id)
        length: int | None = None
        if whole is not None:
            length = len(whole)
        elif (
            not is_sse
            and upstream.content_length is not None
            and not (decoded and "Content-Encoding" in upstream.headers)
        ):
            length = upstream.content_length
        # A body of known length (a JSON answer): its head goes out with it, in one write. Any other's
        # head at once (an SSE stream may send nothing for long).
        kind = web.StreamResponse if length is None else HeldHeadResponse
        response = kind(status=upstream.status, reason=upstream.reason)
        for name, value in client_headers(ctx, upstream, decoded=decoded):
            response.headers.add(name, value)
        if is_sse:
            for name, value in SSE_RESPONSE_HEADERS[1:]:
                response.headers[name] = value
        elif length is not None:
            response.content_length = length
        await response.prepare(request)
        if whole is not None:
            await response.write(whole)
            await response.write_eof()
            return response
        if is_sse:
            ctx.metrics.open_streams.inc()
        writer = ClientWriter(response, request.transport, ctx.settings.stall_timeout, request.writer)
        standalone = request.method == "GET"  # a GET stream may never end: the drain ends it first
        try:
            # A stream the drain ends, as a view; its reads off the upstream's socket are interrupted.
            with ctx.drain.interruptible(standalone, register=is_sse):
                if is_sse and ctx.drain.ends_at_once(standalone):  # begun after the drain ended its kind
                    await end_for_drain(request, response)
                    return response
                async for chunk in upstream.content.iter_any():
                    await writer.write(chunk)
                await response.write_eof()
        except Interrupted:
            await end_for_drain(request, response)
        except (aiohttp.ClientError, OSError) as exc:
            log.info("relay of %s %s ended early: %s", request.method, request.path, type(exc).__name__)
        except Stalled:
            # The client took nothing for stall_timeout: cut it off, the upstream request with it.
            ctx.metrics.backpressure_detaches.inc()
            if request.transport is not None:
                request.transport.abort()
        finally:
            if is_sse:
                ctx.metrics.open_streams.dec()
        return response
    finally:
        upstream.release()
