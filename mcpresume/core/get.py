"""What a GET on the MCP endpoint gets (pure): decided from the request's facts and what the store said.

The executor (``http.get.Gets.serve``) asks ``plan_get`` what to do, fetches what it says it needs (``Need``),
asks again, and carries out the plan it finally gets. The rows, first match wins:

====  =============================================  =================================================
row   facts                                          plan
====  =============================================  =================================================
1     no ``Mcp-Session-Id``, or a revision without   ``Relay``: forwarded as it is
      sessions (``jsonrpc.MODERN_VERSIONS``)
2     the store not asked yet                        ``Need.ACCESS`` (the store's access record, and
                                                     the credential check when it has one)
3     a ``Last-Event-ID``, not decided yet           ``Need.RESUME`` (``core.resume.decide``)
4     decided: a rejection                           ``Reject`` with it
5     decided: the cursor is the end of the          ``Standalone`` (a new one: the session's
      standalone stream, which ended                 server-to-client channel goes on)
6     decided: a re-attach                           ``ServeWindow``: a view after the cursor, of its
                                                     stream and its group
7     no cursor, the session unknown                 ``Reject`` 404 ``unknown_session``
8     no cursor                                      ``Standalone``
====  =============================================  =================================================

``Standalone`` is then planned by ``plan_standalone``, once per look at the store:

====  =============================================  =================================================
row   facts                                          plan
====  =============================================  =================================================
1     a live standalone stream, of another           ``Reject`` 404 (``ENDED_WHILE_JOINING``)
      incarnation than the one checked
2     a live standalone stream the store retains     ``Join`` it at its head (primed with a cursor
                                                     at the head, when the client takes priming
                                                     events and the head is an event)
3     another request of the session is opening it   ``WaitForOpening``, then look again
4     otherwise                                      ``Open`` it (one upstream GET, and its pump)
====  =============================================  =================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mcpresume.core.errors import ProxyError, SessionGone, UnknownSession
from mcpresume.core.resume import ReAttach, SessionView, StreamView


class Need(enum.Enum):
    """What the plan needs to know before it is made."""

    ACCESS = "access"  # the store's access record of the session (and the credential check, if it has one)
    RESUME = "resume"  # the resume decision for the request's cursor


@dataclass(frozen=True, slots=True)
class Resumed:
    """The resume decision's re-attach, with the stream as the decision saw it and the session's newest
    seq then."""

    decision: ReAttach
    stream: StreamView
    newest: int


@dataclass(frozen=True, slots=True)
class GetFacts:
    has_session: bool  # the request carries Mcp-Session-Id
    stateless: bool  # a revision without sessions (MODERN_VERSIONS): the proxy has nothing to add
    has_cursor: bool  # it carries Last-Event-ID
    asked: bool = False  # the store was asked (Need.ACCESS)
    known: bool = False  # ... and has the session
    resumed: Resumed | ProxyError | None = None  # the resume decision (Need.RESUME), once made


@dataclass(frozen=True, slots=True)
class Relay:
    """Forward the request as it is, and relay the answer."""


@dataclass(frozen=True, slots=True)
class Reject:
    error: ProxyError


@dataclass(frozen=True, slots=True)
class ServeWindow:
    """A view of ``streams`` after seq ``after``, from the window (a re-attach)."""

    streams: tuple[int, ...]  # the cursor's stream first, then its group
    after: int
    replay_through: int  # the session's newest seq when decided: the events up to it count as replayed
    standalone: bool


@dataclass(frozen=True, slots=True)
class Standalone:
    """Join the session's live standalone stream, or open it (``plan_standalone``). ``replaces``: the
    number of the ended standalone stream whose end the client had (None: a GET without a cursor)."""

    replaces: int | None = None


GetPlan = Relay | Reject | ServeWindow | Standalone


def plan_get(facts: GetFacts) -> GetPlan | Need:
    """What a GET gets (the module docstring's first table)."""
    if not facts.has_session or facts.stateless:
        return Relay()
    if not facts.asked:
        return Need.ACCESS
    if facts.has_cursor:
        resumed = facts.resumed
        if resumed is None:
            return Need.RESUME
        if isinstance(resumed, ProxyError):
            return Reject(resumed)
        stream, after = resumed.stream, resumed.decision.after
        if stream.standalone and not stream.live and after >= stream.last_seq:
            return Standalone(replaces=stream.number)
        streams = (resumed.decision.stream, *stream.group)
        return ServeWindow(streams, after, resumed.newest, stream.standalone)
    if not facts.known:
        return Reject(UnknownSession())
    return Standalone()


@dataclass(frozen=True, slots=True)
class Join:
    """A view of the live standalone ``stream`` from its head (seq ``head``); ``primed``: it begins with a
    priming event whose cursor is the head, so a client that drops before the next message misses nothing."""

    stream: int
    head: int
    primed: bool


@dataclass(frozen=True, slots=True)
class WaitForOpening:
    """Another request of the session is opening the standalone stream: wait for it, then look again."""


@dataclass(frozen=True, slots=True)
class Open:
    """Open the standalone stream: one upstream GET, and its pump."""


StandalonePlan = Join | WaitForOpening | Open | Reject


def plan_standalone(
    live: int | None, view: SessionView | None, epoch: str, *, opening: bool, primes: bool
) -> StandalonePlan:
    """Join, wait or open (the module docstring's second table). ``live``: the store's live standalone
    stream; ``view``: the store's view of it; ``epoch``: the incarnation the credentials were checked in;
    ``opening``: another request of the session is opening it here; ``primes``: the client takes priming
    events (2025-11-25 and later)."""
    if live is not None and view is not None:
        if view.epoch != epoch:  # re-issued since it was checked
            return Reject(UnknownSession(SessionGone.ENDED_WHILE_JOINING))
        if view.stream is not None:
            head = view.stream.last_seq
            return Join(live, head, primes and head >= view.stream.first_seq)
    if opening:
        return WaitForOpening()
    return Open()
