"""The house by layers: ``pyproject.toml``'s import contracts hold, checked by import-linter itself.

The contracts (``[tool.importlinter]``): daemon > http > replicas | streams > process > store > core, every
package of the tree named in them; the core imports no framework and no I/O; prometheus, pydantic and
opentelemetry each in one module; no circle among the modules of any package. The other tests show the
check is not vacuous: a copy of the package with one import that runs back up, closes a circle, or imports
opentelemetry elsewhere, fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the package under ``root`` (found first on the path), with this repository's
    contracts; no cache (a copy's files change under the same names)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(REPO_ROOT / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of ``mcpresume/`` with ``line`` added after the ``__future__`` import of ``module``."""
    shutil.copytree(REPO_ROOT / "mcpresume", tmp_path / "mcpresume")
    path = tmp_path / "mcpresume" / f"{module.replace('.', '/')}.py"
    text = path.read_text()
    anchor = "from __future__ import annotations\n"
    assert anchor in text
    path.write_text(text.replace(anchor, anchor + line + "\n", 1))
    return tmp_path


def test_the_import_contracts_hold() -> None:
    result = _lint(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 kept, 0 broken" in result.stdout


def test_an_import_that_runs_back_up_breaks_the_layers(tmp_path: Path) -> None:
    root = _copy_with(tmp_path, "store.memory", "from mcpresume.http import context  # noqa")
    result = _lint(root)
    assert result.returncode == 1
    assert "BROKEN" in result.stdout
    assert "mcpresume.store.memory -> mcpresume.http.context" in result.stdout


def test_a_circle_breaks_the_contract_even_through_a_type_only_import(tmp_path: Path) -> None:
    # core.window is imported by core.flow; a type-only import back closes a circle of two.
    root = _copy_with(
        tmp_path,
        "core.window",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mcpresume.core.flow",
    )
    result = _lint(root)
    assert result.returncode == 1
    assert "No circle" in result.stdout and "BROKEN" in result.stdout


def test_opentelemetry_outside_process_tracing_breaks_its_contract(tmp_path: Path) -> None:
    root = _copy_with(tmp_path, "streams.upstream", "import opentelemetry.trace  # noqa")
    result = _lint(root)
    assert result.returncode == 1
    assert "OpenTelemetry (the otel extra) in one place" in result.stdout and "BROKEN" in result.stdout
