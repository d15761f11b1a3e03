"""Run the official MCP conformance suite (npm ``@modelcontextprotocol/conformance``) and read its verdicts.

The suite's ``server`` command acts as an MCP client (the TypeScript SDK's) against a server URL and runs
named scenarios; with ``-o DIR`` it writes each scenario's checks to ``DIR/server-<scenario>-<time>/
checks.json``. A scenario *passes* when none of its checks is a ``FAILURE`` (``WARNING`` and ``INFO`` do not
fail it, as in the suite's own summary).

The runner is installed outside the repository, pinned: ``npm install --prefix <dir>
@modelcontextprotocol/conformance@<RUNNER_VERSION>`` (``.ci/run`` does it). `runner_dir()` says where it is
looked for. ``python -m tests.support.conformance <upstream URL>`` runs the suite against an upstream directly
and through a proxy in front of it and prints the table, for any upstream started by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RUNNER_VERSION",
    "SERVER_SCENARIOS",
    "Runner",
    "ScenarioResult",
    "Unavailable",
    "find_runner",
    "format_table",
    "run_scenario",
    "run_suite",
    "runner_dir",
]

RUNNER_VERSION = "0.1.13"
"""The pinned runner: the newest release that starts on Node 20. 0.1.14 and later import ``fs.globSync``
(Node 22) at load time; their server scenarios are the same 32."""

MIN_NODE = (20, 18)
"""The runner's HTTP client (undici 7) needs Node >= 20.18.1."""

SERVER_SCENARIOS: tuple[str, ...] = (
    "server-initialize",
    "logging-set-level",
    "ping",
    "completion-complete",
    "tools-list",
    "tools-call-simple-text",
    "tools-call-image",
    "tools-call-audio",
    "tools-call-embedded-resource",
    "tools-call-mixed-content",
    "tools-call-with-logging",
    "tools-call-error",
    "tools-call-with-progress",
    "tools-call-sampling",
    "tools-call-elicitation",
    "json-schema-2020-12",
    "elicitation-sep1034-defaults",
    "server-sse-polling",
    "server-sse-multiple-streams",
    "elicitation-sep1330-enums",
    "resources-list",
    "resources-read-text",
    "resources-read-binary",
    "resources-templates-read",
    "resources-subscribe",
    "resources-unsubscribe",
    "prompts-list",
    "prompts-get-simple",
    "prompts-get-with-args",
    "prompts-get-embedded-resource",
    "prompts-get-with-image",
    "dns-rebinding-protection",
)
"""``conformance list``'s server scenarios of `RUNNER_VERSION` (``--suite all``: the active ones and the two
pending, ``json-schema-2020-12`` and ``server-sse-polling``), in the order the suite runs them."""

# A whole-suite run takes a few seconds; a scenario whose server request is lost waits for the upstream's
# own bound (5 s in tests/support/conformance_upstream.py) and the TS client's 60 s at worst.
SUITE_TIMEOUT = 300.0

_RESULT_DIR = re.compile(r"^server-(?P<scenario>.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z$")


class Unavailable(Exception):
    """The runner cannot run here; ``skip`` says whether that is a reason to skip (no Node) or to fail."""

    def __init__(self, message: str, *, skip: bool) -> None:
        super().__init__(message)
        self.skip = skip


@dataclass(frozen=True, slots=True)
class Runner:
    node: str
    script: Path

    def command(self, *args: str) -> list[str]:
        return [self.node, str(self.script), *args]


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    """One scenario's verdict: ``failures`` and ``warnings`` are the ids of its checks with that status."""

    scenario: str
    failures: tuple[str, ...]
    warnings: tuple[str, ...]
    messages: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"


