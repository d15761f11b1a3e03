"""A session's durable state: streams, appends, reads, request-id claims, bounded bookkeeping, and the
resume invariants (ARCHITECTURE.md, invariants #1-#5) under arbitrary interleavings of appends, evictions,
groups and re-attaches."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import pytest
from hypothesis import event as tally
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mcpresume.core.session as session_module
from mcpresume.core.cursor import Cursor, encode_cursor, parse_cursor
from mcpresume.core.errors import (
    CursorAhead,
    CursorOutOfWindow,
    ForeignCursor,
    MalformedCursor,
    UnknownSession,
)
from mcpresume.core.flow import Guard, Readers
from mcpresume.core.resume import ReAttach, StreamView, decide
from mcpresume.core.session import (
    CLAIM_OF_STATE,
    MAX_GONE_STREAMS,
    MAX_REQUEST_IDS,
    READ_MAX_BYTES,
    READ_MAX_EVENTS,
    STREAM_STEPS,
    Claim,
    ClaimOutcome,
    ClaimState,
    NewEvent,
    PumpRecord,
    SessionState,
    StreamEffect,
    StreamInput,
    StreamOrigin,
    StreamPhase,
    claim_refusal,
)
from mcpresume.core.sse import SSEParser, SSERun, frame_body
from mcpresume.core.window import Event, EventKind, EvictReason, WindowLimits
from tests.support.events import append_events, kept

EPOCH = "aaaabbbbcccc"
OTHER_EPOCH = "zzzzyyyyxxxx"
BIG = 10**9
ROOMY = WindowLimits(max_events=10_000, max_bytes=1 << 30, ttl=1e9)


def make_session(
    limits: WindowLimits = ROOMY, retry_ms: int | None = 1500, epoch: str = EPOCH
) -> SessionState:
    return SessionState("sess-1", epoch, limits, retry_ms, now=0.0)


def msg(data: bytes = b'{"jsonrpc":"2.0","method":"notifications/progress"}', **kwargs: object) -> NewEvent:
    return NewEvent(frame_body(data), EventKind.MESSAGE, **kwargs)  # type: ignore[arg-type]


def response(request_id: int) -> NewEvent:
    data = b'{"jsonrpc":"2.0","id":%d,"result":{}}' % request_id
    return NewEvent(frame_body(data), EventKind.RESPONSE, response_key=f"n:{request_id}")


def cursor_of(event: Event) -> bytes:
    first_line = event.body.split(b"\n", 1)[0]
    assert first_line.startswith(b"id: ")
    return first_line[4:]


def seqs(events: object) -> list[int]:
    return [e.seq for e in events]  # type: ignore[attr-defined]


# -- open_stream ---------------------------------------------------------------------------------------


def test_open_stream_appends_a_priming_event_with_the_cursor_and_retry() -> None:
    session = make_session(retry_ms=1500)
    priming = session.open_stream(StreamOrigin.POST, ["n:1"], now=3.0)
    assert (priming.seq, priming.stream, priming.at) == (1, 1, 3.0)
    cursor = encode_cursor(EPOCH, 1, 1)
    assert priming.body == b"id: " + cursor + b"\nretry: 1500\ndata: \n\n"
    # What a WHATWG client makes of it: an event with our cursor as id, the retry, and empty data.
    (parsed,) = SSEParser(1 << 16).feed(priming.body)
    assert parsed.id == cursor and parsed.retry == 1500 and parsed.data == b""
    assert parse_cursor(parsed.id) == Cursor(EPOCH, 1, 1)
    # It is in the window, readable from position 0.
    assert list(session.read([1], 0).events) == [priming]
    state = session.streams[1]
    assert state.origin is StreamOrigin.POST and state.live
    assert (state.first_seq, state.last_seq) == (1, 1)
    assert session.last_active == 3.0
    assert session.version == 1


def test_priming_without_retry() -> None:
    session = make_session(retry_ms=None)
    priming = session.open_stream(StreamOrigin.GET, [], now=0.0)
    assert priming.body == b"id: " + encode_cursor(EPOCH, 1, 1) + b"\ndata: \n\n"
    assert b"retry" not in priming.body


def test_streams_and_seqs_are_numbered_from_one_and_share_one_sequence() -> None:
    session = make_session()
    first = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0)
    appended, _ = append_events(session, first.stream, [msg()], now=0.0)
    second = session.open_stream(StreamOrigin.GET, [], now=0.0)
    assert (first.stream, first.seq) == (1, 1)
    assert appended[0].seq == 2
    assert (second.stream, second.seq) == (2, 3)
    assert session.next_stream == 3 and session.next_seq == 4
    assert session.standalone == 2


# -- append / end_stream ---------------------------------------------------------------------------------


def test_a_followed_stream_emptied_by_the_global_cap_reads_as_a_gap_to_a_reader_that_missed_it() -> None:
    """Regression (found in review): a POST + Last-Event-ID view follows an ended stream whose unsent
    events the global byte cap then takes; the stream is forgotten, but its tombstone says where it ended,
    so the read is a gap, not the new stream's events as if nothing was lost."""
    session = make_session(limits=ROOMY)
    old = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.append(old, [msg(b"%d" % n) for n in range(5)], now=0.0)  # seqs 2..6
    session.end_stream(old, now=0.0)
    new = session.open_stream(StreamOrigin.POST, ["n:2"], now=0.0).stream  # seq 7
    session.shed(20)  # takes every event of the old stream
    assert old not in session.streams and (old, 6) in session.gone
    assert session.read([old, new], 1).gap  # the client had only the priming event of the old stream
    done = session.read([old, new], 6)  # a view that had sent all of it: the new stream's events only
    assert not done.gap and [e.stream for e in done.events] == [new]


def test_a_stream_that_left_the_window_is_forgotten_and_a_cursor_into_it_is_refused() -> None:
    session = make_session(limits=WindowLimits(max_events=4, max_bytes=1 << 30, ttl=1e9))
    old = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.append(old, [msg(b"%d" % n) for n in range(5)], now=0.0)
    session.end_stream(old, now=0.0)
    new = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    session.append(new, [msg(b"x")] * 10, now=0.0)  # evicts all of the old stream
    assert old not in session.streams  # not kept forever
    view = session.view(old, 60.0)
    assert view.stream is None  # a cursor into it is refused, not re-attached to nothing
    assert session.read([old], 6).complete  # a reader that had sent all of it is done, not cut off


def test_only_the_last_gone_streams_are_remembered() -> None:
    session = make_session(limits=WindowLimits(max_events=2, max_bytes=1 << 30, ttl=1e9))
    for n in range(session_module.MAX_GONE_STREAMS + 10):
        stream = session.open_stream(StreamOrigin.POST, [f"n:{n}"], now=0.0).stream
        session.append(stream, [response(n)], now=0.0)
        session.end_stream(stream, now=0.0)
    assert len(session.gone) == session_module.MAX_GONE_STREAMS  # bounded
    assert session.gone[-1][0] == stream - 1  # the newest ones (the last stream is still in the window)


def test_a_run_is_kept_as_the_upstream_sent_it_and_framed_when_read() -> None:
    """The window holds the run's own blocks (no copy per event: for a chunk of one event without an id
    line, the chunk itself); the cursors are written in front of them by the read, in one join."""
    session = make_session()
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    chunk = b"event: message\ndata: {}\n\n"
    (run,) = SSEParser(BIG).feed_batched(chunk)
    assert isinstance(run, SSERun) and run.blocks[0] is chunk
    session.append_run(stream, run, now=0.0)
    assert session.window._order[-1].blocks[-1] is chunk  # joined the priming event's segment
    result = session.read([stream], 1)
    cursor = encode_cursor(EPOCH, stream, 2)
    assert result.body() == b"id: " + cursor + b"\n" + chunk
    assert result.body() == b"".join(e.body for e in result.events)


def test_a_read_of_several_streams_frames_each_event_with_its_own_stream_in_its_cursor() -> None:
    session = make_session()
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    b = session.open_stream(StreamOrigin.POST, ["n:2"], now=0.0).stream
    session.append(a, [msg(b"1")], now=0.0)
    session.append(b, [msg(b"2")], now=0.0)
    body = session.read([a, b], 0).body()
    ids = [e.id for e in SSEParser(BIG).feed(body)]
    assert ids == [encode_cursor(EPOCH, n, seq) for n, seq in ((a, 1), (b, 2), (a, 3), (b, 4))]


