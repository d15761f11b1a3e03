"""Which headers cross the proxy (pure).

RFC 9110 section 7.6.1: a proxy removes the hop-by-hop fields, and every field named in ``Connection``,
before forwarding a message. Everything else is end-to-end and passes untouched, notably ``Mcp-Session-Id``,
``MCP-Protocol-Version``, ``Authorization`` (sessions MUST NOT be used for authentication, so credentials
go to the upstream as they came), ``Accept``, ``Content-Type``, ``Origin``, ``Last-Event-ID`` and
``WWW-Authenticate``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Final
from urllib.parse import urlsplit, urlunsplit

HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",  # not standard, but sent by old clients; never end-to-end
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Framing is the proxy's own on each side: the body is re-framed (chunked or sized) by the HTTP stack.
_FRAMING: Final = frozenset({"content-length"})
# Set by a replica that forwards a request to the replica owning its session (its value: the forwarding
# replica's id). A request that carries it is never forwarded again (core/route.py).
HOP_HEADER: Final = "Mcp-Resume-Hop"
# A replica's liveness check of another (``replicas/hop.py`` ``Hop.probe``): a request to the MCP endpoint
# that carries it is answered by the proxy itself, 204 with the answering replica's id in REPLICA_HEADER
# (503 while it drains), never forwarded anywhere.
PROBE_HEADER: Final = "Mcp-Resume-Probe"
REPLICA_HEADER: Final = "Mcp-Resume-Replica"

# The proxy connects to the upstream's authority; the client's Host travels as X-Forwarded-Host
# (the same default as nginx's proxy_pass). Expect: the proxy's HTTP server answers 100-continue itself
# before the handler runs, so the body is on its way to the proxy: forwarded, the header would make the
# upstream hop hold the body back for a 100 the upstream may never send.
# The hop header: what arrives under its name is never passed on, to the upstream or to another replica;
# a replica that forwards a request sets its own.
_REQUEST_ONLY_DROPS: Final = frozenset({"host", "expect", HOP_HEADER.lower(), PROBE_HEADER.lower()})

SESSION_HEADER: Final = "Mcp-Session-Id"
PROTOCOL_VERSION_HEADER: Final = "MCP-Protocol-Version"
LAST_EVENT_ID_HEADER: Final = "Last-Event-ID"

SSE_RESPONSE_HEADERS: Final = (
    ("Content-Type", "text/event-stream"),
    ("Cache-Control", "no-cache"),
    # Tell nginx-style intermediaries not to buffer the stream (it would defeat streaming and resumption).
    ("X-Accel-Buffering", "no"),
)


# What ``end_to_end`` drops of every message, and of a request besides (each name in lower case).
_DROPS: Final = HOP_BY_HOP | _FRAMING
_REQUEST_DROPS: Final = _DROPS | _REQUEST_ONLY_DROPS

# The proxy re-frames the events it reads: the upstream must send them as they are (``asking_identity``).
IDENTITY: Final = ("Accept-Encoding", "identity")

# Each message's header names are lowercased once (``_lowered``), and every decision about the message is
# made on that one list: a short call's request and answer each cross several of these filters, and
# lowercasing the names again in each would be most of what they cost.


def _lowered(items: Sequence[tuple[str, str]]) -> list[str]:
    return [name.lower() for name, _ in items]


def _connection_tokens(items: Sequence[tuple[str, str]], lowered: Sequence[str]) -> set[str]:
    tokens: set[str] = set()
    for name, (_, value) in zip(lowered, items, strict=False):
        if name == "connection":
            tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def _drops(items: Sequence[tuple[str, str]], lowered: Sequence[str], drop: frozenset[str]) -> frozenset[str]:
    """``drop`` and the fields the message's ``Connection`` names (RFC 9110 section 7.6.1)."""
    if "connection" in lowered:
        return drop | _connection_tokens(items, lowered)
    return drop


def _kept(
    items: Sequence[tuple[str, str]], lowered: Sequence[str], drop: frozenset[str]
) -> list[tuple[str, str]]:
    return [item for name, item in zip(lowered, items, strict=False) if name not in drop]


def end_to_end(headers: Iterable[tuple[str, str]], *, request: bool) -> list[tuple[str, str]]:
    """The end-to-end subset of ``headers`` (names keep their case; repeated fields keep their order)."""
    items = list(headers)
    lowered = _lowered(items)
    return _kept(items, lowered, _drops(items, lowered, _REQUEST_DROPS if request else _DROPS))


