"""The command line: ``mcpresume serve``, ``check-config``, ``demo``, ``--version``.

Every setting is a flag with the setting's name in dashes (``--window-events``); only the flags given on
the command line are passed on, so the precedence CLI > env > file > defaults holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Literal, get_args, get_origin

from mcpresume import __version__
from mcpresume.process.config import Settings, SettingsError, load_settings, unknown_variables

log = logging.getLogger("mcpresume")


# Where ``mcpresume sessions`` reads the inspector: the admin listener's defaults.
DEFAULT_ADMIN_URL = "http://127.0.0.1:9464"

# The settings ``mcpresume demo`` uses (it runs its own upstream; the rest keep their defaults).
DEMO_SETTINGS = (
    "host",
    "port",
    "metrics_host",
    "metrics_port",
    "window_events",
    "log_level",
    "log_format",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcpresume",
        description="A reverse proxy that makes MCP Streamable HTTP streams resumable.",
        epilog="Every setting is also an MCPRESUME_<NAME> environment variable or a line of the TOML file;"
        " precedence: flag > environment > file > default.",
    )
    parser.add_argument("--version", action="version", version=f"mcpresume {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the proxy in front of an upstream MCP server",
        description="Run the proxy in front of an upstream MCP server (--upstream).",
    )
    check = commands.add_parser(
        "check-config",
        help="check the settings, and reach the upstream and the store; exit 0 or 2",
        description="Load the settings as serve would (the same flags, environment and file), then reach the"
        " upstream (any HTTP answer) and the store (Redis: a write). One line per problem; exit 0 when there"
        " is none, else 2.",
    )
    sessions = commands.add_parser(
        "sessions",
        help="list the sessions, or show one, through the admin port's session inspector",
        description="Read the session inspector of a running proxy (its inspect_token set): the sessions"
        " (a page), or one by its id or its 10-character hash (the one in the logs).",
    )
    sessions.add_argument("ref", nargs="?", metavar="SESSION", help="a session id or its 10-character hash")
    sessions.add_argument(
        "--admin-url",
        default=os.environ.get("MCPRESUME_ADMIN_URL", DEFAULT_ADMIN_URL),
        help=f"the admin listener [default: {DEFAULT_ADMIN_URL}; env MCPRESUME_ADMIN_URL]",
    )
    sessions.add_argument(
        "--token",
        default=os.environ.get("MCPRESUME_INSPECT_TOKEN", ""),
        help="the proxy's inspect_token [env MCPRESUME_INSPECT_TOKEN]",
    )
    sessions.add_argument("--offset", type=int, default=0, help="the page's first session [default: 0]")
    sessions.add_argument("--limit", type=int, default=50, help="sessions per page [default: 50]")
    sessions.add_argument("--json", action="store_true", help="the inspector's JSON as it answered")
    demo = commands.add_parser(
        "demo",
        help="run a bundled example upstream behind the proxy and show resumption",
        description="Run a bundled example upstream behind the proxy and show resumption"
        " (needs: pip install 'mcpresume[demo]').",
    )
    demo.add_argument(
        "--once", action="store_true", help="exit after the demo instead of serving until Ctrl-C"
    )
    every = tuple(Settings.model_fields)
    for sub, names in ((serve, every), (check, every), (demo, DEMO_SETTINGS)):
        sub.add_argument(
            "--config", metavar="FILE", help="TOML settings file [default: none; env MCPRESUME_CONFIG]"
        )
        for name in names:
            field = Settings.model_fields[name]
            flag = "--" + name.replace("_", "-")
            help_text = f"{field.description} [{_default_and_env(name)}]".replace("%", "%%")
            if field.annotation is bool:
                sub.add_argument(
                    flag,
                    dest=name,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            else:
                sub.add_argument(
                    flag,
                    dest=name,
                    default=argparse.SUPPRESS,
                    metavar=_metavar(field.annotation),
                    help=help_text,
                )
    return parser


def _metavar(annotation: Any) -> str:
    """What a flag takes: a Literal setting's choices (``{text,json}``), else VALUE."""
    if get_origin(annotation) is Literal:
        return "{" + ",".join(str(choice) for choice in get_args(annotation)) + "}"
    return "VALUE"


