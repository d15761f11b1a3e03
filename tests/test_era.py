"""The pure era decisions (core/era.py) and the bridge's translation (core/bridge.py), row by row."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.bridge import (
    ClientFacts,
    HeldAnswer,
    Local,
    Refuse,
    Send,
    bridged_recipe,
    facts_of_initialize,
    facts_of_recipe,
    header_value,
    initialize_result,
    listen_filter,
    listen_request,
    treat,
)
from mcpresume.core.era import (
    Era,
    UpstreamEra,
    discover_lists_handshake,
    discover_offers_modern,
    initialize_refused,
    negotiate,
    request_era,
    upstream_era,
)
from mcpresume.core.errors import EventTooLarge
from mcpresume.core.jsonrpc import request_key
from mcpresume.core.reinit import Recipe, fold
from mcpresume.core.sse import SSEParser

REFUSAL = {"error": {"code": -32022, "message": "x", "data": {"supported": ["2026-07-28"]}}}


@pytest.mark.parametrize(
    ("header", "method", "era"),
    [
        (None, "tools/call", Era.HANDSHAKE),
        ("2025-06-18", "tools/call", Era.HANDSHAKE),
        ("2026-07-28", "tools/call", Era.MODERN),
        (None, "server/discover", Era.MODERN),
    ],
)
def test_request_era(header: str | None, method: str, era: Era) -> None:
    assert request_era(header, method) is era


@pytest.mark.parametrize(
    ("asked", "answered"),
    [
        ("2025-03-26", "2025-03-26"),
        ("2025-11-25", "2025-11-25"),
        ("2024-11-05", "2025-11-25"),
        (None, "2025-11-25"),
        ("2026-07-28", "2025-11-25"),
        (7, "2025-11-25"),
    ],
)
def test_negotiate(asked: object, answered: str) -> None:
    assert negotiate(asked) == answered


@pytest.mark.parametrize(
    ("status", "body", "modern"),
    [
        (200, {"result": {"supportedVersions": ["2026-07-28"]}}, True),
        (200, {"result": {"supportedVersions": ["2025-11-25"]}}, False),
        (200, {"result": {}}, False),
        (400, {"error": {"code": -32600}}, False),
        (404, None, False),
        (502, None, None),
    ],
)
def test_discover_offers_modern(status: int, body: object, modern: bool | None) -> None:
    assert discover_offers_modern(status, body) is modern


@pytest.mark.parametrize(
    ("status", "body", "refused"),
    [
        (200, {"result": {}}, False),
        (400, REFUSAL, True),
        (400, {"error": {"code": -32022, "data": {"supported": ["2025-06-18", "2026-07-28"]}}}, None),
        (400, {"error": {"code": -32600}}, None),
        (401, None, None),
        (500, REFUSAL, None),
    ],
)
def test_initialize_refused(status: int, body: object, refused: bool | None) -> None:
    assert initialize_refused(status, body) is refused


@pytest.mark.parametrize(
    ("modern", "refused", "era"),
    [
        (None, None, UpstreamEra.UNKNOWN),
        (False, None, UpstreamEra.HANDSHAKE),
        (True, False, UpstreamEra.DUAL),
        (True, True, UpstreamEra.MODERN_ONLY),
        (True, None, UpstreamEra.MODERN),
    ],
)
def test_upstream_era(modern: bool | None, refused: bool | None, era: UpstreamEra) -> None:
    assert upstream_era(modern, refused) is era


@pytest.mark.parametrize(
    ("refused", "era"),
    [(None, UpstreamEra.DUAL), (False, UpstreamEra.DUAL), (True, UpstreamEra.MODERN_ONLY)],
)
def test_a_discover_naming_a_handshake_version_is_dual_until_refused(
    refused: bool | None, era: UpstreamEra
) -> None:
    body = {"result": {"supportedVersions": ["2025-11-25", "2026-07-28"]}}
    assert discover_lists_handshake(body) and not discover_lists_handshake({"result": {}})
    assert upstream_era(discover_offers_modern(200, body), refused, discover_lists_handshake(body)) is era


FACTS = ClientFacts("2025-06-18", {"elicitation": {}}, {"name": "c", "version": "1"})


def test_initialize_answered_from_discover() -> None:
    facts = facts_of_initialize(
        {
            "protocolVersion": "2025-06-18",
            "capabilities": {"roots": {}},
            "clientInfo": {"name": "c", "version": "1"},
        }
    )
    assert facts == ClientFacts("2025-06-18", {"roots": {}}, {"name": "c", "version": "1"})
    discover = {
        "supportedVersions": ["2026-07-28"],
        "capabilities": {"tools": {"listChanged": True}},
        "instructions": "be kind",
        "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "up", "version": "2"}},
    }
    assert initialize_result(facts, discover) == {
        "protocolVersion": "2025-06-18",
        "capabilities": {"tools": {"listChanged": True}, "logging": {}},
        "serverInfo": {"name": "up", "version": "2"},
        "instructions": "be kind",
    }
    assert initialize_result(facts_of_initialize(None), {})["serverInfo"]["name"] == "mcpresume-bridge"


def test_a_request_becomes_a_modern_one() -> None:
    message = {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "hi"}, "_meta": {"progressToken": 3}},
    }
    sent = treat(message, ClientFacts(**{**_fields(FACTS), "log_level": "info"}))
    assert isinstance(sent, Send)
    assert dict(sent.headers) == {
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tools/call",
        "Mcp-Name": "echo",
    }
    assert sent.body["id"] == 3 and sent.body["params"]["arguments"] == {"text": "hi"}
    assert sent.body["params"]["_meta"] == {
        "progressToken": 3,
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}},
        "io.modelcontextprotocol/clientInfo": {"name": "c", "version": "1"},
        "io.modelcontextprotocol/logLevel": "info",
    }
    listed = treat({"jsonrpc": "2.0", "id": 4, "method": "tools/list"}, FACTS)
    assert isinstance(listed, Send) and "Mcp-Name" not in dict(listed.headers)


def _fields(facts: ClientFacts) -> dict[str, object]:
    return {"version": facts.version, "capabilities": facts.capabilities, "info": facts.info}


@pytest.mark.parametrize(
    ("message", "treated"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "ping"}, Local(result={})),
        (
            {"jsonrpc": "2.0", "id": 1, "method": "logging/setLevel", "params": {"level": "debug"}},
            Local(result={}, log_level="debug"),
        ),
        ({"jsonrpc": "2.0", "method": "notifications/initialized"}, Local()),
        (
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}},
            Local(cancelled=True),
        ),
        ({"jsonrpc": "2.0", "id": 9, "result": {}}, Local()),
        ([{"jsonrpc": "2.0", "id": 1, "method": "ping"}], Refuse("batch_not_bridged")),
    ],
)
def test_what_the_proxy_answers_itself(message: object, treated: object) -> None:
    assert treat(message, FACTS) == treated


def test_names_outside_visible_ascii_are_base64() -> None:
    assert header_value("echo") == "echo"
    assert header_value("écho") == "=?base64?w6ljaG8=?="
    assert header_value(" padded") == "=?base64?IHBhZGRlZA==?="


def test_the_listen_filter_is_what_discover_offers() -> None:
    offered = {
        "tools": {"listChanged": True},
        "prompts": {},
        "resources": {"listChanged": True, "subscribe": True},
    }
    assert listen_filter(offered) == {"toolsListChanged": True, "resourcesListChanged": True}
    assert listen_filter({"tools": {}}) == {} and listen_filter(None) == {}
    listen = listen_request("mcpresume-listen-1", {"toolsListChanged": True}, FACTS)
    assert listen["method"] == "subscriptions/listen"
    assert listen["params"]["notifications"] == {"toolsListChanged": True}
    assert listen["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"


def test_a_bridged_sessions_facts_round_trip_through_its_recipe() -> None:
    """What the store keeps of a bridged session gives back the client's facts on any replica; the recipe of
    a session of the upstream's says it is not bridged, and its bytes carry no flag."""
    params = {"protocolVersion": "2025-06-18", "capabilities": {"roots": {}}, "clientInfo": {"name": "c"}}
    told = initialize_result(facts_of_initialize(params), {"capabilities": {"tools": {"listChanged": True}}})
    recipe = bridged_recipe(params, told)
    kept = Recipe.decode(recipe.encode())
    assert kept == recipe and kept.bridged
    assert facts_of_recipe(kept) == ClientFacts("2025-06-18", {"roots": {}}, {"name": "c"})
    assert listen_filter(kept.capabilities) == {"toolsListChanged": True}
    leveled = fold(kept, "logging/setLevel", {"level": "debug"})
    assert leveled is not None and facts_of_recipe(leveled) == ClientFacts(
        "2025-06-18", {"roots": {}}, {"name": "c"}, "debug"
    )
    theirs = Recipe(params=params)
    assert facts_of_recipe(theirs) is None and b"bridged" not in theirs.encode()


