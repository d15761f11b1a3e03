"""The hop: a request of a session owned by another replica, forwarded to it once and its answer streamed
back (the shell of ``core.route.Forward``).

The target is the owner's URL from the store's registry (``core.route.route`` decides; nothing a client sends
names it). The forwarded request keeps the client's end-to-end headers, ``Authorization`` and ``Host``
included (the owner checks ``allowed_hosts`` and ``Origin`` against what the client sent, as this replica
did), drops the hop-by-hop ones (``headers.end_to_end``), adds ``X-Forwarded-For`` for this hop, and sets
the hop header to this replica's id, so the owner never forwards it again. The owner's answer comes back
as it is: status, end-to-end headers, and the body chunk by chunk as it arrives (an SSE stream is never
buffered whole). A client that goes away cancels the handler, which closes the hop's connection, so the
owner sees its client leave as it would a direct one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from mcpresume.core.errors import OwnerUnreachable, ProxyError, jsonrpc_error_body
from mcpresume.core.headers import (
    HOP_HEADER,
    LAST_EVENT_ID_HEADER,
    PROBE_HEADER,
    REPLICA_HEADER,
    end_to_end,
    forwarded,
    valid_session_id,
)
from mcpresume.core.route import HopOutcome, Kind, Route, kind_of, route
from mcpresume.process.drain import Drain, Interrupted, end_for_drain
from mcpresume.process.metrics import Metrics
from mcpresume.process.tracing import NO_TRACING
from mcpresume.store import Registry

log = logging.getLogger("mcpresume.hop")

Reject = Callable[[web.Request, ProxyError, Any], web.StreamResponse]

# Headers aiohttp's client would add on its own when the client sent none: the hop adds nothing the
# client did not send (an Accept-Encoding the client never offered would bring it a compressed answer).
_NO_AUTO_HEADERS: Final = frozenset({"Accept-Encoding", "User-Agent", "Accept"})


@dataclasses.dataclass(frozen=True, slots=True)
class Asked:
    """A request whose session's owner routes it (``routed_session``): the session and the request's kind."""

    session_id: str
    kind: Kind


def routed_session(request: web.Request, session_id: str | None) -> Asked | None:
    """The session whose owner routes ``request`` (``session_id``: its ``Mcp-Session-Id``), with the
    request's kind; None: routing asks the store nothing, it is served here. A session id the handler will
    refuse (400) is not looked up."""
    if session_id is None or not valid_session_id(session_id):
        return None
    kind = kind_of(request.method, session=True, cursor=LAST_EVENT_ID_HEADER in request.headers)
    return None if kind is Kind.OTHER else Asked(session_id, kind)


async def decide(
    owners: Registry,
    request: web.Request,
    asked: Asked,
    owner: str | None,
    here: str,
    now: float,
    *,
    needs_upstream: bool = False,
    takeover_tried: bool = False,
    answered: tuple[str, str] | None = None,
) -> Route:
    """Where ``request`` is served: ``core.route.route`` on what the store says of its session's owner
    (``owner``, as ``Registry.owner`` says it; ``needs_upstream`` and ``takeover_tried`` as there). The
    owner's URL is asked only when the owner is another replica. ``answered``: (replica id, URL) of a
    replica that answered a liveness check there (``Hop.probe``): if it owns the session, it is live
    there, whatever its lease says."""
    owner_url = await owners.replica_url(owner, now) if owner and owner != here else None
    if owner_url is None and answered is not None and owner == answered[0] and owner != here:
        owner_url = answered[1]
    return route(
        asked.kind,
        owner=owner,
        here=here,
        hopped=HOP_HEADER in request.headers,
        owner_url=owner_url,
        needs_upstream=needs_upstream,
        takeover_tried=takeover_tried,
    )


def refusal(request: web.Request, error: ProxyError, request_id: Any = None) -> web.Response:
    """A refusal as every proxy answer has it: status, JSON-RPC error body with the stable reason, one log
    line (the default of ``Hop.reject``; the proxy passes its own, which counts it too)."""
    log.warning("%s %s -> %d %s: %s", request.method, request.path, error.status, error.reason, error.message)
    return web.Response(
        status=error.status,
        body=orjson.dumps(jsonrpc_error_body(error, request_id)),
        content_type="application/json",
    )


def hop_headers(request: web.Request, replica_id: str) -> list[tuple[str, str]]:
    """What the owner receives: the client's end-to-end headers (its own hop header, if it sent one,
    never), its ``Host``, ``X-Forwarded-*`` for this hop, and this replica's hop header."""
    headers = end_to_end(request.headers.items(), request=True)
    peer = request.transport.get_extra_info("peername") if request.transport else None
    client_ip = peer[0] if isinstance(peer, tuple) else None
    headers = forwarded(headers, client_ip=client_ip, proto=request.scheme, host=request.host)
    host = request.headers.get("Host")
    if host is not None:
        headers.append(("Host", host))
    headers.append((HOP_HEADER, replica_id))
    return headers


# Seconds over the owner's own worst case before its answer head, for the time between the replicas.
HEAD_MARGIN: Final = 5.0


def owner_head_timeout(connect_timeout: float, first_byte_timeout: float) -> float:
    """How long a hop waits for the owner's answer head (``Hop``'s ``first_byte_timeout``): longer than
    the owner itself may take before it answers (a credential ping to its upstream, then the request,
    each with a connect and a first byte), so a slow upstream is the owner's own 504 ``upstream_timeout``
    as without a hop, and only an owner that says nothing at all is 502 ``owner_unreachable`` here."""
    return 2 * (connect_timeout + first_byte_timeout) + HEAD_MARGIN