def test_append_frames_each_event_with_its_cursor() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    items = [msg(b"a"), msg(b"b"), response(1)]
    version = session.version
    appended, evicted = append_events(session, stream, items, now=5.0)
    assert not evicted
    assert seqs(appended) == [2, 3, 4]
    for event, item in zip(appended, items, strict=True):
        assert event.stream == stream and event.at == 5.0
        assert event.body == b"id: " + encode_cursor(EPOCH, stream, event.seq) + b"\n" + item.body
        assert cursor_of(event) == encode_cursor(EPOCH, stream, event.seq)
    state = session.streams[stream]
    assert state.last_seq == 4
    # Readers waiting on it wake up; the idle clock does not move (upstream traffic is not client activity).
    assert session.version > version and session.last_active == 0.0


def test_append_reports_evictions() -> None:
    session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
    stream = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    evicted = session.append(stream, [msg(), msg()], now=0.0)
    assert evicted.counts[EvictReason.COUNT][0] == 1
    assert seqs(session.window) == [2, 3]


def test_append_to_an_ended_or_unknown_stream_is_dropped() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.end_stream(stream, now=1.0)
    version, next_seq = session.version, session.next_seq
    for target in (stream, 99, 0):
        evicted = session.append(target, [msg()], now=2.0)
        assert not evicted
    assert session.version == version and session.next_seq == next_seq
    assert session.last_active == 1.0
    assert len(session.window) == 1


def test_end_stream_keeps_its_events_and_the_response() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    (resp,), _ = append_events(session, stream, [response(1)], now=0.0)
    version = session.version
    session.end_stream(stream, now=4.0)
    assert session.version == version + 1 and session.last_active == 4.0
    assert not session.streams[stream].live
    result = session.read([stream], 1)
    assert list(result.events) == [resp]  # invariant #9: ending the stream did not drop the response
    assert result.complete
    # Ending twice, or an unknown stream, changes nothing.
    session.end_stream(stream, now=9.0)
    session.end_stream(42, now=9.0)
    assert session.version == version + 1 and session.last_active == 4.0


def test_an_ended_stream_keeps_nothing_of_its_pump() -> None:
    """A live stream keeps what taking its pump over needs (its record, the upstream's cursor, the responses
    it got); once ended it is no orphan, and it keeps none of it: an idle session's retained stream is its
    events and seqs only."""
    session = make_session()
    record = PumpRecord((1,), "/mcp", (("Mcp-Session-Id", "sess-1"),))
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0, pump=record).stream
    session.append(stream, [msg()], now=0.0)
    session.pumped_at(stream, "up-1")
    session.append(stream, [response(1)], now=0.0)
    [orphan] = session.orphans()
    assert (orphan.pump, orphan.upstream_cursor, orphan.answered) == (record, "up-1", ("n:1",))
    session.end_stream(stream, now=1.0)
    assert session.orphans() == []
    state = session.streams[stream]
    assert (state.pump, state.upstream_cursor, state.answered) == (None, None, ())
    assert seqs(session.read([stream], 0).events) == [1, 2, 3]  # its events stay, priming to response
    session.pumped_at(stream, "up-2")  # a late cursor for an ended stream is not kept either
    assert state.upstream_cursor is None


def test_end_stream_clears_the_standalone_stream() -> None:
    session = make_session()
    get = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    post = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.end_stream(post, now=0.0)
    assert session.standalone == get
    session.end_stream(get, now=0.0)
    assert session.standalone is None


# -- read -----------------------------------------------------------------------------------------------


def test_read_merges_the_requested_streams_in_seq_order() -> None:
    session = make_session()
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream  # seq 1
    b = session.open_stream(StreamOrigin.GET, [], now=0.0).stream  # seq 2
    c = session.open_stream(StreamOrigin.POST, ["n:2"], now=0.0).stream  # seq 3
    for target in (a, b, c, b, a, c, a, b):  # seqs 4..11
        session.append(target, [msg()], now=0.0)
    # a: 1, 4, 8, 10; b: 2, 5, 7, 11; c: 3, 6, 9
    assert seqs(session.read([a, b], 0).events) == [1, 2, 4, 5, 7, 8, 10, 11]
    assert seqs(session.read([b, a], 5).events) == [7, 8, 10, 11]
    assert seqs(session.read([a], 0).events) == [1, 4, 8, 10]
    assert seqs(session.read([c], 3).events) == [6, 9]
    assert seqs(session.read([a, b, c], 8).events) == [9, 10, 11]
    assert seqs(session.read([a, b], 11).events) == []
    assert all(e.stream in (a, b) for e in session.read([a, b], 0).events)


def test_read_is_complete_only_when_every_requested_stream_ended_and_all_was_returned() -> None:
    session = make_session()
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    b = session.open_stream(StreamOrigin.POST, ["n:2"], now=0.0).stream
    session.append(a, [response(1)], now=0.0)
    session.end_stream(a, now=0.0)
    assert session.read([a], 0).complete
    assert not session.read([a, b], 0).complete  # b is still live
    assert not session.read([b], 0).complete
    session.append(b, [response(2)], now=0.0)
    session.end_stream(b, now=0.0)
    both = session.read([a, b], 0)
    assert both.complete and not both.gap and seqs(both.events) == [1, 2, 3, 4]
    # Truncated by a limit: not complete yet, even though both streams ended.
    first = session.read([a, b], 0, max_events=3)
    assert seqs(first.events) == [1, 2, 3] and not first.complete
    rest = session.read([a, b], 3, max_events=3)
    assert seqs(rest.events) == [4] and rest.complete


def test_read_reports_a_gap_when_an_event_after_the_position_was_evicted() -> None:
    session = make_session(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream  # 1
    b = session.open_stream(StreamOrigin.GET, [], now=0.0).stream  # 2
    session.append(a, [msg()], now=0.0)  # 3
    session.append(b, [msg(), msg()], now=0.0)  # 4, 5: evicts 1 and 2
    assert session.window.evicted_through(a) == 1
    gap = session.read([a], 0)
    assert gap.gap and not gap.complete and list(gap.events) == []
    assert session.read([a, b], 0).gap  # one stream's gap is the read's gap
    assert session.read([b], 1).gap
    ok = session.read([a], 1)  # the client held seq 1 itself: nothing after it was lost
    assert not ok.gap and seqs(ok.events) == [3]
    assert seqs(session.read([a, b], 2).events) == [3, 4, 5]


def test_read_of_a_forgotten_stream_is_a_gap() -> None:
    session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.end_stream(a, now=0.0)
    b = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    session.append(b, [msg()], now=0.0)  # evicts stream a's only event; a is forgotten
    assert a not in session.streams
    result = session.read([a], 0)
    assert result.gap and not result.complete and list(result.events) == []


def test_read_of_a_stream_never_opened_does_not_raise() -> None:
    session = make_session()
    session.open_stream(StreamOrigin.GET, [], now=0.0)
    result = session.read([7], 0)
    assert list(result.events) == [] and not result.complete and result.gap


def test_read_limits_truncate_and_the_next_read_returns_the_rest() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.append(stream, [msg() for _ in range(READ_MAX_EVENTS + 50)], now=0.0)
    session.end_stream(stream, now=0.0)
    first = session.read([stream], 0)
    assert len(first.events) == READ_MAX_EVENTS and not first.complete
    assert seqs(first.events) == list(range(1, READ_MAX_EVENTS + 1))
    rest = session.read([stream], first.events[-1].seq)
    assert seqs(rest.events) == list(range(READ_MAX_EVENTS + 1, READ_MAX_EVENTS + 52))
    assert rest.complete


def test_read_byte_limit() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    chunk = b"x" * (READ_MAX_BYTES // 3)
    session.append(stream, [msg(chunk) for _ in range(4)], now=0.0)
    first = session.read([stream], 1)
    assert seqs(first.events) == [2, 3]  # a third would pass READ_MAX_BYTES
    assert sum(kept(e) for e in first.events) <= READ_MAX_BYTES
    assert seqs(session.read([stream], 3).events) == [4, 5]
    # Explicit limits: the first event is always returned, even when it alone is over the byte limit.
    one = session.read([stream], 1, max_bytes=10)
    assert seqs(one.events) == [2]
    assert seqs(session.read([stream], 0, max_events=2, max_bytes=BIG).events) == [1, 2]


def test_read_returns_complete_with_the_final_events() -> None:
    """A reader can stop when the read that carried the response also says complete: it needs no further
    read. A further read finds the stream forgotten once other streams evicted it: complete for a reader
    that had sent it all (its tombstone says where it ended), a gap for one that had not."""
    session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    (resp,), _ = append_events(session, a, [response(1)], now=0.0)
    session.end_stream(a, now=0.0)
    final = session.read([a], 1)
    assert list(final.events) == [resp] and final.complete
    b = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    session.append(b, [msg(), msg()], now=0.0)
    assert a not in session.streams
    assert session.read([a], resp.seq).complete and not session.read([a], resp.seq).gap
    assert session.read([a], resp.seq - 1).gap


def test_read_version_tracks_changes() -> None:
    session = make_session()
    stream = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    v1 = session.read([stream], 0).version
    session.append(stream, [msg()], now=0.0)
    v2 = session.read([stream], 0).version
    session.end_stream(stream, now=0.0)
    v3 = session.read([stream], 0).version
    assert v1 < v2 < v3 == session.version


# -- expire ---------------------------------------------------------------------------------------------


def test_expire_drops_old_events_and_forgets_gone_streams() -> None:
    session = make_session(WindowLimits(max_events=BIG, max_bytes=BIG, ttl=10.0))
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.append(a, [response(1)], now=1.0)
    session.end_stream(a, now=1.0)
    b = session.open_stream(StreamOrigin.GET, [], now=5.0).stream
    version = session.version
    assert not session.expire(9.0)
    assert session.version == version  # nothing changed, nobody woken
    expiring = list(session.read([a], 0).events)
    evicted = session.expire(11.0)
    assert evicted.counts == {EvictReason.TTL: [2, sum(kept(e) for e in expiring)]}
    assert session.version == version + 1
    assert a not in session.streams and b in session.streams
    assert seqs(session.window) == [3]


# -- claim / release (exactly once per request id) --------------------------------------------------------


def test_claim_new_then_in_flight_then_attach() -> None:
    session = make_session()
    assert session.claim(["n:1", "s:1"]) == Claim(ClaimOutcome.NEW)
    assert session.claim(["n:1", "s:1"]) == Claim(ClaimOutcome.IN_FLIGHT)
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.IN_FLIGHT)
    stream = session.open_stream(StreamOrigin.POST, ["n:1", "s:1"], now=0.0).stream
    assert session.claim(["n:1", "s:1"]) == Claim(ClaimOutcome.ATTACH, stream)
    assert session.claim(["s:1"]) == Claim(ClaimOutcome.ATTACH, stream)
    session.end_stream(stream, now=0.0)
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.ATTACH, stream)  # ended, but all still retained


