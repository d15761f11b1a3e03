"""The TypeScript client's packages: the official SDK and undici, pinned, installed at run time outside the
repository (``npm install --prefix DIR``), as tests/support/conformance.py installs its runner.

`find` answers the directory to pass ``node faults/client.mjs --packages``, or `Unavailable` with one line
saying why (no node or npm on PATH, a Node too old, an install that failed): the campaign then runs the
Python clients alone and prints that line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

SDK_VERSION = "1.32.2"
UNDICI_VERSION = "6.29.1"  # the newest that runs on Node 20.0 and later (7 needs 20.18)
MIN_NODE = (18, 17)  # undici 6

CLIENT_SCRIPT = Path(__file__).resolve().parent / "client.mjs"


class Unavailable(Exception):
    pass


def packages_dir() -> Path:
    """``$MCPRESUME_FAULTS_TS_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/mcpresume/faults-ts-<versions>``."""
    explicit = os.environ.get("MCPRESUME_FAULTS_TS_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mcpresume" / f"faults-ts-sdk{SDK_VERSION}-undici{UNDICI_VERSION}"


def _installed(base: Path, package: str) -> str | None:
    try:
        version = json.loads((base / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None
    return str(version)


def find(*, install: bool = True) -> tuple[str, Path]:
    """``(node, packages dir)``; installs the packages first when they are missing and npm is there."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node not found on PATH: the TypeScript SDK clients are skipped")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    version = tuple(int(part) for part in re.findall(r"\d+", out)[:2])
    if version < MIN_NODE:
        raise Unavailable(f"node {out.strip()} is older than 18.17: the TypeScript SDK clients are skipped")
    base = packages_dir()
    wanted = {"@modelcontextprotocol/sdk": SDK_VERSION, "undici": UNDICI_VERSION}
    command = ["npm", "install", "--prefix", str(base), "--no-audit", "--no-fund", "--loglevel=error"]
    command += [f"{name}@{v}" for name, v in wanted.items()]
    if any(_installed(base, name) != v for name, v in wanted.items()):
        npm = shutil.which("npm")
        if not install or npm is None:
            raise Unavailable(f"the TypeScript SDK is not installed in {base} (run: {' '.join(command)})")
        base.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, *command[1:]], check=False, timeout=600, stdin=subprocess.DEVNULL)
    missing = [f"{name}@{v}" for name, v in wanted.items() if _installed(base, name) != v]
    if missing:
        raise Unavailable(f"npm could not install {', '.join(missing)} in {base}: the TS clients are skipped")
    return node, base
