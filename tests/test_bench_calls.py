"""The calls scenario of the benchmark (bench/calls.py): what its runs come to, the targets' verdicts, the
upstream's answers, and the C load generator driving the real paths (the upstream, the floor proxy,
mcpresume) with every answer kind in every mode, every call answered and none an error.

Nothing here asserts a speed: the machine is shared, and the benchmark is run by hand."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import h11
import pytest

from bench import callgen, calls
from bench.callee import ANSWERS, answer, content_length
from bench.procs import Processes

GOALS = {
    "calls_sse_vs_floor": 1.0,
    "calls_json_vs_floor": 1.0,
    "calls_redis_vs_memory": 0.6,
    "calls_serial_added_p50_vs_floor": 1.0,
    "calls_cpu_vs_floor": 1.2,
    "calls_load_headroom": 5.0,
}


def _run(calls_made: int, elapsed: float, cpu: float, lat_us: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "calls": calls_made,
        "elapsed": elapsed,
        "target_cpu": cpu,
        "upstream_cpu": cpu / 10,
        "self_cpu": cpu / 20,
        "lat_us": lat_us,
        "errors": 0,
        "late": 0,
        "stalled": 0,
        "error_example": "",
        **extra,
    }


def test_runs_come_to_median_rates_and_cpu_per_call_and_pooled_latencies() -> None:
    runs = [
        _run(1000, 1.0, 0.5, [100.0] * 10),  # 1,000/s, 500 us of CPU per call
        _run(3000, 1.0, 0.3, [300.0] * 10),  # 3,000/s, 100 us
        _run(2000, 1.0, 0.4, [200.0] * 10, errors=2, stalled=5),  # 2,000/s, 200 us
    ]
    summary = calls.summarize(runs)
    assert summary["rate"] == 2000
    assert summary["rates"] == [1000, 3000, 2000]
    assert summary["cpu_us"] == pytest.approx(200)
    assert summary["upstream_cpu_us"] == pytest.approx(20)
    assert summary["calls"] == 6000
    assert summary["errors"] == 2
    assert summary["stalled"] == 5
    # pooled, in ms: the 30 samples' median is the middle run's
    assert summary["latency_ms"]["p50"] == pytest.approx(0.2)
    assert summary["latency_ms"]["n"] == 30


def test_a_run_without_calls_has_no_cpu_per_call() -> None:
    summary = calls.summarize([_run(0, 1.0, 0.5, [])])
    assert summary["rate"] == 0
    assert summary["cpu_us"] is None
    assert summary["latency_ms"] == {}


def test_behind_is_more_than_one_percent_of_the_calls_finding_no_idle_connection() -> None:
    assert not calls.behind({"calls": 1000, "stalled": 10})
    assert calls.behind({"calls": 1000, "stalled": 11})
    assert not calls.behind({"calls": 1000})


def _summary(rate: float, cpu_us: float, p50_ms: float = 1.0) -> dict[str, Any]:
    return {"rate": rate, "cpu_us": cpu_us, "latency_ms": {"p50": p50_ms}}


def _calls(saturation: dict[str, dict[str, Any]], serial: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"results": {"saturation": saturation, "serial": serial}}


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, tuple[float | None, bool | None]]:
    return {row["key"]: (row["ratio"], row["ok"]) for row in rows}


def test_each_target_is_a_ratio_of_two_paths_measured_in_the_same_run_taking_the_worst_answer() -> None:
    def paths(mine: float, floor: float, redis: float, cpu: float) -> dict[str, Any]:
        return {
            "direct": _summary(10 * floor, 20),
            "nginx": _summary(5 * floor, 30),
            "floor": _summary(floor, 100),
            "mcpresume": _summary(mine, cpu),
            "mcpresume-redis": _summary(redis, 2 * cpu),
        }

    saturation = {
        "sse-ids": paths(mine=900, floor=1000, redis=600, cpu=110),  # 0.9x the floor, Redis 0.67x
        "sse": paths(mine=1100, floor=1000, redis=660, cpu=130),  # 1.1x, CPU 1.3x: the worst CPU
        "json": paths(mine=2000, floor=2000, redis=1000, cpu=100),  # 1.0x, Redis 0.5x: the worst Redis
    }

    def serial_row(mine_ms: float) -> dict[str, Any]:
        return {
            "nginx": _summary(0, 0, p50_ms=0.2),
            "floor": _summary(0, 0, p50_ms=0.6),  # 0.4 ms above nginx
            "mcpresume": _summary(0, 0, p50_ms=mine_ms),
        }

    serial = {"sse-ids": serial_row(0.6), "sse": serial_row(1.0), "json": serial_row(0.4)}
    verdicts = _verdicts(calls.targets(_calls(saturation, serial), GOALS))
    assert verdicts["calls_sse_vs_floor"] == (pytest.approx(0.9), False)  # sse-ids, the worse of the two
    assert verdicts["calls_json_vs_floor"] == (pytest.approx(1.0), True)
    assert verdicts["calls_redis_vs_memory"] == (pytest.approx(0.5), False)
    assert verdicts["calls_serial_added_p50_vs_floor"] == (pytest.approx(2.0), False)  # sse: 0.8 / 0.4
    assert verdicts["calls_cpu_vs_floor"] == (pytest.approx(1.3), False)
    assert verdicts["calls_load_headroom"][1] is True  # direct 10x the floor, mcpresume about the floor


def test_a_target_whose_paths_were_not_measured_has_no_verdict() -> None:
    saturation = {a: {"floor": _summary(1000, 100), "mcpresume": _summary(1000, 100)} for a in ANSWERS}
    rows = calls.targets(_calls(saturation, {}), GOALS)
    verdicts = _verdicts(rows)
    assert verdicts["calls_sse_vs_floor"] == (pytest.approx(1.0), True)
    assert verdicts["calls_redis_vs_memory"] == (None, None)  # no Redis store (redis-server missing)
    assert verdicts["calls_serial_added_p50_vs_floor"] == (None, None)  # no nginx
    assert verdicts["calls_load_headroom"] == (None, None)


def _parse(raw: bytes) -> tuple[h11.Response, bytes]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/mcp", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    head = conn.next_event()
    assert isinstance(head, h11.Response)
    body = b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        assert isinstance(event, h11.Data), event
        body += event.data
    assert conn.next_event() is h11.NEED_DATA  # the answer ends where the bytes end: keep-alive holds
    return head, body


@pytest.mark.parametrize("kind", ANSWERS)
def test_the_upstreams_answers_are_whole_http_responses_carrying_the_call_result(kind: str) -> None:
    head, body = _parse(answer(7, kind, event_id=41))
    assert head.status_code == 200
    content_type = dict(head.headers)[b"content-type"]
    if kind == "json":
        assert content_type == b"application/json"
        assert json.loads(body)["id"] == 7
        return
    assert content_type == b"text/event-stream"
    events = [block for block in body.decode().split("\n\n") if block]
    datas = [line[6:] for block in events for line in block.split("\n") if line.startswith("data: ")]
    assert json.loads(datas[-1]) == {"jsonrpc": "2.0", "id": 7, "result": calls_result()}
    ids = [line[4:] for block in events for line in block.split("\n") if line.startswith("id: ")]
    # sse-ids: a priming event (an id, empty data) and the response with the next id; sse: no ids
    assert ids == (["41", "42"] if kind == "sse-ids" else [])


def calls_result() -> dict[str, Any]:
    return {"content": [{"type": "text", "text": "ok"}], "isError": False}


def test_the_request_length_is_read_whatever_the_header_case() -> None:
    assert content_length(b"POST /mcp HTTP/1.1\r\nHost: x\r\ncontent-LENGTH: 12") == 12
    assert content_length(b"POST /mcp HTTP/1.1\r\nContent-Length: 3\r\nHost: x") == 3
    assert content_length(b"DELETE /mcp HTTP/1.1\r\nHost: x") == 0


# -- the load generator against the real paths --------------------------------------------------------


@pytest.fixture
def procs() -> Iterator[Processes]:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("the calls scenario's load generator needs a C compiler (apt-get install gcc)")
    running = Processes()
    try:
        yield running
    finally:
        running.close()


def test_the_load_generator_drives_every_path_with_every_answer_in_every_mode(procs: Processes) -> None:
    upstream = procs.start_upstream("bench.callee", name="callee")
    paths = {
        "direct": upstream,
        "floor": procs.start_floor(upstream),
        "mcpresume": procs.start_mcpresume(upstream, name="mcpresume"),
    }
    for name, child in paths.items():
        for kind in ANSWERS:
            where = f"{name}, {kind}"
            serial = callgen.run(
                child.port, {"mode": "serial", "answer": kind, "calls": 20, "warmup_calls": 3}, 120
            )
            assert (serial["calls"], serial["errors"], serial["sent"]) == (20, 0, 23), (where, serial)
            assert len(serial["lat_us"]) == 20
            # 4 connections over 2 sessions: a session's calls go out on two connections at once
            layout = {"answer": kind, "connections": 4, "sessions": 2, "pids": [child.pid]}
            full = callgen.run(
                child.port, {"mode": "saturation", "duration": 0.3, "warmup": 0.1, **layout}, 120
            )
            assert full["errors"] == 0 and full["sent"] == full["answered"] > 0, (where, full)
            # 200 calls/s: the calls due in [0.1 s, 0.4 s) are the 20th to the 79th
            paced = callgen.run(
                child.port, {"mode": "rate", "rate": 200, "duration": 0.3, "warmup": 0.1, **layout}, 120
            )
            assert paced["errors"] == 0 and paced["sent"] == paced["answered"] == 80, (where, paced)
            assert 59 <= paced["calls"] <= 61, (where, paced)
