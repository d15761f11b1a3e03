"""``mcpresume check-config``, run as a user runs it (a subprocess): the settings as serve loads them, the
upstream and the store reached; one line per problem, exit 0 or 2."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest


def _env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("MCPRESUME_")}


async def check_config(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str], list[str]]:
    """Exit code, stdout lines, stderr lines. Run without blocking the loop (it may serve the upstream)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mcpresume",
        "check-config",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or _env(),
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode().splitlines(), err.decode().splitlines()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: nothing listens there


async def test_good_settings_and_reachable_neighbours_exit_0(example_upstream: str) -> None:
    code, out, err = await check_config("--upstream", example_upstream)
    assert (code, err) == (0, [])
    assert out == [f"mcpresume: configuration ok: the upstream {example_upstream} answers; store memory"]


async def test_each_problem_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "m.toml"
    config.write_text("window_events = 0\n")
    port = _closed_port()
    env = _env() | {"MCPRESUME_PORT": "http"}
    code, out, err = await check_config("--config", str(config), "--log-format", "xml", env=env)
    assert code == 2 and out == []
    assert sorted(line.split(":")[1].strip() for line in err) == ["log_format", "port", "window_events"]
    assert all(line.startswith("mcpresume: ") for line in err)
    # Valid settings, an upstream where nothing listens: that line alone.
    code, out, err = await check_config("--upstream", f"http://127.0.0.1:{port}/mcp")
    assert code == 2 and out == []
    (line,) = err
    assert line.startswith(f"mcpresume: upstream: http://127.0.0.1:{port}/mcp is not reachable: ")
    code, _, err = await check_config()
    assert code == 2
    assert err == ["mcpresume: upstream: required for serve (--upstream URL or MCPRESUME_UPSTREAM)"]


async def test_a_redis_store_is_written_to(example_upstream: str, redis_db: str) -> None:
    advertise = ("--advertise-url", "http://10.0.0.1:8080/mcp")
    code, out, err = await check_config("--upstream", example_upstream, "--store", redis_db, *advertise)
    assert (code, err) == (0, [])
    assert out[0].endswith(f"store {redis_db} takes writes")
    down = f"redis://:secret@127.0.0.1:{_closed_port()}/0"
    code, out, err = await check_config("--upstream", example_upstream, "--store", down, *advertise)
    assert code == 2 and out == []
    (line,) = err
    assert line.startswith("mcpresume: store: redis://:***@127.0.0.1:") and "did not take a write" in line
    assert "secret" not in line
    code, _, err = await check_config("--upstream", example_upstream, "--store", redis_db)
    assert code == 2
    assert [line.split(":")[1].strip() for line in err] == ["advertise_url"]


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_check_config_takes_every_flag_serve_takes(command: str) -> None:
    from mcpresume.daemon.cli import _parser

    parser = _parser()
    assert parser.parse_args([command, "--window-events", "3"]).window_events == "3"


async def test_an_environment_variable_that_matches_no_setting_is_a_problem(example_upstream: str) -> None:
    env = _env() | {"MCPRESUME_UPSTREM": example_upstream}
    code, out, err = await check_config("--upstream", example_upstream, env=env)
    assert code == 2 and out == []
    assert err == [
        "mcpresume: environment: MCPRESUME_UPSTREM matches no setting and is ignored; did you mean "
        "MCPRESUME_UPSTREAM?"
    ]
