"""Which requests may be served a session's events from the window (pure).

Theory of operation
-------------------
The spec says servers must not use sessions for authentication. A proxy that answers from its window
(a re-attach's history and live events, a re-sent request's answer, the facts a 409 names, a second view
of the standalone stream) answers without the upstream seeing the request, so it must not make the
session id a bearer credential: it serves only requests whose credentials the upstream accepted for that
session.

A request's credentials are the values of the headers that carry them (the ``credential_headers``
setting: ``Authorization``, ``Cookie`` and ``X-API-Key`` by default) and its query string, taken
together. A session remembers,
hashed, the credentials the upstream accepted in it: those of the request that began it, and those a ping
was answered for (below); the last ``MAX_CREDENTIALS`` of them (tokens are refreshed). Not those of any
other 2xx answer: an upstream that checks its caller in the JSON-RPC layer answers anyone's notification
202. A plain SHA-256 digest: the same on every replica, so a shared store can hold it, and a token is
never kept in the clear. ``access`` then decides, for the credentials a request presents:

=========================================  ==========  ================================================
stored digests                             presented   outcome
=========================================  ==========  ================================================
none (the session began without any)       anything    ``OPEN``: served, as without this check
some                                       one of them ``ALLOW``: served
some                                       another     ``VERIFY``: ask the upstream first (the shell
                                                       forwards a JSON-RPC ``ping`` in the session with
                                                       these credentials; a 2xx with a result accepts
                                                       them, anything else is the refusal)
=========================================  ==========  ================================================

Digests are compared with ``hmac.compare_digest`` (constant time), every stored one each time.

A stream the proxy resumes upstream (``streams.pump``) speaks for the client with the credentials of the
request that opened it, until a request of the session presents the ``newest`` credentials the upstream
accepted there: from then on with those (kept by this process only, with its pumps: the shared store holds
digests, and a live stream's record the credentials it was opened with, no more).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol

import orjson

from mcpresume.core.errors import EventTooLarge
from mcpresume.core.sse import SSEParser

# The headers that carry credentials unless configured otherwise: the spec's (``Authorization``), and what
# upstreams that authenticate otherwise use (a session cookie, an API key header).
DEFAULT_CREDENTIAL_HEADERS: Final = ("authorization", "cookie", "x-api-key")

# The field a request target's query string counts as, when it has one (hosted servers take API keys in
# the endpoint's URL). Not a header name: "?" is not a token character (RFC 9110 section 5.6.2).
QUERY_FIELD: Final = "?"

# Digests a session keeps: a refreshed token is normal, so a few recent ones are accepted; older ones are
# forgotten (a request with one is verified with the upstream again, not refused).
MAX_CREDENTIALS: Final = 4

# The most of a ping's answer that is read: a ping's result is ``{}``; anything near this is not a ping's.
MAX_PING_ANSWER: Final = 64 * 1024

# What a request without any credential header presents (distinct from the digest of any header's value).
_NO_CREDENTIALS: Final = hashlib.sha256(b"mcpresume: no credentials").digest()


class Access(enum.Enum):
    OPEN = "open"  # the session has no credentials bound: served as any request of it
    ALLOW = "allow"  # the credentials are ones the upstream accepted in this session
    VERIFY = "verify"  # other credentials, or none: ask the upstream before serving anything


class HeaderLookup(Protocol):
    """A request's headers, looked up by name case-insensitively (aiohttp's ``CIMultiDictProxy``)."""

    def getall(self, key: str, default: tuple[()], /) -> list[str] | tuple[()]: ...


def credential_fields(headers: HeaderLookup, names: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The credential headers of a request: (name, value) for each of ``names`` (in lower case) in that
    order, each header's values in the order they came. One lookup per name: a request's other headers are
    never looked at."""
    return tuple((name, value) for name in names for value in headers.getall(name, ()))


def credential_digest(fields: Sequence[tuple[str, str]]) -> bytes:
    """The digest of a request's credentials (``credential_fields``; none is a value of its own). A name
    holds no ``:`` and a value no line break, so ``name: value`` lines are one unambiguous encoding."""
    if not fields:
        return _NO_CREDENTIALS
    lines = "".join(f"{name}: {value}\n" for name, value in fields)
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).digest()


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


def newest(stored: Sequence[bytes], presented: bytes) -> bool:
    """Whether ``presented`` is the newest of the credentials the upstream accepted in the session (the last
    one ``remember`` kept): what the session's pumps resume its upstream streams with from now on. Not an
    older one still accepted (a client retrying with the token it refreshed away from)."""
    return bool(stored) and hmac.compare_digest(stored[-1], presented)


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


class PingAnswer:
    """The upstream's answer to the proxy's ping, read chunk by chunk: accepted when it is a 2xx carrying
    the ping's JSON-RPC result (as ``application/json``, or as an event of a ``text/event-stream``)."""

    def __init__(self, status: int, content_type: str, ping_id: str) -> None:
        self.ping_id = ping_id
        self.accepted = False
        self.size = 0
        self.json = bytearray() if content_type == "application/json" else None
        self.sse = SSEParser(MAX_PING_ANSWER) if content_type == "text/event-stream" else None
        # Nothing to read of a refusal, or of an answer that is neither.
        self.done = not 200 <= status < 300 or (self.json is None and self.sse is None)

    def feed(self, chunk: bytes) -> bool:
        """Take the next chunk of the body; True once the rest is not needed: the answer is found (an SSE
        answer may stay open after it), or more than MAX_PING_ANSWER came without it."""
        if self.done:
            return True
        self.size += len(chunk)
        if self.json is not None:
            self.json += chunk
        elif self.sse is not None:
            try:
                self.accepted = any(_is_result(event.data, self.ping_id) for event in self.sse.feed(chunk))
            except EventTooLarge:
                self.size = MAX_PING_ANSWER + 1
        self.done = self.accepted or self.size > MAX_PING_ANSWER
        return self.done

    def end(self) -> bool:
        """The body ended, or the rest is not needed: whether the ping was answered."""
        if self.json is not None and self.size <= MAX_PING_ANSWER:
            self.accepted = _is_result(bytes(self.json), self.ping_id)
        self.done = True
        return self.accepted


def _is_result(data: bytes, ping_id: str) -> bool:
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and doc.get("id") == ping_id and "result" in doc and "error" not in doc
