"""Drive the OFFICIAL MCP SDK client (v2) against a URL, in the handshake era (``initialize``, 2025-11-25).

No ``server/discover`` probe is used: `ClientSession.initialize` offers ``LATEST_HANDSHAKE_VERSION``
(2025-11-25); after it, every request carries ``MCP-Protocol-Version: 2025-11-25`` and ``Mcp-Session-Id``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import mcp_types as types
from mcp.client.session import ClientSession, IncomingMessage, MessageHandlerFnT
from mcp.client.streamable_http import streamable_http_client

__all__ = [
    "HANDSHAKE_VERSION",
    "NotificationLog",
    "Progress",
    "ProgressCall",
    "call_with_progress",
    "count_slowly",
    "result_text",
    "sdk_session",
]

HANDSHAKE_VERSION = "2025-11-25"

Progress = tuple[float, float | None, str | None]
"""One progress callback invocation: ``(progress, total, message)``."""


@asynccontextmanager
async def sdk_session(
    url: str,
    *,
    message_handler: MessageHandlerFnT | None = None,
    read_timeout_seconds: float | None = None,
    http_client: httpx2.AsyncClient | None = None,
    terminate_on_close: bool = True,
) -> AsyncIterator[ClientSession]:
    """An initialized `ClientSession` over ``streamable_http_client(url)``.

    On exit the SDK sends ``DELETE`` for the session (unless ``terminate_on_close=False``) and closes its
    standalone GET stream. ``read_timeout_seconds`` bounds each request (the SDK default is no bound; its
    default HTTP client has a 300 s read timeout). ``session.initialize_result`` holds the handshake result.
    """
    async with (
        streamable_http_client(url, http_client=http_client, terminate_on_close=terminate_on_close) as (
            read,
            write,
        ),
        ClientSession(
            read, write, read_timeout_seconds=read_timeout_seconds, message_handler=message_handler
        ) as session,
    ):
        await session.initialize()
        yield session


def result_text(result: types.CallToolResult) -> str:
    """The concatenated text of a tool result's ``TextContent`` blocks."""
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


@dataclass
class ProgressCall:
    """A finished ``tools/call`` and the progress notifications the SDK delivered for it, in arrival order."""

    result: types.CallToolResult
    progress: list[Progress]

    @property
    def text(self) -> str:
        return result_text(self.result)


async def call_with_progress(
    session: ClientSession,
    name: str,
    arguments: dict[str, Any] | None = None,
    *,
    read_timeout_seconds: float | None = None,
) -> ProgressCall:
    """``session.call_tool(name, arguments)`` with a progress callback that records every notification.

    In the v2 SDK, passing ``progress_callback`` makes the dispatcher put ``_meta.progressToken`` (= the
    request id) on the request and route matching ``notifications/progress`` to the callback as
    ``await callback(progress, total, message)``. Each call is spawned as a task in arrival order and this
    callback does not await, so the list is in wire order and complete once ``call_tool`` returns.
    """
    seen: list[Progress] = []

    # Parameter names matter: the SDK's `ProgressFnT` protocol is (progress, total, message).
    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    result = await session.call_tool(
        name, arguments, read_timeout_seconds=read_timeout_seconds, progress_callback=on_progress
    )
    return ProgressCall(result, seen)


async def count_slowly(
    session: ClientSession,
    n: int = 5,
    delay: float = 0.05,
    *,
    tool: str = "count_slowly",
    read_timeout_seconds: float | None = None,
) -> ProgressCall:
    """Call the example upstream's ``count_slowly`` (or ``poll_me``, via ``tool=``); collect its progress."""
    return await call_with_progress(
        session, tool, {"n": n, "delay": delay}, read_timeout_seconds=read_timeout_seconds
    )


@dataclass
class NotificationLog:
    """A ``message_handler`` that records what the SDK surfaces: server notifications and transport errors."""

    notifications: list[types.ServerNotification] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)

    async def __call__(self, message: IncomingMessage) -> None:
        if isinstance(message, Exception):
            self.errors.append(message)
        else:
            self.notifications.append(message)

    def methods(self) -> list[str]:
        return [n.method for n in self.notifications]