def test_claim_with_no_ids_is_new() -> None:
    assert make_session().claim([]) == Claim(ClaimOutcome.NEW)


def test_claim_conflicts() -> None:
    session = make_session()
    session.claim(["n:1"])
    assert session.claim(["n:1", "n:2"]) == Claim(ClaimOutcome.CONFLICT)  # one seen, one not
    assert session.claim(["n:2"]) == Claim(ClaimOutcome.NEW)  # the conflict claimed nothing
    first = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    second = session.open_stream(StreamOrigin.POST, ["n:2"], now=0.0).stream
    assert first != second
    assert session.claim(["n:1", "n:2"]) == Claim(ClaimOutcome.CONFLICT)  # seen on different streams
    session.claim(["n:3"])
    assert session.claim(["n:1", "n:3"]) == Claim(ClaimOutcome.CONFLICT)  # one attached, one in flight


def test_claim_gone_once_the_stream_lost_an_event_or_was_forgotten() -> None:
    session = make_session(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    session.claim(["n:1"])
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream  # seq 1
    session.append(stream, [response(1)], now=0.0)  # seq 2
    session.end_stream(stream, now=0.0)
    other = session.open_stream(StreamOrigin.GET, [], now=0.0).stream  # seq 3
    session.append(other, [msg()], now=0.0)  # seq 4 evicts the priming of `stream`
    assert session.window.evicted_through(stream) == 1
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.GONE, stream)  # a re-attach would miss an event
    session.append(other, [msg()], now=0.0)  # evicts the response: `stream` is forgotten
    assert stream not in session.streams
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.GONE, stream)


def test_every_stream_phase_and_input_has_a_row() -> None:
    assert set(STREAM_STEPS) == {(phase, given) for phase in StreamPhase for given in StreamInput}
    changes = {key: step.phase for key, step in STREAM_STEPS.items() if step.effect is StreamEffect.CHANGE}
    assert changes == {
        (StreamPhase.UNKNOWN, StreamInput.OPEN): StreamPhase.LIVE,
        (StreamPhase.LIVE, StreamInput.APPEND): StreamPhase.LIVE,
        (StreamPhase.LIVE, StreamInput.END): StreamPhase.ENDED,
        (StreamPhase.ENDED, StreamInput.EVICTED_ALL): StreamPhase.GONE,
        (StreamPhase.GONE, StreamInput.FORGOTTEN): StreamPhase.UNKNOWN,
    }
    # A row that changes nothing leaves the phase; only an open of a number given already cannot happen.
    for (phase, happening), step in STREAM_STEPS.items():
        if step.effect is not StreamEffect.CHANGE:
            assert step.phase is phase, (phase, happening)
            assert (step.effect is StreamEffect.IMPOSSIBLE) == (
                happening is StreamInput.OPEN and phase is not StreamPhase.UNKNOWN
            )


def _stream_in(phase: StreamPhase, opening: bool) -> tuple[SessionState, int]:
    """A session and the number of a stream of it in ``phase``. UNKNOWN: the number it gives next if
    ``opening``, else one forgotten (opened, gone, its tombstone pushed out)."""
    session = make_session()
    if phase is StreamPhase.UNKNOWN and opening:
        return session, session.next_stream
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    session.append(stream, [msg()], now=0.0)
    if phase is not StreamPhase.LIVE:
        session.end_stream(stream, now=0.0)
    if phase in (StreamPhase.GONE, StreamPhase.UNKNOWN):
        session.shed(0)
    if phase is StreamPhase.UNKNOWN:
        _apply(session, stream, StreamInput.FORGOTTEN)
    return session, stream


def _apply(session: SessionState, stream: int, happening: StreamInput) -> None:
    match happening:
        case StreamInput.OPEN:
            assert session.open_stream(StreamOrigin.POST, [], now=0.0).stream == stream
        case StreamInput.APPEND:
            session.append(stream, [msg()], now=0.0)
        case StreamInput.END:
            session.end_stream(stream, now=0.0)
        case StreamInput.EVICTED_ALL:
            session.shed(0)  # the window keeps nothing
        case StreamInput.FORGOTTEN:
            for _ in range(MAX_GONE_STREAMS):  # newer tombstones, of streams that never had an event
                other = session.open_stream(StreamOrigin.POST, [], now=0.0, priming=False).stream
                session.end_stream(other, now=0.0)


@pytest.mark.parametrize(
    ("phase", "happening"),
    [key for key, step in STREAM_STEPS.items() if step.effect is not StreamEffect.IMPOSSIBLE],
)
def test_a_stream_follows_its_table(phase: StreamPhase, happening: StreamInput) -> None:
    session, stream = _stream_in(phase, opening=happening is StreamInput.OPEN)
    assert session.phase(stream) is phase

    def seen() -> tuple[StreamPhase, int | None]:
        state = session.streams.get(stream)
        return session.phase(stream), None if state is None else state.last_seq

    before = seen()
    _apply(session, stream, happening)
    step = STREAM_STEPS[phase, happening]
    assert session.phase(stream) is step.phase
    assert (seen() != before) == (step.effect is StreamEffect.CHANGE)


def test_every_claim_state_has_an_outcome_and_none_forwards() -> None:
    assert set(CLAIM_OF_STATE) == set(ClaimState)
    assert set(CLAIM_OF_STATE.values()) == {
        ClaimOutcome.IN_FLIGHT,
        ClaimOutcome.ANSWERED,
        ClaimOutcome.CANCELLED,
        ClaimOutcome.UNKNOWN,
    }


# -- a request id claimed again: the same request (a re-send), or another one (a reused id) -----------------

SAME, OTHER = b"request-A", b"request-B"  # two requests' digests (jsonrpc.request_digest)


