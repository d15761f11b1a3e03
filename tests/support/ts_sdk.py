"""An MCP upstream made with the official TypeScript SDK (npm ``@modelcontextprotocol/sdk``), in a process of
its own: for what the Python SDK's server does differently (it never answers a cancelled request).

The SDK is installed outside the repository, pinned, like the conformance runner
(``tests/support/conformance.py``): ``npm install --prefix <dir> @modelcontextprotocol/sdk@<SDK_VERSION>``,
done by `installed_sdk` when it is missing and npm is on PATH. ``<dir>`` is ``$MCPRESUME_TS_SDK_DIR``, else
``${XDG_CACHE_HOME:-~/.cache}/mcpresume/ts-sdk-<SDK_VERSION>``. The server's script,
``ts_sdk_server.mjs`` beside this module, is copied there (Node resolves its imports from its own
directory) and run with ``node``; it prints its URL. A test skips only when Node is missing or too old.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.support.conformance import Unavailable, npm_install

SDK_VERSION = "1.32.2"
"""The pinned SDK: a 1.x release (the line clients and servers use), its engines field Node >= 18."""

MIN_NODE = (18, 0)
SCRIPT = Path(__file__).resolve().parent / "ts_sdk_server.mjs"
START_TIMEOUT = 30.0


def sdk_dir() -> Path:
    explicit = os.environ.get("MCPRESUME_TS_SDK_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mcpresume" / f"ts-sdk-{SDK_VERSION}"


def installed_sdk() -> tuple[str, Path]:
    """``(node, the SDK's directory)``, installing the SDK first when it is missing; `Unavailable`
    (``skip=True`` only when Node is missing or too old). A script run from that directory resolves the SDK
    (``with_script``)."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node not found on PATH: the TypeScript SDK server needs Node >= 18", skip=True)
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    version = tuple(int(part) for part in re.findall(r"\d+", out)[:2])
    if version < MIN_NODE:
        raise Unavailable(f"node {out.strip()} is too old for the TypeScript SDK (needs >= 18)", skip=True)
    base = sdk_dir()
    package = base / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json"
    install = f"npm install --prefix {base} @modelcontextprotocol/sdk@{SDK_VERSION}"
    npm_install(base, f"@modelcontextprotocol/sdk@{SDK_VERSION}", package)
    try:
        installed = json.loads(package.read_text())["version"]
    except (OSError, ValueError, KeyError):
        raise Unavailable(
            f"the TypeScript SDK is not installed in {base}; run: {install}", skip=False
        ) from None
    if installed != SDK_VERSION:
        raise Unavailable(
            f"{base} holds the TypeScript SDK {installed}, not {SDK_VERSION}; run: {install}", skip=False
        )
    return node, base


def with_script(source: Path) -> tuple[str, Path]:
    """``(node, a copy of the script ``source`` in the SDK's directory)``: ``installed_sdk``, then the copy
    (made again when it differs)."""
    node, base = installed_sdk()
    script = base / source.name
    if not script.exists() or script.read_bytes() != source.read_bytes():
        # Copied aside and renamed: a test process started together with this one may be running it.
        aside = script.with_name(f"{script.name}.{os.getpid()}")
        shutil.copyfile(source, aside)
        os.replace(aside, script)
    return node, script


@dataclass(frozen=True)
class TsServer:
    url: str  # the MCP endpoint

    async def stats(self) -> dict[str, int]:
        """``open``: POST responses the server holds open; ``cancelled``, ``finished``: ``slow`` calls."""
        async with aiohttp.ClientSession() as http, http.get(self.url.rsplit("/", 1)[0] + "/stats") as answer:
            return dict(await answer.json())


@contextlib.asynccontextmanager
async def ts_sdk_server() -> AsyncIterator[TsServer]:
    """The TypeScript SDK server (``ts_sdk_server.mjs``) on a free loopback port, stopped at the end."""
    node, script = with_script(SCRIPT)
    process = await asyncio.create_subprocess_exec(
        node, str(script), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        url = line.decode().strip()
        assert url.startswith("http://"), f"the TypeScript SDK server did not start: {line!r}"
        yield TsServer(url)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
