"""``python -m bench.ab REV [FRAMING ...] [--streams N]``: one stream (``--streams``: N at once) of 256 B
events through nginx, through mcpresume at ``REV`` (its ``mcpresume/`` tree from ``git archive``, in a temp
dir) and through the working tree's, in each upstream framing (default: all of ``bench.upstream.FRAMINGS``),
3 interleaved runs each in rotating order, medians: whether a change made the proxy faster or slower,
measured side by side in one run (the ratios to nginx move with the machine's load from run to run, these
comparisons much less)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import bench.procs as procs_mod
from bench.__main__ import MODES, SESSIONS_CAP, _cpu, run_client, throughput_spec
from bench.upstream import FRAMINGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("rev", help="the git revision to compare with")
    parser.add_argument("framings", nargs="*", help=f"of {', '.join(FRAMINGS)} (default: all)")
    parser.add_argument("--reps", type=int, default=6)  # 6: each order of the three as often
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams per run (default 1)")
    args = parser.parse_args(argv)
    unknown = set(args.framings) - set(FRAMINGS)
    if unknown:
        parser.error(f"unknown framing(s): {', '.join(sorted(unknown))}")
    args.framings = args.framings or list(FRAMINGS)
    with (
        tempfile.TemporaryDirectory(prefix="mcpresume-ab-") as base_dir,
        tempfile.TemporaryDirectory(prefix="mcpresume-ab-new-") as new_dir,
    ):
        procs_mod.tree(Path(base_dir), args.rev)
        procs_mod.tree(Path(new_dir))  # the working tree's, from a copy too (``tree``)
        procs = procs_mod.Processes()
        try:
            upstream = procs.start_upstream()
            nginx = procs.start_nginx(upstream)
            if nginx is None:
                raise SystemExit("nginx is not installed")
            started = {
                name: procs.start_mcpresume(
                    upstream, name=f"mcpresume-{name}", root=Path(directory), **SESSIONS_CAP
                )
                for name, directory in (("base", base_dir), ("new", new_dir))
            }
            base, new = started["base"], started["new"]
            targets = {"nginx": nginx, "base": base, "new": new}
            names = list(targets)
            rates: dict[str, dict[str, list[float]]] = {}
            cpus: dict[str, dict[str, list[float]]] = {}
            for rep in range(args.reps):
                for framing in args.framings:
                    order = names[rep % 3 :] + names[: rep % 3]
                    # Reps 3-5 take the rotations backwards: with 6 reps every target follows every other
                    # one as often (in the cycle nginx, base, new alone, new followed base in 2 of 3 runs,
                    # and an A/A run gave "new" 0.92-0.93x the CPU per event at 100 streams).
                    for name in reversed(order) if rep // 3 % 2 else order:
                        spec = throughput_spec(targets[name].url, MODES["full"], args.streams, 256, framing)
                        cpu0 = _cpu(targets[name])
                        result = run_client(procs, spec, timeout=120)
                        cpu1 = _cpu(targets[name])
                        rates.setdefault(framing, {}).setdefault(name, []).append(result["rate"])
                        # CPU per event, probes included (the client's idle start costs the target nothing):
                        # steadier than events/s on a shared machine, where the target may wait for a core.
                        events = result["events"] + sum(p["events"] for p in result["probes"])
                        if cpu0 is not None and cpu1 is not None and events:
                            cpus.setdefault(framing, {}).setdefault(name, []).append((cpu1 - cpu0) / events)
            print(
                f"| framing | nginx ev/s | {args.rev} ev/s | working tree ev/s | {args.rev} / nginx "
                "| working tree / nginx | working tree / base |"
            )
            print("|---|---|---|---|---|---|---|")
            for framing, by in rates.items():
                med = {name: statistics.median(values) for name, values in by.items()}
                print(
                    f"| {framing} | {med['nginx']:,.0f} | {med['base']:,.0f} | {med['new']:,.0f} | "
                    f"{med['base'] / med['nginx']:.3f} | {med['new'] / med['nginx']:.3f} | "
                    f"{med['new'] / med['base']:.2f} |"
                )
            print()
            print("CPU per event, us (medians; probe runs included):")
            print(f"| framing | nginx | {args.rev} | working tree | working tree / base |")
            print("|---|---|---|---|---|")
            for framing, by in cpus.items():
                us = {name: statistics.median(values) * 1e6 for name, values in by.items()}
                if len(us) == 3:
                    print(
                        f"| {framing} | {us['nginx']:.2f} | {us['base']:.2f} | {us['new']:.2f} | "
                        f"{us['new'] / us['base']:.2f} |"
                    )
        finally:
            procs.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
