"""The checker: a run's recorded history -> its violations and, per fault, the fate of every call (pure: no
I/O, no clock; it reads only `faults.history.RunHistory`).

Theory of operation. The history holds three kinds of witness: the nemesis says which fault held when and
which process was running, stopped or dead (by pid); each upstream says which sessions it created and every
execution of ``work`` it began and ended; each client says what it sent, what came back (every JSON-RPC
response its SDK's transport passed on, every HTTP answer >= 400 with its ``data.reason``), the progress of
each call in order, and how the call ended. From the first two the checker knows the truth; it then holds
every statement the clients received against it.

**Facts** (decided on process liveness alone, never on timing):

- a session is *gone* at ``t`` when the upstream process that created it was dead by ``t`` (killed, or
  restarted: a new pid knows none of the old sessions); in the sidecar layout also when its owner (the pod
  whose upstream created it) had been stopped for a whole lease before ``t``, or killed: only that pod's
  upstream knows the session, and a takeover then is the design;
- an execution is *lost* at ``t`` when no upstream ever began it, or the upstream process running it was
  dead by ``t``, or (sidecar) its pod's proxy had been stopped a whole lease or killed by ``t``.

**Violations** (`Kind`): each one is a broken promise, whatever the timing:

| kind | what was seen |
|---|---|
| ``duplicate_execution`` | one request (session id + JSON-RPC id, or one call's tag) began twice upstream |
| ``duplicate_response`` | a client's transport received two responses for one request id |
| ``foreign_response`` | a response to a request id the client never sent (``mcpresume-probe``) |
| ``wrong_result`` | a result that is not the one the upstream returns for that call |
| ``result_without_execution`` | a result for a call no upstream finished |
| ``lost_call`` | neither a result nor an error within the call deadline (nothing told the client) |
| ``silent_gap`` | progress with a hole (or short of the last step) followed by a result, or by nothing |
| ``progress_out_of_order`` | a progress step received after a later one, never before |
| ``retired_live_session`` | 404 ``unknown_session`` or ``upstream_session_lost``, the session not gone |
| ``false_stream_lost`` | ``upstream_stream_lost`` while the execution was not lost |
| ``false_store_unavailable`` | 503 ``store_unavailable`` with no store fault near |
| ``untruthful_error`` | another reason, with nothing near that makes it true (see `Checker.judge`) |
| ``missing_reason`` | a 404 without ``data.reason`` (the upstream's relayed), or the proxy's own 500 |
| ``unexplained_error`` | a transport error (connection lost, reconnection given up), no fault near |
| ``replica_crashed`` | a proxy that was serving exited by itself, other than refusing (exit 2) |

*Near* means within a fault's window extended by `recovery` (twice the lease and 5 s): errors that a
fault explains only while it lasts, or while the replicas recover from it (503s, transport errors), are
judged with that generous margin, so a slow machine turns no truthful error into a violation. The facts
above, which decide the promises the project exists for, use no margin at all.

**Cells**: each call belongs to an episode (one fault, or two overlapping: ``overlapping``): the first that
began while the call ran (the first fault to hit a call is its cause), else the last that began before it if
that one's window, widened by the recovery margin, reaches the call; else to ``none``. A violation outside a
call belongs likewise by its time.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from faults.history import Record, RunHistory
from faults.plan import REPLICA_FAULTS, STORE_FAULTS, FaultKind

NONE = "none"
OVERLAPPING = "overlapping"
AIOHTTP_ERROR = "Server got itself in trouble"  # aiohttp's own 500: a handler of the proxy raised
REFUSED = 2  # the exit status of a proxy that refuses to start or go on, saying why (mcpresume serve)
RECOVERY_SLACK = 5.0


def recovery(lease: float) -> float:
    """How long after a fault ends its effects may still show: twice the lease (a lapse, then a renewal
    or a takeover) and 5 s of reconnects."""
    return 2 * lease + RECOVERY_SLACK


class Kind(enum.StrEnum):
    DUPLICATE_EXECUTION = "duplicate_execution"
    DUPLICATE_RESPONSE = "duplicate_response"
    FOREIGN_RESPONSE = "foreign_response"
    WRONG_RESULT = "wrong_result"
    RESULT_WITHOUT_EXECUTION = "result_without_execution"
    LOST_CALL = "lost_call"
    SILENT_GAP = "silent_gap"
    PROGRESS_OUT_OF_ORDER = "progress_out_of_order"
    RETIRED_LIVE_SESSION = "retired_live_session"
    FALSE_STREAM_LOST = "false_stream_lost"
    FALSE_STORE_UNAVAILABLE = "false_store_unavailable"
    UNTRUTHFUL_ERROR = "untruthful_error"
    MISSING_REASON = "missing_reason"
    UNEXPLAINED_ERROR = "unexplained_error"
    REPLICA_CRASHED = "replica_crashed"


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Kind
    t: float
    detail: str
    cell: str = NONE
    call: str | None = None


@dataclass(slots=True)
class Cell:
    calls: int = 0
    ok: int = 0
    truthful: int = 0
    violations: int = 0


@dataclass
class Verdict:
    layout: str
    violations: list[Violation] = field(default_factory=list)
    cells: dict[str, Cell] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def kinds(self) -> Counter[str]:
        return Counter(str(v.kind) for v in self.violations)

    def by_cell(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = defaultdict(Counter)
        for v in self.violations:
            out[v.cell][str(v.kind)] += 1
        return dict(out)


# -- the world: what the nemesis and the upstreams say happened ------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    id: int
    kind: FaultKind
    target: str
    episode: int
    start: float
    end: float


@dataclass
class World:
    layout: str
    lease: float
    windows: list[Window]
    episodes: list[tuple[float, float, str]]  # (start, end of its faults, label), by start
    upstream_deaths: dict[int, float]  # upstream pid -> when it was killed
    proxy_down: dict[str, list[tuple[float, float]]]  # pod -> (killed, started again)
    proxy_stopped: dict[str, list[tuple[float, float]]]  # pod -> (SIGSTOP, SIGCONT)
    session_holder: dict[str, tuple[str, int, float]]  # sid -> (upstream name, pid, when it was created)
    begins: dict[str, list[Record]]  # tag -> its begin records
    ended: set[str]  # tags some upstream ended
    end: float

    @property
    def margin(self) -> float:
        return recovery(self.lease)

    def _owner_lost(self, upstream: str, since: float, t: float) -> bool:
        """Sidecar: the pod of ``upstream`` lost its proxy between ``since`` and ``t`` (killed, or stopped a
        whole lease)."""
        if self.layout != "sidecar" or not upstream.startswith("upstream-"):
            return False
        pod = upstream.removeprefix("upstream-")
        if any(since <= start <= t for start, _ in self.proxy_down.get(pod, [])):
            return True
        stops = self.proxy_stopped.get(pod, [])
        return any(min(stop, t) - max(start, since) >= self.lease for start, stop in stops)

    def session_gone(self, sid: str | None, t: float) -> bool:
        holder = self.session_holder.get(sid or "")
        if holder is None:
            return False
        upstream, pid, created = holder
        return self.upstream_deaths.get(pid, math.inf) <= t or self._owner_lost(upstream, created, t)

    def execution_lost(self, tag: str, t: float) -> bool:
        begins = self.begins.get(tag)
        if not begins:
            return True
        first = begins[0]
        upstream, pid, began = str(first["upstream"]), int(first["pid"]), float(first["t"])
        return self.upstream_deaths.get(pid, math.inf) <= t or self._owner_lost(upstream, began, t)

    def near(self, kinds: Iterable[FaultKind] | None, t0: float, t1: float | None = None) -> bool:
        """A fault of ``kinds`` (None: any) held within ``[t0, t1]`` widened by the recovery margin."""
        wanted = None if kinds is None else set(kinds)
        t1 = t0 if t1 is None else t1
        return any(
            (wanted is None or w.kind in wanted) and w.start <= t1 and t0 <= w.end + self.margin
            for w in self.windows
        )

    def cell(self, t0: float, t1: float | None = None) -> str:
        """The episode a call spanning ``[t0, t1]`` (or an event at ``t0``) belongs to: the first that
        began during it (the first fault to hit a call is its cause), else the last that began before it,
        if its window widened by the recovery margin reaches it."""
        t1 = t0 if t1 is None else t1
        before: tuple[float, float, str] | None = None
        for episode in self.episodes:
            start, _, label = episode
            if t0 <= start <= t1:
                return label
            if start < t0:
                before = episode
        if before is not None and t0 <= before[1] + self.margin:
            return before[2]
        return NONE


def _intervals(
    events: list[tuple[float, str]], opens: set[str], closes: set[str], end: float
) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    opened: float | None = None
    for t, state in events:
        if state in opens and opened is None:
            opened = t
        elif state in closes and opened is not None:
            out.append((opened, t))
            opened = None
    if opened is not None:
        out.append((opened, end))
    return out


def build_world(history: RunHistory) -> tuple[World, list[Violation], list[str]]:
    nemesis = history.nemesis
    end = max((r["t"] for r in [*nemesis, *history.upstreams, *history.clients]), default=0.0)
    violations: list[Violation] = []
    notes: list[str] = []

    starts: dict[int, Record] = {}
    windows: list[Window] = []
    deaths: dict[int, float] = {}
    proxy_events: dict[str, list[tuple[float, str]]] = defaultdict(list)
    serving: set[int] = set()  # proxy pids that started serving
    for record in nemesis:
        if record["ev"] == "fault":
            if record["phase"] == "start":
                starts[int(record["id"])] = record
            else:
                begun = starts.pop(int(record["id"]), None)
                if begun is not None:
                    windows.append(_window(begun, record["t"]))
        elif record["ev"] == "proc":
            name, state, t = str(record["name"]), str(record["state"]), float(record["t"])
            pid = int(record.get("pid") or 0)
            if name.startswith("upstream") and state in ("killed", "exited"):
                deaths.setdefault(pid, t)
            if name.startswith("proxy-"):
                proxy_events[name.removeprefix("proxy-")].append((t, state))
                if state == "started":
                    serving.add(pid)
                elif state == "exited" and pid in serving and record.get("code") == REFUSED:
                    notes.append(f"{name} (pid {pid}) refused to serve on (exit 2) at {t:.1f}; started again")
                elif state == "exited" and pid in serving:
                    detail = f"{name} (pid {pid}) exited with {record.get('code')} while serving"
                    violations.append(Violation(Kind.REPLICA_CRASHED, t, detail))
            if state == "failed_start":
                notes.append(f"{name} failed to start (exit {record.get('code')}) at {t:.1f}; started again")
            elif state == "exited" and name.startswith("upstream"):
                notes.append(f"{name} (pid {pid}) exited by itself with {record.get('code')} at {t:.1f}")
    for begun in starts.values():  # a fault never ended (the campaign was interrupted): it held to the end
        windows.append(_window(begun, end))
    windows.sort(key=lambda w: w.start)

    by_episode: dict[int, list[Window]] = defaultdict(list)
    for w in windows:
        by_episode[w.episode].append(w)
    episodes = sorted(
        (
            min(w.start for w in ws),
            max(w.end for w in ws),
            str(ws[0].kind) if len({w.kind for w in ws}) == 1 else OVERLAPPING,
        )
        for ws in by_episode.values()
    )

    holder: dict[str, tuple[str, int, float]] = {}
    begins: dict[str, list[Record]] = defaultdict(list)
    ended: set[str] = set()
    for record in history.upstreams:
        if record["ev"] == "session":
            sid, upstream, pid = str(record["sid"]), str(record["upstream"]), int(record["pid"])
            holder.setdefault(sid, (upstream, pid, float(record["t"])))
        elif record["ev"] == "begin":
            begins[str(record["tag"])].append(record)
        elif record["ev"] == "end":
            ended.add(str(record["tag"]))

    world = World(
        layout=history.layout,
        lease=history.lease,
        windows=windows,
        episodes=episodes,
        upstream_deaths=deaths,
        proxy_down={
            pod: _intervals(events, {"killed", "exited", "failed_start"}, {"started"}, end)
            for pod, events in proxy_events.items()
        },
        proxy_stopped={
            pod: _intervals(events, {"stopped"}, {"continued", "killed"}, end)
            for pod, events in proxy_events.items()
        },
        session_holder=holder,
        begins=dict(begins),
        ended=ended,
        end=end,
    )
    violations = [Violation(v.kind, v.t, v.detail, world.cell(v.t)) for v in violations]
    return world, violations, notes


def _window(begun: Record, end: float) -> Window:
    return Window(
        int(begun["id"]),
        FaultKind(begun["kind"]),
        str(begun.get("target", "")),
        int(begun.get("episode") or begun["id"]),
        float(begun["t"]),
        float(end),
    )


# -- the clients' calls ------------------------------------------------------------------------------------


@dataclass
class Call:
    tag: str
    client: str
    sdk: str
    sid: str | None
    start: float
    steps: int
    progress: list[float] = field(default_factory=list)
    outcome: str | None = None  # "result", "error", "timeout"
    end: float | None = None
    text: str | None = None
    reason: str | None = None
    message: str | None = None

    @property
    def span_end(self) -> float:
        return self.start if self.end is None else self.end


def _calls(history: RunHistory) -> dict[str, Call]:
    sdks = {str(r["client"]): str(r.get("sdk", "?")) for r in history.clients if r["ev"] == "client"}
    calls: dict[str, Call] = {}
    for r in history.clients:
        ev = r["ev"]
        if ev == "call":
            client = str(r["client"])
            calls[str(r["tag"])] = Call(
                str(r["tag"]), client, sdks.get(client, "?"), r.get("sid"), float(r["t"]), int(r["steps"])
            )
            continue
        call = calls.get(str(r.get("tag")))
        if call is None:
            continue
        if ev == "progress":
            call.progress.append(float(r["p"]))
        elif ev in ("result", "error", "timeout") and call.outcome is None:
            call.outcome, call.end = ev, float(r["t"])
            call.text = r.get("text")
            call.reason = r.get("reason")
            call.message = r.get("message")
    return calls


# -- the rules ---------------------------------------------------------------------------------------------


class Checker:
    def __init__(self, history: RunHistory) -> None:
        self.history = history
        self.world, self.violations, self.notes = build_world(history)
        self.calls = _calls(history)
        self.call_violations: Counter[str] = Counter()
        self.repeated = 0
        self.relayed: Counter[str] = Counter()

    def flag(self, kind: Kind, t: float, detail: str, call: Call | None = None) -> None:
        cell = self.world.cell(call.start, call.span_end) if call is not None else self.world.cell(t)
        self.violations.append(Violation(kind, t, detail, cell, call.tag if call else None))
        if call is not None:
            self.call_violations[call.tag] += 1

    def run(self) -> Verdict:
        self.executions()
        self.responses()
        http = self.http_answers()
        truthful = {tag: self.outcome(call, http) for tag, call in self.calls.items()}
        if self.repeated:
            self.notes.append(f"{self.repeated} progress events received again after a re-attach")
        for answer, count in sorted(self.relayed.items()):
            self.notes.append(f"{count} x the upstream's own error answer relayed: {answer}")
        verdict = Verdict(self.history.layout, notes=self.notes)
        for tag, call in self.calls.items():
            cell = verdict.cells.setdefault(self.world.cell(call.start, call.span_end), Cell())
            cell.calls += 1
            if self.call_violations[tag]:
                continue
            if call.outcome == "result":
                cell.ok += 1
            elif truthful[tag]:
                cell.truthful += 1
        for v in self.violations:
            verdict.cells.setdefault(v.cell, Cell()).violations += 1
        verdict.violations = sorted(self.violations, key=lambda v: v.t)
        return verdict

    def executions(self) -> None:
        """No request executed twice: per (session, JSON-RPC id), and per call (its tag)."""
        by_request: dict[tuple[str, str], list[Record]] = defaultdict(list)
        for records in self.world.begins.values():
            for r in records:
                by_request[(str(r["sid"]), str(r["rid"]))].append(r)
        for (sid, rid), records in by_request.items():
            if len(records) > 1:
                where = ", ".join(f"{r['upstream']} pid {r['pid']} at {r['t']:.2f}" for r in records)
                call = self.calls.get(str(records[0]["tag"]))
                detail = f"request {rid} of session {sid[:8]} began {len(records)} times: {where}"
                self.flag(Kind.DUPLICATE_EXECUTION, float(records[1]["t"]), detail, call)
        for tag, records in self.world.begins.items():
            requests = {(str(r["sid"]), str(r["rid"])) for r in records}
            if len(requests) > 1:
                detail = f"call {tag} began under {len(requests)} request ids: {sorted(requests)}"
                self.flag(Kind.DUPLICATE_EXECUTION, float(records[1]["t"]), detail, self.calls.get(tag))

    def responses(self) -> None:
        """Every response a client's transport received answers a request it sent, once."""
        sent: dict[tuple[str, str], dict[str, str | None]] = defaultdict(dict)
        seen: Counter[tuple[str, str, str]] = Counter()
        for r in self.history.clients:
            conn = (str(r.get("client")), str(r.get("conn")))
            if r["ev"] == "sent":
                sent[conn][str(r["rid"])] = r.get("tag")
            elif r["ev"] == "response":
                rid = str(r["rid"])
                key = (*conn, rid)
                seen[key] += 1
                tag = sent[conn].get(rid)
                call = self.calls.get(tag) if tag else None
                if rid not in sent[conn]:
                    detail = f"{conn[0]} received a response to id {rid!r}, which it never sent"
                    self.flag(Kind.FOREIGN_RESPONSE, float(r["t"]), detail, None)
                elif seen[key] == 2:
                    detail = f"{conn[0]} received a second response to request {rid} ({tag})"
                    self.flag(Kind.DUPLICATE_RESPONSE, float(r["t"]), detail, call)

    def http_answers(self) -> dict[str, list[tuple[str | None, bool]]]:
        """Every HTTP error a client received tells the truth; returns, per call, what each one said and
        whether it was true."""
        judged: dict[str, list[tuple[str | None, bool]]] = defaultdict(list)
        for r in self.history.clients:
            if r["ev"] != "http":
                continue
            t, status, reason = float(r["t"]), int(r["status"]), r.get("reason")
            tag = str(r["tag"]) if r.get("tag") else None
            call = self.calls.get(tag) if tag else None
            what = f"{r.get('client')} {r.get('method')} -> {status} {reason or '(no reason)'}"
            if reason is None and (status == 404 or AIOHTTP_ERROR in str(r.get("body", ""))):
                self.flag(Kind.MISSING_REASON, t, f"{what}: an error without data.reason", call)
                true = status == 404 and self.judge("unknown_session", t, r.get("sid"), None, what, call)
            elif reason is None:  # the upstream's own answer, relayed: the upstream's word, not the proxy's
                self.relayed[f"{status} {str(r.get('body', ''))[:60]!r}"] += 1
                true = True
            else:
                true = self.judge(str(reason), t, r.get("sid"), tag, what, call)
            if tag:
                judged[tag].append((reason, true))
        return judged

    def judge(
        self, reason: str, t: float, sid: str | None, tag: str | None, what: str, call: Call | None
    ) -> bool:
        """Whether an answer with ``reason`` at ``t`` told the truth; flags it if it did not.

        ``unknown_session`` (and ``upstream_session_lost``, the one its upstream lost): the session was
        gone; ``upstream_stream_lost``: the execution was lost;
        ``store_unavailable``: a store fault near; ``owner_unreachable``, ``owner_lost``, ``misrouted_hop``:
        a replica fault near; ``upstream_unreachable``, ``upstream_timeout``: an upstream fault near (a
        restart; in the sidecar layout also a pod's kill), or a proxy's pause (every deadline a frozen
        process held on its upstream has passed when it wakes, whatever the upstream did). Any other reason
        (a cursor rejection of a cursor the proxy issued, a limit this load never reaches, ``shutting_down``
        from a proxy never asked to stop) is never true in a campaign."""
        world = self.world
        if reason in ("unknown_session", "upstream_session_lost"):
            if world.session_gone(sid, t):
                return True
            holder = world.session_holder.get(sid or "")
            where = (
                f"its upstream {holder[0]} (pid {holder[1]}) alive" if holder else "no upstream created it"
            )
            detail = f"{what}: session {str(sid)[:8]} was not gone, {where}"
            self.flag(Kind.RETIRED_LIVE_SESSION, t, detail, call)
            return False
        if reason == "upstream_stream_lost":
            if tag is None or world.execution_lost(tag, t):
                return True
            state = "finished" if tag in world.ended else "still running"
            self.flag(
                Kind.FALSE_STREAM_LOST,
                t,
                f"{what}: call {tag}'s execution was {state}, its upstream alive",
                call,
            )
            return False
        if reason == "store_unavailable":
            if world.near(STORE_FAULTS, t):
                return True
            self.flag(Kind.FALSE_STORE_UNAVAILABLE, t, f"{what}: no store fault near", call)
            return False
        if reason in ("owner_unreachable", "owner_lost", "misrouted_hop"):
            if world.near(REPLICA_FAULTS, t):
                return True
            self.flag(Kind.UNTRUTHFUL_ERROR, t, f"{what}: no replica fault near", call)
            return False
        if reason in ("upstream_unreachable", "upstream_timeout"):
            upstream_faults = {FaultKind.RESTART_UPSTREAM, FaultKind.PAUSE_PROXY}
            if world.layout == "sidecar":
                upstream_faults.add(FaultKind.KILL_POD)
            if world.near(upstream_faults, t):
                return True
            self.flag(Kind.UNTRUTHFUL_ERROR, t, f"{what}: no upstream fault near", call)
            return False
        self.flag(Kind.UNTRUTHFUL_ERROR, t, f"{what}: nothing in this campaign makes it true", call)
        return False

    def outcome(self, call: Call, http: dict[str, list[tuple[str | None, bool]]]) -> bool:
        """Checks one call's progress and ending; whether its error (if it ended in one) told the truth."""
        self.progress(call)
        if call.outcome is None or call.outcome == "timeout":
            state = "no outcome recorded" if call.outcome is None else "no outcome within the deadline"
            self.flag(Kind.LOST_CALL, call.span_end, f"{call.client} call {call.tag}: {state}", call)
            return False
        end = call.span_end
        if call.outcome == "result":
            if call.text != f"done {call.tag}":
                self.flag(Kind.WRONG_RESULT, end, f"call {call.tag} got {call.text!r}", call)
            if call.tag not in self.world.ended:
                self.flag(Kind.RESULT_WITHOUT_EXECUTION, end, f"call {call.tag}: no upstream ended it", call)
            return True
        answers = http.get(call.tag, [])
        what = f"{call.client} call {call.tag} -> error {call.reason or call.message!r}"
        if call.reason is not None:
            same = [true for reason, true in answers if reason == call.reason]
            if same:  # the HTTP answer that carried it was judged already
                return all(same)
            return self.judge(call.reason, end, call.sid, call.tag, what, call)
        if answers:  # the SDK turned those HTTP answers into this error
            return all(true for _, true in answers)
        if self.world.near(None, call.start, end):
            return True
        self.flag(Kind.UNEXPLAINED_ERROR, end, f"{what}: no fault near the call", call)
        return False

    def progress(self, call: Call) -> None:
        """In order, gapless, complete before a result; a hole is allowed only before an error."""
        highest = 0
        seen: set[int] = set()
        for p in call.progress:
            step = round(p)
            if step in seen:  # a client may re-attach at an older cursor (the SDKs do): no promise broken
                self.repeated += 1
                continue
            if step < highest:
                detail = f"call {call.tag}: step {step} came after step {highest}"
                self.flag(Kind.PROGRESS_OUT_OF_ORDER, call.span_end, detail, call)
            seen.add(step)
            highest = max(highest, step)
        if call.outcome == "error":
            return
        holes = sorted(set(range(1, highest + 1)) - seen)
        short = call.outcome == "result" and highest < call.steps
        if holes or short:
            hole = f"steps {_ranges(holes)} missing" if holes else ""
            tail = f"steps {highest + 1}-{call.steps} missing" if short else ""
            ending = "then its result" if call.outcome == "result" else "then nothing"
            what = ", ".join(x for x in (hole, tail) if x)
            self.flag(Kind.SILENT_GAP, call.span_end, f"call {call.tag}: {what}, {ending}", call)


def _ranges(steps: list[int]) -> str:
    parts: list[str] = []
    for step in steps:
        if parts and parts[-1].split("-")[-1] == str(step - 1):
            parts[-1] = parts[-1].split("-")[0] + f"-{step}"
        else:
            parts.append(str(step))
    return ",".join(parts)


def check(history: RunHistory) -> Verdict:
    return Checker(history).run()


def describe(verdict: Verdict, limit: int = 20) -> list[str]:
    """Lines for a person: each kind's count, then the first violations with their detail."""
    lines = [f"{verdict.layout}: {len(verdict.violations)} violations"]
    for kind, count in sorted(verdict.kinds().items()):
        lines.append(f"  {kind}: {count}")
    for v in verdict.violations[:limit]:
        lines.append(f"  [{v.cell}] {v.kind}: {v.detail}")
    if len(verdict.violations) > limit:
        lines.append(f"  ... and {len(verdict.violations) - limit} more")
    lines += [f"  note: {note}" for note in verdict.notes]
    return lines
