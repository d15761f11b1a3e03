"""The routing decision (mcpresume/core/route.py): every input combination, against a table written out
here."""

from __future__ import annotations

import itertools

import pytest

from mcpresume.core.errors import jsonrpc_error_body
from mcpresume.core.route import (
    Forward,
    Kind,
    Owner,
    Refuse,
    Route,
    Serve,
    TakeOver,
    kind_of,
    owner_of,
    route,
)

HERE = "pod-a"
OTHER = "pod-b"
OTHER_URL = "http://10.0.0.2:8080/mcp"

# Every value each input can take, as the shell passes it.
OWNERS = (None, "", HERE, OTHER)  # the store's owner(): unknown, no owner recorded, this one, another
URLS = (None, OTHER_URL)  # the registry's replica_url(owner): no live lease, a live one
BOOLS = (False, True)

SESSION_KINDS = (Kind.POST, Kind.RESEND, Kind.GET, Kind.DELETE)  # what only the owner's upstream may see

# (where the owner is, kind) -> what a request without the hop header gets, before any takeover.
EXPECTED: dict[tuple[Owner, Kind], str] = {
    **{(owner, Kind.INITIALIZE): "serve" for owner in Owner},
    **{(owner, Kind.OTHER): "serve" for owner in Owner},
    **{(Owner.UNKNOWN, kind): "serve" for kind in (*SESSION_KINDS, Kind.REATTACH)},
    **{(Owner.HERE, kind): "serve" for kind in (*SESSION_KINDS, Kind.REATTACH)},
    **{(Owner.LIVE, kind): "forward" for kind in SESSION_KINDS},
    (Owner.LIVE, Kind.REATTACH): "serve",  # re-attach anywhere: never forwarded
    **{(Owner.LOST, kind): "takeover" for kind in SESSION_KINDS},
    (Owner.LOST, Kind.REATTACH): "serve, owner lost",
}

# A re-attach whose serving would reach the upstream (a credential ping, a new standalone stream) goes where
# a GET goes: only the owner's upstream knows the session. needs_upstream changes nothing else.
NEEDING_UPSTREAM = {(owner, Kind.REATTACH): EXPECTED[owner, Kind.GET] for owner in Owner}

# What the hop header and a takeover already tried do to those: only refuse, never add a hop or a takeover.
WITH_HOP = {"forward": "refuse misrouted_hop"}
AFTER_TAKEOVER = {"takeover": "refuse owner_lost"}


def _said(decision: Route) -> str:
    match decision:
        case Serve(owner_lost=False):
            return "serve"
        case Serve(owner_lost=True):
            return "serve, owner lost"
        case Forward():
            return "forward"
        case TakeOver():
            return "takeover"
        case Refuse(error=error):
            return f"refuse {error.reason}"
    raise AssertionError(decision)


def test_the_table_covers_every_owner_and_kind() -> None:
    assert set(EXPECTED) == set(itertools.product(Owner, Kind))


@pytest.mark.parametrize(
    ("kind", "owner", "hopped", "owner_url", "needs_upstream", "tried"),
    list(itertools.product(Kind, OWNERS, BOOLS, URLS, BOOLS, BOOLS)),
)
def test_every_combination_is_routed_by_the_table(
    kind: Kind, owner: str | None, hopped: bool, owner_url: str | None, needs_upstream: bool, tried: bool
) -> None:
    decision = route(
        kind,
        owner=owner,
        here=HERE,
        hopped=hopped,
        owner_url=owner_url,
        needs_upstream=needs_upstream,
        takeover_tried=tried,
    )
    key = owner_of(owner, HERE, owner_url), kind
    expected = NEEDING_UPSTREAM.get(key, EXPECTED[key]) if needs_upstream else EXPECTED[key]
    if hopped:
        expected = WITH_HOP.get(expected, expected)
    if tried:
        expected = AFTER_TAKEOVER.get(expected, expected)
    assert _said(decision) == expected
    # The rules the table is there for, said once more on the decision itself:
    if isinstance(decision, Forward):
        assert decision.url == owner_url == OTHER_URL  # the target only ever comes from the registry
        assert not hopped  # a forwarded request is never forwarded again
        assert kind in SESSION_KINDS or (kind is Kind.REATTACH and needs_upstream)
    if isinstance(decision, TakeOver):
        assert decision.owner == owner == OTHER and owner_url is None
        assert not tried  # the second routing never starts another takeover: no loop
    if isinstance(decision, Refuse):
        error = decision.error
        assert error.status in (503,) and error.reason in ("misrouted_hop", "owner_lost")
        body = jsonrpc_error_body(error, 7)
        assert body["error"]["data"]["reason"] == error.reason and body["id"] == 7
    if kind is Kind.REATTACH and not needs_upstream:
        assert isinstance(decision, Serve)  # served anywhere, never forwarded nor refused by routing


def test_owner_of_every_answer_of_the_store() -> None:
    assert [owner_of(o, HERE, u) for o in OWNERS for u in URLS] == [
        Owner.UNKNOWN,
        Owner.UNKNOWN,
        Owner.UNKNOWN,  # "": no owner recorded (the memory store's sessions): served as today
        Owner.UNKNOWN,
        Owner.HERE,
        Owner.HERE,  # a URL for this replica changes nothing: never forward to oneself
        Owner.LOST,
        Owner.LIVE,
    ]


KINDS = {
    # (method, Mcp-Session-Id, Last-Event-ID) -> kind
    ("POST", False, False): Kind.INITIALIZE,
    ("POST", False, True): Kind.INITIALIZE,
    ("GET", False, False): Kind.INITIALIZE,  # no session to route on: the handler answers (400) here
    ("GET", False, True): Kind.INITIALIZE,
    ("DELETE", False, False): Kind.INITIALIZE,
    ("DELETE", False, True): Kind.INITIALIZE,
    ("PUT", False, False): Kind.INITIALIZE,
    ("PUT", False, True): Kind.INITIALIZE,
    ("POST", True, False): Kind.POST,
    ("POST", True, True): Kind.RESEND,  # its new messages must reach the owner's upstream
    ("GET", True, False): Kind.GET,
    ("GET", True, True): Kind.REATTACH,
    ("DELETE", True, False): Kind.DELETE,
    ("DELETE", True, True): Kind.DELETE,  # a cursor means nothing to a DELETE
    ("PUT", True, False): Kind.OTHER,
    ("PUT", True, True): Kind.OTHER,
}


def test_kind_of_every_request() -> None:
    assert set(KINDS) == set(itertools.product(("POST", "GET", "DELETE", "PUT"), BOOLS, BOOLS))
    for (method, session, cursor), kind in KINDS.items():
        assert kind_of(method, session=session, cursor=cursor) is kind, (method, session, cursor)
    assert set(KINDS.values()) == set(Kind)
