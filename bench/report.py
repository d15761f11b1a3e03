"""Writing the results: ``latest.md`` (tables, machine, targets), PNG plots, and the profile summary."""

from __future__ import annotations

import datetime as dt
import platform
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench import calls as calls_scenario
from bench.callee import ANSWERS
from bench.procs import ROOT

KiB = 1024
MiB = 1 << 20


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (done.stdout or done.stderr).strip()


def machine() -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for module in ("aiohttp", "uvloop", "orjson"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:
            versions[module] = "?"
    busy = background_busy()
    rev = _run(["git", "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no", "mcpresume"])
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": _run(["nproc"]),
        "cpu": cpu,
        "memory": _meminfo(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "nginx": _run(["nginx", "-v"]).replace("nginx version: ", ""),
        "libraries": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "mcpresume": rev + (" (with uncommitted changes)" if dirty and dirty != "?" else ""),
        "background load": f"{busy:.0%} of all cores busy before the run (1 s sample, nothing of the "
        f"benchmark running), load average {Path('/proc/loadavg').read_text().split()[0]}",
    }


def background_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat): other tenants' load."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]), idle

    import time

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def _meminfo() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / MiB:.1f} GiB"
    except OSError:
        pass
    return "?"


def _fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def targets_table(results: dict[str, Any]) -> tuple[list[list[str]], dict[str, bool | None]]:
    t = results["targets"]
    rows: list[list[str]] = []
    verdicts: dict[str, bool | None] = {}

    tp = results.get("throughput", {}).get("configs", {}).get("1x256", {})
    if "mcpresume" in tp and "nginx" in tp:
        ratio = tp["mcpresume"]["rate"] / tp["nginx"]["rate"]
        verdicts["throughput"] = ratio >= t["throughput_1x256_vs_nginx"]
        rows.append(
            [
                "Throughput, 1 stream, 256 B events (canonical framing)",
                f">= {t['throughput_1x256_vs_nginx']:.0%} of nginx",
                f"{ratio:.1%} of nginx ({_fmt_rate(tp['mcpresume']['rate'])} vs "
                f"{_fmt_rate(tp['nginx']['rate'])} ev/s)",
                _status(verdicts["throughput"]),
            ]
        )
    configs = results.get("throughput", {}).get("configs", {})
    framed = {
        key: row["mcpresume"]["rate"] / row["nginx"]["rate"]
        for key, row in configs.items()
        if key.startswith("1x256") and "mcpresume" in row and "nginx" in row
    }
    if len(framed) > 1 and "throughput_1x256_every_framing_vs_nginx" in t:
        goal = t["throughput_1x256_every_framing_vs_nginx"]
        worst = min(framed, key=framed.__getitem__)
        verdicts["throughput_every_framing"] = framed[worst] >= goal
        rows.append(
            [
                "Throughput, 1 stream, 256 B events, worst upstream framing",
                f">= {goal:.0%} of nginx in every framing",
                f"{framed[worst]:.1%} of nginx ({worst.partition('-')[2] or 'canonical'}; "
                + ", ".join(f"{k.partition('-')[2] or 'canonical'} {v:.0%}" for k, v in framed.items())
                + ")",
                _status(verdicts["throughput_every_framing"]),
            ]
        )
    many = configs.get("100x256", {})
    if "mcpresume" in many and "nginx" in many and "throughput_100x256_vs_nginx" in t:
        ratio = many["mcpresume"]["rate"] / many["nginx"]["rate"]
        verdicts["throughput_100"] = ratio >= t["throughput_100x256_vs_nginx"]
        rows.append(
            [
                "Throughput, 100 streams, 256 B events",
                f">= {t['throughput_100x256_vs_nginx']:.0%} of nginx",
                f"{ratio:.1%} of nginx ({_fmt_rate(many['mcpresume']['rate'])} vs "
                f"{_fmt_rate(many['nginx']['rate'])} ev/s)",
                _status(verdicts["throughput_100"]),
            ]
        )
    held = results.get("held_sessions")
    if held and "held_sessions_ratio" in t:
        few, lots = (str(n) for n in held["sessions"])
        verdicts["held_sessions"] = held["ratio"] >= t["held_sessions_ratio"]
        rows.append(
            [
                f"Throughput, 1 stream, with {int(lots):,} idle sessions held / with {int(few):,}",
                f">= {t['held_sessions_ratio']}",
                f"{held['ratio']:.2f} ({_fmt_rate(held['by_sessions'][lots]['rate'])} vs "
                f"{_fmt_rate(held['by_sessions'][few]['rate'])} ev/s)",
                _status(verdicts["held_sessions"]),
            ]
        )
    lat = results.get("latency", {}).get("1000", {}).get("mcpresume", {})
    if "added_ms" in lat and "p99" in lat["added_ms"]:
        added = lat["added_ms"]["p99"]
        verdicts["latency"] = added <= t["added_latency_p99_1k_ms"]
        rows.append(
            [
                "Added latency p99 at 1k events/s",
                f"<= {t['added_latency_p99_1k_ms']} ms",
                f"{added:.3f} ms (p99 {lat['latency_ms']['p99']:.3f} ms vs direct "
                f"{lat['latency_ms']['p99'] - added:.3f} ms; median of segments: "
                f"{_ms(lat.get('added_p99_median_segment_ms'))} ms)",
                _status(verdicts["latency"]),
            ]
        )
    res = results.get("resume", {}).get("first_event_ms", {})
    if "p99" in res:
        verdicts["resume"] = res["p99"] <= t["resume_p99_ms"] and results["resume"]["failures"] == 0
        rows.append(
            [
                "Resume p99 (GET + Last-Event-ID -> first replayed event)",
                f"<= {t['resume_p99_ms']} ms",
                f"{res['p99']:.3f} ms (p50 {res['p50']:.3f} ms)",
                _status(verdicts["resume"]),
            ]
        )
    mem = results.get("memory", {})
    if "windows" in mem:
        ratio = mem["windows"]["ratio"]
        verdicts["window_memory"] = ratio <= t["window_memory_ratio"]
        rows.append(
            [
                "Window memory (RSS growth / payload held)",
                f"<= {t['window_memory_ratio']}x",
                f"{ratio:.2f}x ({mem['windows']['growth_bytes'] / MiB:.0f} MiB for "
                f"{mem['windows']['payload_bytes'] / MiB:.0f} MiB, {mem['windows']['sessions']:,} sessions)",
                _status(verdicts["window_memory"]),
            ]
        )
    if "idle" in mem:
        per_session = mem["idle"]["per_session_bytes"] / KiB
        per_stream = mem["idle"]["per_stream_bytes"] / KiB
        verdicts["idle_session"] = per_session <= t["idle_session_kib"]
        verdicts["attached_stream"] = per_stream <= t["attached_stream_kib"]
        rows.append(
            [
                "Idle session (initialize only)",
                f"<= {t['idle_session_kib']} KiB",
                f"{per_session:.2f} KiB ({mem['idle']['sessions']:,} sessions)",
                _status(verdicts["idle_session"]),
            ]
        )
        rows.append(
            [
                "Attached idle stream (standalone GET)",
                f"<= {t['attached_stream_kib']} KiB",
                f"{per_stream:.2f} KiB ({mem['idle']['streams_ok']:,} streams)",
                _status(verdicts["attached_stream"]),
            ]
        )
    _redis_targets(results, t, rows, verdicts)
    if "calls" in results:
        for row in calls_scenario.targets(results["calls"], t):
            verdicts[row["key"]] = row["ok"]
            measured = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            if row.get("worst") and row["detail"].count("x") > 1:
                measured += f" (worst: {row['worst']}; {row['detail']})"
            rows.append([row["label"], row["goal"], measured, _status(row["ok"])])
    return rows, verdicts


