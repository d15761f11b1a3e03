"""The package and the fault campaign (faults/) stay `mypy --strict` and `ruff` clean (both are in the test
extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_clean() -> None:
    result = run("ruff", "check", "mcpresume", "faults", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_clean() -> None:
    result = run("mypy", "mcpresume")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_clean_on_the_fault_campaign() -> None:
    result = run("mypy", "--strict", "faults")
    assert result.returncode == 0, result.stdout + result.stderr
