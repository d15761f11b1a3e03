"""The era bridge: a handshake-era session in front of a 2026-07-28-only upstream (issue 34), the decisions.

``http/bridge.py`` carries them out. A bridged session is the proxy's own: it answers the ``initialize``
(``initialize_result``), mints the session id and keeps the client's info and capabilities (``ClientFacts``);
each later message of the session is one of the rows below (``treat``):

===========================================  =====================================================
client message (handshake era)               what the bridge does
===========================================  =====================================================
``initialize``                               answered by the proxy: the negotiated version, the
                                             upstream's ``server/discover`` (capabilities, server
                                             info, instructions); a session begun in the store
``ping`` (request)                           answered by the proxy: ``{}`` (2026-07-28 has no ping)
``logging/setLevel`` (request)               answered by the proxy: ``{}``; the level rides each later
                                             request's ``_meta`` (``io.modelcontextprotocol/logLevel``)
any other request                            sent upstream as a 2026-07-28 request (``to_modern``):
                                             ``MCP-Protocol-Version``, ``Mcp-Method``, ``Mcp-Name`` where
                                             the method names a thing, and the envelope in ``_meta``
``resources/subscribe``, ``unsubscribe``     answered by the proxy: ``{}`` when the upstream's discover
(request)                                    offers resource subscriptions, the URI kept in the
                                             session's recipe and the listen stream re-opened with the
                                             set (``listen_filter``); else -32601, as a server without
                                             them answers (2026-07-28 has neither method); no ``uri``:
                                             -32602
``notifications/cancelled``                  202; the request's upstream stream is closed (closing is
                                             the modern cancellation)
any other notification, or a response        202, not sent (2026-07-28 defines no client notifications;
                                             responses answer the bridge's own requests: MRTR, later)
a batch (2025-03-26)                         400 ``batch_not_bridged``: a modern request is one message
the standalone GET (no ``Last-Event-ID``)    the upstream's ``subscriptions/listen`` for the list-changed
                                             notifications it offers and the session's subscribed URIs
                                             (``listen_filter``), relayed; 405 when it offers neither
===========================================  =====================================================
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from mcpresume.core.era import MODERN_VERSION, negotiate
from mcpresume.core.errors import INVALID_PARAMS, METHOD_NOT_FOUND
from mcpresume.core.jsonrpc import response_key
from mcpresume.core.reinit import SUBSCRIBE, UNSUBSCRIBE, Recipe
from mcpresume.core.sse import SSEParser, frame_body

PROTOCOL_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_KEY: Final = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL_KEY: Final = "io.modelcontextprotocol/logLevel"
SERVER_INFO_KEY: Final = "io.modelcontextprotocol/serverInfo"

METHOD_HEADER: Final = "Mcp-Method"
NAME_HEADER: Final = "Mcp-Name"

# The methods whose params name a thing, mirrored in ``Mcp-Name`` (the SDK's ``NAME_BEARING_METHODS``).
NAME_PARAMS: Final[Mapping[str, str]] = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}

# What the proxy says of itself when the upstream's discover names no server.
FALLBACK_SERVER_INFO: Final[Mapping[str, str]] = {"name": "mcpresume-bridge", "version": "0"}


@dataclass(frozen=True, slots=True)
class ClientFacts:
    """What a bridged session's client said in its ``initialize``: every modern request carries it."""

    version: str  # the negotiated handshake-era version
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    info: Mapping[str, Any] | None = None
    log_level: str | None = None  # set by logging/setLevel


@dataclass(frozen=True, slots=True)
class Local:
    """Answered by the proxy: ``result`` for a request (None: a 202 for notifications/responses)."""

    result: Mapping[str, Any] | None = None
    log_level: str | None = None  # logging/setLevel's level, to keep in the session's facts
    cancelled: bool = False  # a notifications/cancelled: close the request's upstream stream
    error: Mapping[str, Any] | None = None  # a JSON-RPC error for a request (instead of ``result``)
    # A resources/subscribe or unsubscribe taken: (its method, its URI), to fold into the session's recipe.
    subscription: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Send:
    """Sent upstream as this 2026-07-28 request."""

    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Refuse:
    """Refused: ``reason`` (a batch)."""

    reason: str


