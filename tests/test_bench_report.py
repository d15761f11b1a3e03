"""The committed benchmark results are true to their data: the report written from ``latest.json`` by the
current report code has the same tables as the committed ``latest.md`` (the plots aside: matplotlib is a
bench extra, and the report leaves them out without it)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import report

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _table_rows(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


def test_the_committed_report_is_the_report_of_the_committed_results(tmp_path: Path) -> None:
    results = json.loads((RESULTS / "latest.json").read_text())
    written = report.write(results, tmp_path).read_text()
    committed = (RESULTS / "latest.md").read_text()
    assert _table_rows(written) == _table_rows(committed)


def test_every_target_has_a_verdict_and_the_latency_rows_their_late_share_and_upstream_cpu() -> None:
    results = json.loads((RESULTS / "latest.json").read_text())
    rows, verdicts = report.targets_table(results)
    # A full run measures the Redis store too (when redis-server is installed): its targets then have rows.
    redis = {
        "redis_throughput_1x256_vs_memory",
        "redis_throughput_1x4096_vs_memory",
        "redis_latency",
        "redis_resume",
        "redis_memory",
    }
    assert set(verdicts) == {
        "throughput",
        "throughput_every_framing",
        "throughput_100",
        "held_sessions",
        "latency",
        "resume",
        "window_memory",
        "idle_session",
        "attached_stream",
        *(redis if isinstance(results.get("redis"), dict) else ()),
    }
    assert all(row[-1] in ("**met**", "**MISSED**") for row in rows)
    for rate in results["latency"].values():
        for path in rate.values():
            assert 0.0 <= path["over_1ms"] <= 1.0
            # the paced upstream's CPU share, measured beside every path (a pacer that spins shows here)
            assert 0.0 <= path["upstream_cpu_share"] <= 1.0
    assert "| upstream CPU |" in (RESULTS / "latest.md").read_text()
