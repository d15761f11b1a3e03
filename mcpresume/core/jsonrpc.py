"""Just enough JSON-RPC to route a message (pure).

The proxy parses client POST bodies (small, and it must know the request ids and whether this is an
``initialize``) but never parses upstream events it does not need to. It must only recognise the
JSON-RPC response that completes a POST stream: an event that starts like a notification is not one (one
prefix test), and a response must hold a ``"result"`` or an ``"error"`` key, so only events whose data
contains one of those byte strings are parsed (the hot path parses no event's JSON unless a decision needs
it); progress notifications, the bulk of a stream, never are.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from mcpresume.core.errors import BadRequest, InvalidJson

INITIALIZE: Final = "initialize"
# The notification a client sends to cancel one of its requests (params.requestId names it).
CANCELLED: Final = "notifications/cancelled"
DISCOVER: Final = "server/discover"  # the 2026-07-28 era's probe
# Protocol revisions without sessions, resumption or a GET stream (docs/how-it-works.md, "Eras").
MODERN_VERSIONS: Final = frozenset({"2026-07-28"})
# The first revision whose SSE streams begin with a priming event (an id and empty data, SEP-1699). Clients
# of earlier ones may parse every event's data as JSON (a TypeScript SDK 1.20 client fails on an empty one).
PRIMING_SINCE: Final = "2025-11-25"
# A request without MCP-Protocol-Version is of this revision (2025-06-18: "the server SHOULD assume").
DEFAULT_VERSION: Final = "2025-03-26"


def primes(version: str | None) -> bool:
    """Whether SSE responses to a client of protocol revision ``version`` (None: the header is absent)
    start with a priming event. Revisions are dates, so they compare as strings."""
    return (version or DEFAULT_VERSION) >= PRIMING_SINCE


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """What the proxy needs to know of one client POST body."""

    methods: tuple[str, ...]
    request_ids: tuple[str | int, ...]  # ids of the requests in it (not of notifications or responses)
    is_batch: bool
    protocol_version: str | None = None  # an initialize's params.protocolVersion: what the client speaks
    # Each request's digest (``request_digest``), in the order of ``request_ids``: what tells a re-sent
    # request from another request under the same id.
    request_digests: tuple[bytes, ...] = ()
    cancelled: tuple[str, ...] = ()  # keys of the request ids its notifications/cancelled name
    # The keys of ``request_ids`` (``request_key``), in their order: made once, read by the claim, the
    # stream's opening and a release. Given by ``parse_client_body``, which makes them to find duplicates.
    request_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.request_keys) != len(self.request_ids):
            object.__setattr__(self, "request_keys", tuple(map(request_key, self.request_ids)))

    @property
    def first_id(self) -> str | int | None:
        return self.request_ids[0] if self.request_ids else None

    @property
    def is_initialize(self) -> bool:
        return INITIALIZE in self.methods

    @property
    def is_discover(self) -> bool:
        return DISCOVER in self.methods


# The keys of small integer ids (clients number their requests from 0 or 1): one string each for the whole
# process, not one per request that a session's claim map keeps (52 bytes each, in every idle session).
_SMALL_INT_KEYS: Final = tuple(f"n:{i}" for i in range(1024))


def request_key(request_id: str | int) -> str:
    """A map key for a JSON-RPC id: 1 and "1" are different ids."""
    if type(request_id) is int and 0 <= request_id < 1024:  # not a bool: True is no id 1
        return _SMALL_INT_KEYS[request_id]
    return f"n:{request_id}" if isinstance(request_id, int) else f"s:{request_id}"


# Bytes of a request's digest: 64 bits, so two different requests under one id pass for the same one with a
# chance of 2**-64 (a client numbering its requests from 0 again, say, after a reconnect).
DIGEST_BYTES: Final = 8


def request_digest(method: str, params: Any) -> bytes:
    """What a request asks (its method and params; not its id), as a short digest: a re-sent request has
    the same one, another request under the same id (almost surely) not. The params are serialized with
    their keys sorted, so a client that writes the members in another order sends the same request."""
    canonical = orjson.dumps([method, params], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(canonical, digest_size=DIGEST_BYTES).digest()


def parse_client_body(body: bytes) -> ClientMessage:
    """Classify a client POST body. Raises ``InvalidJson`` or ``BadRequest``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJson(f"request body is not JSON: {exc}") from None
    is_batch = isinstance(doc, list)
    items = doc if is_batch else [doc]
    if not items:
        raise BadRequest("empty JSON-RPC batch")
    methods: list[str] = []
    ids: list[str | int] = []
    cancelled: list[str] = []
    digests: list[bytes] = []
    version: str | None = None
    for item in items:
        if not isinstance(item, dict) or item.get("jsonrpc") != "2.0":
            raise BadRequest("not a JSON-RPC 2.0 message")
        method = item.get("method")
        if method is None:
            continue  # a response to a server request
        if not isinstance(method, str):
            raise BadRequest("JSON-RPC method must be a string")
        methods.append(method)
        if method == INITIALIZE and isinstance(item.get("params"), dict):
            asked = item["params"].get("protocolVersion")
            version = asked if isinstance(asked, str) else None
        if method == CANCELLED and "id" not in item and isinstance(item.get("params"), dict):
            named = item["params"].get("requestId")
            if not isinstance(named, bool) and isinstance(named, str | int):
                cancelled.append(request_key(named))
        if "id" in item:
            request_id = item["id"]
            if isinstance(request_id, bool) or not isinstance(request_id, str | int):
                raise BadRequest("JSON-RPC request id must be a string or an integer")
            ids.append(request_id)
            digests.append(request_digest(method, item.get("params")))
    keys = tuple(map(request_key, ids))
    if len(set(keys)) != len(keys):
        raise BadRequest("duplicate request id within one batch")
    return ClientMessage(
        tuple(methods), tuple(ids), is_batch, version, tuple(digests), tuple(cancelled), keys
    )


