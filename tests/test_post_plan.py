"""What a POST and a DELETE on the MCP endpoint get (``mcpresume.core.post``, ``mcpresume.core.delete``):
their tables, row by row, without sockets.

The executors that carry the plans out (``http.post.Posts``, ``http.delete.serve_delete``) are tested over
real HTTP in ``tests/test_forwarding.py``, ``tests/test_review_findings.py``, ``tests/test_limits.py``,
``tests/test_authorization.py`` and ``tests/test_lifecycle.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mcpresume.core.delete import DeleteFacts, Drop, Keep, plan_delete
from mcpresume.core.delete import Need as DeleteNeed
from mcpresume.core.errors import (
    BadRequest,
    CursorOutOfWindow,
    DuplicateRequest,
    OutcomeUnknown,
    ProxyError,
    RequestCancelled,
    RequestIdInUse,
    ShuttingDown,
    TooManySessions,
    TooManyStreams,
    UnknownSession,
    UpstreamBadResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mcpresume.core.get import Relay, Resumed
from mcpresume.core.post import (
    ANSWER_STEPS,
    CLAIM_ENDS,
    Answer,
    AttachOriginal,
    ClaimEnd,
    FollowResent,
    Forward,
    Need,
    PostFacts,
    Reject,
    Tail,
    TailKind,
    Then,
    Upstream,
    answer_of,
    failed_outcome,
    plan_post,
    tail_kind,
    tail_of,
    upstream_outcome,
)
from mcpresume.core.resume import ReAttach, StreamView
from mcpresume.core.session import Claim, ClaimOutcome

MAX_SESSIONS, MAX_STREAMS = 100, 8
OUT_OF_WINDOW = CursorOutOfWindow("events after the cursor were evicted from the window")

# The cursor's stream 3 (group 4), resumed after seq 20; the session's newest seq 25.
RESUMED = Resumed(ReAttach(3, 20), StreamView(3, False, 10, 22, 0, group=(4,)), newest=25)
TAIL = Tail((3, 4), 20, 3, 25)
# The cursor of a standalone stream: its events are not followed.
STANDALONE = Resumed(ReAttach(7, 20), StreamView(7, True, 10, 22, 0, standalone=True), newest=25)
STANDALONE_TAIL = Tail((), 20, 7, 25)

INIT = PostFacts(stateless=False, has_session=False, initialize=True, has_cursor=False, requests=True)
CALL = PostFacts(stateless=False, has_session=True, initialize=False, has_cursor=False, requests=True)
NOTE = replace(CALL, requests=False)  # notifications or responses only
KNOWN = replace(CALL, asked=True, known=True, authorized=True)
RESEND = replace(KNOWN, has_cursor=True, resumed=RESUMED)
RESEND_STANDALONE = replace(RESEND, resumed=STANDALONE)


def _claimed(facts: PostFacts, outcome: ClaimOutcome | None, stream: int | None = None) -> PostFacts:
    return replace(facts, claimed=True, claim=None if outcome is None else Claim(outcome, stream))


def _original(first: int, delivered: int = 0, primed: bool = True) -> StreamView:
    return StreamView(9, True, first, first + 5, 0, delivered=delivered, primed=primed)


def _looked(facts: PostFacts, original: StreamView | None) -> PostFacts:
    return replace(facts, looked=True, original=original)


ATTACH_9 = _claimed(KNOWN, ClaimOutcome.ATTACH, 9)
RESENT_9 = _claimed(RESEND, ClaimOutcome.ATTACH, 9)
NO_ROOM = TooManySessions(
    f"the proxy holds its maximum of {MAX_SESSIONS} sessions", max_sessions=MAX_SESSIONS
)

# (facts, plan): the module docstring's first table, a row (or more) each.
POST_ROWS = [
    # 1. relayed as it is
    (replace(CALL, stateless=True), Relay()),
    (replace(INIT, stateless=True), Relay()),
    (replace(CALL, has_session=False), Relay()),
    (replace(NOTE, has_session=False), Relay()),
    # 2. initialize: room first
    (INIT, Need.ROOM),
    # 3. no room
    (replace(INIT, room=False), Reject(NO_ROOM, with_id=False)),
    # 4. forwarded, no view counted
    (replace(INIT, room=True), Forward(reserve=False)),
    # 5. the store first
    (CALL, Need.ACCESS),
    (NOTE, Need.ACCESS),
    (replace(CALL, has_cursor=True), Need.ACCESS),
    # 6. no cursor, unknown: 404, the body without an id
    (replace(CALL, asked=True), Reject(UnknownSession(), with_id=False)),
    (replace(NOTE, asked=True), Reject(UnknownSession(), with_id=False)),
    # 7. the credentials checked: for a request, or for a cursor's tail
    (replace(CALL, asked=True, known=True), Need.CREDENTIALS),
    (replace(NOTE, asked=True, known=True, has_cursor=True), Need.CREDENTIALS),
    # 8. the cursor decided (an unknown session too: resume.decide answers 404)
    (replace(CALL, asked=True, has_cursor=True), Need.RESUME),
    (replace(KNOWN, has_cursor=True), Need.RESUME),
    # 9. its rejection
    (replace(KNOWN, has_cursor=True, resumed=OUT_OF_WINDOW), Reject(OUT_OF_WINDOW)),
    # 10. the request ids claimed
    (KNOWN, Need.CLAIM),
    (RESEND, Need.CLAIM),
    # 11. the session ended meanwhile
    (_claimed(KNOWN, None), Reject(UnknownSession())),
    # 12. too many streams
    (_claimed(KNOWN, ClaimOutcome.LIMITED), Reject(TooManyStreams("", limit=MAX_STREAMS))),
    (_claimed(RESEND, ClaimOutcome.LIMITED), Reject(TooManyStreams("", limit=MAX_STREAMS))),
    # 13. re-sent with the cursor of its own stream: followed, not forwarded
    (_claimed(RESEND, ClaimOutcome.ATTACH, 4), FollowResent(TAIL, (3, 4))),
    # 14. the re-sent request's stream looked at
    (ATTACH_9, Need.ORIGINAL),
    (RESENT_9, Need.ORIGINAL),
    (_claimed(RESEND_STANDALONE, ClaimOutcome.ATTACH, 7), Need.ORIGINAL),  # a standalone cursor follows none
    # 15. it began after the cursor and no client had more than its priming event: whole after the tail
    (_looked(RESENT_9, _original(21, delivered=21)), FollowResent(TAIL, (3, 4, 9))),
    (_looked(RESENT_9, _original(21, primed=False)), FollowResent(TAIL, (3, 4, 9))),
    (
        _looked(_claimed(RESEND_STANDALONE, ClaimOutcome.ATTACH, 9), _original(21)),
        FollowResent(STANDALONE_TAIL, (9,)),
    ),
    # 16. otherwise retained: a view of it from its start
    (_looked(ATTACH_9, _original(21)), AttachOriginal(9, 20)),
    (_looked(RESENT_9, _original(21, delivered=22)), AttachOriginal(9, 20)),  # a client had some
    (_looked(RESENT_9, _original(21, delivered=21, primed=False)), AttachOriginal(9, 20)),
    (_looked(RESENT_9, _original(20)), AttachOriginal(9, 19)),  # began at the cursor or before
    # 17. refused as a duplicate
    (_looked(ATTACH_9, None), Reject(CursorOutOfWindow(""), duplicate=True)),
    (_looked(RESENT_9, None), Reject(CursorOutOfWindow(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.ATTACH), Reject(CursorOutOfWindow(""), duplicate=True)),  # no stream
    (_claimed(KNOWN, ClaimOutcome.GONE), Reject(CursorOutOfWindow(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.IN_FLIGHT), Reject(DuplicateRequest(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.ANSWERED), Reject(DuplicateRequest(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.UNKNOWN), Reject(OutcomeUnknown(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.CONFLICT), Reject(DuplicateRequest(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.IN_USE), Reject(RequestIdInUse(""), duplicate=True)),
    (_claimed(RESEND, ClaimOutcome.IN_FLIGHT), Reject(DuplicateRequest(""), duplicate=True)),
    (_claimed(KNOWN, ClaimOutcome.CANCELLED), Reject(RequestCancelled(""), duplicate=True)),
    # 18. forwarded: the view counted first when there is a claim or a tail
    (_claimed(KNOWN, ClaimOutcome.NEW), Forward(reserve=True)),
    (_claimed(RESEND, ClaimOutcome.NEW), Forward(reserve=True, tail=TAIL)),
    (_claimed(RESEND_STANDALONE, ClaimOutcome.NEW), Forward(reserve=True, tail=STANDALONE_TAIL)),
    (replace(NOTE, asked=True, known=True), Forward(reserve=False)),  # notifications: no check, no count
    (
        replace(NOTE, asked=True, known=True, has_cursor=True, authorized=True, resumed=RESUMED),
        Forward(True, TAIL),
    ),
]


def _same(got: object, expected: object) -> bool:
    """Plans compare by value; a rejection by its error's class and reason (and its message, when the row
    gives one), and its flags."""
    if isinstance(got, Reject) and isinstance(expected, Reject):
        same_error = type(got.error) is type(expected.error) and got.error.reason == expected.error.reason
        if expected.error.message:
            same_error = same_error and got.error.message == expected.error.message
        return same_error and (got.with_id, got.duplicate) == (expected.with_id, expected.duplicate)
    return got == expected


@pytest.mark.parametrize(("facts", "expected"), POST_ROWS)
def test_a_post_is_planned_by_its_table(facts: PostFacts, expected: object) -> None:
    got = plan_post(facts, max_sessions=MAX_SESSIONS, max_streams=MAX_STREAMS)
    assert _same(got, expected), got


def test_every_plan_of_a_post_and_every_claim_outcome_has_a_row() -> None:
    plans = {type(expected) for _, expected in POST_ROWS}
    assert plans == {Relay, Reject, Forward, FollowResent, AttachOriginal, Need}
    assert {expected for _, expected in POST_ROWS if isinstance(expected, Need)} == set(Need)
    outcomes = {facts.claim.outcome for facts, _ in POST_ROWS if facts.claim is not None}
    assert outcomes == set(ClaimOutcome)


def test_a_limited_claim_says_the_limit() -> None:
    got = plan_post(_claimed(KNOWN, ClaimOutcome.LIMITED), max_sessions=MAX_SESSIONS, max_streams=MAX_STREAMS)
    assert isinstance(got, Reject) and isinstance(got.error, TooManyStreams)
    assert got.error.facts == {"limit": MAX_STREAMS}


def test_a_tail_follows_the_cursors_stream_and_its_group_unless_standalone() -> None:
    assert tail_of(RESUMED) == TAIL
    assert tail_of(STANDALONE) == STANDALONE_TAIL
    assert [tail_kind(t) for t in (None, TAIL, STANDALONE_TAIL)] == list(TailKind)


def test_every_answer_with_every_tail_has_a_step() -> None:
    assert set(ANSWER_STEPS) == set(itertools.product(Answer, TailKind))
    assert set(ANSWER_STEPS.values()) == set(Then)


@pytest.mark.parametrize(
    ("status", "content_type", "answer"),
    [
        (200, "application/json", Answer.JSON),
        (202, "application/json", Answer.ACCEPTED),
        (202, "", Answer.ACCEPTED),
        (201, "application/json", Answer.OTHER),
        (200, "text/plain", Answer.OTHER),
        (500, "application/json", Answer.OTHER),
        (404, "text/plain", Answer.OTHER),
    ],
)
def test_an_answer_that_is_no_stream_is_told_apart(status: int, content_type: str, answer: Answer) -> None:
    assert answer_of(status, content_type) is answer


# (facts, plan): delete_plan's table.
DELETE_ROWS = [
    # 1. no session id
    (DeleteFacts(has_session=False, status=200), Keep()),
    (DeleteFacts(has_session=False, status=404), Keep()),
    # 2. the upstream ended it: every incarnation
    (DeleteFacts(has_session=True, status=200), Drop(checked_only=False)),
    (DeleteFacts(has_session=True, status=204), Drop(checked_only=False)),
    # 3. a 404: the store first
    (DeleteFacts(has_session=True, status=404), DeleteNeed.ACCESS),
    # 4. known, credentials accepted in it: the incarnation checked
    (DeleteFacts(True, 404, asked=True, known=True, trusted=True), Drop(checked_only=True)),
    # 5. kept
    (DeleteFacts(True, 404, asked=True, known=True, trusted=False), Keep()),
    (DeleteFacts(True, 404, asked=True, known=False), Keep()),
    (DeleteFacts(has_session=True, status=403), Keep()),
    (DeleteFacts(has_session=True, status=500), Keep()),
]


@pytest.mark.parametrize(("facts", "expected"), DELETE_ROWS)
def test_a_delete_is_planned_by_its_table(facts: DeleteFacts, expected: object) -> None:
    assert plan_delete(facts) == expected


def test_every_plan_of_a_delete_has_a_row() -> None:
    assert {type(expected) for _, expected in DELETE_ROWS} == {Keep, Drop, DeleteNeed}
    assert {e for _, e in DELETE_ROWS if isinstance(e, Drop)} == {Drop(True), Drop(False)}


JSON, SSE = "application/json", "text/event-stream"

# (in_session, trusted, status, session_id, requests, content_type, outcome): the third table's rows.
UPSTREAM_ROWS = [
    # FORGOTTEN: a 404 in the session to credentials accepted in it
    (True, True, 404, True, True, JSON, Upstream.FORGOTTEN),
    (True, True, 404, True, False, "text/plain", Upstream.FORGOTTEN),
    # REFUSED: not 2xx (a 404 to other credentials, or to an initialize, too), or no session to answer in
    (True, False, 404, True, True, JSON, Upstream.REFUSED),
    (False, False, 404, False, True, JSON, Upstream.REFUSED),
    (True, True, 500, True, True, SSE, Upstream.REFUSED),
    (True, False, 403, True, True, JSON, Upstream.REFUSED),
    (False, False, 200, False, True, SSE, Upstream.REFUSED),  # an initialize answered without a session id
    # WRONG_TYPE: a request answered neither JSON nor SSE
    (True, False, 200, True, True, "text/plain", Upstream.WRONG_TYPE),
    (False, False, 200, True, True, "text/html", Upstream.WRONG_TYPE),
    # ANSWERED: not a stream
    (True, False, 200, True, True, JSON, Upstream.ANSWERED),
    (True, False, 202, True, True, "text/plain", Upstream.ANSWERED),  # 202 with any body
    (True, False, 200, True, False, "text/plain", Upstream.ANSWERED),  # notifications: any answer
    (False, False, 200, True, True, JSON, Upstream.ANSWERED),
    # STREAM
    (True, False, 200, True, True, SSE, Upstream.STREAM),
    (True, False, 202, True, False, SSE, Upstream.STREAM),
    (False, False, 200, True, True, SSE, Upstream.STREAM),
]


@pytest.mark.parametrize(
    ("in_session", "trusted", "status", "session_id", "requests", "content_type", "outcome"), UPSTREAM_ROWS
)
def test_what_the_upstream_did_is_told_apart_by_its_table(
    in_session: bool,
    trusted: bool,
    status: int,
    session_id: bool,
    requests: bool,
    content_type: str,
    outcome: Upstream,
) -> None:
    got = upstream_outcome(
        in_session=in_session,
        trusted=trusted,
        status=status,
        session_id=session_id,
        requests=requests,
        content_type=content_type,
    )
    assert got is outcome


# A forward that raised (no answer to relay) -> what the upstream did: only a request the proxy knows it
# never sent is UNREACHED (its claim released); any other may have run.
FAILED_ROWS: list[tuple[ProxyError, Upstream]] = [
    (UpstreamUnreachable("connection refused", unsent=True), Upstream.UNREACHED),
    (UpstreamUnreachable("no connection within connect_timeout", unsent=True), Upstream.UNREACHED),
    (UpstreamUnreachable("the connection broke after the request"), Upstream.UNANSWERED),
    (UpstreamTimeout("no answer head within first_byte_timeout"), Upstream.UNANSWERED),
    (UpstreamBadResponse("br"), Upstream.UNREADABLE),
    (BadRequest("a header value HTTP/1.1 does not allow"), Upstream.UNANSWERED),  # not known unsent
    (ShuttingDown("drained"), Upstream.UNANSWERED),
]


@pytest.mark.parametrize(("error", "outcome"), FAILED_ROWS)
def test_a_failed_forward_releases_its_claim_only_when_it_was_never_sent(
    error: ProxyError, outcome: Upstream
) -> None:
    assert failed_outcome(error) is outcome


def test_every_outcome_of_the_upstream_has_a_row_and_ends_its_claim() -> None:
    told = {row[-1] for row in UPSTREAM_ROWS} | {outcome for _, outcome in FAILED_ROWS}
    assert told == set(Upstream)
    assert set(CLAIM_ENDS) == set(Upstream)
    assert set(CLAIM_ENDS.values()) == set(ClaimEnd)
    # Invariant #8: a request that may have run upstream is never released (it would run again).
    ran = {Upstream.UNANSWERED, Upstream.UNREADABLE, Upstream.WRONG_TYPE, Upstream.ANSWERED, Upstream.STREAM}
    assert all(CLAIM_ENDS[outcome] is not ClaimEnd.RELEASE for outcome in ran)
    assert CLAIM_ENDS[Upstream.UNANSWERED] is ClaimEnd.ABANDON
