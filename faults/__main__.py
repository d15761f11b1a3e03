"""``python -m faults``: the fault campaign (docs/faults.md).

    python -m faults                      # the short campaign: every fault once per layout, two overlaps
    python -m faults --minutes 30         # 30 minutes of faults in all, half in each layout
    python -m faults --replay DIR         # the plan of an earlier run again (DIR/<layout>/plan.json)
    python -m faults --check DIR          # only the checker, on an earlier run's histories
    python -m faults --write-docs         # also write the table into docs/faults.md

Exit status: 0 when no violation was found, 1 when some were, 2 when the campaign could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from faults import report, tsclient
from faults.campaign import Clients, run_layout
from faults.checker import check, describe
from faults.cluster import ROOT
from faults.history import RunHistory
from faults.plan import LAYOUTS, Plan, load, make_plan

DOCS = ROOT / "docs" / "faults.md"
LEASE = 3.0


def say(message: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plans(args: argparse.Namespace) -> list[Plan]:
    if args.replay is not None:
        found = [load(path) for path in sorted(args.replay.glob("*/plan.json"))]
        if (args.replay / "plan.json").exists():
            found = [load(args.replay / "plan.json")]
        if not found:
            raise SystemExit(f"faults: no plan.json in {args.replay} or its directories")
        return [p for p in found if p.layout in args.layout]
    per_layout = None if args.minutes is None else args.minutes * 60 / len(args.layout)
    return [make_plan(layout, args.seed, args.lease, fault_seconds=per_layout) for layout in args.layout]


def header(histories: list[RunHistory], plans_run: list[Plan]) -> str:
    commits = sorted({str(h.nemesis[0].get("commit", "?")) for h in histories})
    seeds = sorted({p.seed for p in plans_run})
    faults = sum(len(ep) for p in plans_run for ep in p.faults)
    episodes = sum(len(p.faults) for p in plans_run)
    seconds = 0.0
    for history in histories:  # the faults' phase: from the first fault to the heal
        starts = [r["t"] for r in history.nemesis if r["ev"] == "fault" and r["phase"] == "start"]
        heal = [r["t"] for r in history.nemesis if r["ev"] == "heal"]
        if starts and heal:
            seconds += heal[0] - starts[0]
    layouts = ", ".join(p.layout for p in plans_run)
    day = time.strftime("%Y-%m-%d", time.localtime(min(h.nemesis[0]["t"] for h in histories)))
    return (
        f"Run of {day} at commit `{', '.join(commits)}` ({layouts}): seed"
        f" {', '.join(map(str, seeds))}, lease {plans_run[0].lease:g} s, {faults} faults in {episodes}"
        f" episodes, {seconds / 60:.1f} minutes of faults in all."
    )


async def campaign(args: argparse.Namespace, out: Path) -> list[Path]:
    ts: tuple[str, Path] | None = None
    if not args.no_ts:
        try:
            ts = tsclient.find()
        except tsclient.Unavailable as exc:
            say(str(exc))
    clients = Clients(typescript=1 if ts else 0)
    runs = [(plan, out / plan.layout) for plan in plans(args)]
    if args.parallel:
        return list(await asyncio.gather(*(run_layout(p, d, ts, clients, say) for p, d in runs)))
    return [await run_layout(p, d, ts, clients, say) for p, d in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, help="minutes of faults in all (default: the short plan)")
    parser.add_argument("--seed", type=int, help="the plan's seed (default: drawn, and printed)")
    parser.add_argument("--layout", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--lease", type=float, default=LEASE, help=f"owner_lease_ttl [{LEASE:g} s]")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a new temp directory)")
    parser.add_argument("--replay", type=Path, help="run the plan(s) of an earlier run's directory again")
    parser.add_argument("--check", type=Path, nargs="+", help="only check earlier runs' directories")
    parser.add_argument("--parallel", action="store_true", help="run the layouts at the same time")
    parser.add_argument("--no-ts", action="store_true", help="Python SDK clients only")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOCS}")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.check:
        directories = [
            d
            for path in args.check
            for d in (
                [path]
                if (path / "plan.json").exists()
                else sorted(p.parent for p in path.glob("*/plan.json"))
            )
        ]
        plans_run = [load(d / "plan.json") for d in directories]
    else:
        if shutil.which("redis-server") is None:
            say("redis-server not found on PATH (Debian: apt-get install redis-server)")
            return 2
        out = args.out or Path(tempfile.mkdtemp(prefix="mcpresume-faults-"))
        say(f"seed {args.seed}; runs in {out}")
        try:
            directories = asyncio.run(campaign(args, out))
        except (RuntimeError, OSError) as exc:
            say(f"the campaign could not run: {exc}")
            return 2
        plans_run = [load(d / "plan.json") for d in directories]
    histories = [RunHistory.load(d) for d in directories]
    verdicts = [check(history) for history in histories]
    text = report.results(verdicts, header(histories, plans_run))
    print(text)
    for verdict in verdicts:
        print("\n".join(describe(verdict)), file=sys.stderr)
    if args.write_docs:
        report.write_docs(DOCS, text)
        say(f"written into {DOCS}")
    return 1 if any(v.violations for v in verdicts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
