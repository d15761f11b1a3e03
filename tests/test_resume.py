"""The resume decision: one test per row of core/resume.py's table, the row order, and the re-POST
case (docs/how-it-works.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.cursor import Cursor, CursorParseError, encode_cursor, parse_cursor
from mcpresume.core.errors import (
    CursorAhead,
    CursorOutOfWindow,
    ForeignCursor,
    MalformedCursor,
    ProxyError,
    SessionGone,
    UnknownSession,
)
from mcpresume.core.resume import OUTCOMES, ReAttach, SessionView, StreamView, decide, outcome_label
from mcpresume.core.session import NewEvent, SessionState, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import Event, EventKind, WindowLimits
from tests.support.events import append_events

EPOCH = "aaaabbbbcccc"
OTHER_EPOCH = "aaaabbbbcccd"
NOW = 1000.0

# A session whose streams 1..3 were opened; the cursor's stream is 2, holding seqs 10..20 of which
# 10..11 were evicted; the window holds (1, 12) .. (3, 25); 25 is the newest seq ever issued.
STREAM = StreamView(number=2, live=True, first_seq=10, last_seq=20, evicted_through=11)
VIEW = SessionView(
    epoch=EPOCH,
    expires_at=None,
    next_stream=4,
    newest_seq=25,
    oldest=(1, 12),
    newest=(3, 25),
    stream=STREAM,
)
FACTS = {
    "cursor": None,  # filled per test
    "oldest": f"{EPOCH}-1-12",
    "newest": f"{EPOCH}-3-25",
}


def facts(cursor: Cursor) -> dict[str, str | None]:
    return {**FACTS, "cursor": cursor.encode()}


def assert_rejection(decision: object, kind: type[ProxyError], status: int, reason: str) -> ProxyError:
    assert isinstance(decision, kind), decision
    assert decision.status == status
    assert decision.reason == reason
    assert decision.data()["reason"] == reason
    return decision


# -- row 1: session unknown, deleted or expired -> 404 unknown_session ------------------------------------


def test_row1_unknown_session() -> None:
    decision = decide(None, Cursor(EPOCH, 2, 15), NOW)
    error = assert_rejection(decision, UnknownSession, 404, "unknown_session")
    assert error.data() == {"reason": "unknown_session"}  # no facts about a session that does not exist


@pytest.mark.parametrize("cause", list(SessionGone))
def test_every_way_a_session_is_gone_is_one_404_that_says_re_initialize(cause: SessionGone) -> None:
    error = UnknownSession(cause)
    assert (error.status, error.reason) == (404, "unknown_session")
    assert error.data() == {"reason": "unknown_session"}
    assert error.message == cause.value and error.message.endswith("; re-initialize")
    assert UnknownSession().cause is SessionGone.UNTRACKED  # the default: what the decision says (row 1)


def test_row1_expired_session() -> None:
    expired = replace(VIEW, expires_at=NOW)  # expiry is inclusive: expires_at <= now
    assert_rejection(decide(expired, Cursor(EPOCH, 2, 15), NOW), UnknownSession, 404, "unknown_session")
    idle_but_alive = replace(VIEW, expires_at=NOW + 0.001)
    assert decide(idle_but_alive, Cursor(EPOCH, 2, 15), NOW) == ReAttach(2, 15)


def test_row1_wins_over_a_malformed_cursor() -> None:
    decision = decide(None, CursorParseError("junk"), NOW)
    assert_rejection(decision, UnknownSession, 404, "unknown_session")


# -- row 2: cursor not one the proxy issued -> 400 malformed_cursor ---------------------------------------


def test_row2_malformed_cursor() -> None:
    parsed = parse_cursor("not-a-cursor")
    assert isinstance(parsed, CursorParseError)
    error = assert_rejection(decide(VIEW, parsed, NOW), MalformedCursor, 400, "malformed_cursor")
    assert parsed.detail in error.message
    assert error.data() == {"reason": "malformed_cursor"}


# -- row 3: cursor of another session or epoch -> 409 foreign_cursor --------------------------------------


def test_row3_foreign_cursor() -> None:
    cursor = Cursor(OTHER_EPOCH, 2, 15)
    error = assert_rejection(decide(VIEW, cursor, NOW), ForeignCursor, 409, "foreign_cursor")
    assert error.data() == {"reason": "foreign_cursor", **facts(cursor)}


def test_row3_wins_over_ahead_and_out_of_window() -> None:
    for cursor in (Cursor(OTHER_EPOCH, 9, 99), Cursor(OTHER_EPOCH, 2, 10), Cursor(OTHER_EPOCH, 0, 0)):
        assert_rejection(decide(VIEW, cursor, NOW), ForeignCursor, 409, "foreign_cursor")


# -- row 4: cursor beyond the session's newest event -> 409 cursor_ahead ----------------------------------


def test_row4_cursor_ahead_by_seq() -> None:
    cursor = Cursor(EPOCH, 2, 26)
    error = assert_rejection(decide(VIEW, cursor, NOW), CursorAhead, 409, "cursor_ahead")
    assert error.data() == {"reason": "cursor_ahead", **facts(cursor)}


def test_row4_cursor_ahead_by_stream() -> None:
    cursor = Cursor(EPOCH, 4, 15)  # stream 4 was never opened (next_stream is 4)
    error = assert_rejection(
        decide(replace(VIEW, stream=None), cursor, NOW), CursorAhead, 409, "cursor_ahead"
    )
    assert error.data() == {"reason": "cursor_ahead", **facts(cursor)}


def test_row4_on_a_session_that_never_appended() -> None:
    empty = SessionView(EPOCH, None, next_stream=1, newest_seq=0, oldest=None, newest=None, stream=None)
    cursor = Cursor(EPOCH, 1, 1)
    error = assert_rejection(decide(empty, cursor, NOW), CursorAhead, 409, "cursor_ahead")
    assert error.data() == {
        "reason": "cursor_ahead",
        "cursor": cursor.encode(),
        "oldest": None,
        "newest": None,
    }


# -- row 5: stream or seq 0 (numbering starts at 1) -> 400 malformed_cursor ---------------------------------


def test_row5_stream_zero_is_malformed_not_out_of_window() -> None:
    """Streams are numbered from 1, so ``<epoch>-0-<seq>`` was never issued: 400 malformed_cursor is the
    honest answer (invariant #10), not "no longer retained"."""
    session = SessionState("S1", EPOCH, WindowLimits(16, 1 << 20, 300.0), retry_ms=None, now=0.0)
    priming = session.open_stream(StreamOrigin.GET, [], now=0.0)
    assert priming.stream == 1 and priming.seq == 1
    cursor = Cursor(EPOCH, 0, 1)
    decision = decide(session.view(0, 1e9), cursor, NOW)
    error = assert_rejection(decision, MalformedCursor, 400, "malformed_cursor")
    assert error.data()["cursor"] == cursor.encode()


def test_row5_seq_zero_is_malformed_even_when_the_stream_is_gone() -> None:
    cursor = Cursor(EPOCH, 2, 0)
    decision = decide(replace(VIEW, stream=None), cursor, NOW)
    error = assert_rejection(decision, MalformedCursor, 400, "malformed_cursor")
    assert error.data() == {"reason": "malformed_cursor", **facts(cursor)}


def test_row4_wins_over_row5() -> None:
    assert_rejection(decide(VIEW, Cursor(EPOCH, 0, 26), NOW), CursorAhead, 409, "cursor_ahead")


# -- row 6: cursor's stream no longer retained -> 409 cursor_out_of_window -------------------------------


def test_row6_stream_no_longer_retained() -> None:
    cursor = Cursor(EPOCH, 1, 5)
    decision = decide(replace(VIEW, stream=None), cursor, NOW)
    error = assert_rejection(decision, CursorOutOfWindow, 409, "cursor_out_of_window")
    assert error.data() == {"reason": "cursor_out_of_window", **facts(cursor)}
    assert "no longer retained" in error.message


def test_row6_with_an_empty_window() -> None:
    drained = replace(VIEW, oldest=None, newest=None, stream=None)
    cursor = Cursor(EPOCH, 2, 20)
    decision = decide(drained, cursor, NOW)
    error = assert_rejection(decision, CursorOutOfWindow, 409, "cursor_out_of_window")
    assert error.data() == {
        "reason": "cursor_out_of_window",
        "cursor": cursor.encode(),
        "oldest": None,
        "newest": None,
    }


# -- row 7: seq outside its stream's issued range -> 400 malformed_cursor ---------------------------------


@pytest.mark.parametrize("seq", [9, 21, 25])
def test_row7_seq_outside_the_streams_range(seq: int) -> None:
    cursor = Cursor(EPOCH, 2, seq)
    error = assert_rejection(decide(VIEW, cursor, NOW), MalformedCursor, 400, "malformed_cursor")
    assert error.data() == {"reason": "malformed_cursor", **facts(cursor)}


def test_row7_wins_over_row8() -> None:
    # seq 9 precedes the stream and is below evicted_through: the cursor is not of this stream at all.
    assert_rejection(decide(VIEW, Cursor(EPOCH, 2, 9), NOW), MalformedCursor, 400, "malformed_cursor")


# -- row 8: an event of the stream after the cursor was evicted -> 409 cursor_out_of_window ---------------


def test_row8_evicted_after_the_cursor() -> None:
    cursor = Cursor(EPOCH, 2, 10)  # 11 was evicted: re-attaching after 10 would skip it silently
    error = assert_rejection(decide(VIEW, cursor, NOW), CursorOutOfWindow, 409, "cursor_out_of_window")
    assert error.data() == {"reason": "cursor_out_of_window", **facts(cursor)}
    assert "evicted" in error.message


# -- row 9: otherwise -> re-attach after seq ---------------------------------------------------------------


@pytest.mark.parametrize("seq", [11, 12, 19, 20])
def test_row9_reattach(seq: int) -> None:
    # 11 is evicted itself, but nothing after it was: the client holding it has lost nothing.
    assert decide(VIEW, Cursor(EPOCH, 2, seq), NOW) == ReAttach(2, seq)


def test_row9_on_an_ended_stream() -> None:
    ended = replace(VIEW, stream=replace(STREAM, live=False))
    assert decide(ended, Cursor(EPOCH, 2, 20), NOW) == ReAttach(2, 20)


# -- properties of the whole table -------------------------------------------------------------------------

small = st.integers(0, 12)


@st.composite
def views(draw: st.DrawFn) -> SessionView | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    newest_seq = draw(small)
    first = draw(small)
    last = draw(st.integers(first, first + 4))
    stream = draw(
        st.none()
        | st.builds(StreamView, st.integers(1, 4), st.booleans(), st.just(first), st.just(last), small)
    )
    return SessionView(
        epoch=EPOCH,
        expires_at=draw(st.none() | st.floats(NOW - 2, NOW + 2)),
        next_stream=draw(st.integers(1, 5)),
        newest_seq=newest_seq,
        oldest=draw(st.none() | st.tuples(st.integers(1, 4), small)),
        newest=draw(st.none() | st.tuples(st.integers(1, 4), small)),
        stream=stream,
    )


cursors = st.one_of(
    st.builds(CursorParseError, st.text(max_size=5)),
    st.builds(Cursor, st.sampled_from([EPOCH, OTHER_EPOCH]), st.integers(0, 5), small),
)


@settings(deadline=None, max_examples=400)
@given(view=views(), cursor=cursors)
def test_decide_is_total_and_honest(view: SessionView | None, cursor: Cursor | CursorParseError) -> None:
    decision = decide(view, cursor, NOW)
    assert outcome_label(decision) in OUTCOMES  # the metric exports every label from the start
    gone = view is None or (view.expires_at is not None and view.expires_at <= NOW)
    if isinstance(decision, ReAttach):
        # Re-attach only when every fact allows it (invariant #4, #5).
        assert view is not None and not gone and isinstance(cursor, Cursor)
        assert cursor.epoch == view.epoch
        assert view.stream is not None and decision.stream == view.stream.number
        assert decision.after == cursor.seq
        assert view.stream.first_seq <= cursor.seq <= view.stream.last_seq
        assert view.stream.evicted_through <= cursor.seq
        assert cursor.seq <= view.newest_seq and cursor.stream < view.next_stream
        assert cursor.stream >= 1 and cursor.seq >= 1  # numbering starts at 1
    else:
        assert isinstance(decision, ProxyError)
        # 404 means the session is gone, and nothing else (invariant #10).
        assert (decision.status == 404) == gone
        assert decision.status in (400, 404, 409)
        if not gone and isinstance(cursor, Cursor):
            assert decision.data()["cursor"] == cursor.encode()
            if cursor.epoch != EPOCH:
                assert isinstance(decision, ForeignCursor)


# -- the re-POST case, at the pure level ------------------------------------------------------------------


def _cursor_of(event: Event) -> Cursor:
    first_line = event.body.split(b"\n", 1)[0]
    assert first_line.startswith(b"id: ")
    parsed = parse_cursor(first_line[4:])
    assert isinstance(parsed, Cursor)
    assert (parsed.stream, parsed.seq) == (event.stream, event.seq)
    return parsed


def test_design_note_sequence_reattaches_after_e2_and_sends_the_response_once() -> None:
    """e1, e2, e3 on one stream; the client applied e1 and e2 and dropped. A naive replay from the buffer
    would send e2 again; re-attaching with cursor(e2) must send only e3, and the response exactly once."""
    session = SessionState("S1", EPOCH, WindowLimits(256, 1 << 20, 300.0), retry_ms=1000, now=0.0)
    priming = session.open_stream(StreamOrigin.POST, ["n:7"], now=0.0)
    stream = priming.stream
    events, _ = append_events(
        session,
        stream,
        [
            NewEvent(frame_body(b'{"jsonrpc":"2.0","method":"notifications/progress"}'), EventKind.MESSAGE),
            NewEvent(frame_body(b'{"jsonrpc":"2.0","method":"notifications/message"}'), EventKind.MESSAGE),
            NewEvent(
                frame_body(b'{"jsonrpc":"2.0","id":7,"result":{}}'), EventKind.RESPONSE, response_key="n:7"
            ),
        ],
        now=1.0,
    )
    e1, e2, e3 = events
    session.end_stream(stream, now=1.0)

    # The client read priming, e1, e2, then the connection dropped.
    first = session.read([stream], 0)
    assert list(first.events)[:3] == [priming, e1, e2]

    decision = decide(session.view(stream, 60.0), _cursor_of(e2), now=2.0)
    assert decision == ReAttach(stream, e2.seq)
    assert isinstance(decision, ReAttach)
    resumed = session.read([decision.stream], decision.after)
    assert list(resumed.events) == [e3]
    assert resumed.complete and not resumed.gap
    assert encode_cursor(EPOCH, stream, e3.seq) in e3.body

    # Having received the response, a client re-attaching from it gets nothing more: it is sent once.
    again = decide(session.view(stream, 60.0), _cursor_of(e3), now=3.0)
    assert again == ReAttach(stream, e3.seq)
    tail = session.read([stream], e3.seq)
    assert list(tail.events) == []
    assert tail.complete