def _claimed_as(holder: str) -> tuple[SessionState, int | None]:
    """A session whose n:1 was claimed for request SAME, now held so; and its stream (if it has one)."""
    session = make_session(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    assert session.claim(["n:1"], digests=[SAME]) == Claim(ClaimOutcome.NEW)
    if holder == "pending":
        return session, None
    if holder in ("answered", "abandoned"):
        (session.settle if holder == "answered" else session.abandon)(["n:1"])
        return session, None
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    if holder == "live":
        return session, stream
    session.append(stream, [response(1)], now=0.0)
    session.end_stream(stream, now=0.0)
    if holder == "ended":
        return session, stream
    other = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    session.append(other, [msg()], now=0.0)  # evicts the stream's priming event
    if holder == "forgotten":
        session.append(other, [msg()], now=0.0)  # and its response: it is forgotten
        assert stream not in session.streams
    return session, stream


# (what holds the id's claim) -> what the same request gets, what another request gets: a re-send is never
# forwarded; another request is, once the first is over (answered, its stream ended), and never while it
# is not (in flight, its outcome unknown, its stream live: the upstream could not tell their answers apart).
REUSED_IDS = {
    "pending": (ClaimOutcome.IN_FLIGHT, ClaimOutcome.IN_USE),
    "answered": (ClaimOutcome.ANSWERED, ClaimOutcome.NEW),
    "abandoned": (ClaimOutcome.UNKNOWN, ClaimOutcome.IN_USE),
    "live": (ClaimOutcome.ATTACH, ClaimOutcome.IN_USE),
    "ended": (ClaimOutcome.ATTACH, ClaimOutcome.NEW),
    "evicted": (ClaimOutcome.GONE, ClaimOutcome.NEW),
    "forgotten": (ClaimOutcome.GONE, ClaimOutcome.NEW),
}


@pytest.mark.parametrize("holder", list(REUSED_IDS))
def test_a_claimed_id_is_a_resend_only_for_the_same_request(holder: str) -> None:
    same, other = REUSED_IDS[holder]
    session, stream = _claimed_as(holder)
    pending = session.in_flight
    got = session.claim(["n:1"], digests=[SAME])
    assert got.outcome is same
    assert got.stream == (stream if same in (ClaimOutcome.ATTACH, ClaimOutcome.GONE) else None)
    assert session.claim(["n:1"]) == got  # a claim that does not say its request is taken for a re-send
    assert session.claim(["n:1"], digests=[OTHER]) == Claim(other)
    if other is ClaimOutcome.NEW:  # the id is the other request's now: in flight, its digest kept
        assert session.in_flight == pending + 1
        assert session.claim(["n:1"], digests=[OTHER]) == Claim(ClaimOutcome.IN_FLIGHT)
        assert session.claim(["n:1"], digests=[SAME]) == Claim(ClaimOutcome.IN_USE)
        opened = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream  # its answer: a stream
        assert session.claim(["n:1"], digests=[OTHER]) == Claim(ClaimOutcome.ATTACH, opened)
        assert session.claim(["n:1"], digests=[SAME]) == Claim(ClaimOutcome.IN_USE)
    else:
        assert session.in_flight == pending  # refused: nothing claimed


def test_a_batch_reusing_ids_is_forwarded_only_when_every_reused_id_is_free() -> None:
    session = make_session()
    session.claim(["n:1"], digests=[SAME])
    session.settle(["n:1"])  # over
    session.claim(["n:2"], digests=[SAME])  # in flight
    assert session.claim(["n:1", "n:3"], digests=[SAME, OTHER]) == Claim(
        ClaimOutcome.CONFLICT
    )  # half a re-send
    assert session.claim(["n:2", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.IN_USE)
    assert session.claim(["n:1", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.NEW)
    assert session.claim(["n:1", "n:3"], digests=[OTHER, OTHER]) == Claim(ClaimOutcome.IN_FLIGHT)


def test_a_reused_id_counts_against_the_stream_limit() -> None:
    session = make_session()
    session.claim(["n:1"], digests=[SAME])
    session.settle(["n:1"])
    session.claim(["n:2"], digests=[SAME])  # one in flight: the limit of 1 is reached
    assert session.claim(["n:1"], 1, digests=[OTHER]) == Claim(ClaimOutcome.LIMITED)
    assert session.claim(["n:1"], digests=[SAME]) == Claim(ClaimOutcome.ANSWERED)  # still the first's


def test_abandon_and_settle_take_only_pending_claims() -> None:
    session = make_session()
    session.claim(["n:1", "n:2"], digests=[SAME, OTHER])
    assert session.in_flight == 2
    session.abandon(["n:1", "n:2"])
    assert session.in_flight == 0  # no answer will come: not in flight (and not counted as a stream)
    session.release(["n:1"])  # it may have run: never forgotten, so never forwarded again
    session.settle(["n:1"])
    assert session.claim(["n:1", "n:2"], digests=[SAME, OTHER]) == Claim(ClaimOutcome.UNKNOWN)
    stream = session.open_stream(StreamOrigin.POST, ["n:3"], now=0.0).stream
    session.abandon(["n:3"])  # held by its stream: nothing to abandon
    assert session.claim(["n:3"]) == Claim(ClaimOutcome.ATTACH, stream)


@pytest.mark.parametrize("first_stream", [0, -1, 1])
def test_a_stream_number_is_never_read_as_a_claim_state(first_stream: int) -> None:
    # The claim states once were the ints 0 and -1: a stream so numbered read as "in flight" / "answered".
    session = SessionState("sess-1", EPOCH, ROOMY, 1500, now=0.0, first_stream=first_stream)
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.NEW)
    assert session.in_flight == 1
    stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    assert stream == first_stream
    assert session.in_flight == 0
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.ATTACH, stream)
    session.release(["n:1"])  # forwarded already: nothing to release
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.ATTACH, stream)
    session.settle(["n:1"])  # nor to settle
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.ATTACH, stream)


# Every claim outcome but NEW (forwarded) is answered so: (status, reason). ATTACH: only when its stream
# left the window before the view could be attached.
REFUSALS = {
    ClaimOutcome.ATTACH: (409, "cursor_out_of_window"),
    ClaimOutcome.GONE: (409, "cursor_out_of_window"),
    ClaimOutcome.IN_FLIGHT: (409, "duplicate_request"),
    ClaimOutcome.ANSWERED: (409, "duplicate_request"),
    ClaimOutcome.UNKNOWN: (409, "outcome_unknown"),
    ClaimOutcome.CONFLICT: (409, "duplicate_request"),
    ClaimOutcome.IN_USE: (409, "request_id_in_use"),
    ClaimOutcome.LIMITED: (429, "too_many_streams"),
    ClaimOutcome.CANCELLED: (409, "request_cancelled"),
}


def test_every_claim_outcome_is_forwarded_or_refused_by_the_table() -> None:
    assert set(REFUSALS) | {ClaimOutcome.NEW} == set(ClaimOutcome)
    for outcome, (status, reason) in REFUSALS.items():
        error = claim_refusal(outcome, max_streams=3)
        assert (error.status, error.reason) == (status, reason), outcome
    limited = claim_refusal(ClaimOutcome.LIMITED, max_streams=3)
    assert limited.data() == {"reason": "too_many_streams", "limit": 3}
    with pytest.raises(ValueError):
        claim_refusal(ClaimOutcome.NEW)


def test_cancelled_requests_of_a_stream_are_refused_and_never_sent_again() -> None:
    session = make_session()
    assert session.claim(["n:1", "n:2"]).outcome is ClaimOutcome.NEW
    stream = session.open_stream(StreamOrigin.POST, ["n:1", "n:2"], now=0.0).stream
    assert session.claim(["n:3"]).outcome is ClaimOutcome.NEW  # still in flight: not the stream's
    session.cancel_requests(stream, ["n:1", "n:2", "n:3", "n:99"])
    assert session.claim(["n:1", "n:2"]) == Claim(ClaimOutcome.CANCELLED)
    assert session.claim(["n:3"]) == Claim(ClaimOutcome.IN_FLIGHT)  # another's claim is left alone
    assert session.in_flight == 1
    session.release(["n:1"])  # nothing to release: it ran upstream
    assert session.claim(["n:1"]) == Claim(ClaimOutcome.CANCELLED)
    error = claim_refusal(ClaimOutcome.CANCELLED)
    assert (error.status, error.reason) == (409, "request_cancelled")


def test_a_stream_of_an_ended_incarnation_cancels_nothing_of_the_new_one() -> None:
    old = make_session()
    old.claim(["n:1"])
    ended = old.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    new = SessionState("sess-1", OTHER_EPOCH, ROOMY, 1500, now=0.0, first_stream=old.next_stream)
    new.claim(["n:1"])
    stream = new.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    new.cancel_requests(ended, ["n:1"])
    assert new.claim(["n:1"]) == Claim(ClaimOutcome.ATTACH, stream)


