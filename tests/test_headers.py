"""Which headers cross the proxy: RFC 9110 section 7.6.1, and X-Forwarded-*."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcpresume.core.headers import (
    IDENTITY,
    IP_ADDRESSES,
    LOOPBACK_HOSTS,
    SSE_RESPONSE_HEADERS,
    AskingIdentity,
    answer_headers,
    asking_identity,
    effective_allowed_hosts,
    end_to_end,
    forwarded,
    header,
    host_allowed,
    identity_request_headers,
    request_headers,
    rewrite_locations,
    split_host,
    sse_answer_headers,
    visible_ascii,
)

# RFC 9110 section 7.6.1 names these; Proxy-Connection is the legacy spelling some clients still send.
HOP_BY_HOP = ["Connection", "Proxy-Connection", "Keep-Alive", "TE", "Transfer-Encoding", "Upgrade"]

END_TO_END = [
    ("Mcp-Session-Id", "3f2a"),
    ("MCP-Protocol-Version", "2025-11-25"),
    ("Authorization", "Bearer secret"),
    ("Accept", "application/json, text/event-stream"),
    ("Content-Type", "application/json"),
    ("Origin", "https://app.example"),
    ("Last-Event-ID", "aaaabbbbcccc-1-2"),
    ("WWW-Authenticate", 'Bearer resource_metadata="https://rs.example/.well-known"'),
    ("Cache-Control", "no-cache"),
    ("X-Custom", "kept"),
]


def names(headers: list[tuple[str, str]]) -> list[str]:
    return [name.lower() for name, _ in headers]


@pytest.mark.parametrize("request_side", [True, False], ids=["request", "response"])
def test_end_to_end_fields_pass_untouched(request_side: bool) -> None:
    assert end_to_end(END_TO_END, request=request_side) == END_TO_END


@pytest.mark.parametrize("request_side", [True, False], ids=["request", "response"])
@pytest.mark.parametrize("name", HOP_BY_HOP)
def test_hop_by_hop_fields_are_dropped(name: str, request_side: bool) -> None:
    for spelling in (name, name.lower(), name.upper()):
        headers = [*END_TO_END, (spelling, "keep-alive" if "connection" in name.lower() else "x")]
        assert end_to_end(headers, request=request_side) == END_TO_END


@pytest.mark.parametrize("request_side", [True, False], ids=["request", "response"])
def test_proxy_authentication_and_trailer_are_dropped(request_side: bool) -> None:
    headers = [
        ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
        ("Proxy-Authenticate", "Basic"),
        ("Trailer", "X-Checksum"),
        *END_TO_END,
    ]
    assert end_to_end(headers, request=request_side) == END_TO_END


@pytest.mark.parametrize("request_side", [True, False], ids=["request", "response"])
def test_content_length_is_the_proxys_own_framing(request_side: bool) -> None:
    assert end_to_end([("Content-Length", "12"), *END_TO_END], request=request_side) == END_TO_END


def test_fields_named_in_connection_are_dropped_case_insensitively() -> None:
    headers = [
        ("Connection", "X-Hop,  x-other ,close"),
        ("x-hop", "1"),
        ("X-OTHER", "2"),
        ("X-Kept", "3"),
        ("connection", "X-THIRD"),  # a second Connection field adds to the list
        ("X-Third", "4"),
    ]
    assert end_to_end(headers, request=True) == [("X-Kept", "3")]
    assert end_to_end(headers, request=False) == [("X-Kept", "3")]


def test_connection_can_name_an_end_to_end_field() -> None:
    # RFC 9110 7.6.1: whatever Connection lists is hop-by-hop for this message, even a well-known field.
    headers = [("Connection", "Mcp-Session-Id"), ("Mcp-Session-Id", "3f2a"), ("Accept", "*/*")]
    assert end_to_end(headers, request=True) == [("Accept", "*/*")]


def test_empty_connection_tokens_drop_nothing_else() -> None:
    headers = [("Connection", " , ,"), ("Accept", "*/*")]
    assert end_to_end(headers, request=True) == [("Accept", "*/*")]


def test_host_is_dropped_only_on_requests() -> None:
    headers = [("Host", "proxy.example:8080"), ("Accept", "*/*")]
    assert end_to_end(headers, request=True) == [("Accept", "*/*")]
    assert end_to_end([("host", "x")], request=True) == []
    assert end_to_end(headers, request=False) == headers


def test_repeated_fields_keep_their_order_and_case() -> None:
    headers = [
        ("Set-Cookie", "a=1"),
        ("Keep-Alive", "timeout=5"),
        ("set-cookie", "b=2"),
        ("WWW-Authenticate", "Basic"),
        ("www-authenticate", "Bearer"),
    ]
    assert end_to_end(headers, request=False) == [
        ("Set-Cookie", "a=1"),
        ("set-cookie", "b=2"),
        ("WWW-Authenticate", "Basic"),
        ("www-authenticate", "Bearer"),
    ]


def test_end_to_end_accepts_any_iterable_once() -> None:
    # The shell passes aiohttp's items() view; a generator (single pass) must work as well.
    generator = (pair for pair in [("Connection", "X-Hop"), ("X-Hop", "1"), ("Accept", "*/*")])
    assert end_to_end(generator, request=True) == [("Accept", "*/*")]


# -- forwarded --------------------------------------------------------------------------------------------


def test_forwarded_adds_all_three() -> None:
    headers = [("Accept", "*/*")]
    result = forwarded(headers, client_ip="10.0.0.7", proto="https", host="mcp.example")
    assert result == [
        ("Accept", "*/*"),
        ("X-Forwarded-For", "10.0.0.7"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "mcp.example"),
    ]
    assert headers == [("Accept", "*/*")]  # the input is not changed


def test_forwarded_appends_to_an_existing_chain() -> None:
    headers = [("X-Forwarded-For", "203.0.113.5, 10.1.1.1"), ("Accept", "*/*")]
    result = forwarded(headers, client_ip="10.0.0.7", proto="http", host=None)
    assert header(result, "X-Forwarded-For") == "203.0.113.5, 10.1.1.1, 10.0.0.7"
    assert names(result).count("x-forwarded-for") == 1


def test_forwarded_joins_several_prior_fields_in_order() -> None:
    headers = [("x-forwarded-for", "1.1.1.1"), ("Accept", "*/*"), ("X-FORWARDED-FOR", "2.2.2.2")]
    result = forwarded(headers, client_ip="3.3.3.3", proto="http", host=None)
    xff = [v for n, v in result if n.lower() == "x-forwarded-for"]
    assert xff == ["1.1.1.1, 2.2.2.2, 3.3.3.3"]
    assert ("Accept", "*/*") in result


def test_forwarded_without_client_ip() -> None:
    assert header(forwarded([], client_ip=None, proto="http", host=None), "X-Forwarded-For") is None
    prior = [("X-Forwarded-For", "1.1.1.1")]
    assert header(forwarded(prior, client_ip=None, proto="http", host=None), "X-Forwarded-For") == "1.1.1.1"


def test_forwarded_keeps_a_prior_proto_and_host() -> None:
    headers = [("x-forwarded-proto", "https"), ("X-Forwarded-Host", "public.example")]
    result = forwarded(headers, client_ip="10.0.0.7", proto="http", host="internal:8080")
    assert [v for n, v in result if n.lower() == "x-forwarded-proto"] == ["https"]
    assert [v for n, v in result if n.lower() == "x-forwarded-host"] == ["public.example"]
    assert header(result, "X-Forwarded-For") == "10.0.0.7"


def test_forwarded_without_host() -> None:
    result = forwarded([], client_ip="10.0.0.7", proto="http", host=None)
    assert header(result, "X-Forwarded-Host") is None
    assert header(result, "X-Forwarded-Proto") == "http"


# -- each message's names lowercased once: the same as the filters one after another ----------------------

# Names that every filter above decides on, in several spellings, and values that matter to some of them.
_NAMES = st.sampled_from(
    [
        "Accept",
        "accept-encoding",
        "Accept-Encoding",
        "Connection",
        "connection",
        "Content-Length",
        "Content-Encoding",
        "Content-Type",
        "Cache-Control",
        "X-Accel-Buffering",
        "Host",
        "Location",
        "content-location",
        "Mcp-Session-Id",
        "Transfer-Encoding",
        "X-Forwarded-For",
        "x-forwarded-for",
        "X-Forwarded-Proto",
        "X-FORWARDED-HOST",
        "Expect",
        "Mcp-Resume-Hop",
    ]
)
_VALUES = st.sampled_from(
    [
        "1",
        "keep-alive",
        "X-Forwarded-For, x-forwarded-proto",
        "Location, accept-encoding",
        "x-forwarded-host",
        "http://up.example/a?b",
        "https://elsewhere.example/",
        "10.0.0.1",
    ]
)
_HEADERS = st.lists(st.tuples(_NAMES, _VALUES), max_size=10)
_UPSTREAM = "http://up.example"


@given(_HEADERS, st.sampled_from([None, "10.0.0.7"]), st.sampled_from([None, "proxy.example:8080"]))
def test_request_headers_are_forwarded_of_end_to_end(
    headers: list[tuple[str, str]], client_ip: str | None, host: str | None
) -> None:
    expected = forwarded(end_to_end(headers, request=True), client_ip=client_ip, proto="https", host=host)
    assert request_headers(headers, client_ip=client_ip, proto="https", host=host) == expected
    # A request whose answer the proxy reads: the client's Accept-Encoding replaced by identity, last.
    identity = [(n, v) for n, v in expected if n.lower() != "accept-encoding"] + [IDENTITY]
    asked = identity_request_headers(iter(headers), client_ip=client_ip, proto="https", host=host)
    assert isinstance(asked, AskingIdentity) and list(asked) == identity
    assert list(asking_identity(expected)) == identity
    assert asking_identity(asked) is asked  # asked once: not filtered again


@given(_HEADERS)
def test_answer_headers_are_the_filters_one_after_another(headers: list[tuple[str, str]]) -> None:
    relayed = end_to_end(headers, request=False)
    assert answer_headers(iter(headers), _UPSTREAM, decoded=False) == rewrite_locations(relayed, _UPSTREAM)
    decoded = [(n, v) for n, v in relayed if n.lower() != "content-encoding"]
    assert answer_headers(headers, _UPSTREAM, decoded=True) == rewrite_locations(decoded, _UPSTREAM)
    ours = {name.lower() for name, _ in SSE_RESPONSE_HEADERS}
    sse = [(n, v) for n, v in rewrite_locations(decoded, _UPSTREAM) if n.lower() not in ours]
    assert sse_answer_headers(headers, _UPSTREAM) == sse


def test_an_answer_location_at_the_upstream_points_at_the_proxy() -> None:
    headers = [
        ("Content-Encoding", "gzip"),
        ("Location", "http://up.example/next?x=1"),
        ("Connection", "close"),
    ]
    assert answer_headers(headers, _UPSTREAM, decoded=True) == [("Location", "/next?x=1")]
    assert answer_headers(headers, _UPSTREAM, decoded=False) == [
        ("Content-Encoding", "gzip"),
        ("Location", "/next?x=1"),
    ]


# -- header -----------------------------------------------------------------------------------------------


def test_header_returns_the_first_value_case_insensitively() -> None:
    headers = [("mcp-session-id", "first"), ("Mcp-Session-Id", "second")]
    assert header(headers, "MCP-SESSION-ID") == "first"
    assert header(headers, "Last-Event-ID") is None
    assert header([], "Accept") is None


def test_host_matching_and_the_default_rule() -> None:
    assert split_host("LocalHost:8080") == ("localhost", "8080")
    assert split_host("[::1]:9") == ("[::1]", "9")
    assert split_host("[::1]") == ("[::1]", None)
    assert split_host("example.com") == ("example.com", None)
    assert host_allowed("example.com:1", ["example.com"])
    assert not host_allowed("example.com:1", ["example.com:2"])
    assert not host_allowed("example.com", ["example.com:2"])
    assert not host_allowed(None, ["example.com"])
    assert host_allowed(None, ["*"])
    assert effective_allowed_hosts([], "127.0.0.1") == LOOPBACK_HOSTS
    assert effective_allowed_hosts([], "::1") == LOOPBACK_HOSTS
    assert effective_allowed_hosts([], "localhost") == LOOPBACK_HOSTS
    # Elsewhere: those and any IP address, no DNS name (what a rebinding page's browser sends).
    assert effective_allowed_hosts([], "0.0.0.0") == (*LOOPBACK_HOSTS, IP_ADDRESSES)
    assert effective_allowed_hosts([], "::") == (*LOOPBACK_HOSTS, IP_ADDRESSES)
    assert effective_allowed_hosts([], "10.1.2.3") == (*LOOPBACK_HOSTS, IP_ADDRESSES)
    anywhere = effective_allowed_hosts([], "0.0.0.0")
    for host in ("10.1.2.3:8080", "10.1.2.3", "[fd00::1]:80", "[::1]", "localhost:1", "127.0.0.1"):
        assert host_allowed(host, anywhere), host
    for host in (
        "evil.example",
        "evil.example:8080",
        "10.1.2.3.nip.io",
        "[fd00::1",
        "fd00::1",
        IP_ADDRESSES,
        "",
    ):
        assert not host_allowed(host, anywhere), host
    assert not host_allowed(None, anywhere)
    assert effective_allowed_hosts(["a.example"], "127.0.0.1") == ("a.example",)
    assert not host_allowed("evil.example:80", LOOPBACK_HOSTS)
    assert host_allowed("127.0.0.1:65000", LOOPBACK_HOSTS)


def test_locations_at_the_upstream_become_references_on_the_proxy() -> None:
    origin = "http://127.0.0.1:8000"
    headers = [
        ("Location", "http://127.0.0.1:8000/mcp?a=1#f"),
        ("content-location", "HTTP://127.0.0.1:8000"),
        ("Location", "https://127.0.0.1:8000/mcp"),  # another scheme: another origin
        ("Location", "http://127.0.0.1:8001/mcp"),
        ("Location", "http://127.0.0.1:bad/mcp"),
        ("Location", "/already/relative"),
        ("Link", "http://127.0.0.1:8000/x"),  # only the two location fields
    ]
    assert rewrite_locations(headers, origin) == [
        ("Location", "/mcp?a=1#f"),
        ("content-location", "/"),
        *headers[2:],
    ]
    assert rewrite_locations([("Location", "http://up.example:80/p")], "http://up.example") == [
        ("Location", "/p")
    ]
    assert rewrite_locations([("Location", "https://up.example/p")], "https://UP.example:443") == [
        ("Location", "/p")
    ]


@given(st.text(alphabet=st.characters(max_codepoint=0x2FF)))
def test_visible_ascii_is_every_character_between_0x21_and_0x7e(value: str) -> None:
    assert visible_ascii(value) == all(0x21 <= ord(c) <= 0x7E for c in value)


def test_visible_ascii_edges() -> None:
    assert visible_ascii("!~abc-123") and visible_ascii("")
    for bad in (" ", "a b", "\x7f", "\x20", "\x00", "\t", "é", "\u00a0"):
        assert not visible_ascii(bad), repr(bad)