def runner_dir() -> Path:
    """Where the runner is installed: ``$MCPRESUME_CONFORMANCE_DIR``, else
    ``${XDG_CACHE_HOME:-~/.cache}/mcpresume/conformance-<RUNNER_VERSION>``."""
    explicit = os.environ.get("MCPRESUME_CONFORMANCE_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mcpresume" / f"conformance-{RUNNER_VERSION}"


def _node_version(node: str) -> tuple[int, ...]:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return tuple(int(part) for part in re.findall(r"\d+", out)[:3])


def npm_install(base: Path, spec: str, marker: Path) -> None:
    """``npm install --prefix base spec`` when ``marker`` (a file the install makes) is missing and npm is on
    PATH; under a lock beside ``base``, so test processes started together (pytest-xdist's workers) install
    once and never read a half-made ``node_modules``. A failed install is left for the caller to report."""
    npm = shutil.which("npm")
    if npm is None or marker.exists():
        return
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{base.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return
        subprocess.run(
            [npm, "install", "--prefix", str(base), "--no-audit", "--no-fund", "--loglevel=error", spec],
            check=False,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )


def find_runner(*, install: bool = False) -> Runner:
    """The installed runner, or `Unavailable` (``skip=True`` only when Node itself is missing or too old).

    ``install``: when it is not installed and npm is on PATH, install it first (the tests do, so the
    README's one test command sets everything up on a fresh machine, as they start their own redis)."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node not found on PATH: the MCP conformance runner needs Node >= 20.18", skip=True)
    version = _node_version(node)
    if version[:2] < MIN_NODE:
        found = ".".join(map(str, version))
        raise Unavailable(
            f"node {found} is too old for the MCP conformance runner (needs >= 20.18)", skip=True
        )
    base = runner_dir()
    package = base / "node_modules" / "@modelcontextprotocol" / "conformance"
    spec = f"@modelcontextprotocol/conformance@{RUNNER_VERSION}"
    command = f"npm install --prefix {base} {spec}"
    if install:
        npm_install(base, spec, package / "package.json")
    try:
        installed = json.loads((package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        raise Unavailable(
            f"the MCP conformance runner is not installed in {base}; run: {command}", skip=False
        ) from None
    if installed != RUNNER_VERSION:
        raise Unavailable(
            f"{base} holds conformance {installed}, not {RUNNER_VERSION}; run: {command}", skip=False
        )
    return Runner(node, package / "dist" / "index.js")


def _read_results(out_dir: Path) -> dict[str, ScenarioResult]:
    results: dict[str, ScenarioResult] = {}
    for entry in sorted(out_dir.iterdir()):
        match = _RESULT_DIR.match(entry.name)
        if match is None:
            continue
        scenario = match["scenario"]
        try:
            checks = json.loads((entry / "checks.json").read_text())
        except (OSError, ValueError) as exc:
            results[scenario] = ScenarioResult(scenario, ("no-checks-json",), (), (repr(exc),))
            continue
        failures = tuple(check["id"] for check in checks if check["status"] == "FAILURE")
        warnings = tuple(check["id"] for check in checks if check["status"] == "WARNING")
        messages = tuple(
            f"{check['id']}: {check.get('errorMessage')}" for check in checks if check["status"] == "FAILURE"
        )
        results[scenario] = ScenarioResult(scenario, failures, warnings, messages)
    return results


async def _run(runner: Runner, args: Sequence[str], timeout: float) -> str:
    proc = await asyncio.create_subprocess_exec(
        *runner.command(*args),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    return out.decode(errors="replace")


async def list_server_scenarios(runner: Runner) -> list[str]:
    """The runner's server scenarios, as ``conformance list --server`` prints them."""
    out = await _run(runner, ["list", "--server"], 60.0)
    return re.findall(r"^\s+- (\S+)$", out, flags=re.MULTILINE)


async def run_suite(runner: Runner, url: str, *, timeout: float = SUITE_TIMEOUT) -> dict[str, ScenarioResult]:
    """Every server scenario (``--suite all``) against ``url``, in one runner process; by scenario name.

    A scenario the runner started but that left no ``checks.json`` reads as failed (``no-checks-json``);
    one it never started is absent (the caller compares against `SERVER_SCENARIOS`).
    """
    with tempfile.TemporaryDirectory(prefix="mcp-conformance-") as tmp:
        out_dir = Path(tmp)
        await _run(runner, ["server", "--url", url, "--suite", "all", "-o", str(out_dir)], timeout)
        return _read_results(out_dir)


async def run_scenario(runner: Runner, url: str, scenario: str, *, timeout: float = 120.0) -> ScenarioResult:
    """One scenario against ``url`` (a runner process of its own)."""
    with tempfile.TemporaryDirectory(prefix="mcp-conformance-") as tmp:
        out_dir = Path(tmp)
        await _run(runner, ["server", "--url", url, "--scenario", scenario, "-o", str(out_dir)], timeout)
        results = _read_results(out_dir)
    return results.get(scenario) or ScenarioResult(scenario, ("not-run",), ())


def format_table(columns: Sequence[str], rows: Iterable[tuple[str, Sequence[ScenarioResult | None]]]) -> str:
    """A plain-text table: one row per scenario, a verdict (and the failed / warning check ids) per column."""

    def cell(result: ScenarioResult | None) -> str:
        if result is None:
            return "(not run)"
        detail = [*result.failures, *(f"{w} (warning)" for w in result.warnings)]
        return result.verdict + (f" [{', '.join(detail)}]" if detail else "")

    lines = [" | ".join(["scenario", *columns])]
    for scenario, results in rows:
        verdicts = {r.verdict if r is not None else None for r in results}
        mark = "" if len(verdicts) == 1 else "   <-- differs"
        lines.append(" | ".join([scenario, *(cell(r) for r in results)]) + mark)
    return "\n".join(lines)


async def _compare(upstream: str, proxy_settings: dict[str, object]) -> str:
    from tests.support.proxy import running_proxy

    runner = find_runner()
    direct = await run_suite(runner, upstream)
    async with running_proxy(upstream, **proxy_settings) as proxy:
        proxied = await run_suite(runner, proxy.url)
    rows = [(name, (direct.get(name), proxied.get(name))) for name in SERVER_SCENARIOS]
    return format_table(["direct", "through mcpresume"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the MCP conformance suite directly and through mcpresume."
    )
    parser.add_argument("upstream", help="the upstream's MCP endpoint, e.g. http://localhost:3000/mcp")
    args = parser.parse_args(argv)
    try:
        print(asyncio.run(_compare(args.upstream, {})))
    except Unavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
