"""config/mcpresume.toml documents every setting at its default: it must never drift from
process/config.py."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from mcpresume.process.config import Settings, SettingsError, load_settings

CONFIG_FILE = Path(__file__).resolve().parent.parent / "config" / "mcpresume.toml"
EXAMPLE_UPSTREAM = "http://127.0.0.1:8000/mcp"


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Environment variables outrank the file: clear any MCPRESUME_* so only the file and defaults count.
    for name in list(os.environ):
        if name.startswith("MCPRESUME_"):
            monkeypatch.delenv(name)


def _defaults() -> dict[str, object]:
    return {
        name: field.get_default(call_default_factory=True) for name, field in Settings.model_fields.items()
    }


def test_file_loads_with_defaults_except_upstream() -> None:
    settings = load_settings({}, str(CONFIG_FILE))
    loaded = settings.model_dump()
    expected = _defaults() | {"upstream": EXAMPLE_UPSTREAM}
    assert loaded == expected
    # Same types as the defaults too (300 vs 300.0 compare equal; the file should still say 300.0).
    parsed = tomllib.loads(CONFIG_FILE.read_text())
    for name, value in parsed.items():
        default = _defaults()[name]
        if default is not None:
            assert type(value) is type(default), f"{name}: {value!r} in the file, default {default!r}"


def test_every_setting_is_in_the_file() -> None:
    text = CONFIG_FILE.read_text()
    parsed = tomllib.loads(text)
    fields = Settings.model_fields
    assert set(parsed) <= set(fields), f"unknown keys in the file: {set(parsed) - set(fields)}"
    for name, field in fields.items():
        if field.default is None and name != "upstream":
            # TOML has no null: a setting whose default is "unset" is shown commented out.
            assert name not in parsed, f"{name}: default is unset, so the file must leave it commented out"
            assert re.search(rf"^# {name} = ", text, re.MULTILINE), f"{name}: missing from {CONFIG_FILE}"
        else:
            assert name in parsed, f"{name}: missing from {CONFIG_FILE}"


def test_every_setting_has_a_comment() -> None:
    lines = CONFIG_FILE.read_text().splitlines()
    for name in Settings.model_fields:
        index = next((i for i, line in enumerate(lines) if re.match(rf"^(# )?{name} = ", line)), None)
        assert index, f"{name}: missing from {CONFIG_FILE}"
        above = lines[index - 1]
        assert above.startswith("# ") and not re.match(r"^# \w+ = ", above), (
            f"{name}: no description comment directly above it"
        )


def test_credential_headers_are_header_names_in_lower_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCPRESUME_CREDENTIAL_HEADERS", "Authorization, X-Tenant-Token,authorization")
    assert load_settings({}).credential_headers == ["authorization", "x-tenant-token"]
    assert load_settings({"credential_headers": []}).credential_headers == []
    for bad in (["Authorization: Bearer"], ["x api key"], [""]):
        with pytest.raises(SettingsError, match="credential_headers"):
            load_settings({"credential_headers": bad})
