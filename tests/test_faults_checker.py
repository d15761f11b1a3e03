"""The fault campaign's checker (faults/checker.py) catches every kind of violation it names, and only those:
hand-made histories, each with one thing wrong (or one fault that makes an error true), read through the
same records the campaign writes (faults/history.py). Also the plan (faults/plan.py): seeded, every fault
in the short plan, saved and loaded unchanged for a replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from faults.checker import NONE, OVERLAPPING, Kind, Verdict, check
from faults.history import JsonLines, RunHistory
from faults.plan import FaultKind, Plan, load, make_plan, save

T0 = 1_000.0
LEASE = 3.0
SID = "s-alive"
UPSTREAM_PID = 100


class Story:
    """A history written line by line, as the campaign's parties write theirs (times relative to T0)."""

    def __init__(self, layout: str = "sidecar") -> None:
        self.nemesis: list[dict[str, Any]] = [
            {"ev": "campaign", "t": T0, "layout": layout, "seed": 1, "lease": LEASE}
        ]
        self.upstreams: list[dict[str, Any]] = []
        self.clients: list[dict[str, Any]] = [{"ev": "client", "t": T0, "client": "py1", "sdk": "python"}]
        self.faults = 0
        self.proc(0, "upstream-a", UPSTREAM_PID, "started")
        self.proc(0, "proxy-a", 200, "started")
        self.upstream(1, "session", sid=SID)

    def proc(self, t: float, name: str, pid: int, state: str, **more: Any) -> Story:
        self.nemesis.append({"ev": "proc", "t": T0 + t, "name": name, "pid": pid, "state": state, **more})
        return self

    def fault(self, start: float, end: float, kind: FaultKind, target: str = "a", episode: int = 0) -> Story:
        self.faults += 1
        fields = {"id": self.faults, "kind": str(kind), "target": target, "episode": episode or self.faults}
        self.nemesis.append({"ev": "fault", "t": T0 + start, "phase": "start", **fields})
        self.nemesis.append({"ev": "fault", "t": T0 + end, "phase": "end", **fields})
        return self

    def upstream(
        self, t: float, ev: str, pid: int = UPSTREAM_PID, name: str = "upstream-a", **more: Any
    ) -> Story:
        self.upstreams.append({"ev": ev, "t": T0 + t, "upstream": name, "pid": pid, **more})
        return self

    def client(self, t: float, ev: str, **more: Any) -> Story:
        self.clients.append({"ev": ev, "t": T0 + t, "client": "py1", **more})
        return self

    def call(
        self,
        tag: str,
        start: float,
        *,
        rid: int = 2,
        steps: int = 3,
        progress: list[int] | None = None,
        result: str | None = "",
        executed: bool = True,
        sid: str = SID,
        pid: int = UPSTREAM_PID,
    ) -> Story:
        """A call sent at ``start``, executed upstream (unless not ``executed``), its progress, and its
        result (``""``: the right one; None: none recorded here)."""
        self.client(start, "call", conn="0.0", tag=tag, sid=sid, steps=steps)
        self.client(start, "sent", conn="0.0", rid=rid, method="tools/call", tag=tag)
        ids = {"sid": sid, "rid": str(rid), "tag": tag, "pid": pid}
        if executed:
            self.upstream(start + 0.1, "begin", steps=steps, **ids)
            self.upstream(start + 0.2 + steps * 0.1, "end", **ids)
        for index, step in enumerate(range(1, steps + 1) if progress is None else progress):
            self.client(start + 0.15 + index * 0.1, "progress", tag=tag, p=float(step))
        if result is not None:
            end = start + 0.3 + steps * 0.1
            self.client(end, "response", conn="0.0", rid=rid, kind="result")
            self.client(end, "result", tag=tag, text=result or f"done {tag}")
        return self

    def error(self, t: float, tag: str, reason: str | None = None, message: str = "failed") -> Story:
        return self.client(t, "error", tag=tag, code=-32000, message=message, reason=reason)

    def http(
        self, t: float, status: int, reason: str | None, tag: str | None = None, sid: str = SID
    ) -> Story:
        return self.client(
            t, "http", conn="0.0", method="POST", status=status, reason=reason, sid=sid, tag=tag
        )

    def history(self) -> RunHistory:
        return RunHistory.from_records(self.nemesis, self.upstreams, self.clients)

    def verdict(self) -> Verdict:
        return check(self.history())