def test_ending_a_stream_touches_its_session_never_backwards() -> None:
    session = make_session()
    first = session.open_stream(StreamOrigin.POST, ["n:1"], now=10.0).stream
    second = session.open_stream(StreamOrigin.POST, ["n:2"], now=20.0).stream
    session.end_stream(first, now=15.0)  # ended as of an earlier instant (an unattended stream)
    assert session.last_active == 20.0
    session.end_stream(second, now=30.0)
    assert session.last_active == 30.0


def test_release_forgets_only_pending_claims() -> None:
    session = make_session()
    assert session.claim(["n:1", "n:2"]).outcome is ClaimOutcome.NEW
    session.release(["n:1", "n:2"])
    assert session.claim(["n:1", "n:2"]).outcome is ClaimOutcome.NEW  # a retry may be forwarded
    stream = session.open_stream(StreamOrigin.POST, ["n:1", "n:2"], now=0.0).stream
    session.release(["n:1", "n:2", "n:99"])  # forwarded already: release must not forget them
    assert session.claim(["n:1", "n:2"]) == Claim(ClaimOutcome.ATTACH, stream)


def test_request_ids_are_bounded() -> None:
    session = make_session()
    total = MAX_REQUEST_IDS + 100
    for i in range(total):
        assert session.claim([f"n:{i}"]).outcome is ClaimOutcome.NEW
    assert len(session._requests) == MAX_REQUEST_IDS
    # The oldest were forgotten (oldest first), the newest are remembered.
    assert session.claim(["n:0"]).outcome is ClaimOutcome.NEW
    assert session.claim([f"n:{total - 1}"]).outcome is ClaimOutcome.IN_FLIGHT
    assert session.claim([f"n:{total - MAX_REQUEST_IDS + 1}"]).outcome is ClaimOutcome.IN_FLIGHT
    assert len(session._requests) == MAX_REQUEST_IDS


def test_open_stream_refreshes_a_claimed_id() -> None:
    session = make_session()
    session.claim(["n:keep"])
    for i in range(MAX_REQUEST_IDS - 1):
        session.claim([f"n:{i}"])
    stream = session.open_stream(StreamOrigin.POST, ["n:keep"], now=0.0).stream  # now the most recent
    session.claim(["n:late"])  # pushes out the oldest, which is no longer n:keep
    assert session.claim(["n:keep"]) == Claim(ClaimOutcome.ATTACH, stream)
    assert session.claim(["n:0"]).outcome is ClaimOutcome.NEW


# -- nothing grows with the number of streams opened -------------------------------------------------------


def test_ended_and_evicted_streams_are_forgotten() -> None:
    limits = WindowLimits(max_events=8, max_bytes=BIG, ttl=BIG)
    session = make_session(limits)
    for i in range(10_000):
        stream = session.open_stream(StreamOrigin.POST, [f"n:{i}"], now=float(i))
        session.append(stream.stream, [response(i)], now=float(i))
        session.end_stream(stream.stream, now=float(i))
    assert session.next_stream == 10_001
    assert len(session.streams) <= limits.max_events
    assert len(session.window) <= limits.max_events
    assert len(session.window._evicted_through or ()) <= limits.max_events
    assert len(session._requests) <= MAX_REQUEST_IDS
    assert session.window.evicted_through(1) == 0 and session.view(1, 60.0).stream is None
    assert session.live_post_streams() == 0


def test_live_streams_are_kept_even_when_fully_evicted() -> None:
    session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    b = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    session.append(b, [msg(), msg()], now=0.0)
    assert not session.window.has_events(a)
    assert a in session.streams and session.streams[a].live
    assert session.read([a], 1).gap is False  # the priming was all there was, and the client had it
    session.end_stream(a, now=0.0)
    assert a not in session.streams


# -- idle / view ----------------------------------------------------------------------------------------


def test_idle() -> None:
    session = make_session()
    assert session.idle()
    get = session.open_stream(StreamOrigin.GET, [], now=0.0).stream
    assert session.idle()  # a standalone stream alone keeps nobody waiting for a response
    post = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
    assert not session.idle() and session.live_post_streams() == 1
    session.end_stream(post, now=0.0)
    assert session.idle()  # views keep it from expiring by touching it (last_active), not by idle()
    session.end_stream(get, now=0.0)
    assert session.idle()


def test_view() -> None:
    session = make_session(WindowLimits(max_events=3, max_bytes=BIG, ttl=BIG))
    empty = session.view(1, 60.0)
    assert (empty.epoch, empty.next_stream, empty.newest_seq) == (EPOCH, 1, 0)
    assert empty.oldest is None and empty.newest is None and empty.stream is None
    assert empty.expires_at == 60.0  # idle from the start: last_active (0.0) + ttl

    a = session.open_stream(StreamOrigin.POST, ["n:1"], now=2.0).stream  # 1
    session.append(a, [msg(), msg()], now=3.0)  # 2, 3
    b = session.open_stream(StreamOrigin.GET, [], now=4.0).stream  # 4: evicts 1
    view = session.view(a, 60.0)
    assert view.expires_at is None  # a POST stream is being pumped
    assert (view.next_stream, view.newest_seq) == (3, 4)
    assert view.oldest == (a, 2) and view.newest == (b, 4)
    assert view.stream == StreamView(number=a, live=True, first_seq=1, last_seq=3, evicted_through=1)

    session.end_stream(a, now=7.0)
    idle = session.view(b, 60.0)
    assert idle.expires_at == 67.0
    assert idle.stream is not None and idle.stream.number == b and idle.stream.evicted_through == 0
    assert session.view(99, 60.0).stream is None


# -- the resume invariants, by stateful testing --------------------------------------------------------------

SESSION_TTL = 30.0
GARBAGE = ["", "x", "1-2", f"{EPOCH}-1", f"{EPOCH}-01-1", f"{EPOCH.upper()}-1-1", f"{EPOCH}-1-1 ", "\u00e9"]


@dataclass(eq=False)
class Ref:
    event: Event
    evicted: bool = False

    @property
    def seq(self) -> int:
        return self.event.seq

    @property
    def stream(self) -> int:
        return self.event.stream


@dataclass
class RefStream:
    origin: StreamOrigin
    first_seq: int
    last_seq: int
    live: bool = True


@dataclass
class Reader:
    """An attachment: reads its stream from a position, moving the position forward."""

    stream: int
    position: int
    delivered: list[int] = field(default_factory=list)