def facts_of_initialize(params: object) -> ClientFacts:
    """The facts an ``initialize``'s params give (what is malformed is left out, never guessed)."""
    params = params if isinstance(params, Mapping) else {}
    capabilities = params.get("capabilities")
    info = params.get("clientInfo")
    return ClientFacts(
        version=negotiate(params.get("protocolVersion")),
        capabilities=dict(capabilities) if isinstance(capabilities, Mapping) else {},
        info=dict(info) if isinstance(info, Mapping) else None,
    )


def bridged_recipe(params: object, told: Mapping[str, Any]) -> Recipe:
    """What the store keeps of a bridged session (``core.reinit.Recipe``, ``bridged``): the client's
    ``initialize`` params and what it was told (``initialize_result``), so every replica sends its requests
    with the client's facts (``facts_of_recipe``)."""
    capabilities = told.get("capabilities")
    return Recipe(
        params=dict(params) if isinstance(params, Mapping) else {},
        version=str(told.get("protocolVersion")),
        capabilities=dict(capabilities) if isinstance(capabilities, Mapping) else {},
        bridged=True,
    )


def facts_of_recipe(recipe: Recipe) -> ClientFacts | None:
    """A bridged session's facts as its recipe keeps them (its log level the last ``logging/setLevel``);
    None for the recipe of a session that is not bridged."""
    if not recipe.bridged:
        return None
    facts = facts_of_initialize(recipe.params)
    return ClientFacts(facts.version, facts.capabilities, facts.info, recipe.level)


def initialize_result(facts: ClientFacts, discover: Mapping[str, Any]) -> dict[str, Any]:
    """The bridged ``initialize``'s result, of the upstream's ``server/discover`` result."""
    meta = discover.get("_meta")
    server_info = meta.get(SERVER_INFO_KEY) if isinstance(meta, Mapping) else None
    capabilities = discover.get("capabilities")
    capabilities = dict(capabilities) if isinstance(capabilities, Mapping) else {}
    # logging/setLevel is answered by the proxy (the level rides every request's _meta): offer it.
    capabilities.setdefault("logging", {})
    result: dict[str, Any] = {
        "protocolVersion": facts.version,
        "capabilities": capabilities,
        "serverInfo": dict(server_info) if isinstance(server_info, Mapping) else dict(FALLBACK_SERVER_INFO),
    }
    instructions = discover.get("instructions")
    if isinstance(instructions, str):
        result["instructions"] = instructions
    return result


def header_value(value: str) -> str:
    """A header value for ``Mcp-Name``: as is when visible ASCII (and spaces), else the spec's base64 form."""
    if value.isascii() and value.isprintable() and value == value.strip():
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode("ascii") + "?="


def envelope(facts: ClientFacts) -> dict[str, Any]:
    """The 2026-07-28 per-request ``_meta`` fields of a bridged session's requests."""
    meta: dict[str, Any] = {
        PROTOCOL_VERSION_KEY: MODERN_VERSION,
        CLIENT_CAPABILITIES_KEY: dict(facts.capabilities),
    }
    if facts.info is not None:
        meta[CLIENT_INFO_KEY] = dict(facts.info)
    if facts.log_level is not None:
        meta[LOG_LEVEL_KEY] = facts.log_level
    return meta


PROBE_CLIENT: Final[Mapping[str, str]] = {"name": "mcpresume-probe", "version": "1"}


def discover_request(request_id: str | int) -> dict[str, Any]:
    """The proxy's own ``server/discover`` (the era probe, a bridged session's credentials check)."""
    meta = envelope(ClientFacts(MODERN_VERSION, {}, PROBE_CLIENT))
    return {"jsonrpc": "2.0", "id": request_id, "method": "server/discover", "params": {"_meta": meta}}


def to_modern(message: Mapping[str, Any], facts: ClientFacts) -> Send:
    """A handshake-era request as a 2026-07-28 one: the envelope in ``params._meta`` (the client's own
    ``_meta`` keys, a ``progressToken`` say, kept), and the routing headers."""
    method = str(message.get("method"))
    params = message.get("params")
    params = dict(params) if isinstance(params, Mapping) else {}
    own_meta = params.get("_meta")
    params["_meta"] = {**(own_meta if isinstance(own_meta, Mapping) else {}), **envelope(facts)}
    body = {**message, "params": params}
    headers = [("MCP-Protocol-Version", MODERN_VERSION), (METHOD_HEADER, method)]
    name_key = NAME_PARAMS.get(method)
    name = params.get(name_key) if name_key is not None else None
    if isinstance(name, str):
        headers.append((NAME_HEADER, header_value(name)))
    return Send(body, tuple(headers))


