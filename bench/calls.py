"""The calls scenario: short ``tools/call`` requests answered at once, through every path, in one run.

Most MCP traffic is short requests answered with one event or one JSON body, not long streams. Every path
has the same upstream (``bench.callee``: a raw asyncio protocol answering in microseconds) and the same
load generator (``bench/callgen.c``, in C):

* **direct** to the upstream (what the load side and the upstream cost: the reference),
* **nginx** (one worker, ``proxy_buffering off``, upstream keep-alive: ``bench.procs.NGINX_CONF``),
* **floor**, the thinnest aiohttp reverse proxy (``bench.floorproxy``: read the body, forward it on a pooled
  connection, stream the answer back): what any proxy built on aiohttp costs,
* **mcpresume** on the memory store and **mcpresume-redis** on the Redis store (a ``redis-server`` of the
  benchmark's own), default settings,

each answered three ways (``bench.callee.ANSWERS``: SSE with ``id:`` lines, SSE without, JSON), in three
modes: **saturation** (``connections`` keep-alive connections over ``sessions`` sessions, one call in
flight on each, as fast as the path answers: calls/s), **serial** (one call at a time on one connection:
p50/p99 of what a lone call waits) and **rate** (an open-loop ``rate`` calls/s over the saturation layout:
p50/p99 when the path is not saturated). Runs are interleaved, the targets' order rotating each repetition;
calls/s and CPU are the median of the repetitions, latencies pooled. CPU per call is the target process's
user + system time (``/proc/<pid>/stat``; nginx: master and worker) over the counted window, per call
counted.

Which figures say what (``targets``): mcpresume's calls/s and CPU per call against the floor's, the Redis
store's calls/s against the memory store's, and serial p50 above nginx's against the floor's above nginx's,
all from the same run. The load generator's headroom is direct's calls/s over mcpresume's (5x or more).
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import callgen
from bench.callee import ANSWERS
from bench.procs import LOOPBACK, Child, Processes, children
from bench.stats import percentiles

TARGETS = ("direct", "nginx", "floor", "mcpresume", "mcpresume-redis")
CALL_MODES = ("saturation", "serial", "rate")

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "connections": 16,
        "sessions": 4,
        "saturation": {"duration": 1.0, "warmup": 0.3},
        "saturation_reps": 1,
        "serial": {"calls": 300, "warmup_calls": 50},
        "serial_reps": 1,
        "rate": {"rate": 500, "duration": 1.5, "warmup": 0.3},
        "rate_reps": 1,
    },
    "full": {
        "connections": 16,
        "sessions": 4,
        "saturation": {"duration": 3.0, "warmup": 0.5},
        "saturation_reps": 3,
        "serial": {"calls": 2000, "warmup_calls": 200},
        "serial_reps": 2,
        "rate": {"rate": 500, "duration": 4.0, "warmup": 0.5},
        "rate_reps": 2,
    },
}

# The load generator's headroom: direct's calls/s over mcpresume's, at least this (shown in the report).
HEADROOM = 5.0


# -- pure: what the runs come to -----------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mode, answer, target)'s runs (``callgen`` results) -> calls/s and CPU per call (medians over
    the runs), latency percentiles (samples pooled, ms), and the errors, late sends and calls that found
    no idle connection (summed)."""
    rates = [run["calls"] / run["elapsed"] for run in runs if run["elapsed"] > 0]
    per_call = [run for run in runs if run["calls"] > 0]

    def cpu_us(key: str) -> float | None:
        values = [run[key] / run["calls"] * 1e6 for run in per_call]
        return statistics.median(values) if values else None

    samples = [us / 1000 for run in runs for us in run["lat_us"]]
    return {
        "rate": statistics.median(rates) if rates else 0.0,
        "rates": rates,
        "cpu_us": cpu_us("target_cpu"),
        "upstream_cpu_us": cpu_us("upstream_cpu"),
        "load_cpu_us": cpu_us("self_cpu"),
        "latency_ms": percentiles(samples),
        "calls": sum(run["calls"] for run in runs),
        "errors": sum(run["errors"] for run in runs),
        "late": sum(run.get("late", 0) for run in runs),
        "stalled": sum(run.get("stalled", 0) for run in runs),
        "error_example": next((run["error_example"] for run in runs if run.get("error_example")), ""),
    }