def kinds(verdict: Verdict) -> dict[str, int]:
    return dict(verdict.kinds())


def only(verdict: Verdict, kind: Kind) -> str:
    """The one violation found, which must be of ``kind``; its detail."""
    assert kinds(verdict) == {str(kind): 1}, [v.detail for v in verdict.violations]
    return verdict.violations[0].detail


# -- a history with nothing wrong ---------------------------------------------------------------------------


def test_calls_that_got_their_results_gapless_are_no_violation() -> None:
    verdict = Story().call("c1", 2).call("c2", 3, rid=3).verdict()
    assert verdict.violations == []
    assert verdict.cells[NONE].calls == 2 and verdict.cells[NONE].ok == 2


def test_a_progress_step_received_again_after_a_reattach_is_no_violation() -> None:
    verdict = Story().call("c1", 2, progress=[1, 2, 2, 3]).verdict()
    assert verdict.violations == []
    assert any("received again" in note for note in verdict.notes)


# -- no request executed twice -------------------------------------------------------------------------------


def test_a_request_executed_twice_upstream_is_caught() -> None:
    story = Story().call("c1", 2)
    story.upstream(2.5, "begin", sid=SID, rid="2", tag="c1", steps=3)  # the same session + id, again
    assert "began 2 times" in only(story.verdict(), Kind.DUPLICATE_EXECUTION)


def test_a_call_executed_under_two_request_ids_is_caught() -> None:
    story = Story().call("c1", 2)
    story.upstream(2.5, "begin", sid=SID, rid="7", tag="c1", steps=3)
    assert "under 2 request ids" in only(story.verdict(), Kind.DUPLICATE_EXECUTION)


# -- every call its result exactly once ----------------------------------------------------------------------


def test_a_second_response_to_one_request_id_is_caught() -> None:
    story = Story().call("c1", 2)
    story.client(3, "response", conn="0.0", rid=2, kind="result")
    assert "second response" in only(story.verdict(), Kind.DUPLICATE_RESPONSE)


def test_a_response_to_an_id_the_client_never_sent_is_caught() -> None:
    story = Story().call("c1", 2)
    story.client(3, "response", conn="0.0", rid="mcpresume-probe", kind="result")
    assert "mcpresume-probe" in only(story.verdict(), Kind.FOREIGN_RESPONSE)


def test_another_calls_result_is_caught() -> None:
    verdict = Story().call("c1", 2, result="done c9").verdict()
    assert "done c9" in only(verdict, Kind.WRONG_RESULT)


def test_a_result_no_upstream_finished_is_caught() -> None:
    story = Story().call("c1", 2, executed=False)
    story.upstream(2.1, "begin", sid=SID, rid="2", tag="c1", steps=3)  # began, never ended
    only(story.verdict(), Kind.RESULT_WITHOUT_EXECUTION)


def test_a_call_with_no_outcome_is_caught_timed_out_or_not() -> None:
    timed_out = Story().call("c1", 2, result=None).client(40, "timeout", tag="c1")
    assert "within the deadline" in only(timed_out.verdict(), Kind.LOST_CALL)
    vanished = Story().call("c1", 2, result=None)
    assert "no outcome recorded" in only(vanished.verdict(), Kind.LOST_CALL)


# -- no silent gap -------------------------------------------------------------------------------------------


def test_a_hole_in_the_progress_then_the_result_is_a_silent_gap() -> None:
    verdict = Story().call("c1", 2, steps=5, progress=[1, 2, 4, 5]).verdict()
    assert "steps 3 missing" in only(verdict, Kind.SILENT_GAP)


def test_the_last_steps_missing_before_the_result_is_a_silent_gap() -> None:
    verdict = Story().call("c1", 2, steps=40, progress=list(range(1, 38))).verdict()
    assert "steps 38-40 missing, then its result" in only(verdict, Kind.SILENT_GAP)