class Hop:
    """Forwards requests to other replicas over one pooled client session (``start`` / ``close``).
    ``first_byte_timeout``: ``owner_head_timeout(...)`` of the replicas' settings; ``keepalive_timeout``:
    under the replicas' ``header_timeout`` (half of it, say)."""

    def __init__(
        self,
        replica_id: str,
        metrics: Metrics,
        *,
        connect_timeout: float,
        first_byte_timeout: float,
        stall_timeout: float,
        keepalive_timeout: float = 5.0,
        reject: Reject = refusal,
        drain: Drain | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.metrics = metrics
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.stall_timeout = stall_timeout
        self.reject = reject
        self.drain = drain if drain is not None else Drain()  # the replica's: it ends a relayed answer
        # An idle pooled connection to an owner is dropped before the owner's own idle timeout
        # (header_timeout, 10 s by default, on every replica alike) can close it under a request just sent
        # on it: that request would fail, and a POST is never re-sent (it might have run).
        self.keepalive_timeout = keepalive_timeout
        self._session: aiohttp.ClientSession | None = None
        self._outcomes = {o: metrics.forwarded_requests.labels(o.value) for o in HopOutcome}
        self.tracing = (
            NO_TRACING  # the application's (``process/tracing.py``): the request's context goes along
        )

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # No total timeout: a forwarded SSE stream lives as long as its request or session.
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=None),
            auto_decompress=False,  # the owner's bytes as they came, Content-Encoding and all
            cookie_jar=aiohttp.DummyCookieJar(),  # cookies are the client's, not the proxy's
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_timeout),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, url: str, timeout: float) -> str | None:
        """Who answers at ``url``, another replica's advertised MCP endpoint: its replica id, or None when
        nothing answers there within ``timeout`` (a process killed, stopped, frozen), or a replica that is
        draining. The liveness evidence a takeover needs besides a lapsed lease (``http/route.py``)."""
        assert self._session is not None, "Hop.start() was not awaited"
        try:
            async with asyncio.timeout(timeout):
                async with self._session.get(
                    url,
                    headers={PROBE_HEADER: "1", HOP_HEADER: self.replica_id},
                    allow_redirects=False,
                    skip_auto_headers=_NO_AUTO_HEADERS,
                ) as answer:
                    if answer.status != 204:
                        return None
                    return answer.headers.get(REPLICA_HEADER)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def forward(
        self, request: web.Request, body: bytes, url: str, request_id: Any = None
    ) -> web.StreamResponse:
        """Forward ``request`` (its ``body`` already read) to ``url``, the owner's MCP endpoint from the
        registry, and stream the answer back. An owner that cannot be reached, or sends no answer head
        within ``first_byte_timeout``, is 502 ``owner_unreachable`` (``request_id``: the id in its body).

        The drain ends an answer being relayed cleanly (``Drain.interruptible``); before the answer's head,
        the caller's ``Drain.upstream_wait`` makes it 503."""
        assert self._session is not None, "Hop.start() was not awaited"
        target = URL(url)
        query = request.rel_url.raw_query_string  # as the client sent it: never decoded and encoded again
        if query:
            target = URL(f"{target}?{query}", encoded=True)
        try:
            async with asyncio.timeout(self.first_byte_timeout):
                answer = await self._session.request(
                    request.method,
                    target,
                    headers=self.tracing.inject(hop_headers(request, self.replica_id)),
                    data=body,
                    allow_redirects=False,
                    skip_auto_headers=_NO_AUTO_HEADERS,
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._outcomes[HopOutcome.OWNER_UNREACHABLE].inc()
            what = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return self.reject(
                request,
                OwnerUnreachable(f"the replica that owns this session did not answer ({what})"),
                request_id,
            )
        outcome = HopOutcome.CLIENT_GONE  # unless the relay below says otherwise
        try:
            response = web.StreamResponse(status=answer.status, reason=answer.reason)
            for name, value in end_to_end(answer.headers.items(), request=False):
                response.headers.add(name, value)
            if answer.content_length is not None:
                response.content_length = answer.content_length  # bytes as they came: the same length
            try:
                await response.prepare(request)
            except (aiohttp.ClientError, OSError):  # the client's connection is gone
                return response
            try:
                with self.drain.interruptible(request.method == "GET"):  # a GET stream may never end
                    outcome = await self._relay(request, response, answer)
            except Interrupted:
                # The drain ends a relayed stream as it ends a view: the hop first, then the client's
                # response, cleanly; it re-attaches elsewhere.
                outcome = HopOutcome.DRAINED
                answer.close()
                await end_for_drain(request, response)
            return response
        finally:
            self._outcomes[outcome].inc()
            if outcome is HopOutcome.RELAYED:
                answer.release()
            else:
                answer.close()  # the hop's connection goes: the owner sees its client leave

    async def _relay(
        self, request: web.Request, response: web.StreamResponse, answer: aiohttp.ClientResponse
    ) -> HopOutcome:
        """The owner's body to the client, each chunk as it arrives; how that ended."""
        while True:
            try:
                chunk = await answer.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                log.info("hop to %s ended early: %s", answer.url.origin(), type(exc).__name__)
                return HopOutcome.OWNER_BROKE  # the client's stream ends: an SSE client re-attaches
            if not chunk:
                break
            try:
                async with asyncio.timeout(self.stall_timeout):
                    await response.write(chunk)
            except TimeoutError:  # the client took nothing for stall_timeout: cut it off
                if request.transport is not None:
                    request.transport.abort()
                return HopOutcome.CLIENT_GONE
            except (aiohttp.ClientError, OSError):  # the client's connection is gone
                return HopOutcome.CLIENT_GONE
        try:
            await response.write_eof()
        except (aiohttp.ClientError, OSError):
            return HopOutcome.CLIENT_GONE
        return HopOutcome.RELAYED