def subscribable(capabilities: object) -> bool:
    """Whether the capabilities the client was told (the upstream's discover) offer resource subscriptions
    (a 2026-07-28 server's ``resources.subscribe``: its ``subscriptions/listen`` takes resource URIs)."""
    resources = capabilities.get("resources") if isinstance(capabilities, Mapping) else None
    return isinstance(resources, Mapping) and resources.get("subscribe") is True


def _subscription(method: str, params: object, offered: bool) -> Local:
    if not offered:
        data = {"reason": "subscriptions_not_offered"}
        return Local(error={"code": METHOD_NOT_FOUND, "message": f"Method not found: {method}", "data": data})
    uri = params.get("uri") if isinstance(params, Mapping) else None
    if not isinstance(uri, str) or not uri:
        data = {"reason": "bad_subscription"}
        return Local(error={"code": INVALID_PARAMS, "message": f"{method} needs a uri string", "data": data})
    return Local(result={}, subscription=(method, uri))


def treat(doc: object, facts: ClientFacts, offered: bool = False) -> Local | Send | Refuse:
    """One client message of a bridged session: the table in the module docstring (``offered``: the
    upstream offers resource subscriptions, ``subscribable``)."""
    if isinstance(doc, list):
        return Refuse("batch_not_bridged")
    if not isinstance(doc, Mapping):
        return Refuse("not_jsonrpc")
    method = doc.get("method")
    if not isinstance(method, str):
        return Local()  # a response: nothing of the upstream's asked for it
    if "id" not in doc:
        return Local(cancelled=method == "notifications/cancelled")
    if method == "ping":
        return Local(result={})
    if method == "logging/setLevel":
        params = doc.get("params")
        level = params.get("level") if isinstance(params, Mapping) else None
        return Local(result={}, log_level=level if isinstance(level, str) else None)
    if method in (SUBSCRIBE, UNSUBSCRIBE):
        return _subscription(method, doc.get("params"), offered)
    return to_modern(doc, facts)


# -- MRTR (SEP-2322): an input-required result as handshake-era server-to-client requests ------------------
#
# ==================================================  =====================================================
# the upstream's answer to a bridged request          what the client gets on the request's stream
# ==================================================  =====================================================
# a result with ``resultType: "input_required"``      one request per ``inputRequests`` entry
#                                                     (``elicitation/create``, ``sampling/createMessage``,
#                                                     ``roots/list``), ids the proxy's own; the stream stays
#                                                     open
# the client's responses to all of them               (nothing) the request sent again upstream with
#                                                     ``inputResponses`` (by key) and ``requestState``; its
#                                                     answer on the same stream (input required again: the
#                                                     same again)
# an error response to one of them                    the request's answer: that error, the stream ended
# any other answer                                    itself
# ==================================================  =====================================================
#
# The answer, first or retried, may be JSON or an SSE stream (progress, then the result). An SSE answer is
# read event by event (``HeldAnswer``): every event passed on as it comes but the input-required result
# answering the request, held back (never a response the client sees), whose input requests follow
# instead; the retry's events then continue the same stream of the session, its result the stream's one
# response.


@dataclass(frozen=True, slots=True)
class InputRequired:
    """An input-required result: what the upstream asks (by its keys), and its opaque state."""

    requests: Mapping[str, Mapping[str, Any]]
    state: str | None


def input_required(answer: object) -> InputRequired | None:
    """The input-required result of a JSON-RPC response, or None (any other answer)."""
    result = answer.get("result") if isinstance(answer, Mapping) else None
    if not isinstance(result, Mapping) or result.get("resultType") != "input_required":
        return None
    asked = result.get("inputRequests")
    requests = {
        str(key): request
        for key, request in (asked.items() if isinstance(asked, Mapping) else ())
        if isinstance(request, Mapping) and isinstance(request.get("method"), str)
    }
    state = result.get("requestState")
    return InputRequired(requests, state if isinstance(state, str) else None)


