"""One layout's run: start the cluster and the clients, carry the plan out, heal, let the calls in flight end,
stop everything, and leave the history in the run's directory for the checker.

A run's directory holds ``plan.json`` (the seed and the timeline, to replay it), ``nemesis.jsonl``, every
``upstream*.jsonl`` and ``client-*.jsonl`` (`faults.history`), ``redis/`` (its AOF) and ``logs/`` (every
process's output, one file per incarnation).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from faults import nemesis
from faults.cluster import ROOT, Cluster, _child_setup
from faults.history import CLIENT_PREFIX, NEMESIS_LOG, JsonLines
from faults.plan import Plan, save
from faults.tsclient import CLIENT_SCRIPT


@dataclass(frozen=True)
class Clients:
    python: int = 2  # client processes of the Python SDK
    typescript: int = 1  # and of the TypeScript SDK (when node is there)
    loops: int = 2  # sessions each runs at once, a call at a time
    deadline: float = 30.0  # a call with no outcome by then is lost
    patience: int = 8  # reconnection attempts of each SDK (theirs: 2)
    quiet: float = 4.0  # after the last fault and the heal, calls still run this long before the stop


def source_commit() -> str:
    """The commit the proxies run, ``+`` when the working tree differs from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "mcpresume"], capture_output=True, text=True, check=False
    )
    return (head.stdout.strip() or "?") + ("+" if dirty.stdout.strip() else "")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_setup,
        )


def _start_clients(
    cluster: Cluster, plan: Plan, run_dir: Path, clients: Clients, ts: tuple[str, Path] | None
) -> list[subprocess.Popen[bytes]]:
    stop_file = run_dir / "stop"
    common = ["--url", cluster.balancer.url, "--loops", str(clients.loops), "--stop-file", str(stop_file)]
    common += ["--seed", str(plan.seed), "--deadline", str(clients.deadline)]
    common += ["--patience", str(clients.patience)]
    procs = []
    names = [(f"py{i + 1}", "python") for i in range(clients.python)]
    if ts is not None:
        names += [(f"ts{i + 1}", "typescript") for i in range(clients.typescript)]
    for name, sdk in names:
        out = ["--out", str(run_dir / f"{CLIENT_PREFIX}{name}.jsonl"), "--client", name]
        if sdk == "python":
            argv = [sys.executable, "-m", "faults.client", *common, *out]
        else:
            assert ts is not None
            argv = [ts[0], str(CLIENT_SCRIPT), "--packages", str(ts[1]), *common, *out]
        procs.append(_spawn(argv, run_dir / "logs" / f"client-{name}.log"))
    return procs


async def _wait_clients(procs: list[subprocess.Popen[bytes]], bound: float, log: JsonLines) -> None:
    deadline = time.monotonic() + bound
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            log.write("client_killed", pid=proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)


async def run_layout(
    plan: Plan,
    run_dir: Path,
    ts: tuple[str, Path] | None,
    clients: Clients = Clients(),
    say: Callable[[str], None] = print,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    save(plan, run_dir / "plan.json")
    log = JsonLines(run_dir / NEMESIS_LOG)
    log.write(
        "campaign",
        layout=plan.layout,
        seed=plan.seed,
        lease=plan.lease,
        commit=source_commit(),
        plan=plan.to_json(),
    )
    cluster = Cluster(plan.layout, run_dir, plan.lease, log)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await cluster.start()
        procs = _start_clients(cluster, plan, run_dir, clients, ts)
        t0 = time.time()
        log.write("faults", phase="start", t0=t0)
        say(f"{plan.layout}: running, {len(plan.faults)} episodes over about {plan.span:.0f} s ({run_dir})")
        await nemesis.run(plan, cluster, log, t0)
        await cluster.heal()
        log.write("heal")
        await asyncio.sleep(clients.quiet)
        (run_dir / "stop").touch()
        log.write("stop_clients")
        await _wait_clients(procs, clients.deadline + 30.0, log)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        await cluster.close()
        log.write("end")
        log.close()
    return run_dir
