"""core/tasks.py: which calls become tasks, a task's lifecycle (every status x event), its wire shapes."""

from __future__ import annotations

import calendar
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcpresume.core import tasks as t
from mcpresume.core.tasks import Event, Status


def call(extensions: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    caps: dict[str, Any] = {"sampling": {}}
    if extensions is not None:
        caps["extensions"] = extensions
    params = {
        "name": "slow",
        "arguments": {"s": 1},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28", t.CAPABILITIES_META: caps},
    }
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params, **extra}


DECLARED = {t.TASKS_EXTENSION: {}}


def test_a_modern_tools_call_that_declares_the_extension_may_become_a_task() -> None:
    assert t.plan_call(call(DECLARED), enabled=True, modern=True) is t.Eligibility.TASK


@pytest.mark.parametrize(
    ("doc", "enabled", "modern"),
    [
        (call(DECLARED), False, True),  # the feature off
        (call(DECLARED), True, False),  # handshake era
        (call(None), True, True),  # no extensions declared
        (call({"io.example/other": {}}), True, True),  # another extension only
        ({**call(DECLARED), "method": "resources/read"}, True, True),
        ({k: v for k, v in call(DECLARED).items() if k != "id"}, True, True),  # a notification
        ([call(DECLARED)], True, True),  # a batch
        ({**call(DECLARED), "params": "nope"}, True, True),
        ({**call(DECLARED), "params": {"_meta": {t.CAPABILITIES_META: "x"}}}, True, True),
    ],
)
def test_everything_else_goes_as_today(doc: Any, enabled: bool, modern: bool) -> None:
    assert t.plan_call(doc, enabled=enabled, modern=modern) is t.Eligibility.AS_TODAY


def test_the_upstream_gets_the_call_without_the_extension_and_nothing_else_changes() -> None:
    doc = call({**DECLARED, "io.example/other": {"a": 1}})
    out = t.upstream_params(doc["params"])
    assert out["_meta"][t.CAPABILITIES_META]["extensions"] == {"io.example/other": {"a": 1}}
    assert out["arguments"] == doc["params"]["arguments"]
    assert t.TASKS_EXTENSION in doc["params"]["_meta"][t.CAPABILITIES_META]["extensions"]  # not mutated
    alone = t.upstream_params(call(DECLARED)["params"])
    assert "extensions" not in alone["_meta"][t.CAPABILITIES_META]
    assert alone["_meta"][t.CAPABILITIES_META]["sampling"] == {}
    assert not t.declares_tasks(alone)


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        ({"id": 1, "result": {"content": []}}, t.Answer.RESULT),
        ({"id": 1, "result": {"resultType": "complete", "content": []}}, t.Answer.RESULT),
        ({"id": 1, "result": {"resultType": "task", "taskId": "x"}}, t.Answer.UPSTREAM_TASK),
        ({"id": 1, "result": {"resultType": "input_required", "inputRequests": {}}}, t.Answer.INPUT_REQUIRED),
        ({"id": 1, "error": {"code": -1, "message": "no"}}, t.Answer.ERROR),
        ({"id": 1, "result": 3}, t.Answer.MALFORMED),
        ([], t.Answer.MALFORMED),
    ],
)
def test_what_the_upstreams_answer_means(response: Any, kind: t.Answer) -> None:
    assert t.classify(response) is kind


EXPECTED = {
    (Status.WORKING, Event.ANSWERED): Status.COMPLETED,
    (Status.WORKING, Event.FAILED): Status.FAILED,
    (Status.WORKING, Event.CANCEL): Status.CANCELLED,
    (Status.WORKING, Event.INPUT_REQUIRED): Status.INPUT_REQUIRED,
    (Status.INPUT_REQUIRED, Event.UPDATE): Status.WORKING,
    (Status.INPUT_REQUIRED, Event.CANCEL): Status.CANCELLED,
    (Status.INPUT_REQUIRED, Event.FAILED): Status.FAILED,
}


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("event", list(Event))
def test_every_status_and_event(status: Status, event: Event) -> None:
    got = t.step(status, event)
    if event is Event.EXPIRE:
        assert got is t.GONE
    elif (status, event) in EXPECTED:
        assert got is EXPECTED[(status, event)]
    else:
        assert got is t.REFUSED
    if status in t.TERMINAL and event is not Event.EXPIRE:
        assert got is t.REFUSED  # terminal is terminal: a late answer or a cancel changes nothing


TASKS = st.builds(
    t.Task,
    task_id=st.text(min_size=1, max_size=50),
    owner=st.text(max_size=20),
    status=st.sampled_from(list(Status)),
    created_at=st.floats(0, 4e9),
    updated_at=st.floats(0, 4e9),
    expires_at=st.floats(0, 8e9),
    call=st.binary(max_size=40).map(lambda b: b.hex().encode()),
    result=st.none() | st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3),
    error=st.none() | st.just({"code": -32603, "message": "x"}),
    input_requests=st.none() | st.just({"r1": {"method": "elicitation/create"}}),
    request_state=st.none() | st.text(max_size=10),
    message=st.none() | st.text(max_size=10),
)


@given(TASKS, st.lists(st.sampled_from(list(Event)), max_size=8), st.floats(0, 4e9))
def test_advance_is_total_and_keeps_the_identity(task: t.Task, events: list[Event], now: float) -> None:
    for event in events:
        nxt = t.advance(task, event, now)
        assert nxt is t.REFUSED or nxt is t.GONE or isinstance(nxt, t.Task)
        if isinstance(nxt, t.Task):
            assert (nxt.task_id, nxt.owner, nxt.created_at, nxt.expires_at) == (
                task.task_id,
                task.owner,
                task.created_at,
                task.expires_at,
            )
            assert (task.status, event, nxt.status) in {(a, b, c) for (a, b), c in EXPECTED.items()}
            task = nxt


