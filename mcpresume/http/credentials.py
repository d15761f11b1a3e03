"""Serving a session's events only to requests whose credentials the upstream accepted for it.

``core.credentials.access`` decides (pure); this module does what it decided: nothing for ``OPEN`` and
``ALLOW``; for ``VERIFY``, a JSON-RPC ``ping`` forwarded in the session with the request's credentials.
A 2xx answer carrying the ping's result accepts them (remembered, so the next request with them is not
asked about); anything else is the refusal, with the upstream's status and ``WWW-Authenticate``, and
nothing of the session in it. A request's credentials are its ``credential_headers`` (settings) and its
query string.

A request whose credentials are the newest the upstream accepted in the session (``core.credentials.newest``)
hands them to the session's pumps in this process (``Pumps.refresh_credentials``): a stream is resumed
upstream with the freshest credentials its client presented, not forever with those that opened it. Only
this process keeps them, beside its pumps; the store holds what it held before (digests, and a live
stream's record with the credentials that opened it).

A request's credentials are read from its headers once (``presented_by``), the first time a check needs
them, and kept on the request: a POST in a session is checked (``authorize``), may be trusted on a 404, have
its protocol revision remembered and its stream's resume headers recorded, all with the one reading.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
import orjson
from aiohttp import web

from mcpresume.core.bridge import discover_request
from mcpresume.core.credentials import (
    QUERY_FIELD,
    Access,
    PingAnswer,
    access,
    credential_digest,
    credential_fields,
    newest,
    ping_body,
)
from mcpresume.core.era import MODERN_VERSION
from mcpresume.core.errors import (
    CredentialsRefused,
    ProxyError,
    SessionGone,
    UnknownSession,
    UpstreamBadResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mcpresume.core.headers import PROTOCOL_VERSION_HEADER, SESSION_HEADER
from mcpresume.core.jsonrpc import MODERN_VERSIONS, proxy_request_id
from mcpresume.core.session import SessionAccess
from mcpresume.http import reinit
from mcpresume.http.context import ProxyContext
from mcpresume.http.forward import upstream_headers
from mcpresume.process.logs import log_id

log = logging.getLogger("mcpresume.proxy")

# Set on a request of a bridged session (http/bridge.py): its credentials are checked with a 2026-07-28
# server/discover, not a ping in a session the upstream does not have.
MODERN_CHECK: Final = web.RequestKey("mcpresume_modern_check", bool)

# Of the client's headers, those a ping carries besides its credentials: what the upstream's own checks of
# any request read (Origin and Host for DNS rebinding, the X-Forwarded-* this hop adds).
_PING_KEEPS = frozenset(
    {"origin", "host", "user-agent", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}
)


@dataclass(frozen=True, slots=True)
class Presented:
    """The credentials a request carries: its credential headers (``credential_headers``) as they came, and
    the digest of those and of its query string (an API key in the endpoint's URL); ``bound``: whether
    there are any (a session a request without any begins is bound to none)."""

    headers: tuple[tuple[str, str], ...]
    digest: bytes
    bound: bool


# A request's credentials as read the first time a check needed them (``presented_by``).
PRESENTED: Final = web.RequestKey("mcpresume_presented", Presented)


def presented_by(ctx: ProxyContext, request: web.Request) -> Presented:
    """The request's credentials, read from its headers once per request and kept on it."""
    known = request.get(PRESENTED)
    if known is None:
        headers = credential_fields(request.headers, ctx.settings.credential_headers)
        fields = headers
        query = request.rel_url.raw_query_string
        if query and ctx.settings.credential_headers:  # [] turns the binding off, the query's too
            fields += ((QUERY_FIELD, query),)
        known = request[PRESENTED] = Presented(headers, credential_digest(fields), bool(fields))
    return known


def credential_headers_of(ctx: ProxyContext, request: web.Request) -> tuple[tuple[str, str], ...]:
    """The request's credential headers (``credential_headers``), as they came."""
    return presented_by(ctx, request).headers


# A live stream keeps its pump record as long as it lives (a standalone stream: as long as its session): one
# (header, value) pair per known revision for every record, not a pair and a header value string each.
_VERSION_HEADERS: Final = {
    v: (PROTOCOL_VERSION_HEADER, v) for v in ("2025-03-26", "2025-06-18", "2025-11-25", *MODERN_VERSIONS)
}


def resume_headers(
    ctx: ProxyContext, request: web.Request, session_id: str, version: str | None
) -> tuple[tuple[str, str], ...]:
    """The headers with which a resume GET speaks for the client of this request: its session, protocol
    revision (``version``, its ``MCP-Protocol-Version``) and credentials."""
    # The upstream's own id of a session begun again there (upstream_session_lost = "reinitialize").
    headers = [(SESSION_HEADER, ctx.upstream.aliases.get(session_id, session_id))]
    if version is not None:
        headers.append(_VERSION_HEADERS.get(version) or (PROTOCOL_VERSION_HEADER, version))
    headers += credential_headers_of(ctx, request)
    return tuple(headers)


def presented(ctx: ProxyContext, request: web.Request) -> bytes:
    """The digest of the credentials a request carries."""
    return presented_by(ctx, request).digest


def begins_with(ctx: ProxyContext, request: web.Request) -> bytes | None:
    """What a session that this request begins is bound to: its credentials' digest, None without any."""
    known = presented_by(ctx, request)
    return known.digest if known.bound else None


def trusted(ctx: ProxyContext, request: web.Request, granted: SessionAccess) -> bool:
    """Whether the request's credentials are ones the upstream accepted in the session (or none are bound):
    only then does an upstream 404 to it end the session for everyone (an upstream may answer 404 to a
    session id of another user)."""
    return access(granted.credentials, presented(ctx, request)) is not Access.VERIFY


def refused(
    ctx: ProxyContext, request: web.Request, error: ProxyError, request_id: str | int | None
) -> web.Response:
    """The answer to a request the check refused (or could not make): a refusal carries the upstream's
    ``WWW-Authenticate`` values as they came."""
    response = ctx.reject(request, error, request_id)
    if isinstance(error, CredentialsRefused):
        for value in error.challenges:
            response.headers.add("WWW-Authenticate", value)
    return response


async def authorize(
    ctx: ProxyContext,
    request: web.Request,
    session_id: str,
    granted: SessionAccess,
    request_id: str | int | None = None,
) -> web.Response | None:
    """None when the request may be served from the session's window; else the answer refusing it."""
    digest = presented(ctx, request)
    decided = access(granted.credentials, digest)
    if decided is Access.VERIFY:
        try:
            await _verify(ctx, request, session_id, granted, digest)
        except ProxyError as error:
            return refused(ctx, request, error, request_id)
    # Accepted: the newest the upstream accepted (just now, after a ping) go to the session's pumps here.
    if ctx.pumps.pumping(session_id) and (decided is Access.VERIFY or newest(granted.credentials, digest)):
        resume = resume_headers(ctx, request, session_id, request.headers.get(PROTOCOL_VERSION_HEADER))
        ctx.pumps.refresh_credentials(session_id, request.path_qs, resume)
    return None


# A 2026-07-28 upstream has no sessions and no ping: a server/discover with the request's credentials asks it
# instead (an authenticating server checks every request).
_DISCOVER_HEADERS: Final = ((PROTOCOL_VERSION_HEADER, MODERN_VERSION), ("Mcp-Method", "server/discover"))


def _check_headers(ctx: ProxyContext, request: web.Request) -> list[tuple[str, str]]:
    """What the proxy's own check carries of the request: its credentials, and what the upstream's own
    checks of any request read (``_PING_KEEPS``)."""
    keep = _PING_KEEPS.union(ctx.settings.credential_headers)
    headers = [(n, v) for n, v in upstream_headers(request) if n.lower() in keep]
    return [*headers, ("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")]


async def _verify(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess, digest: bytes
) -> None:
    """Ask the upstream whether these credentials may use the session; raises the refusal."""
    reinit.learn(ctx, session_id, granted)  # a session begun again upstream: the ping goes to the new one
    ping_id = proxy_request_id("ping", secrets.token_hex(8))
    headers = _check_headers(ctx, request)
    if request.get(MODERN_CHECK):
        # A bridged session (http/bridge.py): the upstream has no sessions and no ping.
        headers += _DISCOVER_HEADERS
        body = orjson.dumps(discover_request(ping_id))
    else:
        headers.append((SESSION_HEADER, session_id))
        body = ping_body(ping_id)
        if granted.protocol_version is not None:
            headers.append((PROTOCOL_VERSION_HEADER, granted.protocol_version))
    accepted, status, challenges = await _ask(ctx, request, headers, body, ping_id)
    if accepted:
        log.info("session %s: the upstream accepted other credentials for it", log_id(session_id))
        await ctx.store.accept_credential(session_id, granted.epoch, digest, granted.protocol_version)
        return
    if status == 404:
        raise UnknownSession(SessionGone.UPSTREAM_FORGOT)
    raise _refusal(status, challenges, "for this session")


async def verify_modern(ctx: ProxyContext, request: web.Request) -> None:
    """Ask a 2026-07-28 upstream whether it accepts the request's credentials, as it would were the request
    forwarded: a ``server/discover`` with them (a task's poll, answered from the store: ``http/tasks.py``).
    Raises the refusal: ``CredentialsRefused`` with the upstream's status and challenges, 502 for a 5xx."""
    probe_id = proxy_request_id("ping", secrets.token_hex(8))
    headers = [*_check_headers(ctx, request), *_DISCOVER_HEADERS]
    body = orjson.dumps(discover_request(probe_id))
    accepted, status, challenges = await _ask(ctx, request, headers, body, probe_id)
    if not accepted:
        raise _refusal(status, challenges, "")


def _refusal(status: int, challenges: tuple[str, ...], where: str) -> ProxyError:
    if status >= 500:  # the upstream is in trouble: not a verdict on the credentials
        return UpstreamBadResponse(
            f"the upstream answered the credentials check with {status}", status=status
        )
    return CredentialsRefused(
        f"the upstream did not accept these credentials{' ' + where if where else ''} (it answered {status})",
        status=status if 400 <= status < 500 else 403,
        challenges=challenges,
    )


async def _ask(
    ctx: ProxyContext, request: web.Request, headers: list[tuple[str, str]], body: bytes, ping_id: str
) -> tuple[bool, int, tuple[str, ...]]:
    """Send the proxy's check (a ping, or a server/discover) to the endpoint as the client named it (its
    query string too): whether it was answered, the status, the upstream's ``WWW-Authenticate`` values."""
    with ctx.drain.upstream_wait():
        upstream = await ctx.upstream.request("POST", request.path_qs, headers, body, decoded=True)
    try:
        status = upstream.status
        answer = PingAnswer(status, upstream.content_type, ping_id)
        try:
            async with asyncio.timeout(ctx.settings.first_byte_timeout):
                while not answer.done:  # a refusal's body is not read
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    answer.feed(chunk)
        except TimeoutError:
            raise UpstreamTimeout(
                "the upstream did not answer the credentials check in time",
                timeout=ctx.settings.first_byte_timeout,
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(
                f"the upstream's answer to the credentials check failed: {type(exc).__name__}"
            ) from None
        challenges = tuple(upstream.headers.getall("WWW-Authenticate", ()))
    finally:
        upstream.release()
    return answer.end(), status, challenges


async def upstream_knows(ctx: ProxyContext, path_qs: str, headers: Sequence[tuple[str, str]]) -> bool:
    """Whether the upstream knows the session ``headers`` name (a ping in it is not answered 404): after a
    takeover, this replica's upstream may never have seen it (the sidecar layout). ``headers``: a stream's
    resume headers (its session id, protocol revision, the client's credentials)."""
    ping = [*headers, ("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")]
    # An id of its own each time, unmistakably the proxy's: however the upstream answers it (on this
    # response, or on another stream of the session when this one is gone), no client gets the answer.
    probe = ping_body(proxy_request_id("probe", secrets.token_hex(8)))
    try:
        upstream = await ctx.upstream.request("POST", path_qs, ping, probe, decoded=True)
    except ProxyError:
        return True  # not a verdict: the session is left as it is
    upstream.release()
    return upstream.status != 404


async def remember_version(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess, version: str | None
) -> None:
    """The upstream answered a request of the session with a 2xx: the ``MCP-Protocol-Version`` it carried
    (``version``) is the one a ping in the session is sent with. Its credentials are not remembered from this
    (a 2xx is not always acceptance: see core/credentials.py), only when they are ones accepted there
    already."""
    if version is None or version == granted.protocol_version or not granted.credentials:
        return  # the common case: what the session holds already (no store call); or no ping is ever sent
    digest = presented(ctx, request)
    if access(granted.credentials, digest) is Access.ALLOW:
        await ctx.store.accept_credential(session_id, granted.epoch, digest, version)
