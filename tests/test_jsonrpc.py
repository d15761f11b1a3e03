"""Just enough JSON-RPC: classifying client POST bodies and recognising the response that ends a stream."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.errors import BadRequest, InvalidJson
from mcpresume.core.jsonrpc import (
    ClientMessage,
    error_response,
    parse_client_body,
    request_digest,
    request_key,
    response_key,
)


def body(doc: object) -> bytes:
    return orjson.dumps(doc)


def request(method: str, request_id: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {}}


def notification(method: str) -> dict[str, object]:
    return {"jsonrpc": "2.0", "method": method}


# -- parse_client_body ----------------------------------------------------------------------------------


def test_single_request() -> None:
    message = parse_client_body(body(request("tools/call", 7)))
    digest = request_digest("tools/call", {})
    assert message == ClientMessage(("tools/call",), (7,), is_batch=False, request_digests=(digest,))
    assert message.request_keys == ("n:7",)
    assert message.first_id == 7
    assert not message.is_initialize and not message.is_discover


def test_each_request_has_the_digest_of_what_it_asks_not_of_its_id_or_spelling() -> None:
    """A re-sent request has its first sending's digest (whatever its id, its members' order, its
    whitespace); another request, another digest (what tells a re-send from a reused id)."""
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    sent = parse_client_body(
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":%s}' % orjson.dumps(call)
    )
    again = parse_client_body(
        b'{ "params": {"arguments": {"b": 2, "a": 1}, "name": "add"}, "method": "tools/call", "id": 9,'
        b' "jsonrpc": "2.0" }'
    )
    assert sent.request_digests == again.request_digests == (request_digest("tools/call", call),)
    others = [
        {"name": "add", "arguments": {"a": 40, "b": 2}},
        {"name": "echo", "arguments": {"a": 1, "b": 2}},
        None,
    ]
    digests = {request_digest("tools/call", params) for params in others} | {
        request_digest("tools/list", call)
    }
    assert len(digests) == 4 and sent.request_digests[0] not in digests
    batch = parse_client_body(body([request("a", 1), notification("n"), request("b", "x")]))
    assert batch.request_digests == (request_digest("a", {}), request_digest("b", {}))
    assert len(batch.request_digests[0]) == 8


def test_initialize_and_discover() -> None:
    init = parse_client_body(body(request("initialize", "a")))
    assert init.is_initialize and not init.is_discover
    assert init.request_keys == ("s:a",)
    discover = parse_client_body(body(request("server/discover", 0)))
    assert discover.is_discover and not discover.is_initialize
    assert discover.first_id == 0


def test_notification_only() -> None:
    message = parse_client_body(body(notification("notifications/initialized")))
    assert message.methods == ("notifications/initialized",)
    assert message.request_ids == ()
    assert message.request_keys == ()
    assert message.first_id is None
    assert not message.is_batch


def test_cancellations_name_the_keys_of_the_requests_they_cancel() -> None:
    def cancel(request_id: object) -> dict[str, object]:
        return {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}}

    message = parse_client_body(body(cancel(7)))
    assert message.cancelled == ("n:7",) and message.request_ids == ()
    batch = parse_client_body(body([cancel("7"), cancel(True), cancel(None), request("ping", 1)]))
    assert batch.cancelled == ("s:7",)  # a bool or null id names no request
    assert batch.request_ids == (1,)
    assert parse_client_body(body(notification("notifications/cancelled"))).cancelled == ()
    a_request = {**cancel(7), "id": 9}  # a request of that name is not the notification
    assert parse_client_body(body(a_request)).cancelled == ()
    assert parse_client_body(body(notification("notifications/initialized"))).cancelled == ()


def test_client_response_to_a_server_request() -> None:
    message = parse_client_body(body({"jsonrpc": "2.0", "id": 3, "result": {"roots": []}}))
    assert message.methods == ()
    assert message.request_ids == ()  # the id is the server's request's, not a new client request
    error = parse_client_body(body({"jsonrpc": "2.0", "id": 3, "error": {"code": -1, "message": "no"}}))
    assert error.methods == () and error.request_ids == ()


def test_batch_of_requests_notifications_and_responses() -> None:
    message = parse_client_body(
        body(
            [
                request("tools/list", 1),
                notification("notifications/progress"),
                {"jsonrpc": "2.0", "id": "srv-1", "result": {}},
                request("tools/call", "1"),
            ]
        )
    )
    assert message.is_batch
    assert message.methods == ("tools/list", "notifications/progress", "tools/call")
    assert message.request_ids == (1, "1")
    assert message.request_keys == ("n:1", "s:1")
    assert message.first_id == 1


def test_batch_of_one_is_still_a_batch() -> None:
    message = parse_client_body(body([request("ping", 1)]))
    assert message.is_batch and message.request_ids == (1,)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"not json", b"{'id': 1}", b"\xff\xfe", b'{"jsonrpc": "2.0",}', b"[1,]"],
    ids=["empty", "truncated", "text", "single quotes", "not utf-8", "trailing comma", "bad array"],
)
def test_bad_json(raw: bytes) -> None:
    with pytest.raises(InvalidJson) as info:
        parse_client_body(raw)
    assert info.value.status == 400
    assert info.value.reason == "invalid_json"
    assert info.value.code == -32700


@pytest.mark.parametrize(
    "doc",
    [
        [],
        1,
        "x",
        None,
        {"id": 1, "method": "ping"},  # no jsonrpc member
        {"jsonrpc": "1.0", "id": 1, "method": "ping"},
        {"jsonrpc": 2.0, "id": 1, "method": "ping"},
        [request("ping", 1), 5],
        [request("ping", 1), {"jsonrpc": "1.0", "method": "x"}],
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": 1, "method": ["ping"]},
    ],
    ids=[
        "empty batch",
        "number",
        "string",
        "null",
        "no jsonrpc",
        "jsonrpc 1.0",
        "jsonrpc number",
        "batch with a number",
        "batch with a bad member",
        "method number",
        "method list",
    ],
)
def test_not_jsonrpc(doc: object) -> None:
    with pytest.raises(BadRequest) as info:
        parse_client_body(body(doc))
    assert not isinstance(info.value, InvalidJson)
    assert info.value.status == 400
    assert info.value.reason == "bad_request"
    assert info.value.code == -32600


@pytest.mark.parametrize("bad_id", [None, True, False, 1.5, 1.0, [1], {"a": 1}], ids=repr)
def test_bad_request_ids(bad_id: object) -> None:
    with pytest.raises(BadRequest, match="id"):
        parse_client_body(body(request("ping", bad_id)))
    with pytest.raises(BadRequest, match="id"):
        parse_client_body(body([request("ping", 1), request("ping", bad_id)]))


def test_duplicate_ids_in_a_batch() -> None:
    with pytest.raises(BadRequest, match="duplicate"):
        parse_client_body(body([request("a", 1), request("b", 1)]))
    with pytest.raises(BadRequest, match="duplicate"):
        parse_client_body(body([request("a", "x"), notification("n"), request("b", "x")]))


def test_same_digits_as_number_and_string_are_not_duplicates() -> None:
    message = parse_client_body(body([request("a", 1), request("b", "1")]))
    assert message.request_ids == (1, "1")


def test_duplicate_response_ids_do_not_count() -> None:
    """Responses to server requests are not client requests: their ids are never claimed."""
    message = parse_client_body(
        body(
            [
                {"jsonrpc": "2.0", "id": 1, "result": {}},
                request("ping", 1),
                {"jsonrpc": "2.0", "id": 1, "result": {}},
            ]
        )
    )
    assert message.request_ids == (1,)


# -- request_key ----------------------------------------------------------------------------------------


def test_request_key_distinguishes_number_and_string() -> None:
    assert request_key(1) != request_key("1")
    assert request_key(1) == request_key(1)
    assert request_key("1") == request_key("1")
    assert request_key("n:1") != request_key(1)  # a string that looks like a number key is still a string


@settings(deadline=None, max_examples=200)
@given(a=st.one_of(st.integers(), st.text()), b=st.one_of(st.integers(), st.text()))
def test_request_key_is_injective(a: int | str, b: int | str) -> None:
    same_id = type(a) is type(b) and a == b
    assert (request_key(a) == request_key(b)) == same_id


# -- response_key ---------------------------------------------------------------------------------------


def test_result_response() -> None:
    assert response_key(body({"jsonrpc": "2.0", "id": 7, "result": {"content": []}})) == "n:7"
    assert response_key(body({"jsonrpc": "2.0", "id": "7", "result": None})) == "s:7"


def test_error_response() -> None:
    doc = {"jsonrpc": "2.0", "id": "abc", "error": {"code": -32601, "message": "Method not found"}}
    assert response_key(body(doc)) == "s:abc"


def test_response_whose_result_has_a_method_key_is_a_response() -> None:
    doc = {"jsonrpc": "2.0", "id": 4, "result": {"method": "tools/call", "params": {"result": 1}}}
    assert response_key(body(doc)) == "n:4"
    nested_error = {"jsonrpc": "2.0", "id": 5, "error": {"code": 1, "message": "m", "data": {"method": "x"}}}
    assert response_key(body(nested_error)) == "n:5"


def test_notification_mentioning_result_is_not_a_response() -> None:
    doc = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"result": 1, "error": 2}}
    assert response_key(body(doc)) is None


def test_server_request_mentioning_result_is_not_a_response() -> None:
    doc = {"jsonrpc": "2.0", "id": 9, "method": "sampling/createMessage", "params": {"result": "x"}}
    assert response_key(body(doc)) is None


def test_messages_without_result_or_error_bytes_are_not_parsed() -> None:
    # No "result"/"error" bytes: the fast path says None without parsing (even for invalid JSON).
    assert response_key(b'{"jsonrpc":"2.0","method":"notifications/progress"}') is None
    assert response_key(b"{not json at all") is None
    assert response_key(b"") is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"result": ',
        b'"result"',
        b'["result", "error"]',
        b'{"jsonrpc":"2.0","id":1,"result":1',
        b'\xff"result"',
    ],
    ids=["truncated", "a string", "a list", "unterminated", "not utf-8"],
)
def test_invalid_json_or_non_object_is_not_a_response(raw: bytes) -> None:
    assert response_key(raw) is None


@pytest.mark.parametrize("bad_id", [None, True, 1.5, [1]], ids=repr)
def test_response_with_unusable_id(bad_id: object) -> None:
    assert (
        response_key(body({"jsonrpc": "2.0", "id": bad_id, "error": {"code": -32700, "message": "x"}}))
        is None
    )


def test_object_mentioning_result_only_in_a_value_is_not_a_response() -> None:
    assert response_key(body({"jsonrpc": "2.0", "id": 1, "note": "result"})) is None


def test_response_key_matches_request_key() -> None:
    ids: tuple[int | str, ...] = (0, 1, -3, 2**53, "x", "", "1")
    for request_id in ids:
        doc: dict[str, object] = {"jsonrpc": "2.0", "id": request_id, "result": {}}
        assert response_key(body(doc)) == request_key(request_id)


# -- error_response -------------------------------------------------------------------------------------


def test_error_response_round_trips() -> None:
    raw = error_response(7, -32000, "lost", {"reason": "upstream_stream_lost"})
    assert orjson.loads(raw) == {
        "jsonrpc": "2.0",
        "id": 7,
        "error": {"code": -32000, "message": "lost", "data": {"reason": "upstream_stream_lost"}},
    }
    assert response_key(raw) == "n:7"


def test_response_with_escaped_member_name_is_a_response() -> None:
    """``"res\\u0075lt"`` is the member name ``result`` (RFC 8259 section 7): the document is a response."""
    raw = b'{"jsonrpc":"2.0","id":1,"res\\u0075lt":{}}'
    assert orjson.loads(raw) == {"jsonrpc": "2.0", "id": 1, "result": {}}
    assert response_key(raw) == "n:1"


def test_an_event_serialized_as_a_notification_is_never_taken_for_a_response() -> None:
    """The cheap first test: a top-level "method" (as the SDKs write it) is a request or notification."""
    note = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":{"result":1,"error":2}}}'
    assert response_key(note) is None
    request = b'{"jsonrpc":"2.0","method":"sampling/createMessage","id":3,"params":{}}'
    assert response_key(request) is None
    assert response_key(b'{"jsonrpc":"2.0","id":3,"result":{"method":"x"}}') == request_key(3)


def test_request_keys_of_small_integer_ids_are_one_string_each_and_the_same_keys() -> None:
    """Small integer ids share one key string per process (an idle session's claim map keeps one); every
    id still has the key it always had, and True, False and 1.0 are no integer ids' keys."""
    assert request_key(1) == "n:1" and request_key(1) is request_key(1)
    assert request_key(0) == "n:0" and request_key(1023) == "n:1023"
    assert (
        request_key(1024) == "n:1024"
        and request_key(-1) == "n:-1"
        and request_key(10**20) == "n:" + "1" + "0" * 20
    )
    assert request_key("1") == "s:1"
    assert request_key(True) == "n:True" and request_key(False) == "n:False"
    assert request_key(int("7")) is request_key(7)
