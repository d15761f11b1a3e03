"""Serving a session's events only to requests whose credentials the upstream accepted for it.

``credentials.access`` decides (pure); this module does what it decided: nothing for ``OPEN`` and
``ALLOW``; for ``VERIFY``, a JSON-RPC ``ping`` forwarded in the session with the request's credentials.
A 2xx answer carrying the ping's result accepts them (remembered, so the next request with them is not
asked about); anything else is the refusal, with the upstream's status and ``WWW-Authenticate``, and
nothing of the session in it. ``remember_accepted`` records the credentials of every request of the
session the upstream answered with a 2xx.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets

import aiohttp
from aiohttp import web

from mcpresume.context import ProxyContext, log_id
from mcpresume.credentials import (
    MAX_PING_ANSWER,
    Access,
    access,
    credential_digest,
    ping_accepted,
    ping_body,
)
from mcpresume.errors import (
    CredentialsRefused,
    ProxyError,
    UnknownSession,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mcpresume.forward import upstream_headers
from mcpresume.headers import PROTOCOL_VERSION_HEADER, SESSION_HEADER
from mcpresume.session import SessionAccess

log = logging.getLogger("mcpresume.proxy")

_AUTHORIZATION = "Authorization"
# Of the client's headers, those a ping carries: its credentials, and what the upstream's own checks of
# any request read (Origin and Host for DNS rebinding, the X-Forwarded-* this hop adds).
_PING_KEEPS = frozenset(
    {
        "authorization",
        "origin",
        "host",
        "user-agent",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
    }
)


def presented(request: web.Request) -> bytes:
    """The digest of the credentials a request carries."""
    return credential_digest(request.headers.getall(_AUTHORIZATION, ()))


def begins_with(request: web.Request) -> bytes | None:
    """What a session that this request begins is bound to: its credentials' digest, None without any."""
    return presented(request) if _AUTHORIZATION in request.headers else None


def trusted(request: web.Request, granted: SessionAccess) -> bool:
    """Whether the request's credentials are ones the upstream accepted in the session (or none are bound):
    only then does an upstream 404 to it end the session for everyone (an upstream may answer 404 to a
    session id of another user)."""
    return access(granted.credentials, presented(request)) is not Access.VERIFY


async def authorize(
    ctx: ProxyContext,
    request: web.Request,
    session_id: str,
    granted: SessionAccess,
    request_id: str | int | None = None,
) -> web.Response | None:
    """None when the request may be served from the session's window; else the answer refusing it."""
    digest = presented(request)
    if access(granted.credentials, digest) is not Access.VERIFY:
        return None
    try:
        await _verify(ctx, request, session_id, granted, digest)
    except CredentialsRefused as refusal:
        response = ctx.reject(request, refusal, request_id)
        for value in refusal.challenges:
            response.headers.add("WWW-Authenticate", value)
        return response
    except ProxyError as error:
        return ctx.reject(request, error, request_id)
    return None


async def _verify(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess, digest: bytes
) -> None:
    """Ask the upstream whether these credentials may use the session; raises the refusal."""
    ping_id = f"mcpresume-ping-{secrets.token_hex(8)}"
    headers = [(n, v) for n, v in upstream_headers(request) if n.lower() in _PING_KEEPS]
    headers += [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        (SESSION_HEADER, session_id),
    ]
    if granted.protocol_version is not None:
        headers.append((PROTOCOL_VERSION_HEADER, granted.protocol_version))
    with ctx.upstream_wait():  # to the endpoint as the client named it (its query string too)
        upstream = await ctx.upstream.request(
            "POST", request.path_qs, headers, ping_body(ping_id), decoded=True
        )
    try:
        status, content_type = upstream.status, upstream.content_type
        answer = bytearray()
        if 200 <= status < 300:
            try:
                async with asyncio.timeout(ctx.settings.first_byte_timeout):
                    async for chunk in upstream.content.iter_any():
                        answer += chunk
                        if len(answer) > MAX_PING_ANSWER or ping_accepted(
                            status, content_type, bytes(answer), ping_id
                        ):
                            break  # an SSE answer may stay open after its response
            except TimeoutError:
                raise UpstreamTimeout(
                    "the upstream did not answer a ping in the session in time",
                    timeout=ctx.settings.first_byte_timeout,
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamUnreachable(
                    f"the upstream's answer to a ping failed: {type(exc).__name__}"
                ) from None
        challenges = tuple(upstream.headers.getall("WWW-Authenticate", ()))
    finally:
        upstream.release()
    if ping_accepted(status, content_type, bytes(answer), ping_id):
        log.info("session %s: the upstream accepted other credentials for it", log_id(session_id))
        await ctx.store.accept_credential(session_id, granted.epoch, digest, granted.protocol_version)
        return
    if status == 404:
        raise UnknownSession("the upstream does not know this session (for these credentials)")
    raise CredentialsRefused(
        f"the upstream did not accept these credentials for this session (it answered {status})",
        status=status if 400 <= status < 600 else 403,
        challenges=challenges,
    )


async def remember_accepted(
    ctx: ProxyContext, request: web.Request, session_id: str, granted: SessionAccess
) -> None:
    """The upstream answered a request of the session with a 2xx: its credentials are accepted there."""
    if not granted.credentials:
        return  # the session began without credentials: nothing is bound
    digest = presented(request)
    version = request.headers.get(PROTOCOL_VERSION_HEADER)
    if hmac.compare_digest(granted.credentials[-1], digest) and version in (None, granted.protocol_version):
        return  # the common case: what the session holds already (no store call)
    await ctx.store.accept_credential(session_id, granted.epoch, digest, version)
