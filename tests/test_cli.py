"""The command line and settings: precedence CLI > env > file > defaults; one clear line and exit 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mcpresume import __version__
from mcpresume.daemon.cli import main
from mcpresume.process.config import Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("MCPRESUME_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    settings = load_settings({})
    assert (settings.host, settings.port, settings.metrics_port) == ("127.0.0.1", 8080, 9464)
    assert (settings.window_events, settings.window_bytes, settings.window_ttl) == (256, 4 << 20, 300.0)
    assert settings.store == "memory" and settings.retry_ms == 1000


def test_precedence_cli_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "m.toml"
    config.write_text('window_events = 10\nwindow_ttl = 11.5\nport = 9000\nlog_format = "json"\n')
    monkeypatch.setenv("MCPRESUME_WINDOW_EVENTS", "20")
    monkeypatch.setenv("MCPRESUME_WINDOW_TTL", "21")
    settings = load_settings({"window_events": "30"}, str(config))
    assert settings.window_events == 30  # CLI
    assert settings.window_ttl == 21.0  # env
    assert settings.port == 9000  # file
    assert settings.log_format == "json"  # file
    assert settings.metrics_port == 9464  # default
    monkeypatch.setenv("MCPRESUME_CONFIG", str(config))
    assert load_settings({}).port == 9000  # the file named by MCPRESUME_CONFIG


@pytest.mark.parametrize(
    ("cli", "needle"),
    [
        ({"port": "http"}, "port:"),
        ({"window_events": "0"}, "window_events:"),
        ({"upstream": "ftp://x"}, "upstream:"),
        ({"store": "postgres://x"}, "store:"),
        ({"log_format": "xml"}, "log_format:"),
    ],
)
def test_invalid_values_name_the_setting(cli: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(cli)
    assert str(info.value).startswith(needle)
    assert "\n" not in str(info.value)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    config = tmp_path / "m.toml"
    config.write_text("windw_events = 3\n")
    with pytest.raises(SettingsError, match="windw_events: unknown setting"):
        load_settings({}, str(config))


def test_cli_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--upstream", "http://127.0.0.1:1/mcp", "--window-ttl", "-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcpresume: window_ttl:") and "\n" not in err
    assert main(["serve"]) == 2
    assert "upstream: required" in capsys.readouterr().err


def test_every_setting_has_a_flag() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "mcpresume", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in help_text


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mcpresume", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"mcpresume {__version__}"


def test_demo_runs_end_to_end() -> None:
    """The main job, as a user runs it: a drop and re-attach, a 409 and a 404, then it exits (--once)."""
    out = subprocess.run(
        [sys.executable, "-m", "mcpresume", "demo", "--once", "--port", "0", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "result 'counted to 3'" in out
    assert "-> 200: re-attached" in out
    assert "notifications/progress 4/8" in out and "response to request 2" in out
    assert out.count("notifications/progress 3/8") == 1  # seen before the drop, never again
    assert '"reason":"cursor_out_of_window"' in out
    assert '"reason":"unknown_session"' in out
    assert 'mcpresume_resumptions_total{outcome="reattach"} 1.0' in out


def test_serve_freezes_what_start_up_allocated() -> None:
    import gc

    from mcpresume.daemon.cli import freeze_long_lived

    try:
        frozen = freeze_long_lived()
        assert frozen == gc.get_freeze_count() > 1000  # the imported modules at least
        assert gc.collect() >= 0 and gc.get_freeze_count() == frozen  # a collection leaves them frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


# -- a newcomer's first runs -------------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "mcpresume", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_clean_env())


def _clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("MCPRESUME_")}


def test_a_redis_store_without_advertise_url_is_one_line_naming_it_and_exit_2() -> None:
    done = _run(
        "serve", "--upstream", "http://127.0.0.1:1/mcp", "--store", "redis://127.0.0.1:1/0", "--port", "0"
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("mcpresume: advertise_url: required when store is a Redis URL")


@pytest.mark.parametrize("which", ["port", "metrics_port"])
def test_a_port_in_use_is_one_line_naming_it_and_exit_2(busy_port: int, which: str) -> None:
    ports = {"port": "0", "metrics_port": "0", which: str(busy_port)}
    done = _run(
        "serve",
        "--upstream",
        "http://127.0.0.1:1/mcp",
        "--port",
        ports["port"],
        "--metrics-port",
        ports["metrics_port"],
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"mcpresume: cannot listen on 127.0.0.1:{busy_port} ({which}): Address already in use"
    ]


def test_demo_on_a_port_in_use_says_so(busy_port: int) -> None:
    done = _run("demo", "--once", "--port", str(busy_port), "--metrics-port", "0")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"mcpresume: cannot listen on 127.0.0.1:{busy_port} (port): Address already in use"
    )
    assert "counted" not in done.stdout  # it did not run on other ports instead


async def test_demo_on_a_default_port_in_use_moves_and_says_so(
    busy_port: int, example_upstream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mcpresume.daemon.demo import _start

    settings = load_settings({}).model_copy(update={"port": busy_port, "metrics_port": 0})
    settings.model_fields_set.discard("port")  # as if 8080 were the default taken by something else
    settings.model_fields_set.discard("metrics_port")
    proxy = await _start(settings, example_upstream)
    try:
        assert proxy.port != busy_port
    finally:
        await proxy.stop()
    assert f"127.0.0.1:{busy_port} (port): Address already in use; using free ports instead" in (
        capsys.readouterr().out
    )


def test_demo_without_the_demo_extra_is_one_line_naming_it() -> None:
    # The demo extra's packages made unimportable, as in an install without [demo] (the image's).
    code = (
        "import sys; sys.modules['mcp'] = sys.modules['uvicorn'] = None\n"
        "from mcpresume.daemon.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = _run("demo", "--once", "--port", "0", "--metrics-port", "0", code=code)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("mcpresume: the demo needs the demo extra")
    assert line.endswith("pip install 'mcpresume[demo]'")


def _help(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "mcpresume", *command, "--help"], capture_output=True, text=True, check=True
    )
    return " ".join(done.stdout.split())  # argparse wraps lines anywhere


def test_every_option_shows_its_default_and_its_variable() -> None:
    text = _help("serve")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        found = re.compile(rf"{flag}[ ,]").search(text, text.index("options:"))
        assert found is not None, flag
        start = found.start()
        entry = text[start : text.index("]", start) + 1]
        assert f"env MCPRESUME_{name.upper()}]" in entry, entry
        default = field.get_default(call_default_factory=True)
        if isinstance(default, int | float | str) and not isinstance(default, bool):
            assert f"[default: {default};" in entry, entry
        else:
            assert "[default: " in entry, entry
    assert "[default: none; env MCPRESUME_CONFIG]" in text


def test_demo_help_lists_only_what_the_demo_uses() -> None:
    from mcpresume.daemon.cli import DEMO_SETTINGS

    text = _help("demo")
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text[text.index("options:") :]))
    assert flags == {"--help", "--once", "--config"} | {"--" + n.replace("_", "-") for n in DEMO_SETTINGS}
    assert "--upstream" not in text  # the demo runs its own
    assert "pip install 'mcpresume[demo]'" in text


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text("window_events = = 3\n")
    with pytest.raises(SettingsError) as info:
        load_settings({}, str(config))
    assert str(info.value).startswith(f"config: {config}: ")
    assert "\n" not in str(info.value)


def test_environment_variables_that_match_no_setting_are_named_with_the_closest_setting() -> None:
    from mcpresume.process.config import unknown_variables

    environ = {
        "MCPRESUME_WINDOW_EVENT": "3",  # a typo
        "MCPRESUME_LOGFORMAT": "json",
        "MCPRESUME_ZZZ": "1",  # nothing close
        "MCPRESUME_PORT": "1",  # a setting
        "mcpresume_host": "::",  # a setting too: the variables are read case-insensitively
        "MCPRESUME_CONFIG": "/etc/m.toml",  # the file, not a setting
        "HOME": "/root",
    }
    assert unknown_variables(environ) == [
        "environment: MCPRESUME_LOGFORMAT matches no setting and is ignored; did you mean "
        "MCPRESUME_LOG_FORMAT?",
        "environment: MCPRESUME_WINDOW_EVENT matches no setting and is ignored; did you mean "
        "MCPRESUME_WINDOW_EVENTS?",
        "environment: MCPRESUME_ZZZ matches no setting and is ignored",
    ]


def test_help_shows_the_choices_of_a_setting_that_has_them() -> None:
    text = _help("serve")
    assert "--log-format {text,json}" in text
    assert "--log-level {debug,info,warning,error}" in text
    assert "--overflow {evict,pause}" in text
    assert "--window-events VALUE" in text


def test_the_demo_transcript_is_not_interleaved_with_log_lines() -> None:
    """Its stdout and stderr together, as a terminal shows them: the transcript whole, then the log lines."""
    done = subprocess.run(
        [sys.executable, "-m", "mcpresume", "demo", "--once", "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=True,
        env={**_clean_env(), "PYTHONUNBUFFERED": "1"},
    )
    lines = done.stdout.splitlines()
    logged = [i for i, line in enumerate(lines) if re.match(r"^\d{4}-\d\d-\d\d \S+ (INFO|WARNING) ", line)]
    first = lines.index("== 1. The official MCP SDK client, through the proxy ==")
    heading = lines.index("== What the proxy logged meanwhile (the access log: one line per request) ==")
    counters = lines.index("== Metric counters ==")
    assert first < counters < heading
    assert logged and all(i > heading for i in logged)  # none inside the transcript
    assert any("mcpresume.access" in lines[i] and "reattached" in lines[i] for i in logged)
