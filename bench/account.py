"""``python -m bench.account [--rev REV] [--framing F] [--streams N] [--reps N]``: where a target's time per
event goes, nginx beside mcpresume (the working tree's, and the one at ``REV`` with ``--rev``), one throughput
workload (256 B events, ``bench.ab``'s) run on each in turn, in rotating order.

Per event: user and system CPU (``/proc/<pid>/stat`` utime and stime across a run; nginx: its master and
worker). Per 1,000 events: the socket reads and writes and the event-loop waits the target made, and every
system call (``perf stat`` on the syscall tracepoints, in every other repetition only, so their cost stays out
of the CPU figures; ``/proc/<pid>/io`` would miss ``recv``, which nginx reads with), and the bytes per
read and per write: the upstream's bytes per event (``size``) over the reads, and the bytes written per event
(``/proc/<pid>/io`` wchar: both write to the client with ``write``/``writev``) over the writes. Medians.
Whether a target makes more and smaller socket operations than another (coalescing would pay), or spends
its time in user space. Needs root for the tracepoints (without them, the syscall rows are left out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import bench.procs as procs_mod
from bench.__main__ import MODES, SESSIONS_CAP, run_client, throughput_spec
from bench.upstream import FRAMINGS

_TICK = os.sysconf("SC_CLK_TCK")
_READS = ("read", "readv", "recvfrom", "recvmsg")
_WRITES = ("write", "writev", "sendto", "sendmsg")
_WAITS = ("epoll_wait", "epoll_pwait")
_SYSCALLS = (*_READS, *_WRITES, *_WAITS, "epoll_ctl")
SIZE = 256  # bytes per event, the whole SSE frame as the upstream writes it


def _cpu(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pids``."""
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
    return user / _TICK, system / _TICK


def _wchar(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                total += int(line.split()[1])
    return total


class _SyscallCount:
    """``perf stat`` on the syscall tracepoints of ``pids``, from start to ``stop()``."""

    def __init__(self, pids: list[int], output: Path) -> None:
        self.output = output
        events = ["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{name}" for name in _SYSCALLS)]
        argv = ["perf", "stat", "-x,", "-o", str(output), "-e", ",".join(events)]
        argv += ["-p", ",".join(map(str, pids))]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # attached before the workload starts

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        counts: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in self.output.read_text().splitlines():
                parts = line.split(",")
                if len(parts) > 2 and parts[0].isdigit():
                    name = parts[2].split(":")[-1].removeprefix("sys_enter_")
                    counts["all" if name == "sys_enter" else name] = int(parts[0])
        return counts


def _perf_works() -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(
        ["perf", "stat", "-e", "raw_syscalls:sys_enter", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def _row(counts: dict[str, int], events: int) -> dict[str, float]:
    per_k = {name: counts.get(name, 0) * 1000 / events for name in (*_SYSCALLS, "all")}
    return {
        "reads": sum(per_k[name] for name in _READS),
        "writes": sum(per_k[name] for name in _WRITES),
        "waits": sum(per_k[name] for name in _WAITS),
        "all": per_k["all"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.account", description=__doc__)
    parser.add_argument("--rev", help="also mcpresume at this git revision")
    parser.add_argument("--framing", default="canonical", choices=list(FRAMINGS))
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument(
        "--reps", type=int, default=6, help="runs per target, every other one counting syscalls"
    )
    args = parser.parse_args(argv)
    counting = _perf_works()
    procs = procs_mod.Processes()
    try:
        upstream = procs.start_upstream()
        nginx = procs.start_nginx(upstream)
        if nginx is None:
            raise SystemExit("nginx is not installed")
        targets = {"nginx": nginx}
        trees = {"working tree": procs_mod.tree(procs.tmp / "new")}
        if args.rev:
            trees[args.rev] = procs_mod.tree(procs.tmp / "base", args.rev)
        for index, (name, directory) in enumerate(trees.items()):  # each proxy from its own copy
            targets[name] = procs.start_mcpresume(
                upstream, name=f"mcpresume-{index}", root=directory, **SESSIONS_CAP
            )
        pids = {
            name: [child.pid, *(procs_mod.children(child.pid) if name == "nginx" else [])]
            for name, child in targets.items()
        }
        names = list(targets)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            count = counting and rep % 2 == 1
            for name in order:
                spec = throughput_spec(targets[name].url, MODES["full"], args.streams, SIZE, args.framing)
                cpu0, wchar0 = _cpu(pids[name]), _wchar(pids[name])
                syscalls = _SyscallCount(pids[name], procs.tmp / "perf.txt") if count else None
                result = run_client(procs, spec, timeout=120)
                counts = syscalls.stop() if syscalls is not None else {}
                cpu1, wchar1 = _cpu(pids[name]), _wchar(pids[name])
                events = result["events"] + sum(p["events"] for p in result["probes"])
                row: dict[str, float] = {"rate": result["rate"], "out": (wchar1 - wchar0) / events}
                if counts:
                    row |= _row(counts, events)
                else:
                    row |= {
                        "user": (cpu1[0] - cpu0[0]) / events * 1e6,
                        "sys": (cpu1[1] - cpu0[1]) / events * 1e6,
                    }
                rows[name].append(row)
        _report(rows, args)
    finally:
        procs.close()
    return 0


def _report(rows: dict[str, list[dict[str, float]]], args: Any) -> None:
    def med(name: str, key: str) -> float | None:
        values = [row[key] for row in rows[name] if key in row]
        return statistics.median(values) if values else None

    def cell(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    print(
        f"{args.streams} stream(s) of {SIZE} B events, {args.framing} framing, "
        f"medians of {args.reps} runs per target"
    )
    print()
    print("| | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    lines: list[tuple[str, str, str]] = [
        ("events/s", "rate", ",.0f"),
        ("user CPU per event, us", "user", ".3f"),
        ("system CPU per event, us", "sys", ".3f"),
        ("socket reads per 1,000 events", "reads", ".2f"),
        ("socket writes per 1,000 events", "writes", ".2f"),
        ("event-loop waits (epoll) per 1,000 events", "waits", ".2f"),
        ("system calls per 1,000 events, all", "all", ".2f"),
    ]
    for label, key, spec in lines:
        print(f"| {label} | " + " | ".join(cell(med(name, key), spec) for name in rows) + " |")
    for label, numerator, key in (("bytes per read", None, "reads"), ("bytes per write", "out", "writes")):
        cells = []
        for name in rows:
            count = med(name, key)
            moved = SIZE if numerator is None else med(name, numerator)
            cells.append(cell(moved * 1000 / count if count and moved else None, ",.0f"))
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
