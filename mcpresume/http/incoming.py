"""One request to the MCP endpoint as the executors see it, and what its headers say about its answer.

``Post`` bundles a POST (the aiohttp request, its body, the JSON-RPC message parsed from it, its session
id): one immutable value handed from the dispatch (``http/proxy.py``) to the executors (``http/post.py``,
``http/send.py``) instead of the same arguments passed down level by level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from aiohttp import web

from mcpresume.core.headers import PROTOCOL_VERSION_HEADER, SSE_RESPONSE_HEADERS
from mcpresume.core.jsonrpc import MODERN_VERSIONS, ClientMessage, primes
from mcpresume.core.session import PumpRecord, SessionAccess
from mcpresume.http.context import ProxyContext
from mcpresume.http.credentials import resume_headers
from mcpresume.http.forward import client_headers
from mcpresume.streams.upstream import UpstreamAnswer


@dataclass(frozen=True, slots=True)
class Post:
    """A POST to the MCP endpoint, its body read whole and parsed."""

    request: web.Request
    body: bytes
    message: ClientMessage
    session_id: str | None  # its Mcp-Session-Id
    # A bridged session's request (http/bridge.py): the 2026-07-28 headers it is sent upstream with.
    bridged: tuple[tuple[str, str], ...] | None = None
    # What routing read of the session (``route.Routed``): ``asked``, it did; ``access``, the record it read
    # (None: unknown). The executor's ``Need.ACCESS`` takes it instead of reading it again.
    asked: bool = False
    access: SessionAccess | None = None

    @property
    def request_id(self) -> str | int | None:
        """The id an answer the proxy makes itself carries: the message's first request id."""
        return self.message.first_id


def stateless(request: web.Request, message: ClientMessage | None) -> bool:
    """A revision without sessions (``MCP-Protocol-Version: 2026-07-28``, or a ``server/discover`` probe):
    the proxy has nothing to add to it."""
    version = request.headers.get(PROTOCOL_VERSION_HEADER)
    return version in MODERN_VERSIONS or (message is not None and message.is_discover)


def primes_of(request: web.Request, message: ClientMessage | None = None) -> bool:
    """Whether this request's SSE response starts with a priming event: its client speaks 2025-11-25 or
    later (the version an initialize asks for; after it, MCP-Protocol-Version, the negotiated one)."""
    if message is not None and message.is_initialize:
        return primes(message.protocol_version)
    return primes(request.headers.get(PROTOCOL_VERSION_HEADER))


SSE_HEADERS: Final[list[tuple[str, str]]] = list(SSE_RESPONSE_HEADERS)


def client_sse_headers(ctx: ProxyContext, upstream: UpstreamAnswer) -> list[tuple[str, str]]:
    """The upstream's response headers as the client gets them, with the SSE no-buffering headers set."""
    ours = {name.lower() for name, _ in SSE_RESPONSE_HEADERS}
    kept = [(n, v) for n, v in client_headers(ctx, upstream) if n.lower() not in ours]
    return kept + SSE_HEADERS if kept else SSE_HEADERS  # one shared list when nothing else is kept


def pump_record(
    ctx: ProxyContext, request: web.Request, session_id: str, request_ids: tuple[str | int, ...]
) -> PumpRecord:
    """What a stream's pump keeps to resume it upstream: a resume GET speaks for the client (its session,
    protocol revision and credentials: ``http.credentials.resume_headers``)."""
    return PumpRecord(request_ids, request.path_qs, resume_headers(ctx, request, session_id))