class ResumeMachine(RuleBasedStateMachine):
    """Open, append, end, let time pass, expire; and at any point re-attach from any cursor, and read.

    The reference model is a list of every event ever appended with an evicted flag. Its eviction rule is
    the window's documented one (oldest first; age, then count and bytes, sparing the newest), applied at
    the same moments: after each event appended and on expire().
    """

    @initialize(
        max_events=st.integers(2, 6),
        max_bytes=st.integers(60, 400),
        ttl=st.sampled_from([6.0, 25.0, 1e9]),
        retry_ms=st.sampled_from([None, 500]),
    )
    def setup(self, max_events: int, max_bytes: int, ttl: float, retry_ms: int | None) -> None:
        self.limits = WindowLimits(max_events, max_bytes, ttl)
        self.session = SessionState("S", EPOCH, self.limits, retry_ms, now=0.0)
        self.now = 0.0
        self.last_active = 0.0
        self.history: list[Ref] = []
        self.streams: dict[int, RefStream] = {}
        self.readers: list[Reader] = []
        # Streams the session has forgotten: ended and emptied, at a pass (an eviction, an end), in the
        # order they went; the last MAX_GONE_STREAMS are remembered (a reader that sent all of one is done).
        self.forgotten_streams: list[int] = []
        # The last standalone stream forgotten: a cursor at its very end still re-attaches (the proxy then
        # opens a new standalone stream: its client missed nothing).
        self.gone_standalone: int | None = None
        # Streams one client view followed together (POST + Last-Event-ID), merged as the session merges
        # them: a re-attach to any member is out of window once an event of any member after the cursor
        # is evicted, gone members included.
        self.groups: dict[int, set[int]] = {}
        self.next_request = 0
        # Another incarnation of the same session id: its cursors must never yield anything here.
        other = SessionState("S", OTHER_EPOCH, self.limits, retry_ms, now=0.0)
        other_stream = other.open_stream(StreamOrigin.POST, ["n:0"], now=0.0).stream
        appended, _ = append_events(other, other_stream, [msg(), msg()], now=0.0)
        self.other_cursors = [cursor_of(e) for e in appended]
        # Start with two streams, so short runs already have something to resume.
        self.open_stream(StreamOrigin.POST)
        self.open_stream(StreamOrigin.GET)

    # -- the reference model ------------------------------------------------------------------------------

    def retained(self) -> list[Ref]:
        return [r for r in self.history if not r.evicted]

    def enforce(self) -> bool:
        """Evict as the window does; whether anything was evicted."""
        evicted = False
        retained = self.retained()
        size = sum(kept(r.event) for r in retained)
        while retained:
            oldest = retained[0]
            if oldest.event.at > self.now - self.limits.ttl:
                over = len(retained) > self.limits.max_events or size > self.limits.max_bytes
                if len(retained) <= 1 or not over:
                    break
            oldest.evicted = True
            evicted = True
            size -= kept(oldest.event)
            retained.pop(0)
        return evicted

    def forget_pass(self) -> None:
        """The session's pass over its streams after an eviction or an end."""
        for number, ref in self.streams.items():
            if (
                not ref.live
                and number not in self.forgotten_streams
                and not any(r.stream == number for r in self.retained())
            ):
                self.forgotten_streams.append(number)
                if ref.origin is StreamOrigin.GET and (self.gone_standalone or 0) < number:
                    self.gone_standalone = number  # the newest standalone stream gone

    def record(self, event: Event) -> bool:
        assert event.seq == len(self.history) + 1
        assert cursor_of(event) == encode_cursor(EPOCH, event.stream, event.seq)
        self.history.append(Ref(event))
        self.streams[event.stream].last_seq = event.seq
        return self.enforce()

    def forgotten(self, stream: int) -> bool:
        return stream in self.forgotten_streams

    def remembered(self, stream: int) -> bool:
        """Forgotten, and among the last gone streams the session remembers where they ended."""
        return stream in self.forgotten_streams[-session_module.MAX_GONE_STREAMS :]

    def at_the_end_of_the_gone_standalone(self, stream: int, seq: int) -> bool:
        return stream == self.gone_standalone and seq == self.streams[stream].last_seq

    def evicted_after(self, stream: int, seq: int) -> bool:
        return any(r.evicted and r.stream == stream and r.seq > seq for r in self.history)

    def lost_after(self, stream: int, seq: int) -> bool:
        """Whether a re-attach at (stream, seq) lost an event: of the stream or of its group."""
        return any(self.evicted_after(member, seq) for member in self.groups.get(stream, {stream}))

    def expected_after(self, stream: int, seq: int) -> list[Event]:
        return [r.event for r in self.history if not r.evicted and r.stream == stream and r.seq > seq]

    def expired(self) -> bool:
        idle = not any(s.live and s.origin is StreamOrigin.POST for s in self.streams.values())
        return idle and self.last_active + SESSION_TTL <= self.now

    def pick_stream(self, pick: int) -> int:
        # Any stream number ever opened, plus 0 and one never opened.
        return pick % (self.session.next_stream + 1)

    # -- operations -----------------------------------------------------------------------------------

    @rule(origin=st.sampled_from(StreamOrigin))
    def open_stream(self, origin: StreamOrigin) -> None:
        keys = [] if origin is StreamOrigin.GET else [f"n:{self.next_request}"]
        self.next_request += 1
        priming = self.session.open_stream(origin, keys, self.now)
        assert priming.body.endswith(b"data: \n\n")  # a priming event: an id, no message
        self.streams[priming.stream] = RefStream(origin, priming.seq, priming.seq)
        self.last_active = self.now  # a client request opened it; upstream events are not client activity
        if self.record(priming):
            self.forget_pass()

    @rule(pick=st.integers(0, 1000), sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3))
    def append(self, pick: int, sizes: list[int]) -> None:
        stream = self.pick_stream(pick)
        items = [msg(b"m" * size) for size in sizes]
        self.appended(stream, self.session.append(stream, items, self.now), [item.body for item in items])

    @rule(pick=st.integers(0, 1000), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=4))
    def append_run(self, pick: int, sizes: list[int]) -> None:
        """The hot path: upstream events parsed as one run, framed without a per-event object."""
        stream = self.pick_stream(pick)
        bodies = [b"event: message\ndata: " + b"r" * size + b"\n\n" for size in sizes]
        (run,) = SSEParser(1 << 20).feed_batched(b"".join(bodies))
        assert isinstance(run, SSERun)
        self.appended(stream, self.session.append_run(stream, run, self.now), bodies)

    def appended(self, stream: int, evicted: object, bodies: list[bytes]) -> None:
        """Record what an append should have added: the next seqs, each frame our cursor + its body."""
        first = self.session.next_seq - len(bodies)
        ref = self.streams.get(stream)
        if ref is None or not ref.live:
            assert not evicted
            return
        evicted_any = False
        for offset, body in enumerate(bodies):
            seq = first + offset
            frame = b"id: " + encode_cursor(EPOCH, stream, seq) + b"\n" + body
            evicted_any |= self.record(Event(seq, stream, frame, self.now))
        assert bool(evicted) == evicted_any
        if evicted_any:
            self.forget_pass()

    @rule(pick=st.integers(0, 1000))
    def end_stream(self, pick: int) -> None:
        stream = self.pick_stream(pick)
        self.session.end_stream(stream, self.now)
        ref = self.streams.get(stream)
        if ref is not None and ref.live:
            ref.live = False
            self.last_active = self.now
            self.forget_pass()

    @rule(picks=st.lists(st.integers(0, 1000), min_size=2, max_size=3))
    def group(self, picks: list[int]) -> None:
        """One client view follows these streams together; numbers not retained are not grouped."""
        streams = [self.pick_stream(pick) for pick in picks]
        self.session.group_streams(streams)
        members = [s for s in streams if s in self.streams and not self.forgotten(s)]
        merged: set[int] = set()
        for stream in members:
            merged |= self.groups.get(stream, {stream})
        for stream in merged:
            self.groups[stream] = merged
        tally(f"group of {len(merged)}")

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        evicted = self.session.expire(self.now)
        assert bool(evicted) == self.enforce()
        if evicted:
            self.forget_pass()

    @rule(fraction=st.sampled_from([0.0, 0.3, 0.7]))
    def shed(self, fraction: float) -> None:
        """The global byte cap trims the window, oldest first, sparing nothing (not even a followed
        stream's unsent events: its reader must then read a gap)."""
        retained = self.retained()
        size = sum(kept(r.event) for r in retained)
        cap = int(size * fraction)
        evicted = self.session.shed(cap)
        gone = False
        while retained and size > cap:
            oldest = retained.pop(0)
            oldest.evicted = True
            size -= kept(oldest.event)
            gone = True
        assert bool(evicted) == gone
        if gone:
            self.forget_pass()

    # -- resuming -------------------------------------------------------------------------------------

    def check_reattach(self, decision: ReAttach, cursor: Cursor) -> None:
        assert decision == ReAttach(cursor.stream, cursor.seq)
        # Never re-attach where the model says an event after the cursor is gone (invariant #2, #5).
        assert not self.lost_after(cursor.stream, cursor.seq)
        assert not self.forgotten(cursor.stream)
        result = self.session.read([decision.stream], decision.after)
        expected = self.expected_after(cursor.stream, cursor.seq)
        # Exactly the retained events of the cursor's stream after it: nothing earlier (#1), none missing
        # (#2), none of another stream (#3).
        assert not result.gap
        assert list(result.events) == expected
        assert result.complete == (not self.streams[cursor.stream].live)
        if len(self.readers) < 4:
            self.readers.append(Reader(decision.stream, decision.after))

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 10_000))
    def resume_from_an_issued_cursor(self, pick: int) -> None:
        """Any event ever issued, retained or evicted, of a live, ended or forgotten stream."""
        ref = self.history[pick % len(self.history)]
        raw = cursor_of(ref.event)
        cursor = parse_cursor(raw)
        assert cursor == Cursor(EPOCH, ref.stream, ref.seq)
        decision = decide(self.session.view(ref.stream, SESSION_TTL), cursor, self.now)
        tally(f"issued cursor: {type(decision).__name__}")
        if self.expired():
            assert isinstance(decision, UnknownSession)
        elif self.at_the_end_of_the_gone_standalone(ref.stream, ref.seq):
            assert decision == ReAttach(ref.stream, ref.seq)  # the proxy opens a new one: nothing is read
        elif self.forgotten(ref.stream) or self.lost_after(ref.stream, ref.seq):
            assert isinstance(decision, CursorOutOfWindow), decision
            assert decision.status == 409
        else:
            assert isinstance(decision, ReAttach), decision
            self.check_reattach(decision, cursor)

    @rule(stream_pick=st.integers(0, 1000), seq_pick=st.integers(0, 1000))
    def resume_from_a_made_up_cursor(self, stream_pick: int, seq_pick: int) -> None:
        """Well-formed, right epoch, but not necessarily issued: never an event it should not give."""
        stream = self.pick_stream(stream_pick)
        seq = seq_pick % (self.session.next_seq + 1)
        cursor = Cursor(EPOCH, stream, seq)
        decision = decide(self.session.view(stream, SESSION_TTL), cursor, self.now)
        tally(f"made-up cursor: {type(decision).__name__}")
        if self.expired():
            assert isinstance(decision, UnknownSession)
            return
        if seq > len(self.history) or stream >= self.session.next_stream:
            assert isinstance(decision, CursorAhead)
        elif isinstance(decision, ReAttach):
            issued = self.streams[stream]
            assert issued.first_seq <= seq <= issued.last_seq
            if not self.at_the_end_of_the_gone_standalone(stream, seq):
                self.check_reattach(decision, cursor)
        else:
            assert decision.status in (400, 409)
            ref = self.streams.get(stream)
            if ref is not None and not self.forgotten(stream) and ref.first_seq <= seq <= ref.last_seq:
                # Only an eviction after the cursor (in its stream or group) may stop a re-attach inside
                # the stream's range.
                assert isinstance(decision, CursorOutOfWindow) and self.lost_after(stream, seq)

    @rule(pick=st.integers(0, 100))
    def resume_from_another_incarnation(self, pick: int) -> None:
        cursor = parse_cursor(self.other_cursors[pick % len(self.other_cursors)])
        assert isinstance(cursor, Cursor) and cursor.epoch == OTHER_EPOCH
        decision = decide(self.session.view(cursor.stream, SESSION_TTL), cursor, self.now)
        assert isinstance(decision, UnknownSession if self.expired() else ForeignCursor)

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 10_000))
    def resume_with_another_epoch(self, pick: int) -> None:
        ref = self.history[pick % len(self.history)]
        cursor = Cursor(OTHER_EPOCH, ref.stream, ref.seq)
        decision = decide(self.session.view(ref.stream, SESSION_TTL), cursor, self.now)
        assert isinstance(decision, UnknownSession if self.expired() else ForeignCursor)

    @rule(raw=st.sampled_from(GARBAGE) | st.text(max_size=16))
    def resume_from_garbage(self, raw: str) -> None:
        parsed = parse_cursor(raw)
        if isinstance(parsed, Cursor):
            return  # hypothesis found a well-formed one: covered by the made-up cursor rule
        decision = decide(self.session.view(0, SESSION_TTL), parsed, self.now)
        assert isinstance(decision, UnknownSession if self.expired() else MalformedCursor)

    # -- attachments reading over time ----------------------------------------------------------------

    @precondition(lambda self: self.readers)
    @rule(pick=st.integers(0, 100), limit=st.integers(1, 3))
    def reader_reads(self, pick: int, limit: int) -> None:
        reader = self.readers[pick % len(self.readers)]
        result = self.session.read([reader.stream], reader.position, max_events=limit)
        lost = self.evicted_after(reader.stream, reader.position)
        tally(f"reader: gap={result.gap} complete={result.complete} events={bool(result.events)}")
        if result.gap:
            assert lost or (self.forgotten(reader.stream) and not self.remembered(reader.stream))
            assert list(result.events) == []
            self.drop_reader(reader)
            return
        assert not lost, "an event after the reader's position was evicted, and read() did not say so"
        expected = self.expected_after(reader.stream, reader.position)
        assert list(result.events) == expected[:limit]
        assert result.complete == (len(expected) <= limit and not self.streams[reader.stream].live)
        for event in result.events:
            assert event.stream == reader.stream  # #3
            assert event.seq > reader.position  # #1
            reader.delivered.append(event.seq)
            reader.position = event.seq
        assert reader.delivered == sorted(set(reader.delivered))  # no duplicate, in order
        self.session.mark_delivered([reader.stream], reader.position)
        if result.complete:
            self.drop_reader(reader)

    def drop_reader(self, reader: Reader) -> None:
        self.readers.remove(reader)

    @rule(
        picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3, unique=True), after=st.integers(0, 1000)
    )
    def read_several_streams(self, picks: list[int], after: int) -> None:
        after %= self.session.next_seq
        streams = sorted({1 + p % max(1, self.session.next_stream - 1) for p in picks})
        streams = [s for s in streams if s in self.streams]
        if not streams:
            return
        result = self.session.read(streams, after)
        lost = any(
            self.evicted_after(s, after) or (self.forgotten(s) and not self.remembered(s)) for s in streams
        )
        tally(f"read several: gap={result.gap}")
        assert result.gap == lost
        if not lost:
            expected = [r.event for r in self.retained() if r.stream in streams and r.seq > after]
            assert list(result.events) == expected
            assert result.complete == all(not self.streams[s].live for s in streams)
            # A gone stream the reader had sent all of reads as complete, never as a gap (MAX_GONE_STREAMS).

    # -- the session agrees with the model after every step -------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        session = self.session
        retained = self.retained()
        assert [e.seq for e in session.window] == [r.seq for r in retained]
        assert session.window.bytes == sum(kept(r.event) for r in retained)
        assert len(session.window) <= self.limits.max_events
        assert session.next_seq == len(self.history) + 1
        assert set(session.streams) == {n for n in self.streams if not self.forgotten(n)}
        remembered = self.forgotten_streams[-session_module.MAX_GONE_STREAMS :]
        assert [n for n, _ in session.gone] == remembered
        assert all(last == self.streams[n].last_seq for n, last in session.gone)
        for number, state in session.streams.items():
            ref = self.streams[number]
            assert (state.live, state.first_seq, state.last_seq) == (ref.live, ref.first_seq, ref.last_seq)
            gone = [r.seq for r in self.history if r.evicted and r.stream == number]
            assert session.window.evicted_through(number) == max(gone, default=0)
        assert session.last_active == self.last_active
        # Kept as a count, not walked: the live POST streams of the model.
        live_posts = sum(1 for s in self.streams.values() if s.live and s.origin is StreamOrigin.POST)
        assert session.live_post_streams() == live_posts