def test_a_hole_then_an_explicit_error_is_no_gap() -> None:
    story = Story().fault(2.5, 2.5, FaultKind.CUT, "balancer")
    story.call("c1", 2, steps=5, progress=[1, 2, 4], result=None).error(3, "c1")
    assert story.verdict().violations == []


def test_a_step_after_a_later_one_is_out_of_order() -> None:
    verdict = Story().call("c1", 2, progress=[1, 3, 2]).verdict()
    assert "step 2 came after step 3" in only(verdict, Kind.PROGRESS_OUT_OF_ORDER)


# -- errors that tell the truth ------------------------------------------------------------------------------


def test_unknown_session_while_the_session_lives_is_a_retired_live_session() -> None:
    story = Story().fault(5, 10, FaultKind.REDIS_FULL, "redis")
    story.call("c1", 6, result=None).http(9, 404, "unknown_session", "c1").error(9, "c1", "unknown_session")
    detail = only(story.verdict(), Kind.RETIRED_LIVE_SESSION)
    assert "was not gone, its upstream upstream-a (pid 100) alive" in detail
    assert story.verdict().violations[0].cell == str(FaultKind.REDIS_FULL)


@pytest.mark.parametrize("reason", ["unknown_session", "upstream_session_lost"])
def test_unknown_session_after_its_upstream_died_is_true(reason: str) -> None:
    """Either 404 the proxy gives a session its upstream lost (``upstream_session_lost`` says so)."""
    story = Story().fault(5, 8, FaultKind.RESTART_UPSTREAM)
    story.proc(5, "upstream-a", UPSTREAM_PID, "killed").proc(7, "upstream-a", 101, "started")
    story.call("c1", 4, result=None).http(9, 404, reason, "c1").error(9, "c1", reason)
    verdict = story.verdict()
    assert verdict.violations == []
    assert verdict.cells[str(FaultKind.RESTART_UPSTREAM)].truthful == 1


def test_sidecar_unknown_session_after_its_owner_stopped_a_lease_is_true_and_not_before() -> None:
    def stopped_for(seconds: float) -> Verdict:
        story = Story().fault(5, 5 + seconds, FaultKind.PAUSE_PROXY)
        story.proc(5, "proxy-a", 200, "stopped").proc(5 + seconds, "proxy-a", 200, "continued")
        story.call("c1", 4, result=None).http(12, 404, "unknown_session", "c1")
        return story.error(12, "c1", "unknown_session").verdict()

    assert stopped_for(LEASE + 1).violations == []
    only(stopped_for(LEASE - 1), Kind.RETIRED_LIVE_SESSION)


def test_sidecar_a_pod_killed_before_a_session_began_does_not_make_its_404_true() -> None:
    story = Story().fault(2, 6, FaultKind.KILL_POD)
    story.proc(2, "upstream-a", UPSTREAM_PID, "killed").proc(2, "proxy-a", 200, "killed")
    story.proc(5, "upstream-a", 101, "started").proc(6, "proxy-a", 201, "started")
    story.upstream(7, "session", pid=101, sid="s-new")
    story.call("c1", 8, result=None, sid="s-new", pid=101).http(9, 404, "unknown_session", "c1", sid="s-new")
    story.error(9, "c1", "unknown_session")
    only(story.verdict(), Kind.RETIRED_LIVE_SESSION)


def test_shared_unknown_session_after_a_proxy_stopped_is_a_retired_live_session() -> None:
    story = Story("shared").fault(5, 10, FaultKind.PAUSE_PROXY)
    story.proc(5, "proxy-a", 200, "stopped").proc(10, "proxy-a", 200, "continued")
    story.call("c1", 4, result=None).http(12, 404, "unknown_session", "c1").error(12, "c1", "unknown_session")
    only(story.verdict(), Kind.RETIRED_LIVE_SESSION)


def test_stream_lost_while_its_upstream_finished_the_call_is_false() -> None:
    story = Story().fault(3, 8, FaultKind.RESTART_REDIS, "redis")
    story.call("c1", 2, result=None).error(9, "c1", "upstream_stream_lost")
    assert "execution was finished" in only(story.verdict(), Kind.FALSE_STREAM_LOST)