def _redis_targets(
    results: dict[str, Any], t: dict[str, Any], rows: list[list[str]], verdicts: dict[str, bool | None]
) -> None:
    """The Redis store's rows: each against the memory store measured in the same run."""
    redis = results.get("redis")
    if not isinstance(redis, dict):
        return
    configs = redis["throughput"]["configs"]
    for key, goal_key in (
        ("1x256", "redis_throughput_1x256_vs_memory"),
        ("1x4096", "redis_throughput_1x4096_vs_memory"),
    ):
        row = configs.get(key, {})
        if "mcpresume" in row and "mcpresume-redis" in row:
            ratio = row["mcpresume-redis"]["rate"] / row["mcpresume"]["rate"]
            verdicts[goal_key] = ratio >= t[goal_key]
            rows.append(
                [
                    f"Redis store throughput, {key.replace('x', ' stream(s) of ')} B events",
                    f">= {t[goal_key]:.0%} of the memory store",
                    f"{ratio:.1%} ({_fmt_rate(row['mcpresume-redis']['rate'])} vs "
                    f"{_fmt_rate(row['mcpresume']['rate'])} ev/s)",
                    _status(verdicts[goal_key]),
                ]
            )
    lat = redis["latency"].get("1000", {})
    if "added_ms" in lat.get("mcpresume-redis", {}) and "added_ms" in lat.get("mcpresume", {}):
        on_redis, on_memory = lat["mcpresume-redis"]["added_ms"]["p99"], lat["mcpresume"]["added_ms"]["p99"]
        goal = t["redis_added_latency_p99_1k_over_memory_ms"]
        verdicts["redis_latency"] = on_redis <= on_memory + goal
        rows.append(
            [
                "Redis store added latency p99 at 1k events/s",
                f"<= the memory store's + {goal} ms",
                f"{on_redis:.3f} ms (memory store {on_memory:.3f} ms)",
                _status(verdicts["redis_latency"]),
            ]
        )
    res = redis["resume"].get("first_event_ms", {})
    if "p99" in res:
        verdicts["redis_resume"] = res["p99"] <= t["redis_resume_p99_ms"] and redis["resume"]["failures"] == 0
        rows.append(
            [
                "Redis store resume p99",
                f"<= {t['redis_resume_p99_ms']} ms",
                f"{res['p99']:.3f} ms (p50 {res['p50']:.3f} ms)",
                _status(verdicts["redis_resume"]),
            ]
        )
    mem = redis.get("memory", {})
    if mem.get("ratio") is not None:
        verdicts["redis_memory"] = mem["ratio"] <= t["redis_memory_per_payload"]
        rows.append(
            [
                "Redis memory per payload byte (INFO used_memory growth / window payload)",
                f"<= {t['redis_memory_per_payload']}x",
                f"{mem['ratio']:.2f}x ({mem['used_memory_growth'] / MiB:.1f} MiB for "
                f"{mem['window_payload_bytes'] / MiB:.1f} MiB)",
                _status(verdicts["redis_memory"]),
            ]
        )


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> Path:
    plots = _plots(results, out)
    m = results["machine"]
    parts = [
        "# mcpresume benchmarks: latest results",
        "",
        f"Mode: **{results['mode']}** (`python -m bench{' --quick' if results['mode'] == 'quick' else ''}`), "
        f"run time {results.get('elapsed_s', 0):.0f} s. Every scenario ran side by side in one invocation; "
        "each process (upstream, nginx, mcpresume, load client) is separate. See `bench/README.md` for what "
        "each figure means.",
        "",
        "## Machine",
        "",
        _table(["", ""], [[k, str(v)] for k, v in m.items()]),
        "",
        "The machine is small (2 cores) and shared: the upstream, nginx or mcpresume, and the load client "
        "compete for the same two cores, so absolute figures are noisy; ratios measured side by side hold "
        "better.",
        "",
    ]
    rows, _ = targets_table(results)
    if rows:
        parts += ["## Targets", "", _table(["target", "goal", "measured", "status"], rows), ""]

    if "throughput" in results:
        tp = results["throughput"]
        rows = []
        for key, row in tp["configs"].items():
            shape, _, framing = key.partition("-")
            streams, size = shape.split("x")
            direct, nginx, mine = row.get("direct"), row.get("nginx"), row.get("mcpresume")
            rows.append(
                [
                    streams,
                    f"{int(size):,} B",
                    framing or "canonical",
                    _fmt_rate(direct["rate"]) if direct else "n/a",
                    _fmt_rate(nginx["rate"]) if nginx else "n/a",
                    _fmt_rate(mine["rate"]) if mine else "n/a",
                    f"{mine['mib_per_s']:.1f}" if mine else "n/a",
                    f"{mine['rate'] / direct['rate']:.1%}" if mine and direct else "n/a",
                    f"{mine['rate'] / nginx['rate']:.1%}" if mine and nginx else "n/a",
                    f"{mine['cpu_share']:.0%}" if mine and mine.get("cpu_share") is not None else "n/a",
                    "yes" if all(v["complete"] for v in row.values()) else "NO",
                ]
            )
        parts += [
            "## 1. Throughput (events/s, higher is better)",
            "",
            f"Median of {tp['reps']} interleaved run(s) of about {tp['duration']} s each; events of the "
            "given "
            "size (the whole SSE frame) streamed by the upstream as fast as it can, many events per write, "
            "framed as named (`bench.upstream.FRAMINGS`: canonical = compact JSON, `event:` and one `data:` "
            "line, LF; ids = an `id:` line first in each; default-json-ids = `json.dumps`' separators and "
            "ids; crlf = CRLF endings; pretty = `indent=2`, one `data:` line per JSON line; comments = a "
            "`: keep-alive` block before each event). "
            "mcpresume with its default settings (256-event window: its flow control makes the upstream "
            "reader wait for the client); 'complete' = every stream delivered every event and the response.",
            "",
            _table(
                [
                    "streams",
                    "event",
                    "upstream framing",
                    "direct ev/s",
                    "nginx ev/s",
                    "mcpresume ev/s",
                    "mcpresume MiB/s",
                    "vs direct",
                    "vs nginx",
                    "mcpresume CPU",
                    "all streams complete",
                ],
                rows,
            ),
            "",
        ]
        if "throughput" in plots:
            parts += [f"![throughput]({plots['throughput']})", ""]
    if "latency" in results:
        rows = []
        for rate, row in results["latency"].items():
            for name, r in row.items():
                lat = r["latency_ms"]
                added = r.get("added_ms", {})
                rows.append(
                    [
                        f"{int(rate):,}",
                        name,
                        _ms(lat.get("p50")),
                        _ms(lat.get("p90")),
                        _ms(lat.get("p99")),
                        _ms(lat.get("p99.9")),
                        _ms(lat.get("max")),
                        f"{r['over_1ms']:.2%}" if "over_1ms" in r else "",
                        _ms(added.get("p50")) if added else "",
                        _ms(added.get("p99")) if added else "",
                        _ms(r.get("added_p99_median_segment_ms")) if added else "",
                        _ms(statistics.median(r["segment_p99_ms"])) if r.get("segment_p99_ms") else "",
                        f"{r['cpu_share']:.0%}" if r.get("cpu_share") is not None else "",
                        f"{r['cpu_us_per_event']:.1f}" if r.get("cpu_us_per_event") is not None else "",
                        f"{r['upstream_cpu_share']:.0%}" if "upstream_cpu_share" in r else "",
                        f"{r['received']:,}/{r['expected']:,}",
                    ]
                )
        first = next(iter(results["latency"].values()))
        streams = next(iter(first.values()))["streams"]
        segments = len(next(iter(first.values())).get("segment_p99_ms", []))
        parts += [
            "## 2. Latency at a fixed aggregate rate (ms, lower is better)",
            "",
            f"{streams} streams paced by the upstream to the aggregate rate, 256 B events, each stamped with "
            "`time.time_ns()` just before the upstream writes it; latency = client receive time - stamp. "
            f"{segments} interleaved segments per path, samples pooled. Added = the path's percentile - "
            "direct's (pooled). 'seg. p99' = the median over segments of each segment's p99, and 'added "
            "seg. p99' its difference to direct's: a few scheduler stalls of the shared machine move the "
            "pooled p99, much less this one. '> 1 ms' = the share of events later than 1 ms: p99 moves by "
            "a whole millisecond when it crosses 1%. CPU = the proxy's share of one core (nginx: master and "
            "worker), and what it comes to per event relayed; upstream CPU = the paced upstream's (it shares "
            "the two cores with what it measures, so it must stay small). "
            "Default settings.",
            "",
            _table(
                [
                    "events/s",
                    "path",
                    "p50",
                    "p90",
                    "p99",
                    "p99.9",
                    "max",
                    "> 1 ms",
                    "added p50",
                    "added p99",
                    "added seg. p99",
                    "seg. p99",
                    "CPU",
                    "CPU us/event",
                    "upstream CPU",
                    "received",
                ],
                rows,
            ),
            "",
        ]
        if "latency" in plots:
            parts += [f"![latency]({plots['latency']})", ""]

    if "resume" in results:
        r = results["resume"]
        f, a = r["first_event_ms"], r["full_replay_ms"]
        parts += [
            "## 3. Resume latency (ms)",
            "",
            f"{r['trials']:,} re-attaches (GET + `Mcp-Session-Id` + `Last-Event-ID`, new connection, connect "
            f"not timed) over {r['sessions']} sessions whose 256-event window is full of 1 KiB events; the "
            f"cursor is near the start of the window, so {r['replayed_per_trial']} events are replayed.",
            "",
            _table(
                ["measure", "p50", "p90", "p99", "p99.9", "max"],
                [
                    [
                        "request -> first replayed event",
                        *(_ms(f.get(p)) for p in ("p50", "p90", "p99", "p99.9", "max")),
                    ],
                    [
                        "request -> whole replay, stream closed",
                        *(_ms(a.get(p)) for p in ("p50", "p90", "p99", "p99.9", "max")),
                    ],
                ],
            ),
            "",
            f"Failures: {r['failures']}.",
            "",
        ]
        if "resume" in plots:
            parts += [f"![resume]({plots['resume']})", ""]

    mem = results.get("memory", {})
    if mem:
        rows = []
        if "windows" in mem:
            w = mem["windows"]
            rows.append(["baseline RSS (after warm-up)", f"{w['rss_base_kib'] / KiB:.1f} MiB", ""])
            rows.append(
                [
                    f"{w['sessions']:,} sessions, full 256-event windows of 1 KiB events",
                    f"+{w['growth_bytes'] / MiB:.1f} MiB for {w['payload_bytes'] / MiB:.1f} MiB payload",
                    f"**{w['ratio']:.2f}x** payload",
                ]
            )
        if "idle" in mem:
            i = mem["idle"]
            rows.append(
                [
                    f"{i['sessions']:,} idle sessions (initialize only)",
                    f"+{(i['rss_sessions_kib'] - i['rss_base_kib']) / KiB:.1f} MiB",
                    f"**{i['per_session_bytes'] / KiB:.2f} KiB** per session",
                ]
            )
            rows.append(
                [
                    f"{i['streams_ok']:,} attached idle standalone GET streams",
                    f"+{(i['rss_streams_kib'] - i['rss_sessions_kib']) / KiB:.1f} MiB",
                    f"**{i['per_stream_bytes'] / KiB:.2f} KiB** per stream",
                ]
            )
        parts += [
            "## 4. Memory (RSS of the mcpresume process, VmRSS)",
            "",
            "A fresh mcpresume process per measurement, default settings except `--max-sessions` and "
            "`--max-connections`.",
            "",
            _table(["state", "RSS", "per unit"], rows),
            "",
        ]
        if "idle" in mem and mem["idle"]["streams"] < mem["idle"]["streams_requested"]:
            i = mem["idle"]
            parts += [
                f"Scaled down: {i['streams']:,} attached streams instead of {i['streams_requested']:,}: the "
                f"hard fd limit here is {i['fd_limit']:,} and the proxy holds two sockets per attached "
                "stream "
                "(the client's and its upstream GET).",
                "",
            ]
        if "memory" in plots:
            parts += [f"![memory]({plots['memory']})", ""]

    redis = results.get("redis")
    parts += ["## Redis store", ""]
    if isinstance(redis, dict):
        rows = [
            [
                key,
                _fmt_rate(row["mcpresume"]["rate"]),
                _fmt_rate(row["mcpresume-redis"]["rate"]),
                f"{row['mcpresume-redis']['rate'] / row['mcpresume']['rate']:.2f}",
            ]
            for key, row in redis["throughput"]["configs"].items()
        ]
        parts += [
            "The same proxy with the Redis store (a local `redis-server`) beside the memory store, same run.",
            "",
            _table(["events/s", "memory store", "Redis store", "ratio"], rows),
            "",
        ]
    else:
        parts += [str(redis or "not run"), ""]
    if "calls" in results:
        parts += calls_section(results["calls"])
    path = out / "latest.md"
    path.write_text("\n".join(parts))
    return path