TestResumeInvariants = ResumeMachine.TestCase
TestResumeInvariants.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def _op(
    name: str, **arguments: st.SearchStrategy[object]
) -> st.SearchStrategy[tuple[str, dict[str, object]]]:
    return st.tuples(st.just(name), st.fixed_dictionaries(arguments))


picks = st.integers(0, 10_000)
# The same rules as the state machine, weighted towards appends, re-attaches and reads, in runs long enough
# for readers to follow a stream while other streams evict its events.
LONG_RUN_OPS = st.one_of(
    _op("open_stream", origin=st.sampled_from(StreamOrigin)),
    _op("append", pick=picks, sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3)),
    _op("append", pick=picks, sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3)),
    _op("append", pick=picks, sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3)),
    _op("end_stream", pick=picks),
    _op("tick", dt=st.sampled_from([0.5, 1.0, 3.0, 10.0])),
    _op("expire"),
    _op("resume_from_an_issued_cursor", pick=picks),
    _op("resume_from_an_issued_cursor", pick=picks),
    _op("resume_from_a_made_up_cursor", stream_pick=picks, seq_pick=picks),
    _op("resume_with_another_epoch", pick=picks),
    _op("resume_from_another_incarnation", pick=picks),
    _op("resume_from_garbage", raw=st.sampled_from(GARBAGE)),
    _op("reader_reads", pick=picks, limit=st.integers(1, 3)),
    _op("reader_reads", pick=picks, limit=st.integers(1, 3)),
    _op("reader_reads", pick=picks, limit=st.integers(1, 3)),
    _op("read_several_streams", picks=st.lists(picks, min_size=1, max_size=3, unique=True), after=picks),
)


@settings(deadline=None, max_examples=60)
@given(
    max_events=st.integers(2, 6),
    max_bytes=st.integers(60, 400),
    ttl=st.sampled_from([6.0, 25.0, 1e9]),
    ops=st.lists(LONG_RUN_OPS, min_size=40, max_size=150),
)
def test_resume_invariants_over_long_interleavings(
    max_events: int, max_bytes: int, ttl: float, ops: list[tuple[str, dict[str, object]]]
) -> None:
    machine = ResumeMachine()
    machine.setup(max_events=max_events, max_bytes=max_bytes, ttl=ttl, retry_ms=500)
    for name, arguments in ops:
        if name == "reader_reads" and not machine.readers:
            continue
        getattr(machine, name)(**arguments)
        machine.matches_the_model()