def test_stream_lost_after_its_upstream_died_is_true() -> None:
    story = Story().fault(2.2, 6, FaultKind.KILL_POD)
    story.proc(2.2, "upstream-a", UPSTREAM_PID, "killed").proc(2.2, "proxy-a", 200, "killed")
    story.call("c1", 2, result=None, progress=[1]).error(3, "c1", "upstream_stream_lost")
    assert story.verdict().violations == []


def test_store_unavailable_needs_a_store_fault_near() -> None:
    near = Story().fault(5, 8, FaultKind.PAUSE_REDIS_LONG, "redis")
    near.call("c1", 6, result=None).http(7, 503, "store_unavailable", "c1").error(
        7, "c1", "store_unavailable"
    )
    assert near.verdict().violations == []
    far = Story().fault(5, 8, FaultKind.PAUSE_REDIS_LONG, "redis")
    far.call("c1", 40, result=None).http(41, 503, "store_unavailable", "c1").error(
        41, "c1", "store_unavailable"
    )
    only(far.verdict(), Kind.FALSE_STORE_UNAVAILABLE)


def test_owner_lost_with_only_a_store_fault_near_is_untruthful() -> None:
    story = Story().fault(5, 10, FaultKind.REDIS_FULL, "redis")
    story.call("c1", 6, result=None).http(9, 503, "owner_lost", "c1").error(9, "c1", "owner_lost")
    assert "no replica fault near" in only(story.verdict(), Kind.UNTRUTHFUL_ERROR)


def test_upstream_unreachable_is_true_near_an_upstream_restart_or_a_proxy_pause_and_untruthful_far() -> None:
    # A paused proxy wakes with every deadline it held on its upstream passed (seen in a campaign on a
    # loaded machine: a POST of the paused replica answered 502 upstream_unreachable as it woke).
    for kind in (FaultKind.RESTART_UPSTREAM, FaultKind.PAUSE_PROXY):
        near = Story().fault(5, 8, kind)
        near.call("c1", 6, result=None).http(8, 502, "upstream_unreachable", "c1")
        near.error(8, "c1", "upstream_unreachable")
        assert near.verdict().violations == [], kind
    far = Story().fault(5, 8, FaultKind.PAUSE_PROXY)
    far.call("c1", 60, result=None).http(61, 502, "upstream_unreachable", "c1")
    far.error(61, "c1", "upstream_unreachable")
    assert "no upstream fault near" in only(far.verdict(), Kind.UNTRUTHFUL_ERROR)


def test_a_cursor_rejection_is_untruthful_here() -> None:
    story = Story().call("c1", 6, result=None).http(7, 409, "cursor_ahead", "c1")
    story.error(7, "c1", "cursor_ahead")
    only(story.verdict(), Kind.UNTRUTHFUL_ERROR)


def test_an_error_answer_without_a_reason_is_caught() -> None:
    story = Story().fault(5, 8, FaultKind.RESTART_UPSTREAM)
    story.proc(5, "upstream-a", UPSTREAM_PID, "killed").proc(7, "upstream-a", 101, "started")
    story.call("c1", 9, result=None).http(9.5, 404, None, "c1").error(9.5, "c1", message="Session terminated")
    only(story.verdict(), Kind.MISSING_REASON)  # the 404 itself was true: the session's upstream died


def test_the_proxys_own_500_is_caught_and_an_upstream_500_relayed_is_a_note() -> None:
    own = Story().call("c1", 2, result=None)
    own.client(
        3,
        "http",
        conn="0.0",
        method="GET",
        status=500,
        reason=None,
        sid=SID,
        tag="c1",
        body="500 Internal Server Error\n\nServer got itself in trouble",
    )
    own.error(3, "c1", message="reconnection attempts exhausted")
    only(own.verdict(), Kind.MISSING_REASON)
    relayed = Story().fault(2.5, 2.5, FaultKind.CUT, "balancer").call("c1", 2, result=None)
    relayed.client(
        3,
        "http",
        conn="0.0",
        method="GET",
        status=500,
        reason=None,
        sid=SID,
        tag="c1",
        body="Internal Server Error",
    )
    verdict = relayed.error(3, "c1", message="reconnection attempts exhausted").verdict()
    assert verdict.violations == []
    assert any("relayed: 500" in note for note in verdict.notes)


