"""What the pump makes of parsed upstream events (``UpstreamEvents``, the pure part), through its public
API and without a network: the run fast path, the split at a response, replays dropped after an upstream
resume, and the decisions between upstream connections; then the pump's own part (``Pump``, ``Pumps``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.core.flow import Appended
from mcpresume.core.jsonrpc import is_proxy_id, proxy_request_id
from mcpresume.core.pump import (
    MAX_RESUME_DELAY,
    End,
    UpstreamEvents,
    refuses_resume,
    resume_delay,
    unattended,
    wants_credentials,
)
from mcpresume.core.session import NewEvent
from mcpresume.core.sse import SSEParser, SSERun
from mcpresume.core.window import EventKind, Evicted
from mcpresume.process.local import LocalSessions
from mcpresume.process.metrics import Metrics
from mcpresume.streams.pump import Pump, PumpJob, Pumps, PumpSettings
from tests.support.short_answers import short_answers

NOTE = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":%d}}'


def note(k: int, id: bytes | None = None) -> bytes:
    head = b"" if id is None else b"id: " + id + b"\n"
    return head + b"event: message\ndata: " + NOTE % k + b"\n\n"


def answer(request_id: int, id: bytes | None = None) -> bytes:
    head = b"" if id is None else b"id: " + id + b"\n"
    return head + b'event: message\ndata: {"jsonrpc":"2.0","id":%d,"result":{}}\n\n' % request_id


def feed(events: UpstreamEvents, chunk: bytes) -> list[list[NewEvent] | SSERun]:
    return events.feed(SSEParser(1 << 20).feed_batched(chunk))


def flatten(batches: list[list[NewEvent] | SSERun]) -> list[tuple[str, int]]:
    """(kind of batch, events) per batch: "run" for the fast path, else each event's kind."""
    out: list[tuple[str, int]] = []
    for batch in batches:
        if isinstance(batch, SSERun):
            out.append(("run", len(batch)))
        else:
            out.extend((item.kind.name, 1) for item in batch)
    return out


def test_a_chunk_ending_with_the_response_is_a_run_then_the_response() -> None:
    events = UpstreamEvents((7,))
    chunk = b"".join(note(k) for k in range(50)) + answer(7) + note(99)
    # Only the event that may be the response leaves the run: what follows it is a run again.
    assert flatten(feed(events, chunk)) == [("run", 50), ("RESPONSE", 1), ("run", 1)]
    assert events.pending == {} and events.complete  # answered: the stream is complete
    # Once nothing is pending, a chunk is a run whatever it holds.
    assert flatten(feed(events, answer(8) + note(1))) == [("run", 2)]


def test_an_answer_to_another_request_stays_a_message() -> None:
    events = UpstreamEvents((7,))
    batches = feed(events, note(1) + answer(3) + note(2))
    assert flatten(batches) == [("run", 1), ("MESSAGE", 1), ("run", 1)]
    assert set(events.pending) == {"n:7"} and not events.complete


def test_a_batch_event_settles_every_response_in_it_once() -> None:
    events = UpstreamEvents((1, "two"))
    batch = b'data: [{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","id":"two","result":{}}]\n\n'
    (items,) = feed(events, batch + batch)
    assert isinstance(items, list)
    assert [(item.kind, item.response_key) for item in items] == [
        (EventKind.RESPONSE, "n:1"),
        (EventKind.MESSAGE, None),  # the same answers again: nothing left to settle
    ]
    assert events.complete


def test_a_stream_waiting_for_no_response_never_completes() -> None:
    """A GET stream (no request ids) ends only with its connection: no event completes it."""
    events = UpstreamEvents()
    assert flatten(feed(events, note(1) + answer(7))) == [("run", 2)]
    assert not events.complete and events.resumable(End.CLOSED)


def own_answer(request_id: str, id: bytes | None = None) -> bytes:
    """The upstream's answer to a request the proxy sent itself (a credential ping, a takeover's probe)."""
    head = b"" if id is None else b"id: " + id + b"\n"
    return head + b'event: message\ndata: {"jsonrpc":"2.0","id":"%s","result":{}}\n\n' % request_id.encode()