def behind(summary: dict[str, Any]) -> bool:
    """At a fixed rate: more than 1% of the calls found no idle connection when due, so the path did not
    keep the rate and its latencies are its queue's."""
    return bool(summary.get("stalled", 0) > 0.01 * max(1, summary["calls"]))


def _ratio(mine: float | None, base: float | None) -> float | None:
    return mine / base if mine is not None and base else None


def targets(calls: dict[str, Any], goals: dict[str, float]) -> list[dict[str, Any]]:
    """The issue's targets for calls, each against what was measured in the same run: a list of
    ``{key, label, goal, ratio, ok, detail}`` (``ok`` None where a path it needs was not measured). A target
    over several answer kinds takes the worst of them."""
    rows: list[dict[str, Any]] = []
    saturation = calls["results"].get("saturation", {})
    serial = calls["results"].get("serial", {})

    def rate(answer: str, target: str) -> float | None:
        row = saturation.get(answer, {}).get(target)
        return row["rate"] if row else None

    def cpu(answer: str, target: str) -> float | None:
        row = saturation.get(answer, {}).get(target)
        return row["cpu_us"] if row else None

    def worst(
        key: str,
        label: str,
        goal: str,
        answers: list[str],
        ratio_of: Callable[[str], float | None],
        lower: bool,
    ) -> None:
        ratios = {answer: ratio_of(answer) for answer in answers}
        known = {answer: r for answer, r in ratios.items() if r is not None}
        if not known:
            rows.append({"key": key, "label": label, "goal": goal, "ratio": None, "ok": None, "detail": ""})
            return
        bad = max(known, key=known.__getitem__) if lower else min(known, key=known.__getitem__)
        limit = goals[key]
        ok = known[bad] <= limit if lower else known[bad] >= limit
        detail = ", ".join(f"{answer} {r:.2f}x" for answer, r in known.items())
        rows.append(
            {
                "key": key,
                "label": label,
                "goal": goal,
                "ratio": known[bad],
                "ok": ok,
                "worst": bad,
                "detail": detail,
            }
        )

    sse = [answer for answer in ANSWERS if answer.startswith("sse")]
    worst(
        "calls_sse_vs_floor",
        "Calls/s, SSE answers, mcpresume / floor",
        f">= {goals['calls_sse_vs_floor']}x the floor",
        sse,
        lambda a: _ratio(rate(a, "mcpresume"), rate(a, "floor")),
        lower=False,
    )
    worst(
        "calls_json_vs_floor",
        "Calls/s, JSON answer, mcpresume / floor",
        f">= {goals['calls_json_vs_floor']}x the floor",
        ["json"],
        lambda a: _ratio(rate(a, "mcpresume"), rate(a, "floor")),
        lower=False,
    )
    worst(
        "calls_redis_vs_memory",
        "Calls/s, Redis store / memory store",
        f">= {goals['calls_redis_vs_memory']}x the memory store",
        list(ANSWERS),
        lambda a: _ratio(rate(a, "mcpresume-redis"), rate(a, "mcpresume")),
        lower=False,
    )

    def added_p50(answer: str, target: str) -> float | None:
        row, nginx = serial.get(answer, {}).get(target), serial.get(answer, {}).get("nginx")
        if not row or not nginx or "p50" not in row["latency_ms"] or "p50" not in nginx["latency_ms"]:
            return None
        return float(row["latency_ms"]["p50"] - nginx["latency_ms"]["p50"])

    def added_ratio(answer: str) -> float | None:
        mine, floor = added_p50(answer, "mcpresume"), added_p50(answer, "floor")
        if mine is None or floor is None:
            return None
        # the floor at or under nginx: any time above nginx's is over it
        return mine / floor if floor > 0 else (float("inf") if mine > 0 else 0.0)

    worst(
        "calls_serial_added_p50_vs_floor",
        "One call at a time, p50 added over nginx, mcpresume / floor",
        f"<= {goals['calls_serial_added_p50_vs_floor']}x the floor's",
        list(ANSWERS),
        added_ratio,
        lower=True,
    )
    worst(
        "calls_cpu_vs_floor",
        "CPU per call at saturation, mcpresume / floor",
        f"<= {goals['calls_cpu_vs_floor']}x the floor's",
        list(ANSWERS),
        lambda a: _ratio(cpu(a, "mcpresume"), cpu(a, "floor")),
        lower=True,
    )
    worst(
        "calls_load_headroom",
        "Load generator headroom: direct's calls/s / mcpresume's",
        f">= {goals['calls_load_headroom']}x",
        list(ANSWERS),
        lambda a: _ratio(rate(a, "direct"), rate(a, "mcpresume")),
        lower=False,
    )
    return rows


