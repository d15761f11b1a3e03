"""What the proxy makes of one logical upstream SSE stream's events, without I/O (sans-IO, as h11 is).

A pump (``mcpresume.streams.pump``, the shell) reads the upstream's bytes, parses them
(``mcpresume.core.sse``) and feeds what the parser returns to an ``UpstreamEvents``; it gets back, in order,
the batches to append to the session's window: runs of message events kept as they came (``SSERun``, the hot
path: no call per event) and lists of single events (``NewEvent``). Everything else the pump decides from is
state here, read after each feed:

* ``pending``: the request ids whose responses have not arrived yet (a POST stream; none for a GET). An
  event that answers one of them is a RESPONSE event and settles it (a batch event, 2025-03-26, settles
  every response in it, once); an answer to another request stays a MESSAGE.
* ``complete``: every response this stream waits for is in: nothing more to read.
* ``last_id`` / ``resume_cursor``: the upstream's last event id, what a resume GET sends as
  ``Last-Event-ID``; ``retry_ms``: the upstream's last ``retry:``, the resume back-off's base.
* ``duplicates``: upstream events dropped so far as replays. After ``resumed()`` (the upstream stream was
  reopened from ``last_id``), an event whose upstream id was already appended is dropped: a server's
  replay may overlap what the proxy already has.
* ``proxy_answers``: responses to the proxy's own requests (``jsonrpc.proxy_request_id``: a credential
  ping, a takeover's probe) dropped since the shell last took the count (``take_proxy_answers``). An
  upstream may put one on any stream of the session (the standalone one, a resumed one): it is never
  appended, so no client ever receives it. Only events that may be a response are parsed to look (those
  ``_suspects`` singles out).
* ``cancelled``: the pending requests the client cancelled (``cancel``: it POSTed ``notifications/cancelled``
  for them, and the proxy forwarded it); ``moot``: every request the stream still waits for is one of them.
  The spec says the receiver of a cancellation SHOULD NOT answer the request, so a moot stream may never
  end by itself (the TypeScript SDK's server keeps it open until its client leaves): the pump closes it
  once no client reads it (``streams.pump``), without an answer (the client expects none).

Events with no data (priming, id- or retry-only events) are not appended: the proxy sends its own.

Then the decisions between upstream connections: ``resumable(end)`` says whether a stream whose
connection ended so is to be reopened (from ``resume_cursor``: without one it cannot be), ``resume_delay``
how long to wait before an attempt, ``refuses_resume`` which answers to a resume GET mean it cannot be
resumed (as opposed to "try again"), ``wants_credentials`` which mean that the credentials it carried are
no longer accepted (a token expired: the pump waits for a client of the session to bring fresh ones), and
``unanswered(message)`` the synthesized JSON-RPC errors that complete a stream that cannot be completed, one
per pending request not cancelled, so no client waits forever for an answer that cannot come.

Last, when the proxy gives a stream up before its end, with no client reading it (``Abandon``): a moot
stream after ``cancel_grace``, and any POST stream that ``unattended`` says nobody reads or feeds, so that no
stream without a client and without traffic keeps its session past ``session_ttl``:

==================================================  ===========================================
the stream                                          ``unattended(now, heard, left, reading, ttl)``
==================================================  ===========================================
a client view reads it (``reading``)                no
the upstream sent an event within ``ttl``           no (``now - heard < ttl``)
its last view left within ``ttl`` (or it began so)  no (``now - left < ttl``)
otherwise                                           yes: the proxy closes it, as a client leaving
                                                    would, and answers what is pending with an error
==================================================  ===========================================
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final

from mcpresume.core.errors import UpstreamStreamLost
from mcpresume.core.jsonrpc import (
    NOTIFICATION_PREFIX,
    NOTIFICATION_PREFIXES,
    PROXY_ID_MARKER,
    RESPONSE_MARKERS,
    error_response,
    request_key,
    response_keys,
    without_proxy_answers,
)
from mcpresume.core.session import NewEvent
from mcpresume.core.sse import SSEEvent, SSERun, frame_body
from mcpresume.core.window import EventKind

# Upstream ids remembered per stream to drop replayed events. A resume replays what follows the last id,
# so only a replay that overlaps what was already read matters; 4096 ids cover any sane overlap.
SEEN_IDS: Final = 4096
# Resume back-off doubles from the upstream's retry and stops growing here (seconds).
MAX_RESUME_DELAY: Final = 30.0
# Upstream answers to a resume GET that mean "this cannot be resumed", as opposed to "try again later".
REFUSALS: Final = frozenset({400, 404, 405, 409, 410})
# What ``SSERun.suspects`` looks for to find an answer to the proxy's own request in a run.
_PROXY_ID_MARKERS: Final = (PROXY_ID_MARKER,)
# Upstream answers to a resume GET that refuse the credentials it carried (RFC 9110 15.5.2, 15.5.4): trying
# again with the same ones cannot help, fresh ones may.
CREDENTIAL_REFUSALS: Final = frozenset({401, 403})
# No replay is checked yet: one shared empty set (``frozenset()`` is not a singleton: 216 bytes each).
_NONE_SEEN: Final[frozenset[bytes]] = frozenset()
_NONE_CANCELLED: Final[frozenset[str]] = frozenset()

Batch = list[NewEvent] | SSERun


class End(enum.Enum):
    """How reading one upstream connection ended."""

    COMPLETE = "complete"  # every response is in (POST), nothing left to read
    CLOSED = "closed"  # the upstream ended the connection: resumable if it sent ids
    DROPPED = "dropped"  # the connection failed: resumable if it sent ids
    TOO_LARGE = "too_large"  # an event over max_event_bytes: resuming would meet it again


# The ends after which the stream is reopened from its last upstream id (unless it is complete).
RESUMABLE_ENDS: Final = frozenset({End.CLOSED, End.DROPPED})


class Abandon(enum.Enum):
    """Why the proxy gave a stream up before its end, with no client reading it. The value is the metric's
    label (``mcpresume_abandoned_streams_total{reason}``)."""

    CANCELLED = "cancelled"  # moot (every pending request cancelled), unread for cancel_grace: no answer
    UNATTENDED = "unattended"  # unread and unfed for session_ttl: its pending requests get an error


def unattended(now: float, heard: float, left: float, *, reading: bool, ttl: float) -> bool:
    """Whether a POST stream is given up as unattended (the table in the module docstring): no client view
    reads it, the upstream sent no event on it since ``heard``, and its last view left at ``left`` (or it
    began then), both ``ttl`` ago or more."""
    return not reading and now - max(heard, left) >= ttl


def resume_delay(retry_ms: int, attempts: int) -> float:
    """Seconds to wait before resume attempt ``attempts + 1``: the retry, doubling, capped."""
    return min(MAX_RESUME_DELAY, retry_ms / 1000 * 2.0**attempts)


def refuses_resume(status: int) -> bool:
    """Whether an upstream's non-SSE answer to a resume GET means the stream cannot be resumed."""
    return status in REFUSALS