# -- an event-stream answer, the input-required result held back (MRTR) ----------------------------------

PROGRESS = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":0}}'
ASKING = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {
            "resultType": "input_required",
            "inputRequests": {"word": {"method": "elicitation/create", "params": {"message": "?"}}},
            "requestState": "s",
        },
    }
)
# What the SDK's SSE mode sends: CRLF lines, a priming event with an id, the progress, the result.
ANSWER = b"id: 0\r\nretry: 100\r\ndata: \r\n\r\nid: 1\r\nevent: message\r\ndata: " + PROGRESS
ANSWER += b"\r\n\r\nid: 2\r\nevent: message\r\ndata: " + ASKING + b"\r\n\r\n"


def _held(chunks: list[bytes], request_id: int = 7) -> tuple[bytes, HeldAnswer]:
    held = HeldAnswer(request_key(request_id), 1 << 16)
    return b"".join(held.feed(chunk) for chunk in chunks), held


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_an_input_required_result_is_held_back_however_the_answer_is_cut(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(ANSWER)]
    passed, held = _held([ANSWER[a:b] for a, b in itertools.pairwise(points)])
    # The progress passed on, re-framed without the upstream's ids (each retry is another upstream stream).
    assert passed == b"event: message\ndata: " + PROGRESS + b"\n\n"
    assert held.asked is not None and held.asked.state == "s"
    assert list(held.asked.requests) == ["word"]
    assert [e.id for e in SSEParser(1 << 16).feed(passed)] == [None]


def test_any_other_answer_passes_as_it_came() -> None:
    passed, held = _held([ANSWER], request_id=8)  # another request's: not this one's answer
    assert held.asked is None and orjson.loads(SSEParser(1 << 16).feed(passed)[-1].data)["id"] == 7
    done = ASKING.replace(b"input_required", b"complete")
    passed, held = _held([b"data: " + done + b"\n\n"])
    assert held.asked is None and passed == b"data: " + done + b"\n\n"  # its event name as it came: none
    empty = ASKING.replace(b'{"word":{"method":"elicitation/create","params":{"message":"?"}}}', b"{}")
    passed, held = _held([b"data: " + empty + b"\n\n"])  # nothing asked: no input to collect, the answer
    assert held.asked is None and passed.endswith(empty + b"\n\n")


def test_what_follows_the_held_result_is_not_passed_and_an_event_too_large_is_refused() -> None:
    passed, held = _held([ANSWER + b"data: " + PROGRESS + b"\n\n"])
    assert held.asked is not None and passed.count(b"data:") == 1
    with pytest.raises(EventTooLarge):
        HeldAnswer(request_key(7), 64).feed(b"data: " + b"x" * 100 + b"\n\n")