# -- the runs ----------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def start_targets(procs: Processes, upstream: Child, *, nginx: bool, redis: bool) -> dict[str, Child]:
    """Every path in front of ``upstream`` (a ``bench.callee``), by name; nginx and the Redis store only
    where asked and installed."""
    found: dict[str, Child] = {"direct": upstream}
    if nginx:
        child = procs.start_nginx(upstream, name="nginx-calls")
        if child is None:
            log("nginx not found: the calls scenario runs without it (apt-get install nginx-light)")
        else:
            found["nginx"] = child
    found["floor"] = procs.start_floor(upstream)
    found["mcpresume"] = procs.start_mcpresume(upstream, name="mcpresume-calls")
    if redis:
        server = procs.start_redis("redis-calls")
        if server is None:
            log("redis-server not found: the calls scenario runs without the Redis store")
        else:
            url = f"redis://{LOOPBACK}:{server.port}/0"
            found["mcpresume-redis"] = procs.start_mcpresume(
                upstream, name="mcpresume-calls-redis", advertise=True, store=url
            )
    return found


def _pids(child: Child) -> list[int]:
    """The processes whose CPU is the target's: nginx's master and worker, else the one process."""
    return [child.pid, *children(child.pid)] if child.name.startswith("nginx") else [child.pid]


def _spec(mode: dict[str, Any], call_mode: str, answer: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"mode": call_mode, "answer": answer, **mode[call_mode]}
    if call_mode != "serial":
        spec |= {"connections": mode["connections"], "sessions": mode["sessions"]}
    return spec


def _timeout(spec: dict[str, Any]) -> float:
    if spec["mode"] == "serial":
        # a call of a slow path takes a few ms; 50 ms each is far past anything measured
        return 60.0 + (int(spec["calls"]) + int(spec["warmup_calls"])) * 0.05
    return 60.0 + float(spec["duration"]) + float(spec["warmup"])


def run(
    procs: Processes,
    mode_name: str,
    *,
    nginx: bool = True,
    redis: bool = True,
    answers: tuple[str, ...] = ANSWERS,
) -> dict[str, Any]:
    """The whole scenario on fresh processes (stopped at the end): every mode x answer x target."""
    mode = MODES[mode_name]
    upstream = procs.start_upstream("bench.callee", name="callee")
    found = start_targets(procs, upstream, nginx=nginx, redis=redis)
    callgen.binary()  # built before anything is timed
    names = list(found)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        # one short saturation run through each path first: lazily imported code, pools and caches warm
        for name in names:
            callgen.run(found[name].port, {**_spec(mode, "saturation", "json"), "duration": 0.5}, 60)
        for call_mode in CALL_MODES:
            for answer in answers:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for rep in range(mode[f"{call_mode}_reps"]):
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in order:
                        spec = _spec(mode, call_mode, answer)
                        spec |= {"pids": _pids(found[name]), "upstream_pid": upstream.pid}
                        runs[name].append(callgen.run(found[name].port, spec, _timeout(spec)))
                row = {name: summarize(runs[name]) for name in names}
                results.setdefault(call_mode, {})[answer] = row
                log(
                    f"calls {call_mode} {answer}: "
                    + ", ".join(_brief(call_mode, name, summary) for name, summary in row.items())
                )
    finally:
        for name in reversed(names):
            if name != "direct":
                found[name].stop()
        upstream.stop()
    return {
        "mode": mode_name,
        "connections": mode["connections"],
        "sessions": mode["sessions"],
        "settings": {call_mode: mode[call_mode] for call_mode in CALL_MODES},
        "reps": {call_mode: mode[f"{call_mode}_reps"] for call_mode in CALL_MODES},
        "targets": names,
        "results": results,
    }


