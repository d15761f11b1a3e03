"""The pure core (``mcpresume/core/``) imports no framework and no I/O (ARCHITECTURE.md: "the pure core").

Each core module is imported in a fresh interpreter with a meta-path finder installed first, so any attempt
to import a forbidden package is recorded, even one guarded by ``try: ... except ImportError``; the
interpreter's ``sys.modules`` is checked afterwards as well. A fresh process per module means one module's
imports cannot hide another's.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Every module of the core package: the folder is the list (``pyproject.toml``'s import contract says the
# same of the whole package; this probe also sees imports made at run time, and in a fresh interpreter).
CORE_MODULES = tuple(
    sorted(f"core.{m.name}" for m in pkgutil.iter_modules([str(REPO_ROOT / "mcpresume" / "core")]))
)

# The shell's frameworks, and the standard library's doors to I/O and concurrency.
FORBIDDEN = (
    "aiohttp",
    "pydantic",
    "pydantic_settings",
    "prometheus_client",
    "redis",
    "uvloop",
    "asyncio",
    "socket",
)

# The mcpresume modules a core module may import: only other core modules (imports point inward).
ALLOWED_OWN = {"mcpresume", "mcpresume.core", *(f"mcpresume.{m}" for m in CORE_MODULES)}

_PROBE = r"""
import json, sys

FORBIDDEN = frozenset(sys.argv[1].split(","))
attempts = []


class Recorder:
    # A meta-path finder that only watches: it records the name and lets the real finders do the work.
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in FORBIDDEN:
            attempts.append(fullname)
        return None


baseline = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
sys.meta_path.insert(0, Recorder())
import importlib

module = importlib.import_module("mcpresume." + sys.argv[2])
print(json.dumps({
    "baseline": baseline,
    "attempts": sorted(set(attempts)),
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN),
    "own": sorted(m for m in sys.modules if m == "mcpresume" or m.startswith("mcpresume.")),
    "file": module.__file__,
}))
"""


def _probe(module: str) -> dict[str, list[str] | str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(FORBIDDEN), module],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, list[str] | str] = json.loads(result.stdout)
    return report


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_framework_no_io_and_no_shell(module: str) -> None:
    report = _probe(module)
    # The probe itself is meaningful only if the interpreter did not start with a forbidden module loaded.
    assert report["baseline"] == []
    # The module under test is this checkout's, not some other installed copy.
    assert Path(str(report["file"])).resolve() == REPO_ROOT / "mcpresume" / f"{module.replace('.', '/')}.py"
    assert report["attempts"] == [], f"mcpresume.{module} tried to import {report['attempts']}"
    assert report["loaded"] == [], f"mcpresume.{module} loaded {report['loaded']}"
    own = set(report["own"])
    assert f"mcpresume.{module}" in own
    assert own <= ALLOWED_OWN, f"mcpresume.{module} pulled in shell modules {sorted(own - ALLOWED_OWN)}"


def test_probe_detects_a_forbidden_import() -> None:
    """The probe is not vacuous: the process layer's local state imports asyncio, and the probe sees it."""
    report = _probe("process.local")
    assert "asyncio" in report["attempts"]
    assert "asyncio" in report["loaded"]
