"""The short fault campaign (``python -m faults``, docs/faults.md) finds no violation.

Both layouts at once (``--parallel``), each with the short plan: every fault once alone and two overlapping
pairs, about 80 s of faults; real processes (redis-server, three proxies, their upstreams, the balancer,
clients of the official Python SDK and, with Node, of the TypeScript SDK). The verdict depends on no timing
luck: an error that tells the truth is never a violation, and the facts that decide the project's promises
(who executed what, which process was alive) are read from the processes' own records, not timed.

The seed is fixed (``MCPRESUME_FAULTS_SEED`` picks another); a failing run's directory holds the seed and
the timeline (``plan.json`` per layout), and the failure message says how to replay it.

Select with ``-m faults``. About 2 minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from faults import report
from faults.checker import check, describe
from faults.history import RunHistory
from faults.plan import LAYOUTS, FaultKind

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("MCPRESUME_FAULTS_SEED", "2029"))
CAMPAIGN_TIMEOUT = 600.0  # the short campaign takes about 2 minutes; a run that hangs is stopped at this


def test_the_short_campaign_finds_no_violation(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        message = "redis-server not found on PATH (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the fault campaign", pytrace=False)
        pytest.skip(message)
    command = [sys.executable, "-m", "faults", "--parallel", "--seed", str(SEED), "--out", str(tmp_path)]
    run = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=CAMPAIGN_TIMEOUT,
        check=False,
    )
    assert run.returncode in (0, 1), f"the campaign could not run:\n{run.stdout}\n{run.stderr[-4000:]}"
    directories = sorted(path.parent for path in tmp_path.glob("*/plan.json"))
    verdicts = [check(RunHistory.load(directory)) for directory in directories]
    assert [v.layout for v in verdicts] == sorted(LAYOUTS)

    for directory, verdict in zip(directories, verdicts, strict=True):
        history = RunHistory.load(directory)
        ran = {r["kind"] for r in history.nemesis if r["ev"] == "fault" and r["phase"] == "end"}
        assert ran == {str(kind) for kind in FaultKind}, f"{verdict.layout}: faults run: {sorted(ran)}"
        sdks = {r["sdk"] for r in history.clients if r["ev"] == "client"}
        calls = [r for r in history.clients if r["ev"] == "call"]
        results = [r for r in history.clients if r["ev"] == "result"]
        assert "python" in sdks and len(results) >= 10, f"{verdict.layout}: {len(calls)} calls, {sdks}"
        if shutil.which("node"):
            assert "typescript" in sdks, f"{verdict.layout}: no TypeScript client ran\n{run.stderr[-2000:]}"

    found = [line for verdict in verdicts if verdict.violations for line in describe(verdict, limit=40)]
    assert not found, (
        f"the fault campaign found violations (seed {SEED}; runs in {tmp_path}; replay: "
        f"python -m faults --replay {tmp_path}):\n\n{report.table(verdicts)}\n\n" + "\n".join(found)
    )
    assert run.returncode == 0, run.stderr[-4000:]