# What an SSE event's data must hold to be an input-required result: only those events are parsed.
INPUT_REQUIRED_MARKER: Final = b'"input_required"'


class HeldAnswer:
    """A bridged request's SSE answer (one upstream stream of it, the first or a retry's), event by event:
    what is passed on, and the input-required result answering the request, held back (``asked``).

    Passed on re-framed (``frame_body``: its name and data), without the upstream's ids and ``retry``: each
    retry is another upstream stream whose ids would mean nothing next to the first's, and a 2026-07-28
    upstream resumes none (the session's window is what the client resumes). Priming and id-only events
    carry nothing then and go; what follows the held result (nothing, from a server that ends its stream
    with the response) goes too."""

    __slots__ = ("_key", "_parser", "asked")

    def __init__(self, request_key: str, max_event_bytes: int) -> None:
        self._key = request_key
        self._parser = SSEParser(max_event_bytes)  # an event over the limit raises EventTooLarge
        self.asked: InputRequired | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The events of ``chunk`` to pass on (b"" when none is complete yet, or after ``asked``)."""
        passed = []
        for event in self._parser.feed(chunk):
            data = event.data
            if not data or self.asked is not None:
                continue
            if INPUT_REQUIRED_MARKER in data and response_key(data) == self._key:
                asked = input_required(orjson.loads(data))
                if asked is not None and asked.requests:
                    self.asked = asked
                    continue
            passed.append(frame_body(data, event.event))
        return b"".join(passed)


def client_requests(asked: InputRequired, ids: Mapping[str, str]) -> list[dict[str, Any]]:
    """The handshake-era requests the input requests stand for, each under the proxy's id for its key."""
    requests = []
    for key, request in asked.requests.items():
        params = request.get("params")
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": ids[key], "method": request["method"]}
        if isinstance(params, Mapping):
            message["params"] = dict(params)
        requests.append(message)
    return requests


def retry_body(
    original: Mapping[str, Any], responses: Mapping[str, Any], state: str | None
) -> dict[str, Any]:
    """The bridged request sent again with the client's answers (``inputResponses``) and ``requestState``."""
    params = original.get("params")
    params = dict(params) if isinstance(params, Mapping) else {}
    params["inputResponses"] = dict(responses)
    if state is not None:
        params["requestState"] = state
    else:
        params.pop("requestState", None)
    return {**original, "params": params}


def listen_filter(capabilities: object, subscriptions: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a bridged standalone GET's ``subscriptions/listen`` opts in to: the list-changed notifications
    the upstream's ``server/discover`` capabilities offer, and the session's subscribed resource URIs
    (``resourceSubscriptions``, sorted) when it offers resource subscriptions."""
    offered = capabilities if isinstance(capabilities, Mapping) else {}
    wanted: dict[str, Any] = {}
    for feature, key in (
        ("tools", "toolsListChanged"),
        ("prompts", "promptsListChanged"),
        ("resources", "resourcesListChanged"),
    ):
        entry = offered.get(feature)
        if isinstance(entry, Mapping) and entry.get("listChanged") is True:
            wanted[key] = True
    if subscriptions and subscribable(offered):
        wanted["resourceSubscriptions"] = sorted(subscriptions)
    return wanted


ACKNOWLEDGED: Final = "notifications/subscriptions/acknowledged"


def listen_event(data: bytes) -> tuple[bool, bool]:
    """An event of the upstream's ``subscriptions/listen`` stream: (whether the client gets it, whether it is
    the stream's acknowledgement). The acknowledgement and a response (the listen request's own result or
    error) answer the proxy's request, never the client's: not passed; every notification is."""
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError:
        return True, False
    if not isinstance(message, Mapping):
        return True, False
    method = message.get("method")
    if method == ACKNOWLEDGED:
        return False, True
    return isinstance(method, str), False


def listen_request(request_id: str, notifications: Mapping[str, Any], facts: ClientFacts) -> dict[str, Any]:
    """The 2026-07-28 ``subscriptions/listen`` a bridged standalone GET stands for."""
    params = {"notifications": dict(notifications), "_meta": envelope(facts)}
    return {"jsonrpc": "2.0", "id": request_id, "method": "subscriptions/listen", "params": params}