def test_an_append_is_blocked_while_it_would_evict_what_an_attached_reader_has_not_sent() -> None:
    """Flow control: appending must not evict events a reader still has to send; it may once it moved."""
    session = SessionState("S", "aaaaaaaaaaaa", WindowLimits(4, 1 << 20, 300.0), retry_ms=None, now=0.0)
    priming = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0)
    session.append(priming.stream, [NewEvent(b"data: x\n\n", EventKind.MESSAGE)] * 3, now=0.0)
    assert len(session.window) == 4
    assert session.blocked(1, 10, None) is None  # no guard: the window simply evicts
    readers = Readers()
    readers.add(7, [priming.stream], priming.seq - 1)
    assert session.blocked(1, 10, readers.guard()) == (0,)  # the priming event the reader has not sent
    readers.move(7, priming.seq)
    assert session.blocked(1, 10, readers.guard()) is None  # the oldest is sent: evicting it loses nothing
    assert session.blocked(2, 10, readers.guard()) == (0,)
    readers.remove(7)
    assert readers.guard() is None and session.blocked(2, 10, readers.guard()) is None


def test_pause_protects_every_streams_undelivered_events() -> None:
    """overflow = pause: an append of any stream waits while it would evict what no client was sent, a
    neighbour's included (a busy stream must not evict another's unsent result)."""
    session = SessionState("S", "aaaaaaaaaaaa", WindowLimits(4, 1 << 20, 300.0), retry_ms=None, now=0.0)
    unread = session.open_stream(StreamOrigin.GET, [], now=0.0)
    session.append(unread.stream, [NewEvent(b"data: x\n\n", EventKind.MESSAGE)] * 2, now=0.0)
    session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0)  # a busy stream
    pause = Guard(keep_undelivered=True)
    assert session.blocked(1, 10, pause) == ()  # no client was sent anything: no reader is in the way
    session.mark_delivered([unread.stream], unread.seq)  # its priming event reached a client
    assert session.blocked(1, 10, pause) is None  # evicting that loses nothing undelivered
    assert session.blocked(2, 10, pause) == ()  # the next is one no client was sent
    session.mark_delivered([unread.stream], unread.seq + 2)
    assert session.blocked(3, 10, pause) is None
    assert session.blocked(4, 10, pause) == ()  # the busy stream's priming event: never sent


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["claim", "open", "end", "release", "settle", "abandon"]),
            st.lists(st.integers(0, 6), min_size=1, max_size=3),
            st.sampled_from([b"", b"A", b"B"]),
        ),
        max_size=40,
    )
)
def test_in_flight_counts_exactly_the_pending_request_ids(steps: list[tuple[str, list[int], bytes]]) -> None:
    """The stream limit counts requests in flight: the count never drifts, whatever the order of claims
    (re-sends and other requests under used ids), answers (a stream, a JSON answer, none) and releases,
    batches included."""
    session = make_session()
    for action, ids, digest in steps:
        keys = sorted({f"n:{i}" for i in ids})
        if action == "claim":
            session.claim(keys, digests=[digest] * len(keys))
        elif action == "open":
            session.open_stream(StreamOrigin.POST, keys, now=0.0)
        elif action == "end":
            for number in list(session.streams):
                session.end_stream(number, now=0.0)
        else:
            getattr(session, action)(keys)
        pending = sum(1 for claimed in session._requests.values() if claimed.holder is ClaimState.PENDING)
        assert session.in_flight == pending >= 0


def test_a_dropped_session_is_freed_at_once_not_by_the_cycle_collector() -> None:
    """No reference cycle in a session's state (its window asks the streams what was delivered through a
    partial, not a bound method): a proxy dropping sessions gives their memory back immediately."""
    gc.collect()
    gc.disable()
    try:
        session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=BIG))
        stream = session.open_stream(StreamOrigin.POST, ["n:1"], now=0.0).stream
        session.append(stream, [msg(), response(1)], now=0.0)
        session.mark_delivered([stream], 2)
        del session
        assert not any(isinstance(o, SessionState) for o in gc.get_objects())
    finally:
        gc.enable()


# -- stream groups (POST + Last-Event-ID) ------------------------------------------------------------------


def _grouped_pair(limits: WindowLimits) -> tuple[SessionState, int, int]:
    session = make_session(limits)
    a = session.open_stream(StreamOrigin.POST, ["n:1"], 0.0).stream
    b = session.open_stream(StreamOrigin.POST, ["n:2"], 0.0).stream
    session.group_streams([a, b])
    return session, a, b


def test_a_re_attach_to_a_group_that_lost_events_after_the_cursor_is_out_of_window() -> None:
    """The view of a group follows every member: an eviction past the cursor in any of them is a gap, so
    decide answers 409 (it looked at the cursor's stream alone: a 200 with nothing, to every retry)."""
    session, a, b = _grouped_pair(WindowLimits(max_events=6, max_bytes=BIG, ttl=1e9))
    session.append(b, [msg()], 0.0)
    cursor_seq = session.next_seq - 1  # the client's last event: of b
    session.append(a, [msg()], 0.0)  # a's event after the cursor ...
    for _ in range(6):
        session.append(b, [msg()], 0.0)  # ... evicted by b's (window of 6: seqs 1-4 go)
    view = session.view(b, 60.0)
    assert view.stream is not None
    assert view.stream.evicted_through <= cursor_seq  # b itself lost nothing after the cursor
    decision = decide(view, Cursor(EPOCH, b, cursor_seq), 0.0)
    assert isinstance(decision, CursorOutOfWindow)
    assert session.read([b, a], cursor_seq).gap  # what the view would have found


def test_a_group_names_retained_members_only_and_remembers_what_a_gone_one_lost() -> None:
    session, a, b = _grouped_pair(WindowLimits(max_events=4, max_bytes=BIG, ttl=1e9))
    session.append(a, [msg(), response(1)], 0.0)
    cursor_seq = session.next_seq - 1
    session.end_stream(a, 0.0)
    for _ in range(4):
        session.append(b, [msg()], 0.0)  # evicts all of a: gone
    assert a not in session.streams
    state = session.streams[b]
    assert state.group == ()  # no gone member kept: bounded by what the window holds
    view = session.view(b, 60.0)
    assert view.stream is not None and view.stream.group_evicted_through == cursor_seq
    assert isinstance(decide(view, Cursor(EPOCH, b, cursor_seq - 1), 0.0), CursorOutOfWindow)  # a's response
    assert isinstance(decide(view, Cursor(EPOCH, b, session.next_seq - 1), 0.0), ReAttach)


def test_grouping_many_streams_over_time_keeps_each_group_within_the_retained_streams() -> None:
    session = make_session(WindowLimits(max_events=8, max_bytes=BIG, ttl=1e9))
    previous = session.open_stream(StreamOrigin.POST, ["n:0"], 0.0).stream
    for request in range(1, 300):  # a client that sends its cursor with every request
        stream = session.open_stream(StreamOrigin.POST, [f"n:{request}"], 0.0).stream
        session.group_streams([previous, stream])
        session.append(previous, [response(request - 1)], 0.0)
        session.end_stream(previous, 0.0)
        previous = stream
    assert len(session.streams) <= 9
    assert max(len(s.group) for s in session.streams.values()) < len(session.streams)


def test_the_newest_gone_standalone_stream_is_the_one_remembered() -> None:
    """Of the standalone streams gone, the newest is the one a cursor at its end re-attaches to (an older
    one would skip the newer one's messages)."""
    session = make_session(WindowLimits(max_events=2, max_bytes=BIG, ttl=1e9))
    older = session.open_stream(StreamOrigin.GET, [], 0.0).stream
    session.end_stream(older, 0.0)
    newer = session.open_stream(StreamOrigin.GET, [], 0.0)
    session.end_stream(newer.stream, 0.0)
    post = session.open_stream(StreamOrigin.POST, ["n:1"], 0.0).stream
    session.append(post, [msg(), msg()], 0.0)  # evicts both standalone streams' priming events
    assert newer.stream not in session.streams and older not in session.streams
    assert session.gone_standalone is not None and session.gone_standalone[0] == newer.stream
    at_the_end = decide(session.view(newer.stream, 60.0), Cursor(EPOCH, newer.stream, newer.seq), 0.0)
    assert at_the_end == ReAttach(newer.stream, newer.seq)
    assert isinstance(decide(session.view(older, 60.0), Cursor(EPOCH, older, 1), 0.0), CursorOutOfWindow)
