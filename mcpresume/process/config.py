"""Settings: the only module that imports pydantic-settings.

Sources, highest precedence first: command-line flags, ``MCPRESUME_<NAME>`` environment variables, a TOML
file (``--config FILE`` or ``MCPRESUME_CONFIG``), then the defaults below. ``config/mcpresume.toml``
documents every setting; keep it in step with this class.
"""

from __future__ import annotations

import difflib
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mcpresume.core.credentials import DEFAULT_CREDENTIAL_HEADERS

MiB = 1 << 20


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MCPRESUME_", extra="forbid", validate_default=True)

    # -- where ------------------------------------------------------------------------------------------
    upstream: str | None = Field(None, description="URL of the upstream MCP endpoint (required for serve)")
    host: str = Field("127.0.0.1", description="address the proxy listens on")
    port: int = Field(8080, ge=0, le=65535, description="port the proxy listens on (0: any free port)")
    metrics_host: str | None = Field(
        None, description="address of the admin listener (none: the same as host)"
    )
    metrics_port: int = Field(9464, ge=0, le=65535, description="admin listener port; 0 disables it")

    # -- the window (per session) ------------------------------------------------------------------------
    window_events: int = Field(256, ge=1, description="most events retained per session")
    window_bytes: int = Field(
        4 * MiB, ge=1024, description="most event bytes retained per session (SSE events, id lines aside)"
    )
    window_ttl: float = Field(300.0, gt=0, description="seconds an event stays resumable")

    # -- sessions ----------------------------------------------------------------------------------------
    session_ttl: float = Field(300.0, gt=0, description="seconds an idle session is kept")
    max_sessions: int = Field(
        10_000, ge=1, description="most sessions tracked; beyond it initialize gets 503"
    )
    cancel_grace: float = Field(
        5.0,
        ge=0,
        description="seconds a stream whose requests the client all cancelled stays open unread before "
        "the proxy closes it upstream",
    )
    store: str = Field(
        "memory", description="'memory' (this process), or a redis://, rediss:// or unix:// URL (shared)"
    )
    store_outage_grace: float = Field(
        10.0, gt=0, description="seconds a pump holds its upstream while the shared store is down"
    )

    # -- several replicas (a shared store) ----------------------------------------------------------------
    advertise_url: str | None = Field(
        None,
        description="URL at which the other replicas reach this proxy's MCP endpoint, e.g. "
        "http://POD_IP:8080/mcp (required with a redis:// store)",
    )
    owner_lease_ttl: float = Field(
        10.0, gt=0, description="seconds this replica's lease lives unrenewed (renewed every third of it)"
    )

    # -- clients -----------------------------------------------------------------------------------------
    replica_id: str = Field(
        "", description="this replica's name in a shared store (empty: the host name, the pod's)"
    )
    stall_timeout: float = Field(30.0, gt=0, description="seconds a client may not drain before detach")
    overflow: Literal["evict", "pause"] = Field(
        "evict", description="while no client reads a full window: evict the oldest, or pause the upstream"
    )
    # Views: every SSE response of the session open now (one per POST answered with SSE, the standalone
    # GET's, re-attaches). Streams: POST streams being read from the upstream, and requests in flight. A
    # client runs each concurrent call on a POST stream of its own next to its standalone GET, so the
    # views default to the streams' limit plus that GET and a few re-attaches.
    max_attached_per_session: int = Field(72, ge=1, description="most client views open per session (429)")
    max_streams_per_session: int = Field(64, ge=1, description="most live POST streams per session (429)")
    max_total_window_bytes: int = Field(512 * MiB, ge=1024, description="most window bytes, all sessions")
    retry_ms: int = Field(1000, ge=0, description="SSE retry: hint sent to clients (milliseconds)")
    resume_notification: bool = Field(
        False, description="also send notifications/mcpresume/resumed on a re-attach"
    )
    bridge: Literal["auto", "off"] = Field(
        "auto",
        description="auto: give handshake-era clients sessions and resumption in front of an upstream that "
        "refuses the handshake era (2026-07-28 only); off: never",
    )
    max_body_bytes: int = Field(4 * MiB, ge=1024, description="largest client POST body to the MCP endpoint")
    body_timeout: float = Field(
        30.0, gt=0, description="seconds a client may take to send a request body (408)"
    )
    max_header_bytes: int = Field(16384, ge=1024, description="largest total of request header bytes (431)")
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a connection may take to send a complete request head (closed)"
    )
    max_connections: int = Field(
        4096, ge=1, description="most client connections open at once (503 beyond; fitted to the fd limit)"
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origin values accepted, every path (empty: any)"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host values accepted, every path; no port: any port; '*': any (empty: loopback "
        "names when listening on loopback, else those and IP addresses: no DNS name)",
    )
    credential_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_CREDENTIAL_HEADERS),
        description="request headers that carry credentials; a session is served only to those the "
        "upstream accepted in it (empty: no check)",
    )

    # -- upstream ----------------------------------------------------------------------------------------
    connect_timeout: float = Field(10.0, gt=0, description="seconds to connect to the upstream")
    first_byte_timeout: float = Field(120.0, gt=0, description="seconds to wait for upstream headers")
    max_event_bytes: int = Field(
        4 * MiB, ge=1024, description="largest upstream SSE event, or compressed non-SSE answer inflated"
    )
    upstream_resume_attempts: int = Field(
        5, ge=0, description="attempts to resume an upstream stream without progress before giving up"
    )
    upstream_session_lost: Literal["end", "reinitialize"] = Field(
        "end",
        description="an upstream that lost a session (404 in it): end it (404 upstream_session_lost), or "
        "keep what it takes to begin it again upstream (the initialize, the shaping requests)",
    )
    credential_wait: float = Field(
        60.0,
        ge=0,
        description="seconds a stream whose upstream resume was refused 401/403 waits for a client of the "
        "session to bring credentials the upstream accepts (and, under upstream_session_lost = "
        "reinitialize, a standalone stream whose upstream lost the session waits for a request of the "
        "session to begin it again)",
    )

    # -- durable long calls (tasks, 2026-07-28 clients that declare the extension) -----------------------
    tasks: bool = Field(
        True,
        description="turn a long 2026-07-28 tools/call into a task (io.modelcontextprotocol/tasks) when its "
        "client declared the extension and the upstream answers with none",
    )
    task_after: float = Field(
        10.0, gt=0, description="seconds a call may run before the client gets a task handle instead"
    )
    task_ttl: float = Field(
        3600.0, gt=0, description="seconds a task and its result are kept from the task's creation"
    )

    # -- operations --------------------------------------------------------------------------------------
    drain_timeout: float = Field(10.0, ge=0, description="seconds to let POST streams finish on shutdown")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="log line format")
    access_log: bool = Field(True, description="one line per request (logger mcpresume.access, at info)")
    inspect_token: str = Field(
        "",
        description="a token that turns the session inspector on (GET /sessions on the admin port, "
        "Authorization: Bearer TOKEN; empty: off)",
    )
    ready_on_upstream: bool = Field(
        False,
        description="/readyz also needs the upstream to answer HTTP (a sidecar's pod then leaves the "
        "balancer while its upstream is down)",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("allowed_origins", "allowed_hosts", "credential_headers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        # Flags and environment variables give one comma-separated string; TOML gives a list.
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("credential_headers")
    @classmethod
    def _header_names(cls, value: list[str]) -> list[str]:
        names = [name.lower() for name in value]
        for name in names:
            if not name or any(c in name for c in ' \t:()<>@,;\\"/[]?={}') or not name.isascii():
                raise ValueError(f"{name!r} is not a header name")
        return list(dict.fromkeys(names))  # each once, in the order given

    @property
    def replica(self) -> str:
        """This replica's name: ``replica_id``, else the host name."""
        return self.replica_id or socket.gethostname()

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("advertise_url")
    @classmethod
    def _check_advertise_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("must have no query or fragment")
        if parts.hostname in _UNREACHABLE_HOSTS:
            raise ValueError("must name an address the other replicas reach, not a wildcard listen address")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
            # redis-py parses these three itself; no other scheme (redis+sentinel:// included) is invented.
            raise ValueError("must be 'memory' or a redis://, rediss:// or unix:// URL")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file comes from ``model_config["toml_file"]``, set by ``load_settings`` on a subclass.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


class SettingsError(Exception):
    """A setting is invalid: the message is one line naming the setting and the problem; ``problems``, one
    line per problem (``mcpresume check-config`` prints them so)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


# Listen-on-everything addresses: valid for ``host``, never an address another replica can connect to.
_UNREACHABLE_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


def check_advertise_url(store: str, advertise_url: str | None) -> None:
    """At start-up: a shared store needs the URL at which the other replicas reach this one (requests of
    its sessions are forwarded there), and there is no default that would be right in a cluster."""
    if store != "memory" and advertise_url is None:
        raise SettingsError(
            "advertise_url: required when store is a Redis URL (the URL at which the other replicas "
            "reach this proxy's MCP endpoint, e.g. http://$POD_IP:8080/mcp; env MCPRESUME_ADVERTISE_URL)"
        )


def load_settings(cli: dict[str, Any], config_file: str | None = None) -> Settings:
    """Build the settings from flags (``cli``, only those given), env, the TOML file and defaults."""
    path = config_file or os.environ.get("MCPRESUME_CONFIG")
    if path and not Path(path).is_file():
        raise SettingsError(f"config: file not found: {path}")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=Path(path) if path else None)

    try:
        return FileSettings(**cli)
    except ValidationError as exc:
        problems = _problems(exc)
        raise SettingsError("; ".join(problems), problems) from None
    except (ValueError, OSError) as exc:  # a TOML syntax error, an unreadable file: which file says where
        raise SettingsError(f"config: {path}: {exc}" if path else f"config: {exc}") from None


# The variables of the prefix that name no setting but mean something.
OTHER_VARIABLES: frozenset[str] = frozenset({"MCPRESUME_CONFIG", "MCPRESUME_ADMIN_URL"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each ``MCPRESUME_*`` environment variable that matches no setting (a typo is otherwise
    ignored in silence), with the closest name there is."""
    known = {f"MCPRESUME_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    lines = []
    for variable in sorted(environ):
        name = variable.upper()  # the variables are read case-insensitively
        if not name.startswith("MCPRESUME_") or name in known:
            continue
        # Compared without the prefix, which every name shares: it would make any two look alike.
        closest = difflib.get_close_matches(name[10:], sorted(k[10:] for k in known), n=1, cutoff=0.6)
        hint = f"; did you mean MCPRESUME_{closest[0]}?" if closest else ""
        lines.append(f"environment: {variable} matches no setting and is ignored{hint}")
    return lines


def _problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        problems.append(f"{name}: {message} (got {error.get('input')!r})")
    return problems