def _cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def calls_table(calls: dict[str, Any]) -> str:
    """One row per answer kind and path; calls/s and CPU per call at saturation (and their ratios to the
    floor proxy's and nginx's), one call at a time, and the fixed rate."""
    results = calls["results"]
    saturation, serial, fixed = (results.get(m, {}) for m in calls_scenario.CALL_MODES)
    rate = calls["settings"]["rate"]["rate"]
    rows = []
    for answer in ANSWERS:
        for name in calls["targets"]:
            sat = saturation.get(answer, {}).get(name)
            floor = saturation.get(answer, {}).get("floor")
            nginx = saturation.get(answer, {}).get("nginx")
            one = serial.get(answer, {}).get(name)
            one_nginx = serial.get(answer, {}).get("nginx")
            paced = fixed.get(answer, {}).get(name)

            def ratio(mine: dict[str, Any] | None, base: dict[str, Any] | None, key: str) -> str:
                if not mine or not base or mine.get(key) is None or not base.get(key):
                    return ""
                return f"{mine[key] / base[key]:.2f}"

            def lat(row: dict[str, Any] | None, p: str) -> str:
                if not row or p not in row["latency_ms"]:
                    return "n/a"
                # an open-loop rate the path could not keep up with: its latencies are its queue
                mark = " (behind)" if p == "p50" and calls_scenario.behind(row) else ""
                return _ms(row["latency_ms"][p]) + mark

            added = ""
            if one and one_nginx and "p50" in one["latency_ms"] and "p50" in one_nginx["latency_ms"]:
                added = _ms(one["latency_ms"]["p50"] - one_nginx["latency_ms"]["p50"])
            errors = sum(row["errors"] for row in (sat, one, paced) if row)
            rows.append(
                [
                    answer,
                    name,
                    _cell(sat["rate"], ",.0f") if sat else "n/a",
                    ratio(sat, floor, "rate"),
                    ratio(sat, nginx, "rate"),
                    _cell(sat["cpu_us"], ".0f") if sat else "n/a",
                    ratio(sat, floor, "cpu_us"),
                    lat(one, "p50"),
                    lat(one, "p99"),
                    added if name != "nginx" else "",
                    lat(paced, "p50"),
                    lat(paced, "p99"),
                    _cell(paced["cpu_us"], ".0f") if paced else "n/a",
                    f"{errors:,}",
                ]
            )
    header = [
        "answer",
        "path",
        "calls/s",
        "vs floor",
        "vs nginx",
        "CPU us/call",
        "CPU vs floor",
        "one at a time p50",
        "p99",
        "p50 over nginx",
        f"{rate:,} calls/s p50",
        "p99",
        "CPU us/call",
        "errors",
    ]
    return _table(header, rows)