def _default_and_env(name: str) -> str:
    """``default: 8080; env MCPRESUME_PORT``: what a flag's help ends with."""
    field = Settings.model_fields[name]
    default = field.get_default(call_default_factory=True)
    if default is None:
        shown = "none"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, list):
        shown = ",".join(default) or "empty"
    else:
        shown = str(default)
    return f"default: {shown}; env MCPRESUME_{name.upper()}"


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# The attributes every log record has: any other one came from ``extra=`` (an access line's fields).
_RECORD_ATTRIBUTES: frozenset[str] = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the fields a line was logged with
    (``extra=``) as fields of their own."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _RECORD_ATTRIBUTES and name not in line:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return 2
    config_file = args.pop("config", None)
    once = args.pop("once", False)
    if command == "check-config":
        return check_config(args, config_file)
    if command == "sessions":
        return show_sessions(args)
    try:
        settings = load_settings(args, config_file)
        if command == "serve" and settings.upstream is None:
            raise SettingsError("upstream: required for serve (--upstream URL or MCPRESUME_UPSTREAM)")
    except SettingsError as exc:
        print(f"mcpresume: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    for line in unknown_variables(os.environ):
        log.warning("%s", line)
    _use_uvloop()
    if command == "serve":
        return asyncio.run(serve(settings))
    try:
        from mcpresume.daemon.demo import run_demo  # imports the optional MCP SDK: only for the demo
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in DEMO_EXTRA:
            raise
        print(
            f"mcpresume: the demo needs the demo extra ({exc.name} is not installed):"
            " pip install 'mcpresume[demo]'",
            file=sys.stderr,
        )
        return 2
    from mcpresume.daemon.app import ListenError

    try:
        return asyncio.run(run_demo(settings, once=once))
    except ListenError as exc:
        print(f"mcpresume: {exc}", file=sys.stderr)
        return 2


def show_sessions(args: dict[str, Any]) -> int:
    """``mcpresume sessions [SESSION]``: 0 with what the inspector answered; 1 for an unknown session; 2
    when it cannot be read (unreachable, off, or the token refused)."""
    import aiohttp

    from mcpresume.daemon.inspector import read, table

    ref = args["ref"]
    try:
        status, body = asyncio.run(read(args["admin_url"], args["token"], ref, args["offset"], args["limit"]))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"mcpresume: cannot read the inspector at {args['admin_url']}: {exc}", file=sys.stderr)
        return 2
    if status != 200:
        print(f"mcpresume: {body.get('error', status)}", file=sys.stderr)
        return 1 if status == 404 and ref else 2
    if args["json"] or ref:
        print(json.dumps(body, indent=2))
    else:
        print("\n".join(table(body)))
    return 0


def check_config(args: dict[str, Any], config_file: str | None) -> int:
    """``mcpresume check-config``: each problem one line on stderr, exit 2; else one line on stdout, 0."""
    from mcpresume.daemon.check import check

    try:
        settings = load_settings(args, config_file)
    except SettingsError as exc:
        problems = exc.problems
    else:
        configure_logging("error", settings.log_format)  # the lines below say it all
        problems = asyncio.run(check(settings))
    problems = problems + unknown_variables(os.environ)
    for problem in problems:
        print(f"mcpresume: {problem}", file=sys.stderr)
    if problems:
        return 2
    from mcpresume.daemon.check import without_password

    store = "memory" if settings.store == "memory" else f"{without_password(settings.store)} takes writes"
    print(f"mcpresume: configuration ok: the upstream {settings.upstream} answers; store {store}")
    return 0


# The top-level modules of the demo extra's packages (pyproject.toml: demo = ["mcp", "uvicorn"]) and of
# what they bring.
DEMO_EXTRA = frozenset({"mcp", "uvicorn", "starlette", "sse_starlette", "httpx", "httpx2", "anyio"})


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is optional (no wheels on some platforms); asyncio's loop works too
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def freeze_long_lived() -> int:
    """Move everything allocated so far (modules, the app, the upstream client: it lives as long as the
    process) out of the cyclic collector's sight, so a full collection walks only what serving allocates.
    A fresh proxy's full collection takes ~7 ms; one under the latency benchmark stalled the loop 23 ms,
    and 0.3 ms with this. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(settings: Settings) -> int:
    from mcpresume.daemon.app import ListenError, start_proxy
    from mcpresume.replicas.lease import DuplicateReplica

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        proxy = await start_proxy(settings)
    except (ListenError, SettingsError, NotImplementedError, DuplicateReplica) as exc:  # a port in use;
        # settings that cannot serve together; the Redis store without its extra installed; another live
        # process with this replica id
        print(f"mcpresume: {exc}", file=sys.stderr)
        return 2
    freeze_long_lived()
    log.info("mcpresume %s: %s -> %s (store %s)", __version__, proxy.url, settings.upstream, settings.store)
    if proxy.admin_url:
        log.info("admin: %s/metrics %s/healthz %s/readyz", proxy.admin_url, proxy.admin_url, proxy.admin_url)
    await stop.wait()
    log.info("draining (up to %.0f s)", settings.drain_timeout)
    await proxy.stop()
    log.info("stopped")
    return 0
