"""Bounded polling, for what the code under test offers no event to await (a background pump finishing, a
counter moving): every test file polls through this one helper."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 10.0,
    what: str = "the condition",
    every: float = 0.01,
) -> None:
    """Wait until ``condition()`` (a value, or an awaitable of one) holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(every)