def appended(batches: list[list[NewEvent] | SSERun]) -> list[bytes]:
    """The data of every event to append, in order."""
    out: list[bytes] = []
    for batch in batches:
        if isinstance(batch, SSERun):
            out.extend(event.data for event in batch.events())
        else:
            out.extend(event.data for item in batch for event in SSEParser(1 << 20).feed(item.body))
    return out


PROBE = proxy_request_id("probe", secrets.token_hex(8))
PING = proxy_request_id("ping", secrets.token_hex(8))


@pytest.mark.parametrize("request_ids", [(), (7,)], ids=["standalone", "post"])
def test_an_answer_to_the_proxys_own_request_is_never_appended(request_ids: tuple[int, ...]) -> None:
    """On any stream (the standalone one, a POST's), in a run or alone, with or without an upstream id: an
    answer to a request the proxy made is dropped and counted, what surrounds it kept in order; its upstream
    id still moves the resume cursor (a resume would only bring it back)."""
    events = UpstreamEvents(request_ids)
    chunk = note(1, b"u1") + own_answer(PROBE, b"u2") + note(2, b"u3") + own_answer(PING, b"u4")
    batches = feed(events, chunk)
    assert flatten(batches) == [("run", 1), ("run", 1)]
    assert appended(batches) == [NOTE % 1, NOTE % 2]
    assert events.take_proxy_answers() == 2 and events.take_proxy_answers() == 0
    assert events.last_id == b"u4" and set(events.pending) == {f"n:{i}" for i in request_ids}
    odd = b"retry: 10\n" + own_answer(PROBE)  # a retry field: a single event, the slow path
    assert feed(events, odd) == [] and events.take_proxy_answers() == 1


def test_a_batch_loses_only_its_answers_to_the_proxys_own_requests() -> None:
    events = UpstreamEvents((1,))
    batch = b'data: [{"jsonrpc":"2.0","id":"%s","result":{}},{"jsonrpc":"2.0","id":1,"result":{}}]\n\n'
    ((item,),) = feed(events, batch % PROBE.encode())
    assert item.kind is EventKind.RESPONSE and item.response_key == "n:1" and events.complete
    (event,) = SSEParser(1 << 20).feed(item.body)
    assert json.loads(event.data) == [{"jsonrpc": "2.0", "id": 1, "result": {}}]
    assert events.take_proxy_answers() == 1


@pytest.mark.parametrize(
    "request_id",
    [
        "mcpresume-probe-" + "0" * 15,  # not the proxy's: its random part is 16 hex digits
        "mcpresume-Probe-" + "0" * 16,
        "mcpresume-probe-" + "0" * 16 + "x",
        "x-mcpresume-probe",
    ],
)
def test_a_client_id_that_only_looks_like_the_proxys_is_kept(request_id: str) -> None:
    events = UpstreamEvents()
    assert not is_proxy_id(request_id)
    assert len(appended(feed(events, own_answer(request_id)))) == 1  # a client's answer: appended
    assert events.take_proxy_answers() == 0


def test_the_proxys_request_ids_are_unmistakable_and_never_repeat() -> None:
    made = {
        proxy_request_id(purpose, secrets.token_hex(8)) for purpose in ("ping", "probe") for _ in range(50)
    }
    assert len(made) == 100 and all(is_proxy_id(i) for i in made)
    assert is_proxy_id("mcpresume-probe")  # what an earlier version's probe carried (a rolling upgrade)
    assert not any(is_proxy_id(i) for i in (1, None, "1", "mcpresume-", "mcpresume-ping"))