# How the official SDKs serialize a request or notification (the TypeScript SDK with JSON.stringify, the
# Python SDK with pydantic): a top-level "method" member, so certainly not a response. Checked first:
# progress notifications are most of a stream's events.
NOTIFICATION_PREFIX: Final = b'{"jsonrpc":"2.0","method":'
# The same as Python's json.dumps writes it, with its default separators and with indent=2: data starting
# so has a "method" member at the top level (the second one), so it is not a response either.
NOTIFICATION_PREFIXES: Final = (
    NOTIFICATION_PREFIX,
    b'{"jsonrpc": "2.0", "method":',
    b'{\n  "jsonrpc": "2.0",\n  "method":',
)


# A response has a member named "result" or "error"; a JSON escape (\\u) may spell either name. Data that
# holds none of these is not a response, however it is spelled (none holds LF: they are found in the SSE
# bytes whatever the data's lines).
RESPONSE_MARKERS: Final = (b'"result"', b'"error"', b"\\u")


def response_key(data: bytes) -> str | None:
    """If an SSE event's data is a JSON-RPC response, the key of the id it answers; else None."""
    if data.startswith(NOTIFICATION_PREFIXES):
        return None
    if not any(marker in data for marker in RESPONSE_MARKERS):
        return None  # no member named result or error, even written with a JSON escape: not a response
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return _answer_key(doc)


def _answer_key(doc: Any) -> str | None:
    """If a parsed JSON-RPC message is a response, the key of the id it answers; else None."""
    if not isinstance(doc, dict) or "method" in doc or ("result" not in doc and "error" not in doc):
        return None
    request_id = doc.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        return None
    return request_key(request_id)


def response_keys(data: bytes) -> tuple[str, ...]:
    """The keys of the ids an SSE event's data answers: one response's, or those of the responses in a
    batch (2025-03-26 allows one event to carry a JSON array of messages; its requests and notifications
    answer nothing). Empty when it answers none."""
    if data.lstrip()[:1] != b"[":
        key = response_key(data)
        return () if key is None else (key,)
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ()
    if not isinstance(doc, list):
        return ()
    return tuple(key for item in doc if (key := _answer_key(item)) is not None)


def error_response(request_id: str | int | None, code: int, message: str, data: dict[str, Any]) -> bytes:
    """A serialized JSON-RPC error response."""
    return orjson.dumps(
        {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message, "data": data}}
    )


# -- the proxy's own requests ----------------------------------------------------------------------------
#
# The proxy sends a few requests of its own in a session (a ``ping`` asking the upstream about credentials
# new to it, a probe asking whether the upstream knows a session it took over). Their answers are the
# proxy's alone: one must never reach a client, whichever stream the upstream puts it on (an upstream may
# answer a request whose POST stream is gone on the standalone GET stream, or on a resumed one). So their
# ids are unmistakable: this prefix, what the request is for, and a random part (``proxy_request_id``),
# and a pump drops any response to one (``core.pump.UpstreamEvents``). ``mcpresume-probe`` alone is what
# earlier versions sent as the probe's id (a replica of one may share the upstream during an upgrade).
PROXY_ID_PREFIX: Final = "mcpresume-"
# What the bytes of an event answering one hold (a JSON serializer writes a string's ASCII letters as they
# are, never escaped): only such events are parsed to look.
PROXY_ID_MARKER: Final = b'"mcpresume-'
_PROXY_ID: Final = re.compile(r"mcpresume-(?:[a-z]+-[0-9a-f]{16}|probe)")


def proxy_request_id(purpose: str, nonce: str) -> str:
    """The id of a request the proxy sends itself: ``purpose`` (lower-case letters: ``ping``, ``probe``) and
    ``nonce`` (16 random hex digits)."""
    return f"{PROXY_ID_PREFIX}{purpose}-{nonce}"


def is_proxy_id(request_id: object) -> bool:
    """Whether a JSON-RPC id is one the proxy made (``proxy_request_id``)."""
    return isinstance(request_id, str) and _PROXY_ID.fullmatch(request_id) is not None


def _answers_proxy(doc: Any) -> bool:
    return (
        isinstance(doc, dict)
        and "method" not in doc
        and ("result" in doc or "error" in doc)
        and is_proxy_id(doc.get("id"))
    )


def without_proxy_answers(data: bytes) -> tuple[bytes | None, int]:
    """An SSE event's data without the responses to the proxy's own requests, and how many it held:
    ``(data, 0)`` when none (also when it is not JSON); ``(None, n)`` when nothing else is left; a batch
    (2025-03-26) with other messages too, re-encoded without them."""
    if PROXY_ID_MARKER not in data:
        return data, 0
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data, 0
    if not isinstance(doc, list):
        return (None, 1) if _answers_proxy(doc) else (data, 0)
    kept = [item for item in doc if not _answers_proxy(item)]
    dropped = len(doc) - len(kept)
    if not dropped:
        return data, 0
    return (orjson.dumps(kept) if kept else None), dropped
