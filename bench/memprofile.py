"""Where an idle session's and an attached stream's memory goes: ``python -m bench.memprofile``.

Runs mcpresume in this process under ``tracemalloc`` (default settings), the synthetic upstream and the
load client in their own processes (the ``idle`` workload of ``bench.client``), and writes
``bench/results/memprofile.md``: the allocation sites that grew per session and per stream, next to the RSS
growth. tracemalloc sees what goes through Python's allocators only (not libuv's buffers, nor malloc's own
overhead and fragmentation), so its total is lower than the RSS growth; the split is what it is for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

from bench.procs import LOOPBACK, PYTHON, ROOT, Processes, free_port, raise_fd_limit, rss_kib

RESULTS = Path(__file__).resolve().parent / "results"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", str(ROOT) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def _source(filename: str, lineno: int) -> str:
    with contextlib.suppress(OSError, IndexError):
        return Path(filename).read_text().splitlines()[lineno - 1].strip()[:80]
    return ""


def _top(
    after: tracemalloc.Snapshot, before: tracemalloc.Snapshot, units: int, limit: int
) -> tuple[list[list[str]], float]:
    stats = after.compare_to(before, "lineno")
    total = sum(s.size_diff for s in stats)
    rows = []
    for stat in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:limit]:
        frame = stat.traceback[0]
        rows.append(
            [
                f"`{_short(frame.filename)}:{frame.lineno}`",
                f"{stat.size_diff / units:,.0f}",
                f"{stat.count_diff / units:.2f}",
                "`" + _source(frame.filename, frame.lineno).replace("|", "\\|") + "`",
            ]
        )
    return rows, total / units


async def run(sessions: int, streams: int, out: Path) -> Path:
    from mcpresume.daemon.app import start_proxy
    from mcpresume.process.config import load_settings

    procs = Processes()
    try:
        upstream = procs.start_upstream()
        settings = load_settings(
            {
                "upstream": upstream.url,
                "host": LOOPBACK,
                "port": free_port(),
                "metrics_port": 0,
                "log_level": "warning",
                "max_sessions": 200_000,
            }
        )
        proxy = await start_proxy(settings)
        spec = {
            "kind": "idle",
            "url": proxy.url,
            "host": LOOPBACK,
            "port": proxy.port,
            "sessions": sessions,
            "streams": streams,
            "concurrency": 100,
            "timeout": 600,
            "phase_timeout": 600,
        }
        tracemalloc.start(1)
        gc.collect()
        marks: dict[str, tuple[tracemalloc.Snapshot, int]] = {"start": (tracemalloc.take_snapshot(), 0)}
        marks["start"] = (marks["start"][0], rss_kib(os.getpid()))
        client = await asyncio.create_subprocess_exec(
            PYTHON,
            "-m",
            "bench.client",
            json.dumps(spec),
            cwd=str(ROOT),
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert client.stdout is not None and client.stdin is not None
        try:
            async with asyncio.timeout(900):
                while line := (await client.stdout.readline()).decode():
                    if line.startswith("PHASE "):
                        name = line.split()[1]
                        await asyncio.sleep(1.0)
                        gc.collect()
                        marks[name] = (tracemalloc.take_snapshot(), rss_kib(os.getpid()))
                        client.stdin.write(b"continue\n")
                        await client.stdin.drain()
                await client.wait()
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()
        tracemalloc.stop()
        await proxy.stop()
    finally:
        procs.close()

    parts = [
        "# Memory per idle session and per attached stream (tracemalloc)",
        "",
        f"mcpresume in-process under tracemalloc, default settings; {sessions:,} sessions (initialize only), "
        f"then {streams:,} standalone GET streams held open and idle. Bytes and allocated blocks per unit, "
        "by allocation site (the innermost frame). tracemalloc sees Python allocations only.",
        "",
    ]
    for name, before, units in (("sessions", "start", sessions), ("streams", "sessions", streams)):
        if name not in marks:
            continue
        rows, per_unit = _top(marks[name][0], marks[before][0], units, 25)
        rss_per_unit = (marks[name][1] - marks[before][1]) * 1024 / units
        parts += [
            f"## Per {'idle session' if name == 'sessions' else 'attached idle stream'}",
            "",
            f"tracemalloc: {per_unit:,.0f} B per unit; RSS: {rss_per_unit:,.0f} B per unit.",
            "",
            "| site | bytes/unit | blocks/unit | source |",
            "|---|---|---|---|",
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
    path = out / "memprofile.md"
    path.write_text("\n".join(parts))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memprofile", description=__doc__)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    raise_fd_limit()
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    started = time.monotonic()
    path = asyncio.run(run(args.sessions, args.streams, args.output))
    print(f"memprofile: {path} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