def test_after_a_resume_replayed_ids_are_dropped_in_runs_and_single_events() -> None:
    events = UpstreamEvents((7,))
    odd = b"id: u5\nretry: 10\ndata: two\ndata: lines\n\n"  # a retry: a single event, the slow path
    first = b"".join(note(k, b"u%d" % k) for k in range(5)) + odd
    assert flatten(feed(events, first)) == [("run", 5), ("MESSAGE", 1)]
    assert events.last_id == b"u5" and events.resume_cursor == "u5" and events.retry_ms == 10
    events.resumed()  # the upstream stream was reopened from u5
    # The upstream replays u3, u4 and u5, then goes on to u6 and its answer.
    replay = note(3, b"u3") + note(4, b"u4") + odd + note(6, b"u6") + answer(7, b"u7")
    batches = feed(events, replay)
    assert flatten(batches) == [("run", 1), ("RESPONSE", 1)]
    assert events.duplicates == 3
    assert events.last_id == b"u7"
    (run, [response]) = batches
    assert isinstance(run, SSERun) and [e.id for e in run.events()] == [b"u6"]
    assert response.kind is EventKind.RESPONSE and response.response_key == "n:7"


def test_a_stream_opened_again_in_a_new_upstream_session_forgets_the_old_ids() -> None:
    """``reopened`` (the session begun again upstream, its standalone stream opened there): the new
    session's ids may repeat the old one's; none is a replay, and a resume starts from the new ones."""
    events = UpstreamEvents()
    feed(events, note(1, b"u1") + note(2, b"u2"))
    events.resumed()
    events.reopened()
    assert events.resume_cursor is None
    assert flatten(feed(events, note(1, b"u1"))) == [("run", 1)] and events.duplicates == 0
    assert events.resume_cursor == "u1"


def test_replays_are_kept_until_the_stream_is_resumed() -> None:
    """Before a resume, a repeated upstream id is the upstream's business: nothing is dropped."""
    events = UpstreamEvents()
    feed(events, note(1, b"u1"))
    assert flatten(feed(events, note(1, b"u1"))) == [("run", 1)] and events.duplicates == 0


def test_the_resume_cursor_is_the_last_id_without_the_spaces_a_header_cannot_carry() -> None:
    events = UpstreamEvents()
    assert events.resume_cursor is None  # no ids: not resumable
    feed(events, b"id:  7 \ndata: x\n\n")
    assert events.last_id == b" 7 " and events.resume_cursor == "7"


@pytest.mark.parametrize(("end", "complete"), list(itertools.product(End, (False, True))))
def test_only_an_incomplete_stream_whose_connection_ended_is_resumed(end: End, complete: bool) -> None:
    """Every end x complete: a closed or dropped connection is reopened unless the stream is complete; a
    complete stream, or an event too large (resuming would meet it again), is not."""
    events = UpstreamEvents((7,))
    if complete:
        feed(events, answer(7))
    assert events.complete is complete
    expected = {
        End.COMPLETE: False,
        End.CLOSED: not complete,
        End.DROPPED: not complete,
        End.TOO_LARGE: False,
    }
    assert set(expected) == set(End)
    assert events.resumable(end) is expected[end]


