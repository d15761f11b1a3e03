"""Which requests may be served a session's events from the window (pure).

Theory of operation
-------------------
The spec says servers must not use sessions for authentication. A proxy that answers from its window
(a re-attach's history and live events, a re-sent request's answer, the facts a 409 names, a second view
of the standalone stream) answers without the upstream seeing the request, so it must not make the
session id a bearer credential: it serves only requests whose credentials the upstream accepted for that
session.

A session remembers, hashed, the ``Authorization`` values the upstream accepted in it (a 2xx answer to a
request of the session carrying it), the last ``MAX_CREDENTIALS`` of them (tokens are refreshed). A plain
SHA-256 digest: the same on every replica, so a shared store can hold it, and a token is never kept in the
clear. ``access`` then decides, for the credentials a request presents:

=========================================  ==========  ================================================
stored digests                             presented   outcome
=========================================  ==========  ================================================
none (the session began without one)       anything    ``OPEN``: served, as without this check
some                                       one of them ``ALLOW``: served
some                                       another     ``VERIFY``: ask the upstream first (the shell
                                                       forwards a JSON-RPC ``ping`` in the session with
                                                       these credentials; a 2xx with a result accepts
                                                       them, anything else is the refusal)
=========================================  ==========  ================================================

Digests are compared with ``hmac.compare_digest`` (constant time), every stored one each time.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson

from mcpresume.errors import EventTooLarge
from mcpresume.sse import SSEParser

# Digests a session keeps: a refreshed token is normal, so a few recent ones are accepted; older ones are
# forgotten (a request with one is verified with the upstream again, not refused).
MAX_CREDENTIALS: Final = 4

# The most of a ping's answer that is read: a ping's result is ``{}``; anything near this is not a ping's.
MAX_PING_ANSWER: Final = 64 * 1024

# What a request without ``Authorization`` presents (distinct from every header value's digest).
_NO_AUTHORIZATION: Final = hashlib.sha256(b"mcpresume: no Authorization").digest()


class Access(enum.Enum):
    OPEN = "open"  # the session has no credentials bound: served as any request of it
    ALLOW = "allow"  # the credentials are ones the upstream accepted in this session
    VERIFY = "verify"  # other credentials, or none: ask the upstream before serving anything


def credential_digest(authorization: Sequence[str]) -> bytes:
    """The digest of a request's ``Authorization`` values (every one, in order; none is its own value)."""
    if not authorization:
        return _NO_AUTHORIZATION
    joined = "\n".join(authorization).encode("utf-8", "surrogateescape")
    return hashlib.sha256(b"Authorization: " + joined).digest()


def access(stored: Iterable[bytes], presented: bytes) -> Access:
    """The decision table above."""
    found = False
    seen = False
    for digest in stored:
        seen = True
        found |= hmac.compare_digest(digest, presented)  # no early exit: every stored one is compared
    if not seen:
        return Access.OPEN
    return Access.ALLOW if found else Access.VERIFY


def remember(stored: tuple[bytes, ...], digest: bytes) -> tuple[bytes, ...]:
    """The digests after the upstream accepted ``digest``: it becomes the newest; at most MAX_CREDENTIALS.
    A session without credentials stays without (``OPEN``): only its beginning binds it."""
    if not stored:
        return stored
    if hmac.compare_digest(stored[-1], digest):
        return stored  # the common case: the same token again, nothing changes
    kept = tuple(d for d in stored if not hmac.compare_digest(d, digest))
    return (*kept, digest)[-MAX_CREDENTIALS:]


def ping_body(ping_id: str) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": ping_id, "method": "ping"})


def ping_accepted(status: int, content_type: str, body: bytes, ping_id: str) -> bool:
    """Whether the upstream's answer to the proxy's ping is a 2xx carrying the ping's JSON-RPC result (as
    ``application/json``, or as an event of a ``text/event-stream``)."""
    if not 200 <= status < 300:
        return False
    if content_type == "application/json":
        return _is_result(body, ping_id)
    if content_type == "text/event-stream":
        try:
            parser = SSEParser(MAX_PING_ANSWER)
            events = [*parser.feed(body)]
            parser.close()
        except EventTooLarge:  # not a ping's answer
            return False
        return any(_is_result(event.data, ping_id) for event in events if event.data)
    return False


def _is_result(data: bytes, ping_id: str) -> bool:
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and doc.get("id") == ping_id and "result" in doc and "error" not in doc
