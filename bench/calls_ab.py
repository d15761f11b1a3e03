"""``python -m bench.calls_ab REV [--store memory|redis]``: short calls (``bench.calls``' saturation layout)
through the floor proxy, mcpresume at ``REV`` (its ``mcpresume/`` tree from ``git archive``) and the working
tree's mcpresume, interleaved in rotating order, each answer kind: CPU per call, medians, and the newer's over
the older's. Whether a change to the call path paid, measured side by side in one run (the full run's ratios
move by 10-15% with the machine's load; these much less). JSON is the control where a change leaves its
path untouched."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import bench.procs as procs_mod
from bench import callgen
from bench.callee import ANSWERS
from bench.calls import MODES, _spec, _timeout
from bench.procs import LOOPBACK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calls_ab", description=__doc__)
    parser.add_argument("rev", help="the git revision to compare with")
    parser.add_argument("--store", choices=("memory", "redis"), default="memory")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per run (default 2)")
    parser.add_argument(
        "--serial", action="store_true", help="one call at a time (2,000 calls a run), p50 shown too"
    )
    parser.add_argument("--restart", action="store_true", help="both proxies started afresh each repetition")
    args = parser.parse_args(argv)
    mode = MODES["full"]
    with (
        tempfile.TemporaryDirectory(prefix="mcpresume-calls-ab-") as base_dir,
        tempfile.TemporaryDirectory(prefix="mcpresume-calls-ab-new-") as new_dir,
    ):
        procs_mod.tree(Path(base_dir), args.rev)
        procs_mod.tree(Path(new_dir))
        procs = procs_mod.Processes()
        try:
            upstream = procs.start_upstream("bench.callee", name="callee")
            store: dict[str, Any] = {}
            if args.store == "redis":
                server = procs.start_redis("redis-calls-ab")
                if server is None:
                    raise SystemExit("redis-server is not installed")
                store = {"advertise": True, "store": f"redis://{LOOPBACK}:{server.port}/0"}

            def proxies(rep: int) -> dict[str, procs_mod.Child]:
                """mcpresume at both trees, started afresh (a process's own speed differs from the next's
                of the same code by up to a tenth: fresh ones each repetition average that out)."""
                return {
                    name: procs.start_mcpresume(  # (one Redis: a replica id each)
                        upstream,
                        name=f"mcpresume-{name}-{rep}",
                        root=Path(directory),
                        **(store | {"replica_id": f"calls-ab-{name}-{rep}"} if store else {}),
                    )
                    for name, directory in (("base", base_dir), ("new", new_dir))
                }

            targets = {"floor": procs.start_floor(upstream), **proxies(0)}
            callgen.binary()
            names = list(targets)
            cpu: dict[str, dict[str, list[float]]] = {
                answer: {name: [] for name in names} for answer in ANSWERS
            }
            p50: dict[str, dict[str, list[float]]] = {
                answer: {name: [] for name in names} for answer in ANSWERS
            }
            for rep in range(args.reps):
                if rep and args.restart:
                    for name in ("base", "new"):
                        targets[name].stop()
                    targets |= proxies(rep)
                for name in names if not rep or args.restart else ():  # warm: imports, pools, caches
                    callgen.run(
                        targets[name].port, {**_spec(mode, "saturation", "json"), "duration": 0.5}, 60
                    )
                for answer in ANSWERS:
                    order = names[rep % 3 :] + names[: rep % 3]
                    for name in reversed(order) if rep // 3 % 2 else order:
                        if args.serial:
                            spec = _spec(mode, "serial", answer)
                        else:
                            spec = _spec(mode, "saturation", answer) | {"duration": args.duration}
                        spec |= {"pids": [targets[name].pid], "upstream_pid": upstream.pid}
                        result = callgen.run(targets[name].port, spec, _timeout(spec))
                        if result["calls"] and not result["errors"]:
                            cpu[answer][name].append(result["target_cpu"] / result["calls"] * 1e6)
                            if result["lat_us"]:
                                p50[answer][name].append(statistics.median(result["lat_us"]) / 1000)
                        elif result["errors"]:
                            print(
                                f"{name} {answer}: {result['errors']} errors: {result.get('error_example')}"
                            )
            how = "one at a time" if args.serial else f"saturation, {args.duration:g} s each"
            print(f"{how}, store {args.store}, {args.reps} reps; CPU us per call, medians")
            for answer in ANSWERS:
                med = {name: statistics.median(values) for name, values in cpu[answer].items() if values}
                if "base" in med and "new" in med:
                    line = ", ".join(f"{name} {value:.0f}" for name, value in med.items())
                    print(f"{answer}: {line}; new/base {med['new'] / med['base']:.3f}")
                    if args.serial:
                        lat = {
                            name: statistics.median(values) for name, values in p50[answer].items() if values
                        }
                        print("  p50 ms: " + ", ".join(f"{name} {value:.3f}" for name, value in lat.items()))
                    runs = "; ".join(
                        f"{n} " + " ".join(f"{v:.0f}" for v in vs) for n, vs in cpu[answer].items()
                    )
                    print(f"  runs: {runs}")
        finally:
            for child in reversed(procs.children):
                child.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
