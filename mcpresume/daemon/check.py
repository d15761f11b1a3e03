"""``mcpresume check-config``: the settings as ``serve`` would load them, then what they name, reached.

Each problem is one line; none means the proxy would start and find both its neighbours:

* the settings: loaded as ``serve`` loads them (flags, environment, file), each invalid one a line; the
  ones that cannot serve together (``upstream`` missing, a Redis store without ``advertise_url``);
* the upstream: one HTTP request to its URL, whose answer, any status (an MCP endpoint answers a bare GET
  with 400, 405 or 406), shows that something speaks HTTP there;
* the store: with Redis, a write of the store's own readiness key (what ``/readyz`` asks: it proves Redis
  answers and takes writes, where a PING would pass at ``maxmemory``); the memory store has nothing to
  reach.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from mcpresume.core.errors import StoreUnavailable
from mcpresume.process.config import Settings, SettingsError, check_advertise_url

# How long the upstream's answer head may take once connected: a check, not a call (first_byte_timeout is
# the time a tool call may take to begin its answer).
HEAD_WAIT: Final = 10.0


def settings_problems(settings: Settings) -> list[str]:
    """What keeps loaded settings from serving."""
    problems = []
    if settings.upstream is None:
        problems.append("upstream: required for serve (--upstream URL or MCPRESUME_UPSTREAM)")
    try:
        check_advertise_url(settings.store, settings.advertise_url)
    except SettingsError as exc:
        problems.extend(exc.problems)
    return problems


async def upstream_problem(settings: Settings) -> str | None:
    """None when the upstream's URL answers HTTP (any status); else a line saying what failed."""
    url = settings.upstream
    assert url is not None
    timeout = aiohttp.ClientTimeout(sock_connect=settings.connect_timeout, sock_read=HEAD_WAIT)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(url, headers={"Accept": "application/json, text/event-stream"}) as response,
        ):
            response.close()  # the head is enough (an SSE stream would never end)
            return None
    except TimeoutError:
        return f"upstream: {url} did not answer within {settings.connect_timeout + HEAD_WAIT:.0f} s"
    except aiohttp.ClientError as exc:
        return f"upstream: {url} is not reachable: {type(exc).__name__}: {exc}"
    except OSError as exc:
        return f"upstream: {url} is not reachable: {exc.strerror or exc}"


async def store_problem(settings: Settings) -> str | None:
    """None when the store takes a write (the memory store: always); else a line naming it (no password)."""
    if settings.store == "memory":
        return None
    from mcpresume.daemon.app import build_store

    try:
        store = build_store(settings)
    except NotImplementedError as exc:  # the redis extra is not installed
        return str(exc)
    shown = without_password(settings.store)
    try:
        await store.start()
        if await store.ready():
            return None
        return f"store: {shown} did not take a write (down, unreachable, refused the password, or full)"
    except (StoreUnavailable, OSError) as exc:
        return f"store: {shown} is not reachable: {exc}"
    finally:
        with contextlib.suppress(Exception):
            await store.close()


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


async def check(settings: Settings) -> list[str]:
    """Every problem of loaded settings: their own, then the upstream's and the store's (asked together)."""
    problems = settings_problems(settings)
    if settings.upstream is None:
        return problems
    reached = await asyncio.gather(upstream_problem(settings), store_problem(settings))
    return problems + [problem for problem in reached if problem is not None]
