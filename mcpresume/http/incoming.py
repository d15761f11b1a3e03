"""One request to the MCP endpoint as the executors see it, and what its headers say about its answer.

``Post`` bundles a POST (the aiohttp request, its body, the JSON-RPC message parsed from it, and what its
headers say: its session id, cursor and protocol revision, read once at admission): one immutable value
handed from the dispatch (``http/proxy.py``) to the executors (``http/post.py``, ``http/send.py``) instead
of the same arguments passed down level by level, and of the same headers looked up again at each level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from aiohttp import web

from mcpresume.core.headers import (
    LAST_EVENT_ID_HEADER,
    PROTOCOL_VERSION_HEADER,
    SSE_RESPONSE_HEADERS,
    sse_answer_headers,
)
from mcpresume.core.jsonrpc import MODERN_VERSIONS, ClientMessage, primes
from mcpresume.core.session import PumpRecord, SessionAccess
from mcpresume.http.context import ProxyContext
from mcpresume.http.credentials import resume_headers
from mcpresume.streams.upstream import UpstreamAnswer


@dataclass(frozen=True, slots=True)
class Post:
    """A POST to the MCP endpoint, its body read whole and parsed."""

    request: web.Request
    body: bytes
    message: ClientMessage
    session_id: str | None  # its Mcp-Session-Id
    cursor: str | None  # its Last-Event-ID
    version: str | None  # its MCP-Protocol-Version
    stateless: bool  # of a revision without sessions (``stateless_version``): the proxy adds nothing to it
    # A bridged session's request (http/bridge.py): the 2026-07-28 headers it is sent upstream with.
    bridged: tuple[tuple[str, str], ...] | None = None
    # What routing read of the session (``route.Routed``): ``asked``, it did; ``access``, the record it read
    # (None: unknown). The executor's ``Need.ACCESS`` takes it instead of reading it again.
    asked: bool = False
    access: SessionAccess | None = None

    @classmethod
    def admit(cls, request: web.Request, body: bytes, message: ClientMessage, session_id: str | None) -> Post:
        """The POST, its headers read (``session_id``: read and checked by the admission already)."""
        headers = request.headers
        cursor, version = headers.get(LAST_EVENT_ID_HEADER), headers.get(PROTOCOL_VERSION_HEADER)
        return cls(request, body, message, session_id, cursor, version, stateless_version(version, message))

    @property
    def request_id(self) -> str | int | None:
        """The id an answer the proxy makes itself carries: the message's first request id."""
        return self.message.first_id

    @property
    def primes(self) -> bool:
        """Whether its SSE response starts with a priming event (``primes_version``)."""
        return primes_version(self.version, self.message)


def stateless_version(version: str | None, message: ClientMessage | None) -> bool:
    """A revision without sessions (``MCP-Protocol-Version: 2026-07-28``, or a ``server/discover`` probe):
    the proxy has nothing to add to it."""
    return version in MODERN_VERSIONS or (message is not None and message.is_discover)


def stateless(request: web.Request, message: ClientMessage | None) -> bool:
    """``stateless_version`` of a request's ``MCP-Protocol-Version`` (a POST's: ``Post.stateless``)."""
    return stateless_version(request.headers.get(PROTOCOL_VERSION_HEADER), message)


def primes_version(version: str | None, message: ClientMessage | None = None) -> bool:
    """Whether a request's SSE response starts with a priming event: its client speaks 2025-11-25 or later
    (the version an initialize asks for; after it, ``version``, its MCP-Protocol-Version, the negotiated
    one)."""
    if message is not None and message.is_initialize:
        return primes(message.protocol_version)
    return primes(version)


def primes_of(request: web.Request, message: ClientMessage | None = None) -> bool:
    """``primes_version`` of a request's ``MCP-Protocol-Version`` (a POST's: ``Post.primes``)."""
    return primes_version(request.headers.get(PROTOCOL_VERSION_HEADER), message)


SSE_HEADERS: Final[list[tuple[str, str]]] = list(SSE_RESPONSE_HEADERS)


def client_sse_headers(ctx: ProxyContext, upstream: UpstreamAnswer) -> list[tuple[str, str]]:
    """The upstream's response headers as the client gets them, with the SSE no-buffering headers set."""
    kept = sse_answer_headers(upstream.headers.items(), ctx.upstream.origin_url)
    return kept + SSE_HEADERS if kept else SSE_HEADERS  # one shared list when nothing else is kept


def pump_record(
    ctx: ProxyContext,
    request: web.Request,
    session_id: str,
    request_ids: tuple[str | int, ...],
    version: str | None,
) -> PumpRecord:
    """What a stream's pump keeps to resume it upstream: a resume GET speaks for the client (its session,
    protocol revision ``version`` and credentials: ``http.credentials.resume_headers``)."""
    return PumpRecord(request_ids, request.path_qs, resume_headers(ctx, request, session_id, version))