_LOCATIONS: Final = frozenset({"location", "content-location"})
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int] | None:
    """scheme, host and port (the scheme's default when absent) of an absolute http(s) URL, else None."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a port that is not a number, a bracket left open
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def rewrite_locations(headers: list[tuple[str, str]], upstream_origin: str) -> list[tuple[str, str]]:
    """``Location`` and ``Content-Location`` values that point at the upstream's origin, made references
    to the same path on the proxy (as nginx's ``proxy_redirect default``): the client resolves them against
    the URL it asked, the proxy's, so a redirect never hands it the upstream's address. The proxy serves
    every path of the upstream's origin as it is, so only the origin goes. Other values are untouched."""
    if not any(name.lower() in _LOCATIONS for name, _ in headers):
        return headers  # almost every answer: nothing to parse, not even the upstream's origin
    upstream = _origin(upstream_origin)
    result = []
    for name, value in headers:
        if name.lower() in _LOCATIONS and upstream is not None and _origin(value) == upstream:
            parts = urlsplit(value.strip())
            value = urlunsplit(("", "", parts.path or "/", parts.query, parts.fragment))
        result.append((name, value))
    return result


# What a client gets of an answer the proxy read decoded (``Upstream.request(decoded=True)``): not its
# ``Content-Encoding``, which the proxy did not apply; of an SSE answer, not the SSE headers either, which
# the proxy sets itself (``SSE_RESPONSE_HEADERS``).
_DECODED_DROPS: Final = _DROPS | {"content-encoding"}
_SSE_DROPS: Final = _DECODED_DROPS | {name.lower() for name, _ in SSE_RESPONSE_HEADERS}


def _answer(
    headers: Iterable[tuple[str, str]], upstream_origin: str, drop: frozenset[str]
) -> list[tuple[str, str]]:
    items = list(headers)
    lowered = _lowered(items)
    kept = _kept(items, lowered, _drops(items, lowered, drop))
    if "location" in lowered or "content-location" in lowered:
        return rewrite_locations(kept, upstream_origin)
    return kept  # almost every answer: nothing to parse, not even the upstream's origin


def answer_headers(
    headers: Iterable[tuple[str, str]], upstream_origin: str, *, decoded: bool
) -> list[tuple[str, str]]:
    """An upstream answer's headers as the client gets them: ``rewrite_locations`` of ``end_to_end``'s
    (``request=False``); ``decoded``: the body was read uncompressed, its ``Content-Encoding`` dropped."""
    return _answer(headers, upstream_origin, _DECODED_DROPS if decoded else _DROPS)


def sse_answer_headers(headers: Iterable[tuple[str, str]], upstream_origin: str) -> list[tuple[str, str]]:
    """``answer_headers(decoded=True)`` of an SSE answer the proxy relays with ``SSE_RESPONSE_HEADERS`` of
    its own: the upstream's fields of those names dropped too (the caller adds the proxy's)."""
    return _answer(headers, upstream_origin, _SSE_DROPS)


def forwarded(
    headers: list[tuple[str, str]], *, client_ip: str | None, proto: str, host: str | None
) -> list[tuple[str, str]]:
    """Add ``X-Forwarded-For/-Proto/-Host``.

    ``X-Forwarded-For`` appends this hop's client to the chain a load balancer in front may have started;
    ``-Proto`` and ``-Host`` set by that load balancer describe the original request better than we can,
    so they are kept when present.
    """
    return _forwarded(headers, _lowered(headers), frozenset(), client_ip=client_ip, proto=proto, host=host)


def _forwarded(
    items: Sequence[tuple[str, str]],
    lowered: Sequence[str],
    drop: frozenset[str],
    *,
    client_ip: str | None,
    proto: str,
    host: str | None,
) -> list[tuple[str, str]]:
    """``forwarded`` of the fields of ``items`` not named in ``drop`` (``lowered``: their names in lower
    case)."""
    prior: list[str] = []
    if "x-forwarded-for" in lowered and "x-forwarded-for" not in drop:
        prior = [value for name, (_, value) in zip(lowered, items, strict=False) if name == "x-forwarded-for"]
        drop = drop | {"x-forwarded-for"}
    result = _kept(items, lowered, drop) if drop else list(items)
    chain = ", ".join([*prior, client_ip] if client_ip else prior)
    if chain:
        result.append(("X-Forwarded-For", chain))
    if "x-forwarded-proto" in drop or "x-forwarded-proto" not in lowered:
        result.append(("X-Forwarded-Proto", proto))
    if host and ("x-forwarded-host" in drop or "x-forwarded-host" not in lowered):
        result.append(("X-Forwarded-Host", host))
    return result


def request_headers(
    headers: Iterable[tuple[str, str]], *, client_ip: str | None, proto: str, host: str | None
) -> list[tuple[str, str]]:
    """A client's request headers as the upstream gets them: ``forwarded`` of ``end_to_end``'s
    (``request=True``)."""
    items = list(headers)
    lowered = _lowered(items)
    drop = _drops(items, lowered, _REQUEST_DROPS)
    return _forwarded(items, lowered, drop, client_ip=client_ip, proto=proto, host=host)


class AskingIdentity(tuple[tuple[str, str], ...]):
    """Request headers whose one ``Accept-Encoding`` is ``IDENTITY``, the last field (``asking_identity``,
    ``identity_request_headers``): what a request whose answer the proxy reads is sent with. A tuple, so it
    stays so: a request made of it and more fields is another value, which is asked the same of again."""

    __slots__ = ()


def asking_identity(headers: Iterable[tuple[str, str]]) -> AskingIdentity:
    """``headers`` without ``Accept-Encoding``, then ``IDENTITY``."""
    if isinstance(headers, AskingIdentity):
        return headers
    return AskingIdentity([*(item for item in headers if item[0].lower() != "accept-encoding"), IDENTITY])


# A request whose answer the proxy reads: the client's Accept-Encoding is not sent (``IDENTITY`` is).
_IDENTITY_REQUEST_DROPS: Final = _REQUEST_DROPS | {"accept-encoding"}


def identity_request_headers(
    headers: Iterable[tuple[str, str]], *, client_ip: str | None, proto: str, host: str | None
) -> AskingIdentity:
    """``asking_identity(request_headers(...))``, each name lowercased once."""
    items = list(headers)
    lowered = _lowered(items)
    drop = _drops(items, lowered, _IDENTITY_REQUEST_DROPS)
    result = _forwarded(items, lowered, drop, client_ip=client_ip, proto=proto, host=host)
    result.append(IDENTITY)
    return AskingIdentity(result)


# Spec: a session id "MUST only contain visible ASCII characters (ranging from 0x21 to 0x7E)". The length
# bound is ours, one bound for both sides (what a client may send, what an upstream's initialize may issue:
# an id the proxy cannot carry is refused there, http/send.py). Random ids are 32-64 characters, but an
# upstream may issue a signed token (a JWT with a few claims: 300-1,500); 2,048 holds those and stays well
# within the request header limits on the way (max_header_bytes, 16 KiB by default; aiohttp's and Node's
# 8 KiB per field and more in all), while keeping a hostile header out of the store.
MAX_SESSION_ID_LEN: Final = 2048


def valid_session_id(value: str) -> bool:
    return 0 < len(value) <= MAX_SESSION_ID_LEN and visible_ascii(value)


def visible_ascii(value: str) -> bool:
    """Whether every character of ``value`` is visible ASCII (0x21-0x7E): ASCII, printable (0x20-0x7E) and
    no space, three scans in C (a loop over the characters cost ~5 us per request)."""
    return value.isascii() and value.isprintable() and " " not in value


# The host names the MCP SDKs accept in Host when their server listens on loopback (their DNS-rebinding
# protection), on any port: a page of another site that a rebinding DNS name points at 127.0.0.1 sends
# that name in Host, never one of these.
LOOPBACK_HOSTS: Final = ("localhost", "127.0.0.1", "[::1]")
ANY_HOST: Final = "*"
# Any IP address (IPv6 in brackets), on any port. A DNS-rebinding page reaches the proxy under a DNS name of
# its attacker's, and its browser sends that name in Host, never an address: so IP addresses and the
# loopback names are what the proxy accepts by default on a non-loopback address (a name clients use, a
# load balancer's or a Service's, is listed in ``allowed_hosts``). Not a Host value: it matches none.
IP_ADDRESSES: Final = "<any IP address>"


def split_host(value: str) -> tuple[str, str | None]:
    """A Host value's name (lower case; an IPv6 literal keeps its brackets) and its port (None: none)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end >= 0:
            rest = value[end + 1 :]
            return value[: end + 1], rest[1:] if rest.startswith(":") else None
        return value, None
    name, sep, port = value.rpartition(":")
    return (name, port) if sep else (value, None)


def host_allowed(value: str | None, allowed: Sequence[str]) -> bool:
    """Whether a Host value matches one of ``allowed``: the same name, and the same port when the entry
    names one (an entry without a port matches any port); ``*`` matches anything, ``IP_ADDRESSES`` any IP
    address. No Host matches nothing but ``*``."""
    if ANY_HOST in allowed:
        return True
    if value is None:
        return False
    name, port = split_host(value)
    for entry in allowed:
        if entry == IP_ADDRESSES:
            if _ip_address(name):
                return True
            continue
        entry_name, entry_port = split_host(entry)
        if entry_name == name and (entry_port is None or entry_port == port):
            return True
    return False


def _ip_address(name: str) -> bool:
    """Whether a Host's name (``split_host``'s) is an IP address: IPv4, or IPv6 in brackets."""
    if name.startswith("["):
        if not name.endswith("]"):
            return False
        name = name[1:-1]
    elif ":" in name:
        return False  # an IPv6 address in Host is always bracketed (RFC 3986 3.2.2)
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(address: str) -> bool:
    """Whether a listen address is a loopback one (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def effective_allowed_hosts(allowed: Sequence[str], listen: str) -> tuple[str, ...]:
    """The Host values the proxy accepts: ``allowed_hosts`` as set. Unset: the SDKs' loopback rule when the
    proxy listens on loopback; on any other address, that and any IP address (``IP_ADDRESSES``): no DNS
    name. The proxy sends the upstream its own authority, never the client's Host, so an upstream's own
    DNS-rebinding check cannot see the client's: this one is what stands in for it."""
    if allowed:
        return tuple(allowed)
    return LOOPBACK_HOSTS if is_loopback(listen) else (*LOOPBACK_HOSTS, IP_ADDRESSES)


def header_bytes(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The size of a raw header block as sent: ``name: value\r\n`` per field."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


def header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    """The first value of ``name`` (case-insensitive), or None."""
    lowered = name.lower()
    for key, value in headers:
        if key.lower() == lowered:
            return value
    return None