def calls_section(calls: dict[str, Any]) -> list[str]:
    settings, reps = calls["settings"], calls["reps"]
    sat = calls["results"].get("saturation", {})
    direct = [row["direct"] for row in sat.values() if "direct" in row]
    load = [row["load_cpu_us"] for row in direct if row.get("load_cpu_us") is not None]
    upstream = [row["cpu_us"] for row in direct if row.get("cpu_us") is not None]
    parts = [
        "## Calls",
        "",
        f"Short `tools/call` requests, each answered at once by the upstream (`bench.callee`) as SSE with "
        "`id:` lines (a priming event and the response), SSE without (the response event) or JSON. "
        f"Saturation: {calls['connections']} keep-alive connections over {calls['sessions']} sessions, one "
        f"call in flight on each, {settings['saturation']['duration']} s counted after "
        f"{settings['saturation']['warmup']} s, median of {reps['saturation']} interleaved run(s); CPU = "
        "the path's process (nginx: master and worker), user + system, per call. One at a time: "
        f"{settings['serial']['calls']:,} calls on one connection after "
        f"{settings['serial']['warmup_calls']}, {reps['serial']} run(s) pooled. Fixed rate: "
        f"{settings['rate']['rate']:,} calls/s open loop over the saturation layout, "
        f"{settings['rate']['duration']} s counted, {reps['rate']} run(s) pooled, timed from each call's due "
        "time ('behind': the path could not keep that rate, its latency is its queue). "
        "Latencies in ms; floor = the thinnest aiohttp reverse proxy (`bench.floorproxy`).",
        "",
        calls_table(calls),
        "",
    ]
    if load and upstream:
        parts += [
            f"The load generator (`bench/callgen.c`) took {min(load):.0f}-{max(load):.0f} us of CPU per call "
            f"driving the upstream directly, the upstream {min(upstream):.0f}-{max(upstream):.0f} us.",
            "",
        ]
    return parts