def test_the_resume_delay_doubles_from_the_retry_and_stops_growing() -> None:
    assert [resume_delay(1000, attempts) for attempts in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert resume_delay(1000, 10) == MAX_RESUME_DELAY


@pytest.mark.parametrize(
    ("status", "refused"),
    [
        (400, True),
        (404, True),
        (405, True),
        (409, True),
        (410, True),
        (200, False),
        (429, False),
        (500, False),
        (503, False),
    ],
)
def test_which_answers_to_a_resume_mean_it_cannot_be_resumed(status: int, refused: bool) -> None:
    assert refuses_resume(status) is refused


def test_each_pending_request_gets_its_own_error_with_its_own_id() -> None:
    events = UpstreamEvents((7, "seven"))
    feed(events, answer(7))
    (error,) = events.unanswered("the upstream went away")
    assert error.kind is EventKind.RESPONSE and error.response_key == "s:seven"
    (event,) = SSEParser(1 << 20).feed(error.body)
    doc = json.loads(event.data)
    assert doc["id"] == "seven" and doc["error"]["message"] == "the upstream went away"
    assert doc["error"]["data"] == {"reason": "upstream_stream_lost"}


def test_a_stream_is_moot_once_every_request_it_waits_for_is_cancelled() -> None:
    events = UpstreamEvents((1, 2))
    assert not events.cancel(["n:1", "n:9"])  # one of two; another stream's id counts for nothing
    assert events.cancelled == {"n:1"}
    assert events.cancel(["n:2"]) and events.moot
    assert events.unanswered("lost") == []  # a cancelled request is never answered by the proxy
    feed(events, answer(2))  # an upstream that answers a cancelled request anyway: a response as any
    assert events.pending == {"n:1": 1} and events.moot and not events.complete
    feed(events, answer(1))
    assert events.complete and not events.moot  # nothing pending: complete, not moot
    assert not UpstreamEvents(()).cancel(["n:1"])  # a standalone stream waits for nothing


def test_a_stream_not_moot_answers_only_its_requests_not_cancelled_with_errors() -> None:
    events = UpstreamEvents((1, 2))
    events.cancel(["n:1"])
    assert [error.response_key for error in events.unanswered("lost")] == ["n:2"]


@pytest.mark.parametrize(
    ("reading", "heard", "left", "gone"),
    [
        (True, 0.0, 0.0, False),  # a client view reads it
        (False, 50.0, 0.0, False),  # the upstream sent an event within the ttl
        (False, 0.0, 50.0, False),  # its last view left within the ttl
        (False, 40.0, 40.0, True),  # neither, for the ttl exactly
        (False, 0.0, 0.0, True),
    ],
)
def test_a_stream_is_unattended_when_nobody_reads_or_feeds_it_for_the_ttl(
    reading: bool, heard: float, left: float, gone: bool
) -> None:
    assert unattended(100.0, heard, left, reading=reading, ttl=60.0) is gone


@pytest.mark.parametrize(("status", "wanted"), [(401, True), (403, True), (404, False), (500, False)])
def test_a_resume_refused_for_its_credentials_wants_new_ones(status: int, wanted: bool) -> None:
    assert wants_credentials(status) is wanted
    assert not (wanted and refuses_resume(status))  # not a refusal of the stream itself


async def test_pumps_keep_each_sessions_tasks_until_they_end() -> None:
    pumps = Pumps()
    release = asyncio.Event()
    a1 = pumps.spawn("a", release.wait())
    a2 = pumps.spawn("a", release.wait())
    b = pumps.spawn("b", asyncio.sleep(30))
    assert len(pumps) == 3
    pumps.cancel_session("b")
    await asyncio.gather(b, return_exceptions=True)
    assert b.cancelled() and len(pumps) == 2 and not a1.done()
    release.set()
    await asyncio.gather(a1, a2)
    await asyncio.sleep(0)  # done callbacks run one loop step after the tasks end
    assert len(pumps) == 0 and not pumps._tasks


async def test_room_is_asked_for_the_bytes_the_window_will_hold() -> None:
    """Flow control checks room for what the window will keep of a run: the store's append measures a run
    by ``run.size``, which must be its blocks, without the upstream id lines the chunk carried (asking for
    more pauses or detaches a reader too early)."""
    appended: list[SSERun] = []

    class Store:
        async def append_run(self, _sid: str, _stream: int, run: SSERun, _now: float, *_: object) -> Appended:
            appended.append(run)
            return Appended(Evicted())

        async def end_stream(self, _sid: str, _stream: int, _now: float, *_: object) -> None:
            return None

    class Response:  # an upstream answer delivering one chunk, then its end
        def __init__(self, chunks: list[bytes]) -> None:
            self.content = self
            self.chunks = chunks

        async def readany(self) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

        def release(self) -> None:
            return None

    settings = PumpSettings(1 << 20, 5.0, 256, 1000, 0)  # no resume attempts: the stream ends with the read
    unused: Any = None  # the upstream: never asked to resume
    local = LocalSessions()
    pump = Pump(PumpJob("s", 1, (), "log"), Store(), local, Metrics(), unused, lambda: 0.0, settings)  # type: ignore[arg-type]
    chunk = note(1, b"u-1") + note(2, b"u-2")
    await pump.run(Response([chunk]))  # type: ignore[arg-type]
    (run,) = appended
    assert len(run) == 2 and run.size == sum(map(len, run.blocks))
    assert run.size == len(chunk) - len(b"id: u-1\n") - len(b"id: u-2\n")


def test_a_run_of_one_kind_after_a_run_of_the_other_is_checked_for_its_response() -> None:
    """The core remembers which notification spelling matched last; a multi-line (general) run's needles
    outnumber a one-line run's, and the hint from one must not break the other (it raised IndexError)."""
    events = UpstreamEvents((7,))
    pretty = b'event: message\ndata: {\ndata:   "jsonrpc": "2.0",\ndata:   "method": "x"\ndata: }\n\n'
    assert flatten(feed(events, pretty * 3)) == [("run", 3)]
    assert flatten(feed(events, note(1) + note(2) + answer(7))) == [("run", 2), ("RESPONSE", 1)]
    assert events.pending == {} and events.complete


# -- a short answer (SSEParser._short, the one-event check of _suspects) against the general path -----------


class CountedEvents(UpstreamEvents):
    """``UpstreamEvents`` without the direct check of a run of one event: the counts decide."""

    __slots__ = ()

    def _answer(self, run: SSERun) -> None:
        return None


class GeneralParser(SSEParser):
    __slots__ = ()

    def _short(self, chunk: bytes) -> None:
        return None


def batches_described(batches: list[list[NewEvent] | SSERun]) -> list[object]:
    return [
        (batch.blocks, batch.ids, batch.size, batch.general, batch.events())
        if isinstance(batch, SSERun)
        else batch
        for batch in batches
    ]


def events_state(events: UpstreamEvents) -> dict[str, object]:
    state = {name: getattr(events, name) for name in UpstreamEvents.__slots__}
    state["_recent"] = None if events._recent is None else list(events._recent)
    return state


@settings(max_examples=400, deadline=None)
@given(
    short_answers(),
    st.sampled_from([(), (7,), (7, 8), (8,)]),
    st.sampled_from([b"", b"id: 42\ndata: x\n\nid: 2\ndata: y\n\n"]),
    st.integers(0, 3),
)
def test_property_a_short_answer_makes_the_same_batches_and_state(
    body: bytes, request_ids: tuple[int, ...], appended_before: bytes, spelling: int
) -> None:
    # The batches to append, the duplicates, the proxy's answers, completion and cursor: the same whether
    # the answer is read the short way or the general one; also after a resume (replays dropped).
    outcomes = []
    for events, parser in (
        (UpstreamEvents(request_ids), SSEParser(1 << 20)),
        (CountedEvents(request_ids), GeneralParser(1 << 20)),
    ):
        events._spelling = spelling
        if appended_before:
            events.feed(SSEParser(1 << 20).feed_batched(appended_before))
            events.resumed()
        batches = events.feed(parser.feed_batched(body))
        outcomes.append((batches_described(batches), events_state(events)))
    assert outcomes[0] == outcomes[1]


def test_a_short_answer_to_the_pending_request_completes_the_stream_in_one_batch() -> None:
    events = UpstreamEvents([7])
    body = b'id: 41\ndata: \n\nid: 42\nevent: message\ndata: {"jsonrpc":"2.0","id":7,"result":{}}\n\n'
    batches = events.feed(SSEParser(1 << 20).feed_batched(body))
    assert flatten(batches) == [("RESPONSE", 1)]
    assert events.complete and events.last_id == b"42" and not events.pending
    # A notification alone stays a run (it answers nothing).
    events = UpstreamEvents([7])
    assert flatten(feed(events, note(1, b"5"))) == [("run", 1)]
    assert not events.complete and events.last_id == b"5"