@given(TASKS)
def test_a_record_survives_the_store(task: t.Task) -> None:
    assert t.Task.from_json(task.to_json()) == task


@given(TASKS, st.integers(100, 5000))
def test_the_wire_shapes_are_total(task: t.Task, poll: int) -> None:
    created = t.created_result(task, poll)
    assert created["resultType"] == "task"
    assert not {"result", "error", "inputRequests"} & created.keys()
    got = t.get_result(task, poll)
    assert got["taskId"] == task.task_id and got["status"] == task.status.value
    assert ("result" in got) == (task.status is Status.COMPLETED)


def test_an_update_clears_the_answered_input_requests() -> None:
    task = t.new_task("id", "o", b"{}", 10.0, 60.0)
    waiting = t.advance(task, Event.INPUT_REQUIRED, 11.0, input_requests={"a": {}}, request_state="s")
    assert isinstance(waiting, t.Task) and waiting.status is Status.INPUT_REQUIRED
    assert t.get_result(waiting, 100)["inputRequests"] == {"a": {}}
    back = t.advance(waiting, Event.UPDATE, 12.0)
    assert isinstance(back, t.Task) and back.status is Status.WORKING
    assert back.input_requests is None and back.request_state is None and back.updated_at == 12.0


def test_expiry_is_from_creation() -> None:
    task = t.new_task("id", "o", b"{}", 100.0, 60.0)
    assert not t.expired(task, 159.9)
    assert t.expired(task, 160.0)
    assert t.created_result(task, 500)["ttlMs"] == 60_000


@given(st.integers(0, 2**34))
def test_stamps_are_rfc3339_utc(seconds: int) -> None:
    assert t._stamp(float(seconds)) == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    assert calendar.timegm(time.strptime(t._stamp(float(seconds)), "%Y-%m-%dT%H:%M:%SZ")) == seconds


@pytest.mark.parametrize(
    ("params", "header", "named"),
    [
        ({"taskId": "abc"}, None, "abc"),
        ({"taskId": "abc"}, "abc", "abc"),
        ({"taskId": "abc"}, "other", None),  # Mcp-Name and the body disagree
        ({"taskId": ""}, None, None),
        ({"taskId": "x" * 129}, None, None),
        ({"taskId": 3}, None, None),
        (None, "abc", None),
    ],
)
def test_the_task_a_request_names(params: Any, header: str | None, named: str | None) -> None:
    assert t.task_id_of(params, header) == named
    assert (t.task_id_problem(params, header) is None) == (named is not None)


@pytest.mark.parametrize(
    ("params", "header", "problem"),
    [
        ({}, None, "taskId is missing"),
        ([], None, "taskId is missing"),
        ({"taskId": None}, None, "taskId is not a non-empty string"),
        ({"taskId": ["a"]}, None, "taskId is not a non-empty string"),
        ({"taskId": "x" * 129}, None, "taskId is longer than 128 characters"),
        ({"taskId": "a"}, "b", "Mcp-Name names another task than taskId"),
    ],
)
def test_what_is_wrong_with_a_task_id_is_said(params: Any, header: str | None, problem: str) -> None:
    assert t.task_id_problem(params, header) == problem


def test_poll_interval_is_bounded() -> None:
    assert t.poll_interval_ms(0.5) == 100
    assert t.poll_interval_ms(10) == 1000
    assert t.poll_interval_ms(3600) == 5000


@pytest.mark.parametrize(
    ("response", "makes"),
    [
        ({"result": {"capabilities": {"extensions": {t.TASKS_EXTENSION: {}}}}}, True),
        ({"result": {"capabilities": {"extensions": {"io.example/x": {}}}}}, False),
        ({"result": {"capabilities": {}}}, False),
        ({"error": {"code": -32601}}, False),
        (None, False),
    ],
)
def test_an_upstream_that_declares_the_extension_makes_its_own_tasks(response: Any, makes: bool) -> None:
    assert t.upstream_makes_tasks(response) is makes


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"method": "notifications/progress", "params": {"progress": 2, "total": 5, "message": "step 2"}},
            "step 2",
        ),
        ({"method": "notifications/progress", "params": {"progress": 2, "total": 5}}, "2/5"),
        ({"method": "notifications/progress", "params": {"progress": 0.5}}, "0.5"),
        ({"method": "notifications/progress", "params": {"message": "x" * 2000, "progress": 1}}, "x" * 1024),
        ({"method": "notifications/progress", "params": {}}, None),
        ({"method": "notifications/message", "params": {"progress": 1}}, None),
        ([], None),
    ],
)
def test_progress_as_a_status_message(doc: Any, message: str | None) -> None:
    assert t.progress_message(doc) == message


def test_only_a_working_task_takes_progress() -> None:
    task = t.new_task("id", "o", b"{}", 10.0, 60.0)
    moved = t.progressed(task, "half", 11.0)
    assert isinstance(moved, t.Task) and moved.message == "half" and moved.status is Status.WORKING
    assert t.get_result(moved, 100)["statusMessage"] == "half"
    done = t.advance(task, Event.ANSWERED, 12.0, result={})
    assert isinstance(done, t.Task) and t.progressed(done, "late", 13.0) is t.REFUSED
