"""The calls scenario's load generator (``bench/callgen.c``): built on first use, run once per measurement.

A C program, one thread and one epoll loop, so the load side costs a few microseconds per call and is
never what a run measures (the scenario reports its CPU per call, and direct's calls/s beside the
proxies'). It is built with ``gcc -O2`` into ``bench/build/`` under a name carrying the source's digest, so
an edited source is rebuilt and a stale binary is never run. See the source's header for what it does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from bench.procs import child_setup

SOURCE = Path(__file__).resolve().with_name("callgen.c")
BUILD = Path(__file__).resolve().parent / "build"


def binary() -> Path:
    """The built load generator, built now if this source's build is not there yet."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    built = BUILD / f"callgen-{digest}"
    if built.exists():
        return built
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("the calls scenario needs a C compiler (apt-get install gcc)")
    BUILD.mkdir(exist_ok=True)
    partial = built.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, "-O2", "-Wall", "-o", str(partial), str(SOURCE)], check=True)
    partial.replace(built)  # atomic: two benchmarks building at once both end with a whole binary
    return built


def run(port: int, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement against ``127.0.0.1:port``: ``spec`` holds the options (``answer``, ``mode``,
    ``connections``, ``sessions``, ``duration``, ``warmup``, ``calls``, ``warmup_calls``, ``rate``, ``pids``,
    ``upstream_pid``); its JSON result. Killed past ``timeout`` seconds."""
    argv = [str(binary()), "--port", str(port)]
    for key, value in spec.items():
        if key == "pids":
            value = ",".join(str(pid) for pid in value)
        argv += ["--" + key.replace("_", "-"), str(value)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=child_setup,  # dies with the benchmark
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"callgen {spec.get('mode')} did not finish within {timeout} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"callgen failed (exit {proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result