def test_a_transport_error_is_true_near_a_fault_and_unexplained_far_from_any() -> None:
    near = Story().fault(3, 3, FaultKind.CUT, "balancer")
    near.call("c1", 2, result=None).error(4, "c1", message="reconnection attempts exhausted")
    assert near.verdict().violations == []
    far = Story().call("c1", 2, result=None).error(4, "c1", message="reconnection attempts exhausted")
    only(far.verdict(), Kind.UNEXPLAINED_ERROR)


def test_a_proxy_that_exits_by_itself_while_serving_has_crashed() -> None:
    story = Story().proc(20, "proxy-a", 200, "exited", code=1)
    assert "exited with 1 while serving" in only(story.verdict(), Kind.REPLICA_CRASHED)


def test_a_proxy_that_fails_to_start_or_refuses_with_exit_2_is_a_note_not_a_violation() -> None:
    story = Story().proc(20, "proxy-b", 300, "failed_start", code=1)
    story.proc(30, "proxy-b", 301, "started").proc(31, "proxy-b", 301, "exited", code=2)
    verdict = story.verdict()
    assert verdict.violations == []
    assert any("failed to start" in note for note in verdict.notes)
    assert any("refused to serve on (exit 2)" in note for note in verdict.notes)


# -- cells ---------------------------------------------------------------------------------------------------


def test_a_call_belongs_to_the_first_fault_that_hit_it_and_overlaps_are_one_row() -> None:
    story = Story().fault(5, 6, FaultKind.CUT, "balancer")
    story.fault(30, 34, FaultKind.PAUSE_REDIS_LONG, "redis", episode=9)
    story.fault(31, 33, FaultKind.PAUSE_PROXY, "b", episode=9)
    story.call("hit-by-cut", 4, steps=20).call("after-the-cut", 8, rid=3).call("in-overlap", 30.5, rid=4)
    story.call("long-after", 80, rid=5)
    cells = story.verdict().cells
    assert cells[str(FaultKind.CUT)].calls == 2
    assert cells[OVERLAPPING].calls == 1
    assert cells[NONE].calls == 1


# -- reading a run back --------------------------------------------------------------------------------------


def test_a_run_directory_reads_back_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    story = Story().call("c1", 2)
    for name, records in (
        ("nemesis.jsonl", story.nemesis),
        ("upstream-a.jsonl", story.upstreams),
        ("client-py1.jsonl", story.clients),
    ):
        log = JsonLines(tmp_path / name)
        for record in records:
            log.write(record.pop("ev"), **record)
        log.close()
    with (tmp_path / "client-py1.jsonl").open("ab") as torn:
        torn.write(b'{"ev":"result","t":10')  # a process killed mid-line
    verdict = check(RunHistory.load(tmp_path))
    assert verdict.violations == []
    assert verdict.cells[NONE].ok == 1


# -- the plan ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sidecar", "shared"])
def test_the_short_plan_has_every_fault_and_two_overlaps_and_one_seed_one_plan(layout: str) -> None:
    plan = make_plan(layout, 42, LEASE)
    assert plan == make_plan(layout, 42, LEASE)
    assert plan != make_plan(layout, 43, LEASE)
    singles = {ep[0].kind for ep in plan.faults if len(ep) == 1}
    assert singles == set(FaultKind)
    overlaps = [ep for ep in plan.faults if len(ep) == 2]
    assert len(overlaps) == 2
    for first, second in overlaps:
        assert first.offset < second.offset < first.offset + max(first.hold, 1.0)


def test_a_longer_plan_fills_its_minutes_and_a_saved_plan_replays_unchanged(tmp_path: Path) -> None:
    plan = make_plan("sidecar", 5, LEASE, fault_seconds=300)
    assert plan.span - plan.warmup >= 300
    assert {f.kind for ep in plan.faults for f in ep} == set(FaultKind)
    save(plan, tmp_path / "plan.json")
    assert load(tmp_path / "plan.json") == plan
    assert Plan.from_json(plan.to_json()) == plan