# -- plots -----------------------------------------------------------------------------------------------


def _plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, str] = {}
    colors = {"direct": "#4c72b0", "nginx": "#55a868", "mcpresume": "#c44e52"}

    if "throughput" in results:
        configs = results["throughput"]["configs"]
        keys = list(configs)
        names = [n for n in ("direct", "nginx", "mcpresume") if any(n in configs[k] for k in keys)]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [configs[k].get(name, {}).get("rate", 0) for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=name, color=colors[name])
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(keys))])
        ax.set_xticklabels([f"{k.split('x')[0]} stream(s)\n{k.split('x')[1]} B events" for k in keys])
        ax.set_yscale("log")
        ax.set_ylabel("events/s (log)")
        ax.set_title("Throughput")
        ax.legend()
        ax.grid(axis="y", which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=110)
        plt.close(fig)
        made["throughput"] = "throughput.png"

    if "latency" in results:
        rates = list(results["latency"])
        fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
        for ax, rate in zip(axes[0], rates, strict=True):
            for name, r in results["latency"][rate].items():
                curve = r.get("curve_ms") or []
                if curve:
                    ys = [i / (len(curve) - 1) for i in range(len(curve))]
                    ax.plot(curve, ys, label=name, color=colors.get(name))
            ax.set_xscale("log")
            ax.set_xlabel("one-way latency (ms, log)")
            ax.set_ylabel("fraction of events")
            ax.set_title(f"{int(rate):,} events/s")
            ax.grid(alpha=0.3, which="both")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=110)
        plt.close(fig)
        made["latency"] = "latency.png"

    if "resume" in results and results["resume"].get("curve_ms"):
        curve = results["resume"]["curve_ms"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(curve, [i / (len(curve) - 1) for i in range(len(curve))], color=colors["mcpresume"])
        ax.axvline(results["targets"]["resume_p99_ms"], linestyle="--", color="gray", label="target p99")
        ax.set_xlabel("GET + Last-Event-ID -> first replayed event (ms)")
        ax.set_ylabel("fraction of re-attaches")
        ax.set_title("Resume latency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "resume.png", dpi=110)
        plt.close(fig)
        made["resume"] = "resume.png"

    mem = results.get("memory", {})
    if mem:
        t = results["targets"]
        bars = []
        if "windows" in mem:
            bars.append(("window / payload (x)", mem["windows"]["ratio"], t["window_memory_ratio"]))
        if "idle" in mem:
            bars.append(
                ("per idle session (KiB)", mem["idle"]["per_session_bytes"] / KiB, t["idle_session_kib"])
            )
            bars.append(
                ("per attached stream (KiB)", mem["idle"]["per_stream_bytes"] / KiB, t["attached_stream_kib"])
            )
        fig, axes = plt.subplots(1, len(bars), figsize=(4 * len(bars), 3.8), squeeze=False)
        for ax, (label, value, target) in zip(axes[0], bars, strict=True):
            ax.bar([0], [value], color=colors["mcpresume"] if value > target else "#55a868", width=0.5)
            ax.axhline(target, linestyle="--", color="gray", label=f"target {target:g}")
            ax.set_xticks([])
            ax.set_title(label)
            ax.text(0, value, f"{value:.2f}", ha="center", va="bottom")
            ax.set_ylim(0, max(value, target) * 1.25)
            ax.legend(loc="lower right")
        fig.suptitle("Memory (RSS of the proxy)")
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
        plt.close(fig)
        made["memory"] = "memory.png"
    return made


# -- profile summary -------------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def snapshot_sources() -> dict[str, list[str]]:
    """The mcpresume sources as they are now (the profiled process runs this code; others may edit the
    files while the profile is summarised)."""
    return {
        str(path.relative_to(ROOT)): path.read_text().splitlines()
        for path in sorted((ROOT / "mcpresume").rglob("*.py"))
    }


def profile_summary(
    raw_files: list[Path], out: Path, sources: dict[str, list[str]] | None = None, top: int = 20
) -> Path:
    """Self and inclusive sample shares per function, and the hottest lines, from py-spy ``--format raw``
    (collapsed stacks: ``frame;frame;... count``, each frame ``function (file:line)``)."""
    rev = _run(["git", "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no", "mcpresume"])
    if dirty and dirty != "?":
        rev += " with uncommitted changes"
    sources = sources if sources is not None else snapshot_sources()
    parts = [
        "# Profile of mcpresume under load (py-spy)",
        "",
        f"mcpresume at {rev}; `python -m bench --profile` (py-spy record --nonblocking, 250 Hz, on the proxy "
        "process while the throughput and latency clients run; samples where the process was idle are "
        "not counted). "
        "Line numbers and source text are those of the code the profiled process ran.",
        "",
    ]
    for raw in raw_files:
        if not raw.exists():
            continue
        self_fn: Counter[str] = Counter()
        self_line: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        by_file: Counter[str] = Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            total += count
            frames = [_parse_frame(f) for f in stack.split(";") if f.strip()]
            if not frames:
                continue
            function, file, lineno = frames[-1]
            self_fn[f"{function} ({file})"] += count
            self_line[f"{file}:{lineno}"] += count
            by_file[file] += count
            for name in {f"{f} ({p})" for f, p, _ in frames}:
                inclusive[name] += count
        if not total:
            continue
        parts += [f"## {raw.name} ({total:,} samples)", "", "### Self time by function", ""]
        parts += [
            _table(
                ["function", "self"], [[f"`{k}`", f"{v / total:.1%}"] for k, v in self_fn.most_common(top)]
            )
        ]
        parts += ["", "### Inclusive time, mcpresume functions", ""]
        boring = ("<module> (mcpresume/__main__.py)", "main (mcpresume/daemon/cli.py)")
        ours = [(k, v) for k, v in inclusive.most_common() if "mcpresume/" in k and k not in boring][:top]
        parts += [_table(["function", "inclusive"], [[f"`{k}`", f"{v / total:.1%}"] for k, v in ours])]
        parts += ["", "### Hottest lines (self)", ""]
        rows = []
        for key, value in self_line.most_common(top):
            file, _, lineno = key.rpartition(":")
            rows.append([f"`{key}`", f"{value / total:.1%}", f"`{_source(sources, file, lineno)}`"])
        parts += [_table(["line", "self", "source"], rows)]
        parts += ["", "### Self time by file", ""]
        parts += [
            _table(["file", "self"], [[f"`{k}`", f"{v / total:.1%}"] for k, v in by_file.most_common(12)]),
            "",
        ]
    path = out / "profile.md"
    path.write_text("\n".join(parts))
    return path


def _parse_frame(frame: str) -> tuple[str, str, str]:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip(), "?", ""
    file = match["file"]
    for marker in ("site-packages/", "/lib/python3.11/", str(ROOT) + "/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return match["func"], file, match["line"] or ""


def _source(sources: dict[str, list[str]], file: str, lineno: str) -> str:
    lines = sources.get(file)
    if not lines or not lineno.isdigit() or int(lineno) > len(lines):
        return ""
    return lines[int(lineno) - 1].strip().replace("|", "\\|")[:90]
