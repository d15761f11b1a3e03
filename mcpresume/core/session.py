"""A session's durable state: epoch, one sequence, its streams, its window, its request ids (pure).

Theory of operation
-------------------
The session is the durable object; an SSE connection is an ephemeral view of one of its streams
(ARCHITECTURE.md, the bird's-eye view). This module is the durable part, with no I/O:

* ``open_stream`` starts a stream (an upstream POST's SSE response, or the standalone GET stream) and
  appends its priming event, so a client holds a cursor in that stream before any message arrives.
* ``append`` gives each upstream event the next seq and puts it in the window.
* ``end_stream`` marks a stream ended; its events stay in the window (a POST stream's response must stay
  resumable for as long as the window keeps it: a client that drops at the instant of the response still
  needs it).
* ``read`` returns what a reader positioned at ``after`` on a set of streams should send next, or says the
  position can no longer be served (``gap``) or that everything has been sent (``complete``).
* ``claim`` records the JSON-RPC request ids a POST carries, each with its request's digest, so the upstream
  sees each request at most once (an id again only for another request, once the first is over);
  ``cancel_requests`` marks those of a stream the proxy closed after the client cancelled them.

Stream states (``StreamPhase``, the table ``STREAM_STEPS``: every phase x input has a row):

==========  ========  ==========  ==========  ===========  ==========
phase       open      append      end         evicted-all  forgotten
==========  ========  ==========  ==========  ===========  ==========
unknown     live      (dropped)   (ignored)   (ignored)    (ignored)
live        --        live        ended       (stays live) (ignored)
ended       --        (dropped)   (ignored)   gone         (ignored)
gone        --        (dropped)   (ignored)   (ignored)    unknown
==========  ========  ==========  ==========  ===========  ==========

``--``: impossible (a stream number is given once). ``evicted-all``: the window holds none of the stream's
events any more (a stream that never had one is so as soon as it ends). Gone, only a tombstone is kept,
(number, last seq) in ``SessionState.gone``, so a view that had sent the whole stream finds it complete;
``forgotten``: ``MAX_GONE_STREAMS`` newer tombstones pushed it out. Nothing grows with the number of streams
ever opened.

``version`` increases on every change a reader could be waiting for (append, end, drop), which lets a
store implement "wait for news after what I last read" without a lost wake-up.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, assert_never

from mcpresume.core.credentials import remember
from mcpresume.core.cursor import encode_cursor, id_line_prefix
from mcpresume.core.errors import (
    CursorOutOfWindow,
    DuplicateRequest,
    OutcomeUnknown,
    ProxyError,
    RequestCancelled,
    RequestIdInUse,
    TooManyStreams,
)
from mcpresume.core.flow import Appended, Guard, refusal
from mcpresume.core.resume import SessionView, StreamView
from mcpresume.core.sse import SSERun, encode_frame, frame_into, frame_parts, priming_block
from mcpresume.core.window import Event, EventKind, Evicted, Segment, Window, WindowLimits

# A session remembers this many request ids (oldest forgotten first). A client that re-sends a request id
# older than the last 4096 it used is far outside any reconnect scenario; the bound keeps a long-lived
# session's memory flat.
MAX_REQUEST_IDS: Final = 4096

# One read returns at most this much (and at least one event), so one write to a client stays bounded and a
# re-attach to a full window is sent in several writes rather than one huge one. 64 KiB: a view writes only
# while its client's socket buffer is under the transport's high-water mark (64 KiB by default), so a view
# whose client never reads holds at most about twice that (attach.ClientWriter), whatever the window holds.
READ_MAX_EVENTS: Final = 512
READ_MAX_BYTES: Final = 64 << 10


class StreamPhase(enum.Enum):
    """Where a stream is in its life (the module docstring's table)."""

    UNKNOWN = "unknown"  # no record: not opened yet, or its tombstone was forgotten
    LIVE = "live"  # being pumped: appends go to it
    ENDED = "ended"  # no more appends; some of its events are still in the window
    GONE = "gone"  # ended, every event left the window: only its tombstone (number, last seq) is kept


class StreamInput(enum.Enum):
    OPEN = "open"
    APPEND = "append"
    END = "end"
    EVICTED_ALL = "evicted_all"  # the window holds none of its events any more
    FORGOTTEN = "forgotten"  # MAX_GONE_STREAMS newer tombstones pushed its out


class StreamEffect(enum.Enum):
    CHANGE = "change"  # the input takes effect
    IGNORE = "ignore"  # nothing happens (an append to an ended stream is dropped)
    IMPOSSIBLE = "impossible"  # cannot happen: a stream number is given once


@dataclass(frozen=True, slots=True)
class StreamStep:
    effect: StreamEffect
    phase: StreamPhase  # the phase after


# A stream's lifecycle, phase x input (the module docstring's table; tests/test_session.py checks that
# every pair has a row and that SessionState follows it).
_LIVE, _ENDED, _GONE, _UNKNOWN = StreamPhase.LIVE, StreamPhase.ENDED, StreamPhase.GONE, StreamPhase.UNKNOWN
_CHANGE, _IGNORE, _IMPOSSIBLE = StreamEffect.CHANGE, StreamEffect.IGNORE, StreamEffect.IMPOSSIBLE
STREAM_STEPS: Final[Mapping[tuple[StreamPhase, StreamInput], StreamStep]] = {
    (_UNKNOWN, StreamInput.OPEN): StreamStep(_CHANGE, _LIVE),
    (_UNKNOWN, StreamInput.APPEND): StreamStep(_IGNORE, _UNKNOWN),
    (_UNKNOWN, StreamInput.END): StreamStep(_IGNORE, _UNKNOWN),
    (_UNKNOWN, StreamInput.EVICTED_ALL): StreamStep(_IGNORE, _UNKNOWN),
    (_UNKNOWN, StreamInput.FORGOTTEN): StreamStep(_IGNORE, _UNKNOWN),
    (_LIVE, StreamInput.OPEN): StreamStep(_IMPOSSIBLE, _LIVE),
    (_LIVE, StreamInput.APPEND): StreamStep(_CHANGE, _LIVE),
    (_LIVE, StreamInput.END): StreamStep(_CHANGE, _ENDED),
    (_LIVE, StreamInput.EVICTED_ALL): StreamStep(_IGNORE, _LIVE),  # more may come: it stays
    (_LIVE, StreamInput.FORGOTTEN): StreamStep(_IGNORE, _LIVE),
    (_ENDED, StreamInput.OPEN): StreamStep(_IMPOSSIBLE, _ENDED),
    (_ENDED, StreamInput.APPEND): StreamStep(_IGNORE, _ENDED),
    (_ENDED, StreamInput.END): StreamStep(_IGNORE, _ENDED),
    (_ENDED, StreamInput.EVICTED_ALL): StreamStep(_CHANGE, _GONE),
    (_ENDED, StreamInput.FORGOTTEN): StreamStep(_IGNORE, _ENDED),
    (_GONE, StreamInput.OPEN): StreamStep(_IMPOSSIBLE, _GONE),
    (_GONE, StreamInput.APPEND): StreamStep(_IGNORE, _GONE),
    (_GONE, StreamInput.END): StreamStep(_IGNORE, _GONE),
    (_GONE, StreamInput.EVICTED_ALL): StreamStep(_IGNORE, _GONE),
    (_GONE, StreamInput.FORGOTTEN): StreamStep(_CHANGE, _UNKNOWN),
}


def _changes(given: StreamInput) -> tuple[bool, bool]:
    """Whether ``given`` changes a stream with a record, indexed by its ``live`` flag: (ended, live). What
    ``SessionState`` consults where it decides, at the cost of a tuple index (the append hot path)."""
    return (
        STREAM_STEPS[StreamPhase.ENDED, given].effect is StreamEffect.CHANGE,
        STREAM_STEPS[StreamPhase.LIVE, given].effect is StreamEffect.CHANGE,
    )


_APPENDS: Final = _changes(StreamInput.APPEND)  # (False, True): only a live stream takes appends
_ENDS: Final = _changes(StreamInput.END)  # (False, True)
_GOES_WHEN_EMPTIED: Final = _changes(StreamInput.EVICTED_ALL)  # (True, False): only an ended stream goes


class StreamOrigin(enum.Enum):
    POST = "post"  # the SSE response to a client POST: ends with the JSON-RPC response(s)
    GET = "get"  # the standalone stream a client opens with GET: server-initiated messages


@dataclass(frozen=True, slots=True)
class PumpRecord:
    """What reading a stream's upstream again needs, kept with the stream: a replica that restarts (or takes
    over) resumes the stream upstream from its last upstream event id, or answers its pending requests."""

    request_ids: tuple[str | int, ...]  # as the client sent them: the synthesized errors answer with them
    path_qs: str  # the MCP endpoint, where a resume GET goes
    # Mcp-Session-Id, the client's MCP-Protocol-Version and credentials: what a resume GET carries.
    resume_headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Orphan:
    """A live stream whose pump may be gone (``SessionStore.orphans``)."""

    session_id: str
    epoch: str
    stream: int
    origin: StreamOrigin
    pump: PumpRecord
    upstream_cursor: str | None  # the upstream's last event id appended; None: it sent none
    answered: tuple[str, ...]  # the request keys whose responses are in
    fence: int = 0  # the session's fence once adopted: its pump writes under it (``store.Fenced``)


@dataclass(slots=True)
class StreamState:
    """A stream's record (its number is its key in ``SessionState.streams``)."""

    origin: StreamOrigin
    first_seq: int
    last_seq: int
    live: bool = True
    # The highest seq some client was sent: what overflow=pause protects, and what an eviction of
    # "undelivered" events is counted against.
    delivered: int = 0
    # The streams one client view followed together with this one (POST + Last-Event-ID): a re-attach with a
    # cursor of any of them follows them all, since that view's client holds one cursor for all of them.
    # Retained ones only (bounded by the window); ``group_lost``: the last seq of members gone since.
    group: tuple[int, ...] = ()
    group_lost: int = 0
    # It began with a priming event (2025-11-25 and later); without one, its first event is a message and
    # ``last_seq`` stays ``first_seq - 1`` until it comes.
    primed: bool = True
    pump: PumpRecord | None = None  # how to read its upstream again (None: it cannot be)
    upstream_cursor: str | None = None  # the upstream's last event id appended
    answered: tuple[str, ...] = ()  # request keys whose responses were appended


@dataclass(slots=True)  # not frozen: built per upstream event, and frozen construction is ~3.5x slower
class NewEvent:
    """An upstream event about to be appended: its serialized body and its kind."""

    body: bytes  # the SSE event without its id line (sse.frame_body): kept so, its cursor written on send
    kind: EventKind
    response_key: str | None = None  # for a RESPONSE: the request id it answers


@dataclass(frozen=True, slots=True)
class ReadResult:
    segments: Sequence[Segment]  # what to send, in seq order: copies, safe to keep across an await
    complete: bool  # every stream read has ended and everything has been returned
    gap: bool  # an event after the position was evicted: the reader must stop (the client re-attaches)
    version: int  # the session's version when read: wait(version) returns at once if anything changed since
    more: bool = False  # cut at the read limits: more is retained already (read again, do not wait)
    epoch: bytes = b""  # the session's epoch: the cursors written in front of the events

    @property
    def count(self) -> int:
        return sum(len(segment.blocks) for segment in self.segments)

    @property
    def last_seq(self) -> int:
        """The seq of the last event returned (a reader's next position); only when some were."""
        return self.segments[-1].last

    def body(self) -> bytes:
        """Every event, in order, as one write: each one's cursor (``id:`` line) then the event as kept."""
        parts: list[bytes] = []
        epoch = self.epoch
        for segment in self.segments:
            frame_into(parts, id_line_prefix(epoch, segment.stream), segment.seq, segment.blocks)
        return b"".join(parts)

    def _frame_parts(self, segment: Segment) -> list[bytes]:
        """A segment's events framed with their cursors, in parts (``sse.frame_parts``)."""
        return frame_parts(id_line_prefix(self.epoch, segment.stream), segment.seq, segment.blocks)

    def count_through(self, seq: int) -> int:
        """How many of the events returned have a seq of at most ``seq``."""
        return sum(max(0, min(len(s.blocks), seq - s.seq + 1)) for s in self.segments)

    @property
    def events(self) -> list[Event]:
        """The events returned as sent, cursor included, one object each (tests and slow paths; the hot
        path uses ``body``)."""
        events = []
        for segment in self.segments:
            parts = self._frame_parts(segment)
            for i, at in enumerate(segment.times):
                events.append(Event(segment.seq + i, segment.stream, parts[2 * i] + parts[2 * i + 1], at))
        return events


@dataclass(frozen=True, slots=True)
class SessionAccess:
    """What deciding who may read a session needs: its incarnation, and the credentials bound to it."""

    epoch: str
    credentials: tuple[bytes, ...]  # digests (core/credentials.py); empty: the session began without any
    protocol_version: str | None  # the MCP-Protocol-Version its requests carried, if any (a ping says it)
    # The upstream's own id of the session once it was begun again there (upstream_session_lost =
    # "reinitialize"): requests carry it upstream instead of the client's. None: the client's own.
    upstream_id: str | None = None


class ClaimOutcome(enum.Enum):
    """What a claim of a POST's request ids says. "Seen": the id was claimed before for the same request
    (the same method and params: a re-send); an id claimed for another request whose request is over is
    as new (``NEW``), one whose request is not over is ``IN_USE``."""

    NEW = "new"  # no id seen before (or each one's earlier request is over): forward the request
    ATTACH = "attach"  # every id belongs to one retained stream: attach to it, do not forward
    GONE = "gone"  # the ids were seen, but their stream is no longer retained
    IN_FLIGHT = "in_flight"  # seen, and the original is still being forwarded (no stream yet)
    ANSWERED = "answered"  # seen, and answered with application/json: relayed, not retained
    UNKNOWN = "unknown"  # seen, sent upstream, and no answer came: it may have run, what it did is unknown
    CONFLICT = "conflict"  # some ids seen, some not, or seen on different streams
    IN_USE = "in_use"  # another request under an id whose request is not over (pending, unknown, live)
    LIMITED = "limited"  # new, but the session already has max_streams_per_session live streams
    CANCELLED = "cancelled"  # seen, cancelled by the client, and its stream closed unanswered


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    stream: int | None = None


def claim_refusal(outcome: ClaimOutcome, max_streams: int | None = None) -> ProxyError:
    """What a client whose request ids are not forwarded is told, by the claim's outcome (invariant #8: a
    request reaches the upstream at most once). ``ATTACH``: only when its stream could not be attached
    after all (it left the window meanwhile). ``NEW`` is forwarded: asking is an error."""
    match outcome:
        case ClaimOutcome.ATTACH | ClaimOutcome.GONE:
            return CursorOutOfWindow(
                "this request id was already answered and its stream is no longer retained"
            )
        case ClaimOutcome.IN_FLIGHT:
            return DuplicateRequest("this request id is already being forwarded")
        case ClaimOutcome.ANSWERED:
            return DuplicateRequest(
                "this request id was answered with application/json, which is not retained"
            )
        case ClaimOutcome.UNKNOWN:
            return OutcomeUnknown(
                "this request was sent upstream and no answer came: it may have run, and what it did is "
                "unknown; it is not sent again (send it under a new request id to run it again)"
            )
        case ClaimOutcome.CONFLICT:
            return DuplicateRequest("request ids of this batch were seen before, on different requests")
        case ClaimOutcome.IN_USE:
            return RequestIdInUse(
                "this request id is another request's in this session, and that request is not over "
                "(in flight, its outcome unknown, or its stream live); use a new request id"
            )
        case ClaimOutcome.LIMITED:
            return TooManyStreams(f"the session already has {max_streams} live streams", limit=max_streams)
        case ClaimOutcome.CANCELLED:
            return RequestCancelled("this request id was cancelled (notifications/cancelled): not sent again")
        case ClaimOutcome.NEW:
            raise ValueError("a new claim is forwarded, not refused")
        case _:  # pragma: no cover
            assert_never(outcome)


# A session remembers the last this many streams that ended and left the window (``SessionState.gone``):
# a view that follows several streams (POST + Last-Event-ID) finds one it had sent whole complete, not a gap.
MAX_GONE_STREAMS: Final = 64

# One string object per revision for every session, not one per session (a header value is a new str).
_KNOWN_VERSIONS: Final = {v: v for v in ("2025-03-26", "2025-06-18", "2025-11-25")}


class ClaimState(enum.Enum):
    """What the request-id map holds for a claimed id without a stream (else: its stream's number). Not
    ints: no stream number can be mistaken for one."""

    PENDING = "pending"  # claimed, the upstream has not answered yet
    ANSWERED = "answered"  # answered without a stream (application/json): relayed, not retained
    # Cancelled by the client (notifications/cancelled), and its stream closed by the proxy without an answer
    # (``cancel_requests``): a re-send is refused, never forwarded again; another request may take the id.
    CANCELLED = "cancelled"
    # Sent upstream, and no answer came (its head not within first_byte_timeout, the connection broken): it
    # may have run, so it is never sent again; what it did is unknown.
    ABANDONED = "abandoned"


# What a re-sent id whose entry is a ClaimState gets (tests/test_session.py checks every state has a row).
CLAIM_OF_STATE: Final[Mapping[ClaimState, ClaimOutcome]] = {
    ClaimState.PENDING: ClaimOutcome.IN_FLIGHT,
    ClaimState.ANSWERED: ClaimOutcome.ANSWERED,
    ClaimState.CANCELLED: ClaimOutcome.CANCELLED,
    ClaimState.ABANDONED: ClaimOutcome.UNKNOWN,
}


class Claimed(NamedTuple):
    """A request id's entry in the session's request-id map."""

    holder: int | ClaimState  # the number of the stream its answer became, or a ClaimState
    digest: bytes  # its request's digest (jsonrpc.request_digest); empty: not known (any request matches)


def same_request(digest: bytes, other: bytes) -> bool:
    """Whether two claims of one request id are one request (a re-send): the same digest, or one not known
    (a claim made without it is taken for the same request, as before digests were kept)."""
    return not digest or not other or digest == other


class SessionState:
    """All the proxy holds for one session."""

    __slots__ = (
        "_requests",
        "credentials",
        "epoch",
        "gone",
        "gone_standalone",
        "in_flight",
        "last_active",
        "live_posts",
        "next_seq",
        "next_stream",
        "protocol_version",
        "retired",
        "retry_ms",
        "session_id",
        "standalone",
        "streams",
        "version",
        "window",
    )

    def __init__(
        self,
        session_id: str,
        epoch: str,
        limits: WindowLimits,
        retry_ms: int | None,
        now: float,
        first_stream: int = 1,
        first_version: int = 0,
        credential: bytes | None = None,
    ) -> None:
        self.session_id = session_id
        self.retry_ms = retry_ms
        self.epoch = epoch
        self.streams: dict[int, StreamState] = {}
        # The window reads delivery marks from the stream records themselves (no reference back to the
        # session: no cycle, so a dropped session is freed at once, not by the cyclic collector).
        self.window = Window(limits, self.streams)
        self.next_seq = 1
        # A new incarnation of a session id numbers its streams after the old one's, so a reader or pump of
        # the old incarnation (which holds only the id and a stream number) finds nothing to read or feed.
        self.next_stream = first_stream
        # And its versions after the old one's: a view of the old incarnation that waits on the version it
        # last read is woken at once, never parked on the new one by a coincidence of change counts.
        self.version = first_version
        self.last_active = now
        self.standalone: int | None = None  # the live standalone GET stream, if any
        # (number, first seq, last seq) of the last standalone stream that ended and left the window: a
        # re-attach with its last cursor then still opens a new one (its client missed nothing).
        self.gone_standalone: tuple[int, int, int] | None = None
        # (number, last seq) of the streams that ended and left the window, newest last (MAX_GONE_STREAMS).
        self.gone: tuple[tuple[int, int], ...] = ()
        # request id key -> its claim (its stream's number or a ClaimState, and its request's digest), oldest
        # first (a dict keeps insertion order; an OrderedDict would cost ~150 bytes more per session for
        # nothing).
        self._requests: dict[str, Claimed] = {}
        # Request ids claimed and not yet answered (each id of a batch counts): they will open streams, so
        # they count against max_streams_per_session as much as live streams do. Kept exact by
        # _remember_request and _forget_request, the only writers of the request map.
        self.in_flight = 0
        # The live POST streams (what live_post_streams says): kept by open_stream and end_stream, the only
        # places a stream begins or stops being live, so a claim or an idle check counts no streams.
        self.live_posts = 0
        # Digests of the credentials the upstream accepted in this session (core/credentials.py), the newest
        # last; empty when the session began without any (then nothing is checked). And the
        # MCP-Protocol-Version its requests carried: what a verifying ping says.
        self.credentials: tuple[bytes, ...] = () if credential is None else (credential,)
        self.protocol_version: str | None = None
        # The upstream does not know the session (store.retire): new requests find it unknown.
        self.retired = False

    # -- streams -----------------------------------------------------------------------------------------

    def open_stream(
        self,
        origin: StreamOrigin,
        request_keys: Sequence[str],
        now: float,
        *,
        priming: bool = True,
        pump: PumpRecord | None = None,
    ) -> Event:
        """Start a stream and append its priming event; returns the priming event. ``priming=False`` (a
        client of a revision before 2025-11-25, which may parse every event's data as JSON): no event is
        appended, and the returned one (empty) only says the seq the stream's first event may take."""
        number = self.next_stream
        self.next_stream += 1
        seq = self.next_seq
        self.streams[number] = StreamState(
            origin, seq, seq if priming else seq - 1, primed=priming, pump=pump
        )
        for key in request_keys:
            self._remember_request(key, number)
        if origin is StreamOrigin.GET:
            self.standalone = number
        else:
            self.live_posts += 1
        self.last_active = now
        if not priming:
            self.version += 1  # a reader of the stream may wait on it (its end, say): the stream is news
            return Event(seq, number, b"", now)
        block = priming_block(self.retry_ms)
        self._add(Segment.of(number, seq, [block], now, len(block)), now)
        return Event(seq, number, encode_frame(encode_cursor(self.epoch, number, seq), block), now)

    def append(self, stream: int, items: Sequence[NewEvent], now: float) -> Evicted:
        """Append upstream events to a live stream (events for an ended stream are dropped): the next seqs,
        the window's limits enforced once for them all."""
        state = self.streams.get(stream)
        if state is None or not _APPENDS[state.live] or not items:
            return Evicted()
        answered = [item.response_key for item in items if item.response_key is not None]
        if answered:
            state.answered = (*state.answered, *answered)
        return self._add(Segment.of(stream, self.next_seq, [item.body for item in items], now), now)

    def append_run(self, stream: int, run: SSERun, now: float) -> Evicted:
        """Append a run of upstream message events (the hot path: their blocks kept as they came, one
        segment in all)."""
        state = self.streams.get(stream)
        if state is None or not _APPENDS[state.live] or not run.blocks:
            return Evicted()
        return self._add(Segment.of(stream, self.next_seq, list(run.blocks), now, run.size), now)

    def _add(self, segment: Segment, now: float) -> Evicted:
        self.next_seq = segment.seq + len(segment.blocks)
        self.streams[segment.stream].last_seq = self.next_seq - 1
        # Not last_active: upstream traffic is not client activity (an idle session with a chatty
        # standalone stream must still expire).
        self.version += 1
        evicted = self.window.add(segment, now)
        if evicted.streams:
            self._forget_gone_streams(evicted.streams)
        return evicted

    def end_stream(self, stream: int, now: float) -> None:
        state = self.streams.get(stream)
        if state is None or not _ENDS[state.live]:
            return
        state.live = False  # ended
        if state.origin is StreamOrigin.POST:
            self.live_posts -= 1
        # Never backwards (as ``touch``): a stream the proxy gave up as unattended ends as of when it was last
        # read or fed, so it gives its session no time of its own (``streams.pump``).
        if self.last_active < now:
            self.last_active = now
        # What taking the stream's pump over needed (``orphans`` lists live streams only): an ended stream
        # keeps none of it (its record, its request ids and credential headers, the response keys it got),
        # so an idle session holds no more than its events and its stream's seqs.
        state.pump = None
        state.upstream_cursor = None
        state.answered = ()
        if self.standalone == stream:
            self.standalone = None
        self.version += 1
        self._forget_gone_streams((stream,))

    def group_streams(self, streams: Sequence[int]) -> None:
        """Record that one client view follows ``streams`` together (with the groups they are in already)."""
        states = self.streams
        members: set[int] = set()
        lost = 0
        for number in streams:
            state = states.get(number)
            if state is not None:
                members.add(number)
                members.update(state.group)  # retained ones: _forget_gone_streams takes the others out
                lost = max(lost, state.group_lost)
        for number in members:
            state = states[number]
            state.group = tuple(sorted(members - {number}))
            state.group_lost = max(state.group_lost, lost)

    def expire(self, now: float) -> Evicted:
        return self._after_eviction(self.window.expire(now))

    def shed(self, max_bytes: int) -> Evicted:
        """Trim the window to ``max_bytes`` (the global cap), oldest first."""
        return self._after_eviction(self.window.shed(max_bytes))

    def _after_eviction(self, evicted: Evicted) -> Evicted:
        """An eviction outside an append: readers must look again, and emptied streams are forgotten."""
        if evicted:
            self.version += 1
            if evicted.streams:
                self._forget_gone_streams(evicted.streams)
        return evicted

    def _forget_gone_streams(self, candidates: Iterable[int]) -> None:
        """Forget the ended streams among ``candidates`` that hold no event any more: only a stream that
        just ended or just lost events can have become so (never a walk over every stream: a session keeps
        a hundred ended streams of short calls while their events stay in the window)."""
        window, streams = self.window, self.streams
        # Eviction takes a stream's events oldest first, so its last one is the last to go.
        # (A stream that never had an event, ``last_seq < first_seq``, is gone as soon as it ends.)
        gone = [
            n
            for n in candidates
            if (s := streams.get(n)) is not None
            and _GOES_WHEN_EMPTIED[s.live]
            and (window.evicted_through(n) >= s.last_seq or s.last_seq < s.first_seq)
        ]
        if not gone:
            return  # the common case (every append to a full window gets here)
        gone.sort()  # oldest first: the order of the tombstones
        for number in gone:
            state = self.streams.pop(number)
            window.forget_emptied(number)  # its last event is evicted (or it had none): no walk
            self.gone = (*self.gone[1 - MAX_GONE_STREAMS :], (number, state.last_seq))
            gone_before = self.gone_standalone
            if state.origin is StreamOrigin.GET and (gone_before is None or number > gone_before[0]):
                self.gone_standalone = (number, state.first_seq, state.last_seq)
            for member in state.group:  # they name it no more, and remember what of it was lost
                other = self.streams.get(member)
                if other is not None:
                    other.group = tuple(n for n in other.group if n != number)
                    other.group_lost = max(other.group_lost, state.last_seq)

    def phase(self, stream: int) -> StreamPhase:
        """Where stream ``stream`` is in its life (``STREAM_STEPS``)."""
        state = self.streams.get(stream)
        if state is not None:
            return StreamPhase.LIVE if state.live else StreamPhase.ENDED
        if any(number == stream for number, _ in self.gone):
            return StreamPhase.GONE
        return StreamPhase.UNKNOWN

    def pumped_at(self, stream: int, upstream_cursor: str) -> None:
        """The stream's upstream events are appended through ``upstream_cursor`` (its last event id)."""
        state = self.streams.get(stream)
        if state is not None and state.live:
            state.upstream_cursor = upstream_cursor

    def orphans(self) -> list[Orphan]:
        """The live streams with a pump record (``Orphan``)."""
        return [
            Orphan(self.session_id, self.epoch, n, s.origin, s.pump, s.upstream_cursor, s.answered)
            for n, s in self.streams.items()
            if s.live and s.pump is not None
        ]

    def live_streams(self) -> int:
        return sum(1 for s in self.streams.values() if s.live)

    def live_post_streams(self) -> int:
        return self.live_posts

    # -- reading -----------------------------------------------------------------------------------------

    def read(
        self,
        streams: Sequence[int],
        after: int,
        max_events: int = READ_MAX_EVENTS,
        max_bytes: int = READ_MAX_BYTES,
    ) -> ReadResult:
        """What a reader at ``after`` on ``streams`` sends next (merged in seq order), at most the limits
        (and at least one event when there is one)."""
        window, states = self.window, self.streams
        if any(n not in states for n in streams):
            # A stream that ended and left the window: complete for a reader that sent all of it, a gap
            # for one that did not (or that names a stream this session never had, or forgot long ago).
            gone = dict(self.gone)
            if any(n not in states and gone.get(n, after + 1) > after for n in streams):
                return ReadResult((), complete=False, gap=True, version=self.version)
            streams = [n for n in streams if n in states]
        for number in streams:
            if window.evicted_through(number) > after:
                return ReadResult((), complete=False, gap=True, version=self.version)
        found: list[Segment] = []
        events = size = 0
        truncated = False
        for segment, start in window.slices_after(tuple(streams), after):
            blocks = segment.blocks[start:]  # a copy: the window's lists change in place
            part = segment.size if not start else sum(map(len, blocks))
            if events + len(blocks) > max_events or size + part > max_bytes:
                truncated = True
                blocks = blocks[: max(0, max_events - events)]
                taken = 0
                for index, block in enumerate(blocks):
                    if (events or index) and size + taken + len(block) > max_bytes:
                        blocks = blocks[:index]
                        break
                    taken += len(block)
                part = taken
            if blocks:
                times = segment.times[start : start + len(blocks)]
                found.append(Segment(segment.stream, segment.seq + start, blocks, times, part))
                events += len(blocks)
                size += part
            if truncated:
                break
        complete = not truncated
        if complete:
            for number in streams:
                if states[number].live:
                    complete = False
                    break
        return ReadResult(found, complete, False, self.version, truncated, self.epoch.encode())

    # -- request ids (exactly once per request) ----------------------------------------------------------

    def claim(
        self,
        request_keys: Sequence[str],
        max_live_streams: int | None = None,
        digests: Sequence[bytes] = (),
    ) -> Claim:
        """Record the request ids of a POST about to be forwarded, or say what to do instead. ``digests``:
        each request's (``jsonrpc.request_digest``), in the order of ``request_keys``; none: not known.

        An id claimed before for the same request is a re-send: never forwarded again (its stream, or why
        not). An id claimed before for another request (a client that numbers its requests from 0 again)
        is free again once that request is over: answered, or its stream ended (the upstream saw it
        through, as it would a client's next request under that id directly); not over (pending, its
        outcome unknown, its stream live), the upstream could not tell the two apart: ``IN_USE``."""
        requests = self._requests
        asked = digests if digests else (b"",) * len(request_keys)
        seen = [requests.get(key) for key in request_keys]
        if seen.count(None) < len(seen):  # some id was claimed before (new ids, the usual case, skip this)
            resent = [s is not None and same_request(s.digest, d) for s, d in zip(seen, asked, strict=True)]
            if any(resent):
                holders = {s.holder for s in seen if s is not None}
                if not all(resent) or len(holders) != 1:
                    return Claim(ClaimOutcome.CONFLICT)
                (holder,) = holders
                if isinstance(holder, ClaimState):
                    return Claim(CLAIM_OF_STATE[holder])
                if holder in self.streams and self.window.evicted_through(holder) == 0:
                    return Claim(ClaimOutcome.ATTACH, holder)
                return Claim(ClaimOutcome.GONE, holder)
            if any(s is not None and not self._over(s.holder) for s in seen):
                return Claim(ClaimOutcome.IN_USE)
        if max_live_streams is not None and self.live_post_streams() + self.in_flight >= max_live_streams:
            return Claim(ClaimOutcome.LIMITED)
        for key, digest in zip(request_keys, asked, strict=True):
            self._remember_request(key, ClaimState.PENDING, digest)
        return Claim(ClaimOutcome.NEW)

    def _over(self, holder: int | ClaimState) -> bool:
        """Whether a claimed request is over: answered, or its stream ended (or gone)."""
        if isinstance(holder, ClaimState):
            return holder in (ClaimState.ANSWERED, ClaimState.CANCELLED)
        state = self.streams.get(holder)
        return state is None or not state.live

    def release(self, request_keys: Sequence[str]) -> None:
        """Forget a claim whose request never reached the upstream (so a retry may be forwarded)."""
        for key in request_keys:
            claimed = self._requests.get(key)
            if claimed is not None and claimed.holder is ClaimState.PENDING:
                self._forget_request(key)

    def settle(self, request_keys: Sequence[str]) -> None:
        """A claim the upstream answered without a stream (application/json): seen, but nothing retained."""
        self._conclude(request_keys, ClaimState.ANSWERED)

    def cancel_requests(self, stream: int, request_keys: Sequence[str]) -> None:
        """The client cancelled these requests of ``stream`` and the proxy closed the stream unanswered: a
        re-send of their ids is refused (``CANCELLED``). Only ids claimed by that stream: a stream number is
        never given twice, so the work of an ended incarnation never touches a new one's claims."""
        for key in request_keys:
            claimed = self._requests.get(key)
            if claimed is not None and claimed.holder == stream:
                self._remember_request(key, ClaimState.CANCELLED)

    def abandon(self, request_keys: Sequence[str]) -> None:
        """A claim whose request was sent upstream and got no answer: it may have run (never sent again),
        what it did is unknown."""
        self._conclude(request_keys, ClaimState.ABANDONED)

    def _conclude(self, request_keys: Sequence[str], state: ClaimState) -> None:
        for key in request_keys:
            claimed = self._requests.get(key)
            if claimed is not None and claimed.holder is ClaimState.PENDING:
                self._remember_request(key, state)

    def _remember_request(self, key: str, holder: int | ClaimState, digest: bytes | None = None) -> None:
        """Record ``key``'s claim as the newest; ``digest`` None: the one it has (if any) is kept."""
        requests = self._requests
        if key in requests:
            if digest is None:
                digest = requests[key].digest
            self._forget_request(key)  # re-inserted: now the newest
        requests[key] = Claimed(holder, digest or b"")
        if holder is ClaimState.PENDING:
            self.in_flight += 1
        while len(requests) > MAX_REQUEST_IDS:
            self._forget_request(next(iter(requests)))

    def _forget_request(self, key: str) -> None:
        if self._requests.pop(key).holder is ClaimState.PENDING:
            self.in_flight -= 1

    def view(self, stream: int, session_ttl: float) -> SessionView:
        """The facts the resume decision needs, for a cursor naming ``stream``."""
        state = self.streams.get(stream)
        window = self.window
        oldest, newest = window.oldest, window.newest
        return SessionView(
            epoch=self.epoch,
            expires_at=self.last_active + session_ttl if self.idle() else None,
            next_stream=self.next_stream,
            newest_seq=self.next_seq - 1,
            oldest=(oldest.stream, oldest.seq) if oldest else None,
            newest=(newest.stream, newest.seq) if newest else None,
            stream=self._gone_view(stream)
            if state is None
            else StreamView(
                stream,
                state.live,
                state.first_seq,
                state.last_seq,
                window.evicted_through(stream),
                state.origin is StreamOrigin.GET,
                state.group,
                max([state.group_lost, *(window.evicted_through(n) for n in state.group)]),
                state.delivered,
                state.primed,
            ),
        )

    def _gone_view(self, stream: int) -> StreamView | None:
        """The last standalone stream that ended and left the window, as it was: all of it evicted (only a
        cursor at its very end can be re-attached: to a new standalone stream). Other gone streams: None."""
        gone = self.gone_standalone
        if gone is None or gone[0] != stream:
            return None
        _, first_seq, last_seq = gone
        return StreamView(stream, False, first_seq, last_seq, last_seq, standalone=True)

    # -- flow control (core/flow.py) -------------------------------------------------------------------------

    def mark_delivered(self, streams: Sequence[int], seq: int) -> None:
        """A client was sent everything of ``streams`` up to ``seq``."""
        for stream in streams:
            state = self.streams.get(stream)
            if state is not None and state.delivered < seq:
                state.delivered = seq

    def blocked(self, count: int, size: int, guard: Guard | None) -> tuple[int, ...] | None:
        """Whether appending ``count`` events of ``size`` bytes would evict what ``guard`` protects
        (``flow.blocked_by``): None if it would not (or there is no guard)."""
        refused = self.refusal(count, size, guard)
        return None if refused is None else refused.blocked

    def refusal(self, count: int, size: int, guard: Guard | None) -> Appended | None:
        """``blocked`` as an append's answer, with how far each reader in the way must get (``refusal``)."""
        if guard is None:
            return None
        would_evict = self.window.would_evict(count, size)
        if not would_evict:
            return None
        # The delivered marks of the streams the append would evict only (all ``refusal`` reads), not of
        # every stream the session retains; and only under ``keep_undelivered``, the one guard reading them.
        streams = self.streams
        delivered = (
            {n: state.delivered for n, _ in would_evict if (state := streams.get(n)) is not None}
            if guard.keep_undelivered
            else {}
        )
        return refusal(would_evict, guard, delivered)

    # -- credentials -----------------------------------------------------------------------------------

    def access(self) -> SessionAccess:
        return SessionAccess(self.epoch, self.credentials, self.protocol_version)

    def accept_credential(self, digest: bytes, protocol_version: str | None) -> None:
        """The upstream accepted these credentials in this session (``SessionStore.accept_credential``)."""
        if not self.credentials:
            return  # began without credentials: nothing is bound, nothing to remember
        self.credentials = remember(self.credentials, digest)
        if protocol_version is not None and protocol_version != self.protocol_version:
            self.protocol_version = _KNOWN_VERSIONS.get(protocol_version, protocol_version)

    # -- liveness ----------------------------------------------------------------------------------------

    def idle(self) -> bool:
        """No POST stream being pumped: the session may expire ``session_ttl`` after its last client
        activity (``last_active``; a process holding a view of it touches it, see process/local.py)."""
        return self.live_post_streams() == 0

    def claim_counts(self) -> tuple[int, int, int]:
        """The request ids remembered, by what they hold: (in flight, over without a stream: answered with
        JSON, cancelled, or their outcome unknown; on a stream). For the session inspector."""
        in_flight = concluded = streamed = 0
        for claimed in self._requests.values():
            if claimed.holder is ClaimState.PENDING:
                in_flight += 1
            elif isinstance(claimed.holder, ClaimState):
                concluded += 1
            else:
                streamed += 1
        return in_flight, concluded, streamed
