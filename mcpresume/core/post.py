"""What a POST on the MCP endpoint gets (pure): decided from the request's facts and what the store said.

The executor (``http.post.Posts.serve``) asks ``plan_post`` what to do, fetches what it says it needs
(``Need``), asks again, and carries out the plan it finally gets; once the request went upstream,
``ANSWER_STEPS`` says what its answer becomes, and ``CLAIM_ENDS`` what becomes of its claim. Owner routing
(several replicas) came first (``core/route.py``).

The rows of ``plan_post``, first match wins ("the claim": the store's claim of the message's request ids,
exactly once per request in the session, invariant #8; "the tail": POST + ``Last-Event-ID``, the streams the
cursor resumes, which this response carries before anything new):

====  =============================================  =================================================
row   facts                                          plan
====  =============================================  =================================================
1     a revision without sessions, or no             ``Relay``: forwarded as it is
      ``Mcp-Session-Id`` and not ``initialize``
2     ``initialize``, room not counted yet           ``Need.ROOM`` (the store's session count)
3     ``initialize``, no room                        ``Reject`` 503 ``too_many_sessions`` (before the
                                                     upstream starts a session the proxy cannot track)
4     ``initialize``                                 ``Forward``, no view counted (``attach_view``
                                                     counts it if the answer is a stream)
5     the store not asked yet                        ``Need.ACCESS`` (its access record)
6     no cursor, the session unknown                 ``Reject`` 404 ``unknown_session`` (not
                                                     forwarded: a re-sent request would run twice)
7     known, a cursor or request ids, the            ``Need.CREDENTIALS`` (``authorize``: a refusal
      credentials not checked yet                    is the answer)
8     a cursor, not decided yet                      ``Need.RESUME`` (``core.resume.decide``)
9     a cursor, decided: a rejection                 ``Reject`` with it
10    request ids, not claimed yet                   ``Need.CLAIM``
11    claimed: the session ended meanwhile           ``Reject`` 404 ``unknown_session``
12    claimed ``LIMITED``                            ``Reject`` 429 ``too_many_streams``
13    claimed ``ATTACH``, a cursor whose tail        ``FollowResent``: the tail's view follows the
      holds the request's stream                     re-sent request's stream, nothing forwarded
14    claimed ``ATTACH``, its stream not looked at   ``Need.ORIGINAL`` (the store's view of it)
15    claimed ``ATTACH``, a cursor, the stream       ``FollowResent`` (it comes whole after the tail)
      began after the cursor and sent no client
      anything but its priming event
16    claimed ``ATTACH``, the stream retained        ``AttachOriginal``: a view of it from its start
17    claimed otherwise (``ATTACH`` of a stream      ``Reject`` with ``session.claim_refusal``,
      gone, ``GONE``, ``IN_FLIGHT``, ``ANSWERED``,   counted as a duplicate
      ``UNKNOWN``, ``CONFLICT``, ``IN_USE``, ``CANCELLED``)
18    otherwise (``NEW``, or no request ids:         ``Forward``, the client's view counted first
      notifications and responses only)              when there is a tail or a claim
====  =============================================  =================================================

``ANSWER_STEPS``: what the upstream's answer to a forwarded POST becomes, by the answer (``Answer``) and
the tail (``Tail``; ``TailKind.NONE`` without a cursor, ``STANDALONE`` for the cursor of a standalone
stream: a standalone stream never ends and this response must, so its events stay for a GET re-attach):

==========  ========================  ========================  ========================
answer      no tail                   a tail                    a standalone cursor
==========  ========================  ========================  ========================
FAILED      ``REJECT`` its error      ``REJECT``                ``REJECT``
OPENED      ``VIEW`` of the stream    ``VIEW`` tail + stream    ``VIEW`` of the stream
JSON        ``RELAY``                 ``RETAIN`` then ``VIEW``  ``RETAIN`` then ``VIEW``
ACCEPTED    ``RELAY``                 ``TAIL``: the tail alone  ``EMPTY``: 202, no body
OTHER       ``RELAY``                 ``RELAY`` (an error)      ``RELAY``
==========  ========================  ========================  ========================

``CLAIM_ENDS``: what becomes of the claim once the upstream answered (``http.send.Sender`` records it in
the forward's own task, so it happens even when the client left), by the ``Upstream`` outcome
(``upstream_outcome`` tells them apart, first match wins, after ``UNREACHED``, ``UNANSWERED`` and
``UNREADABLE``, which are errors raised by the request itself):

==============  ===============================================  ===========  ===========================
outcome         the upstream                                     the claim    the client gets
==============  ===============================================  ===========  ===========================
``UNREACHED``   never got the request (no connection was made:   released     the error (502)
                refused, failed, not within
                ``connect_timeout``)
``UNANSWERED``  may have got it (a connection was made), and    abandoned    the error (502, 504)
                no answer head came (``first_byte_timeout``,
                the connection broke)
``UNREADABLE``  answered in an encoding the proxy cannot read    settled      502 ``upstream_bad_response``
``FORGOTTEN``   404 in the session, to credentials accepted in   dropped      404 ``unknown_session``
                it: the upstream forgot the session              (session)    (the client re-initializes)
``REFUSED``     not 2xx (a 404 to other credentials too), or     released     the upstream's answer
                an initialize answered without a session id
``WRONG_TYPE``  a request answered neither JSON nor SSE (spec)   settled      502 ``upstream_bad_response``
``ANSWERED``    answered, not with a stream                      settled      the upstream's answer
``STREAM``      an SSE stream                                    the stream   a view of the stream
==============  ===============================================  ===========  ===========================

Released: the request never ran, the same id may be sent again. Settled: it ran, a re-send is refused and
never forwarded again (invariant #8). Abandoned: it may have run, and what it did is unknown: never
forwarded again either, a re-send is refused with 409 ``outcome_unknown`` (``ClaimOutcome.UNKNOWN``). Only
a request the proxy knows it never sent is released.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from mcpresume.core.errors import (
    ProxyError,
    TooManySessions,
    UnknownSession,
    UpstreamBadResponse,
    UpstreamUnreachable,
)
from mcpresume.core.get import Relay, Resumed
from mcpresume.core.resume import StreamView
from mcpresume.core.session import Claim, ClaimOutcome, claim_refusal


class Need(enum.Enum):
    """What the plan needs to know before it is made."""

    ROOM = "room"  # whether the store has room for one more session (initialize)
    ACCESS = "access"  # the store's access record of the session
    CREDENTIALS = "credentials"  # the credential check (authorize): a refusal is the answer
    RESUME = "resume"  # the resume decision for the request's cursor
    CLAIM = "claim"  # the store's claim of the request ids
    ORIGINAL = "original"  # the store's view of the stream a re-sent request id belongs to


@dataclass(frozen=True, slots=True)
class Tail:
    """POST + ``Last-Event-ID``: the streams the cursor resumes (``followed``: the cursor's stream and its
    group; none when it is a standalone stream's), after seq ``after``; ``stream``: the cursor's stream;
    ``newest``: the session's newest seq when decided."""

    followed: tuple[int, ...]
    after: int
    stream: int
    newest: int


def tail_of(resumed: Resumed) -> Tail:
    """The tail a re-attach's decision gives a POST (a standalone stream's events are not followed)."""
    stream = resumed.stream
    followed = () if stream.standalone else (resumed.decision.stream, *stream.group)
    return Tail(followed, resumed.decision.after, resumed.decision.stream, resumed.newest)


# Not frozen: the executor (http/post.py) fills each need's answer in, where a replace() per need cost a
# few microseconds a call; plan_post only reads it.
@dataclass(slots=True)
class PostFacts:
    stateless: bool  # a revision without sessions (MODERN_VERSIONS): the proxy has nothing to add
    has_session: bool  # the request carries Mcp-Session-Id
    initialize: bool  # the message is initialize
    has_cursor: bool  # it carries Last-Event-ID
    requests: bool  # the message carries request ids (each claimed once)
    room: bool | None = None  # Need.ROOM: the store has room for a session
    asked: bool = False  # Need.ACCESS was asked ...
    known: bool = False  # ... and the store has the session
    authorized: bool = False  # Need.CREDENTIALS: the credentials may use the session
    resumed: Resumed | ProxyError | None = None  # Need.RESUME: the decision, once made
    claimed: bool = False  # Need.CLAIM was asked ...
    claim: Claim | None = None  # ... and this is its claim (None: the session ended meanwhile)
    looked: bool = False  # Need.ORIGINAL was asked ...
    original: StreamView | None = None  # ... and the stream of the claim, if retained


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer with ``error``. ``with_id``: its body carries the message's first request id;
    ``duplicate``: a request id seen before (``mcpresume_duplicate_requests_total``)."""

    error: ProxyError
    with_id: bool = True
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the request upstream. ``reserve``: count the client's view before (a request refused for too
    many views must not run upstream); ``tail``: what the view carries first (POST + ``Last-Event-ID``)."""

    reserve: bool
    tail: Tail | None = None


@dataclass(frozen=True, slots=True)
class FollowResent:
    """A re-sent request id whose stream the client takes after the tail: a view of ``streams``, the
    request not forwarded again (a duplicate)."""

    tail: Tail
    streams: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AttachOriginal:
    """A re-sent request id: a view of its retained ``stream`` from its start (after seq ``after``)."""

    stream: int
    after: int


PostPlan = Relay | Reject | Forward | FollowResent | AttachOriginal


def plan_post(facts: PostFacts, *, max_sessions: int, max_streams: int) -> PostPlan | Need:
    """What a POST gets (the module docstring's first table)."""
    if facts.stateless or (not facts.has_session and not facts.initialize):
        return Relay()
    if not facts.has_session:
        if facts.room is None:
            return Need.ROOM
        if not facts.room:
            return Reject(
                TooManySessions(
                    f"the proxy holds its maximum of {max_sessions} sessions", max_sessions=max_sessions
                ),
                with_id=False,
            )
        return Forward(reserve=False)
    if not facts.asked:
        return Need.ACCESS
    if not facts.has_cursor and not facts.known:
        return Reject(UnknownSession(), with_id=False)
    if facts.known and (facts.has_cursor or facts.requests) and not facts.authorized:
        return Need.CREDENTIALS
    tail = None
    if facts.has_cursor:
        if facts.resumed is None:
            return Need.RESUME
        if isinstance(facts.resumed, ProxyError):
            return Reject(facts.resumed)
        tail = tail_of(facts.resumed)
    if not facts.requests:
        return Forward(reserve=tail is not None, tail=tail)
    if not facts.claimed:
        return Need.CLAIM
    claim = facts.claim
    if claim is None:
        return Reject(UnknownSession())
    if claim.outcome is ClaimOutcome.NEW:
        return Forward(reserve=True, tail=tail)
    if claim.outcome is ClaimOutcome.LIMITED:
        return Reject(claim_refusal(claim.outcome, max_streams))
    if claim.outcome is ClaimOutcome.ATTACH and claim.stream is not None:
        stream = claim.stream
        if tail is not None and stream in tail.followed:
            return FollowResent(tail, tail.followed)
        if not facts.looked:
            return Need.ORIGINAL
        original = facts.original
        if tail is not None and original is not None and _untouched_since(original, tail.after):
            return FollowResent(tail, (*tail.followed, stream))
        if original is not None:
            return AttachOriginal(stream, original.first_seq - 1)
    return Reject(claim_refusal(claim.outcome), duplicate=True)


def _untouched_since(stream: StreamView, after: int) -> bool:
    """The stream of a re-sent request can come whole after the cursor, without an event twice: it began
    after the cursor, and no client was sent anything of it but its priming event (when it has one)."""
    return stream.first_seq > after and stream.delivered < stream.first_seq + stream.primed


class Answer(enum.Enum):
    """The upstream's answer to a forwarded POST, as far as the view cares."""

    FAILED = "failed"  # no answer to relay: the forward's error (502/503/504, 404 for an ended session)
    OPENED = "opened"  # an SSE answer, now a stream of the session read by its pump
    JSON = "json"  # 200 application/json
    ACCEPTED = "accepted"  # 202 (notifications and responses only)
    OTHER = "other"  # anything else: relayed as it is (an upstream error, say)


def answer_of(status: int, content_type: str) -> Answer:
    """The kind of an answer that did not become a stream."""
    if status == 200 and content_type == "application/json":
        return Answer.JSON
    if status == 202:
        return Answer.ACCEPTED
    return Answer.OTHER


class TailKind(enum.Enum):
    NONE = "none"  # no cursor
    FOLLOWS = "follows"  # a cursor whose streams the view follows first
    STANDALONE = "standalone"  # the cursor of a standalone stream: nothing of it is followed


def tail_kind(tail: Tail | None) -> TailKind:
    if tail is None:
        return TailKind.NONE
    return TailKind.FOLLOWS if tail.followed else TailKind.STANDALONE


class Then(enum.Enum):
    """What the answer becomes."""

    REJECT = "reject"  # the forward's error is the answer
    RELAY = "relay"  # the upstream's answer, relayed as it is
    VIEW = "view"  # a view of the tail's streams and the new stream
    RETAIN = "retain"  # the JSON answer kept as a one-event stream, then VIEW
    TAIL = "tail"  # the answer dropped (202): the view carries the tail alone
    EMPTY = "empty"  # the answer dropped (202) and nothing to carry: 202, no body


# (answer, tail) -> what it becomes: the module docstring's second table (tests/test_post_plan.py checks
# every pair has a row).
ANSWER_STEPS: Final[Mapping[tuple[Answer, TailKind], Then]] = {
    (Answer.FAILED, TailKind.NONE): Then.REJECT,
    (Answer.FAILED, TailKind.FOLLOWS): Then.REJECT,
    (Answer.FAILED, TailKind.STANDALONE): Then.REJECT,
    (Answer.OPENED, TailKind.NONE): Then.VIEW,
    (Answer.OPENED, TailKind.FOLLOWS): Then.VIEW,
    (Answer.OPENED, TailKind.STANDALONE): Then.VIEW,
    (Answer.JSON, TailKind.NONE): Then.RELAY,
    (Answer.JSON, TailKind.FOLLOWS): Then.RETAIN,
    (Answer.JSON, TailKind.STANDALONE): Then.RETAIN,
    (Answer.ACCEPTED, TailKind.NONE): Then.RELAY,
    (Answer.ACCEPTED, TailKind.FOLLOWS): Then.TAIL,
    (Answer.ACCEPTED, TailKind.STANDALONE): Then.EMPTY,
    (Answer.OTHER, TailKind.NONE): Then.RELAY,
    (Answer.OTHER, TailKind.FOLLOWS): Then.RELAY,
    (Answer.OTHER, TailKind.STANDALONE): Then.RELAY,
}


class Upstream(enum.Enum):
    """What the upstream did with a forwarded POST, as far as its claim cares (the third table)."""

    UNREACHED = "unreached"
    UNANSWERED = "unanswered"
    UNREADABLE = "unreadable"
    FORGOTTEN = "forgotten"
    REFUSED = "refused"
    WRONG_TYPE = "wrong_type"
    ANSWERED = "answered"
    STREAM = "stream"


_REQUEST_ANSWERS: Final = frozenset({"application/json", "text/event-stream"})


def upstream_outcome(
    *, in_session: bool, trusted: bool, status: int, session_id: bool, requests: bool, content_type: str
) -> Upstream:
    """The outcome of an answer (the rows after ``UNREACHED`` and ``UNREADABLE``). ``in_session``: a
    request of a tracked session (else an initialize); ``trusted``: its credentials are accepted in it;
    ``session_id``: the answer's session is known (the request's, or the initialize's answer names one);
    ``requests``: the message carries request ids."""
    if in_session and status == 404 and trusted:
        return Upstream.FORGOTTEN
    if not (200 <= status < 300) or not session_id:
        return Upstream.REFUSED
    if requests and status != 202 and content_type not in _REQUEST_ANSWERS:
        return Upstream.WRONG_TYPE  # spec: a POST with a request is answered with JSON or SSE
    if content_type != "text/event-stream":
        return Upstream.ANSWERED
    return Upstream.STREAM


def failed_outcome(error: ProxyError) -> Upstream:
    """What the upstream did with a request whose forward raised ``error`` (the table's first three rows):
    it never got the request only when the proxy knows so (no connection was made); a request that may have
    been sent may have run."""
    if isinstance(error, UpstreamBadResponse):
        return Upstream.UNREADABLE  # an answer came, in an encoding the proxy cannot read: it ran
    if isinstance(error, UpstreamUnreachable) and error.unsent:
        return Upstream.UNREACHED
    return Upstream.UNANSWERED


class ClaimEnd(enum.Enum):
    RELEASE = "release"  # it never ran: the same id may be sent again
    SETTLE = "settle"  # it ran: a re-send is refused, never forwarded again
    ABANDON = "abandon"  # it may have run, no answer came: a re-send is refused (outcome unknown)
    DROP = "drop"  # the upstream forgot the session: dropped (its claims with it)
    STREAM = "stream"  # it ran, and its stream holds it (``open_stream`` records the claim's stream)


CLAIM_ENDS: Final[Mapping[Upstream, ClaimEnd]] = {
    Upstream.UNREACHED: ClaimEnd.RELEASE,
    Upstream.UNANSWERED: ClaimEnd.ABANDON,
    Upstream.UNREADABLE: ClaimEnd.SETTLE,
    Upstream.FORGOTTEN: ClaimEnd.DROP,
    Upstream.REFUSED: ClaimEnd.RELEASE,
    Upstream.WRONG_TYPE: ClaimEnd.SETTLE,
    Upstream.ANSWERED: ClaimEnd.SETTLE,
    Upstream.STREAM: ClaimEnd.STREAM,
}