def wants_credentials(status: int) -> bool:
    """Whether an upstream's answer to a resume GET refuses its credentials: retried only with fresh ones."""
    return status in CREDENTIAL_REFUSALS


class UpstreamEvents:
    """One logical upstream stream's events -> what to append, over as many connections as it takes."""

    __slots__ = (
        "_answers",
        "_recent",
        "_seen",
        "_spelling",
        "cancelled",
        "complete",
        "duplicates",
        "last_id",
        "pending",
        "proxy_answers",
        "retry_ms",
    )

    def __init__(self, request_ids: Iterable[str | int] = ()) -> None:
        # Request key -> the id as the client sent it (the synthesized errors answer with it). Mutated in
        # place, never rebound: a holder of this dict sees what is pending.
        self.pending: dict[str, str | int] = {request_key(i): i for i in request_ids}
        self._answers = bool(self.pending)  # a POST stream: complete once every response is in
        self.complete = False
        self.last_id: bytes | None = None
        self.retry_ms: int | None = None
        self.duplicates = 0
        self.proxy_answers = 0
        # Upstream id lines (``id: X\n``) of the last SEEN_IDS events appended (cheap to keep: no hashing per
        # event), and, from the last resume on, those as a set: what an upstream replay is checked against.
        # Both made at first need: an empty deque costs ~630 bytes, and most streams (no upstream ids, or no
        # resume) never need them.
        self._recent: deque[bytes] | None = None
        self._seen: frozenset[bytes] | set[bytes] = _NONE_SEEN
        self._spelling = 0  # of NOTIFICATION_PREFIXES, the one counted first (see _suspects)
        self.cancelled: frozenset[str] = _NONE_CANCELLED  # request keys the client cancelled (``cancel``)

    # -- between connections -----------------------------------------------------------------------------

    @property
    def resume_cursor(self) -> str | None:
        """The ``Last-Event-ID`` a resume GET sends; None when the upstream sent no ids (not resumable). An
        SSE id keeps the spaces after the one the field's colon takes; a header value cannot (RFC 9110 5.5:
        a recipient strips them anyway)."""
        if self.last_id is None:
            return None
        return self.last_id.decode("ascii", "replace").strip()

    def resumable(self, end: End) -> bool:
        """Whether the stream is reopened after its connection ended with ``end``."""
        return end in RESUMABLE_ENDS and not self.complete

    def restore(self, cursor: str | None, answered: Iterable[str]) -> None:
        """Continue a stream another pump read (a restart, a takeover): from the upstream's last event id it
        appended, with the responses it appended settled."""
        self.last_id = None if cursor is None else cursor.encode("ascii", "replace")
        for key in answered:
            self.pending.pop(key, None)
        self.complete = bool(self._answers) and not self.pending

    def take_proxy_answers(self) -> int:
        """The responses to the proxy's own requests dropped since the last call (the shell counts them)."""
        taken, self.proxy_answers = self.proxy_answers, 0
        return taken

    def resumed(self) -> None:
        """The upstream stream was reopened from ``last_id``: from now on, drop what it replays."""
        self._seen = set(self._recent or ())

    def reopened(self) -> None:
        """The standalone stream was opened again in another upstream session (the session begun again
        there, ``upstream_session_lost = "reinitialize"``): its ids are that session's, nothing it sends is
        a replay of the old one's, and a resume starts from what it sends."""
        self.last_id = None
        self._recent = None
        self._seen = _NONE_SEEN

    def cancel(self, keys: Iterable[str]) -> bool:
        """The client cancelled these requests (those of them pending here count); whether the stream is
        ``moot`` now. A response to one may still come (an upstream that answers anyway): it is appended and
        settles its request as any response does."""
        mine = frozenset(key for key in keys if key in self.pending)
        if mine:
            self.cancelled = self.cancelled | mine
        return self.moot

    @property
    def moot(self) -> bool:
        """Every request the stream still waits for was cancelled: none of it may ever be answered."""
        pending = self.pending
        return bool(pending) and all(key in self.cancelled for key in pending)

    def unanswered(self, message: str) -> list[NewEvent]:
        """A JSON-RPC error for each pending request (``message`` says why), as RESPONSE events; none for a
        request the client cancelled (the spec: a cancelled request SHOULD NOT be answered)."""
        lost = UpstreamStreamLost(message)
        data = lost.data()
        cancelled = self.cancelled
        return [
            NewEvent(
                frame_body(error_response(request_id, lost.code, message, data)), EventKind.RESPONSE, key
            )
            for key, request_id in self.pending.items()
            if key not in cancelled
        ]

    # -- events ------------------------------------------------------------------------------------------

    def feed(self, parsed: Sequence[SSEEvent | SSERun]) -> list[Batch]:
        """Upstream events -> batches to append, in order. Hot path: a run of message events passes whole
        (see ``_run``) but for the events that may be a response this stream waits for (``_suspects``);
        single events are converted one by one (``_event``)."""
        batches: list[Batch] = []
        items: list[NewEvent] = []
        for event in parsed:
            if type(event) is not SSERun:
                self._event(event, items)  # type: ignore[arg-type]
                continue
            for piece in self._suspects(event):
                if type(piece) is not SSERun:
                    self._event(piece, items)  # type: ignore[arg-type]
                    continue
                run = self._run(piece)
                if run.blocks:
                    if items:
                        batches.append(items)
                        items = []
                    batches.append(run)
        if items:
            batches.append(items)
        return batches

    def _suspects(self, run: SSERun) -> list[SSERun | SSEEvent]:
        """A run cut around the events that may be a response this stream waits for (the end of a POST
        stream), those as single events: the events whose data does not start like a notification and
        holds a member name a response must have (``jsonrpc.RESPONSE_MARKERS``; ``response_key`` parses
        no other). A few C-level scans, no call per event. Those events include any answer to the proxy's
        own request (``_event`` drops it); where no response is awaited (a GET stream), only such answers
        are looked for (one scan: a standalone stream carries few events)."""
        if not self.pending:
            own = run.suspects(NOTIFICATION_PREFIX, _PROXY_ID_MARKERS)
            return _apart(run, own) if own else [run]
        # The one event of a read that is not a notification is most often the stream's response, its last
        # event: that one is looked at first (one event parsed), and only the others are counted, where
        # counting them all would fail and finding the response by its markers scan the run thrice more.
        # A run of one event (a paced stream: one per read) is counted as before, at the cost of one count.
        count = len(run)
        if count == 1:
            answer = self._answer(run)
            if answer is not None:
                return [answer]
        last = run.split(count - 1, count) if count > 1 else run
        if count > 1 and not last.events()[0].data.startswith(NOTIFICATION_PREFIXES):
            spelling = run.all_start_with(NOTIFICATION_PREFIXES, self._spelling, but_last=True)
            if spelling is not None:
                self._spelling = spelling
                if not last.suspects(NOTIFICATION_PREFIX, RESPONSE_MARKERS):
                    return [run]
                return [run.split(0, count - 1), *last.events()]
        else:
            spelling = run.all_start_with(NOTIFICATION_PREFIXES, self._spelling)
            if spelling is not None:  # every event starts like a notification: none is a response
                self._spelling = spelling
                return [run]
        suspects = run.suspects(NOTIFICATION_PREFIX, RESPONSE_MARKERS)
        if not suspects:
            return [run]
        return _apart(run, suspects)

    def _answer(self, run: SSERun) -> SSEEvent | None:
        """A run of one event (a short answer, a paced stream) as the single event ``_suspects`` makes of it
        when its data holds a response's member names and does not start like a notification (what the
        counts single out), found directly; None: the counts decide."""
        if not any(marker in run.blocks[0] for marker in RESPONSE_MARKERS):
            return None
        event = run.events()[0]
        data = event.data
        if data.startswith(NOTIFICATION_PREFIXES) or not any(marker in data for marker in RESPONSE_MARKERS):
            return None
        return event

    def _run(self, run: SSERun) -> SSERun:
        """A run as it will be appended: no call per event; upstream ids are checked only after a resume
        (against a replay)."""
        ids = run.ids
        if ids is None:
            return run
        last_id = run.last_id()
        if last_id is not None:
            self.last_id = last_id
        seen = self._seen
        if seen:
            kept = [i for i, line in enumerate(ids) if line not in seen]
            if len(kept) != len(ids):
                self.duplicates += len(ids) - len(kept)
                run = run.keep(kept)
                ids = run.ids or []
        self._remember(filter(None, ids))
        return run

    def _remember(self, id_lines: Iterable[bytes]) -> None:
        recent = self._recent
        if recent is None:
            recent = self._recent = deque(maxlen=SEEN_IDS)
        recent.extend(id_lines)

    def _event(self, event: SSEEvent, items: list[NewEvent]) -> None:
        """One upstream event -> an event to append (or nothing: priming, id/retry-only, a replay)."""
        upstream_id = event.id
        if event.retry is not None:
            self.retry_ms = event.retry
        if upstream_id:
            self.last_id = upstream_id
        data = event.data
        if not data:
            return  # priming, or an id/retry-only event: the proxy sends its own
        if upstream_id:
            line = b"id: " + upstream_id + b"\n"
            if line in self._seen:
                self.duplicates += 1
                return  # an upstream replay of an event already appended
            self._remember((line,))
        if PROXY_ID_MARKER in data:
            kept, dropped = without_proxy_answers(data)
            if dropped:
                self.proxy_answers += dropped
                if kept is None:
                    return  # an answer to the proxy's own request: never a client's
                data = kept
        body = frame_body(data, event.event)
        pending = self.pending
        if pending and not data.startswith(NOTIFICATION_PREFIX):
            # A batch event (2025-03-26) settles every response in it, once.
            settled = [key for key in response_keys(data) if pending.pop(key, None) is not None]
            if settled:
                if not pending:
                    self.complete = True
                items.append(NewEvent(body, EventKind.RESPONSE, settled[0]))
                return
        items.append(NewEvent(body, EventKind.MESSAGE, None))


def _apart(run: SSERun, singled: Sequence[int]) -> list[SSERun | SSEEvent]:
    """``run`` cut around the events at the indexes ``singled`` (ascending), those as single events."""
    pieces: list[SSERun | SSEEvent] = []
    start = 0
    for index in singled:
        if index > start:
            pieces.append(run.split(start, index))
        pieces.extend(run.split(index, index + 1).events())
        start = index + 1
    if start < len(run):
        pieces.append(run.split(start, len(run)))
    return pieces