def _brief(call_mode: str, name: str, summary: dict[str, Any]) -> str:
    lat = summary["latency_ms"]
    cpu = summary["cpu_us"]
    cpu_text = f", {cpu:.0f} us CPU" if cpu is not None else ""
    errors = f", {summary['errors']} ERRORS" if summary["errors"] else ""
    if call_mode == "saturation":
        return f"{name} {summary['rate']:,.0f}/s{cpu_text}{errors}"
    return f"{name} p50 {lat.get('p50', float('nan')):.3f} p99 {lat.get('p99', float('nan')):.3f} ms{errors}"


# -- profiling -------------------------------------------------------------------------------------------


def profile(procs: Processes, out: Path, seconds: float, answer: str, store: str | None = None) -> Path:
    """mcpresume (the memory store, or ``store``) under cProfile (``bench.cprofiled``) while the load
    generator saturates it with ``answer`` calls for ``seconds``, after a warm-up outside the profile;
    writes ``calls-profile.md`` (the top functions by own time and mcpresume's by cumulative time, per
    call) and the raw ``calls-profile.pstats``. cProfile's own cost per Python call inflates small
    functions, and it counts wall time: read it for the ranking and the calls per request."""
    import pstats

    upstream = procs.start_upstream("bench.callee", name="callee")
    stats_path = out / "calls-profile.pstats"
    stats_path.unlink(missing_ok=True)
    settings: dict[str, Any] = {"advertise": True, "store": store} if store else {}
    proxy = procs.start_mcpresume(
        upstream,
        name="mcpresume-profile",
        python_args=("-m", "bench.cprofiled", str(stats_path)),
        **settings,
    )
    spec = _spec(MODES["full"], "saturation", answer) | {"pids": [proxy.pid]}
    try:
        callgen.run(proxy.port, spec | {"duration": 1.0}, 120)  # warm, not profiled
        os.kill(proxy.pid, signal.SIGUSR1)
        result = callgen.run(proxy.port, spec | {"duration": seconds, "warmup": 0}, seconds + 120)
        os.kill(proxy.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while not stats_path.exists():
            if time.monotonic() > deadline or not proxy.alive():
                raise RuntimeError(f"no profile written: {proxy.log_tail()}")
            time.sleep(0.1)  # a file another process writes can only be polled
    finally:
        proxy.stop()
        upstream.stop()
    # Every call the run made was profiled (no warm-up in it): per call = over all of them.
    calls = result["answered"]
    entries = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in entries.values())
    by_own = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:40]
    ours = [item for item in entries.items() if "/mcpresume/" in item[0][0]]
    by_cumulative = sorted(ours, key=lambda item: item[1][3], reverse=True)[:30]
    lines = [
        f"# mcpresume under calls load (cProfile), {answer} answers, {store or 'memory'} store",
        "",
        f"Saturation, {spec['connections']} connections over {spec['sessions']} sessions, {seconds:.0f} s "
        f"profiled after a 1 s warm-up: {calls:,} calls at {calls / result['elapsed']:,.0f}/s under the "
        f"profiler, {result['target_cpu'] / calls * 1e6:.0f} us of the proxy's CPU per call (user + system). "
        f"The profile's own time sums to {total / calls * 1e6:.0f} us per call (wall time while running "
        "Python). 'Entries per call': a coroutine is entered once more at each resumption.",
        "",
        "## Own time",
        "",
        "| function | own us/call | own share | cumulative us/call | entries per call |",
        "|---|---|---|---|---|",
    ]
    for (file, line, name), (_cc, ncalls, tt, ct, _callers) in by_own:
        lines.append(
            f"| `{name}` ({_short(file, line)}) | {tt / calls * 1e6:.1f} | {tt / total:.1%} | "
            f"{ct / calls * 1e6:.1f} | {ncalls / calls:.2f} |"
        )
    lines += [
        "",
        "## Cumulative time, mcpresume's functions",
        "",
        "| function | cumulative us/call | share | entries per call |",
        "|---|---|---|---|",
    ]
    for (file, line, name), (_cc, ncalls, _tt, ct, _callers) in by_cumulative:
        lines.append(
            f"| `{name}` ({_short(file, line)}) | {ct / calls * 1e6:.1f} | {ct / total:.1%} | "
            f"{ncalls / calls:.2f} |"
        )
    path = out / "calls-profile.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _short(file: str, line: int) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", "/mcpresume/"):
        if marker in file:
            file = ("mcpresume/" if marker == "/mcpresume/" else "") + file.split(marker, 1)[1]
            break
    return f"{file}:{line}" if line else file
