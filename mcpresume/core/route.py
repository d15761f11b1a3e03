"""Which replica serves a request of a session: this one, its owner, or none (pure).

Theory of operation. With a shared store several replicas serve one MCP endpoint behind a balancer with no
affinity. The replica whose upstream answered ``initialize`` owns the session (the store records its
``replica_id``): only its upstream knows the session, so only it may send the session's requests upstream.
Every replica registers the URL at which the others reach it (``advertise_url``) under a lease it renews.

A request of a session is then, by its kind and where the session's owner is:

- ``INITIALIZE`` (no ``Mcp-Session-Id``): nothing to route on; served here (a new session begins here).
- ``REATTACH`` (``GET`` with ``Last-Event-ID``): served here, wherever the owner is, never forwarded: the
  window is in the store, and live events reach every replica through the store's news. With the owner's
  lease gone it is served all the same, and the shell starts the owner's takeover beside it
  (``Serve.lost_owner``). Unless serving it would reach the upstream (``needs_upstream``: a credential
  ping for credentials new to the session, a new standalone stream after the upstream ended the old one):
  only the owner's upstream knows the session, so it then goes where a ``GET`` goes.
- ``POST``, ``RESEND`` (``POST`` with ``Last-Event-ID``: the new messages it carries go upstream beside
  the tail it asks for), ``GET`` (the standalone stream), ``DELETE``: served here when this replica owns
  the session or no owner is known (an unknown session: the handler's own rules answer, 404
  ``unknown_session`` or the adoption of a session the upstream knows); forwarded to the owner's
  advertised URL while its lease is live; while it is not, the takeover path runs (``TakeOver``) and the
  request is routed again after it.
- ``OTHER`` (any other method): answered here, as without a store.

Two rules keep forwarding finite and safe:

- A forwarded request carries the hop header; one that already carries it is never forwarded again: for
  a session owned by another live replica it is refused (``misrouted_hop``: ownership moved while it was
  on its way, or a client sent the header). So the header can only make a replica do less, never more:
  forging it gains a client nothing.
- The forward target is only ever the owner's URL from the store's registry (``owner_url``): nothing a
  client sends can name an address.

The takeover path ends with a live owner (this replica or the winner of the store's atomic claim) or a
session gone; the second routing is told so (``takeover_tried``) and refuses (``owner_lost``) rather than
start another takeover, so a request never loops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from mcpresume.core.errors import MisroutedHop, OwnerLost, ProxyError


class Kind(enum.Enum):
    """What a request to the MCP endpoint asks, as far as routing cares."""

    INITIALIZE = "initialize"  # no Mcp-Session-Id: initialize, or a request the handler answers alone
    POST = "post"  # a JSON-RPC message of a session, no Last-Event-ID
    GET = "get"  # the session's standalone stream, no Last-Event-ID
    REATTACH = "reattach"  # a GET with Last-Event-ID: a re-attach
    RESEND = "resend"  # a POST with Last-Event-ID: a re-attach that may carry new messages too
    DELETE = "delete"  # the session's end
    OTHER = "other"  # any other method (405 as without a store)


def kind_of(method: str, *, session: bool, cursor: bool) -> Kind:
    """The kind of a request to the MCP endpoint: its method, whether it carries ``Mcp-Session-Id``
    (``session``) and ``Last-Event-ID`` (``cursor``)."""
    if not session:
        return Kind.INITIALIZE
    return _KIND_OF_METHOD.get((method, cursor and method != "DELETE"), Kind.OTHER)


# (method, carries a cursor) -> kind; a cursor means nothing to a DELETE.
_KIND_OF_METHOD: Final = {
    ("GET", False): Kind.GET,
    ("GET", True): Kind.REATTACH,
    ("POST", False): Kind.POST,
    ("POST", True): Kind.RESEND,
    ("DELETE", False): Kind.DELETE,
}


class Owner(enum.Enum):
    """Where a session's owner is, seen from this replica."""

    UNKNOWN = "unknown"  # the store knows no session (None), or no owner recorded ("": a memory store)
    HERE = "here"  # this replica
    LIVE = "live"  # another replica, whose lease is live: its URL is known
    LOST = "lost"  # another replica, without a live lease (dead, or released it on a drain)


def owner_of(owner: str | None, here: str, owner_url: str | None) -> Owner:
    """``owner``: the store's ``owner(session_id)``; ``owner_url``: its ``replica_url(owner, now)``."""
    if not owner:
        return Owner.UNKNOWN
    if owner == here:
        return Owner.HERE
    return Owner.LIVE if owner_url is not None else Owner.LOST


@dataclass(frozen=True, slots=True)
class Serve:
    """Serve the request here. ``lost_owner``: the owner, whose lease is gone; start its takeover without
    waiting for it (a re-attach reads the store, and the takeover's ending reaches it as news)."""

    lost_owner: str | None = None

    @property
    def owner_lost(self) -> bool:
        return self.lost_owner is not None


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward the request, once, with the hop header, to ``url``: the owner's URL from the registry."""

    url: str


@dataclass(frozen=True, slots=True)
class Refuse:
    error: ProxyError


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The owner ``owner`` has no live lease: claim its streams (the store's atomic claim picks one
    winner), then route the request again with ``takeover_tried=True``."""

    owner: str


Route = Serve | Forward | Refuse | TakeOver

# The kinds whose answer depends on where the session's owner is.
_ROUTED: Final = frozenset({Kind.POST, Kind.RESEND, Kind.GET, Kind.DELETE, Kind.REATTACH})


def route(
    kind: Kind,
    *,
    owner: str | None,
    here: str,
    hopped: bool,
    owner_url: str | None,
    needs_upstream: bool = False,
    takeover_tried: bool = False,
) -> Route:
    """Where a request is served. ``owner``: the session's owner as the store has it (None: session
    unknown); ``here``: this replica's id; ``hopped``: the request carries the hop header; ``owner_url``:
    the registry's live URL of ``owner`` (None: no live lease; ignored unless the owner is another
    replica); ``needs_upstream``: serving a re-attach here would reach the upstream (only ``REATTACH``
    asks); ``takeover_tried``: this is the routing after the takeover path ran for this request."""
    if kind not in _ROUTED:
        return Serve()
    where = owner_of(owner, here, owner_url)
    if where in (Owner.UNKNOWN, Owner.HERE):
        return Serve()
    if kind is Kind.REATTACH and not needs_upstream:
        return Serve(lost_owner=owner if where is Owner.LOST else None)
    if where is Owner.LIVE:
        assert owner_url is not None  # owner_of said so
        if hopped:
            return Refuse(
                MisroutedHop("a forwarded request reached a replica that does not own its session; retry")
            )
        return Forward(owner_url)
    assert owner is not None  # LOST
    if takeover_tried:
        return Refuse(OwnerLost("the replica that owned this session is gone and no other took it over"))
    return TakeOver(owner)


class HopOutcome(enum.Enum):
    """How a forwarded request ended (``mcpresume_forwarded_requests_total{outcome}``)."""

    RELAYED = "relayed"  # the owner's whole answer reached the client
    OWNER_UNREACHABLE = "owner_unreachable"  # no connection, or no answer head in time: 502
    OWNER_BROKE = "owner_broke"  # the owner's answer ended early (the client's stream ends; it re-attaches)
    CLIENT_GONE = "client_gone"  # the client left, or stopped reading, before the answer's end
    DRAINED = "drained"  # this replica's drain ended the relay cleanly (its client re-attaches)


FORWARD_OUTCOMES: Final = tuple(outcome.value for outcome in HopOutcome)
