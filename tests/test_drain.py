"""The drain (``mcpresume.process.drain``): a view ended by its flag, an await interrupted, the order of its
steps.

The drain as an operator sees it (SIGTERM, readyz, streams that finish or re-attach) is tested over real
HTTP in ``tests/test_lifecycle.py``, ``tests/test_routing.py`` and ``tests/test_hop.py``.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from mcpresume.core.errors import ShuttingDown
from mcpresume.core.session import NewEvent, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.http.context import ProxyContext
from mcpresume.http.view import ClientWriter, ViewEnd, follow
from mcpresume.process.drain import Drain, Interrupted
from mcpresume.process.local import LocalSessions
from mcpresume.store.memory import MemoryStore
from tests.support.transport import BufferedTransport

HANG_GUARD = 10.0  # a drain that fails to end something hangs: this turns it into a failure


class _Client:
    """A client response that takes every write at once."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.wrote = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.wrote.set()


async def _parked_view(drain: Drain, *, standalone: bool) -> tuple[asyncio.Task[Any], LocalSessions]:
    """A view (``follow``) of a stream with one event, under ``drain``: it sent the event and waits."""
    store = MemoryStore(WindowLimits(64, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None)
    local = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    body = frame_body(b'{"jsonrpc":"2.0","method":"m"}')
    await store.append("s", opened.number, [NewEvent(body, EventKind.MESSAGE)], now=0.0)
    client = _Client()
    writer = ClientWriter(client, BufferedTransport(), 30.0)  # type: ignore[arg-type]

    async def view() -> Any:
        with drain.view(standalone, local.news, "s") as flag:
            return await follow(
                writer,
                store,
                local,
                "s",
                [opened.number],
                opened.priming_seq,  # after the priming event: the message is sent
                replay_through=0,
                view=flag,
            )

    task = asyncio.ensure_future(view())
    async with asyncio.timeout(HANG_GUARD):
        await client.wrote.wait()
        while len(local.news) == 0:  # until it parks for news
            await asyncio.sleep(0)
    return task, local


async def test_a_drain_ends_a_waiting_view_by_its_flag_not_by_cancelling_it() -> None:
    drain = Drain()
    task, _ = await _parked_view(drain, standalone=False)
    assert drain.end_views(standalone_only=True) == 0  # not standalone: it waits for the deadline
    assert drain.end_views() == 1
    async with asyncio.timeout(HANG_GUARD):
        outcome = await task
    assert (outcome.reason, outcome.sent) == (ViewEnd.DRAINING, 1)
    assert task.cancelling() == 0  # never cancelled: woken, it saw its flag
    assert drain.end_views() == 0  # ended once


async def test_a_standalone_view_ends_at_the_drains_start() -> None:
    drain = Drain()
    task, _ = await _parked_view(drain, standalone=True)
    assert drain.end_views(standalone_only=True) == 1
    async with asyncio.timeout(HANG_GUARD):
        assert (await task).reason is ViewEnd.DRAINING


async def test_a_view_opened_after_the_deadline_sends_what_is_there_then_ends() -> None:
    drain = Drain()
    drain.begin(0.0)
    drain.end_views()  # the deadline came
    assert drain.ends_at_once(standalone=False)
    with drain.view(False, LocalSessions().news, "s") as view:
        assert view.ending
    assert drain.end_views() == 0  # it was never registered: nothing to end


async def test_an_interrupted_block_raises_interrupted_and_takes_the_cancellation_back() -> None:
    drain = Drain()
    entered = asyncio.Event()

    async def waiting() -> str:
        try:
            with drain.interruptible(standalone=True):
                entered.set()
                await asyncio.get_running_loop().create_future()  # an answer that never comes
        except Interrupted:
            return "interrupted"
        return "finished"

    task = asyncio.ensure_future(waiting())
    await entered.wait()
    assert drain.end_views(standalone_only=True) == 1
    async with asyncio.timeout(HANG_GUARD):
        assert await task == "interrupted"
    assert task.cancelling() == 0


async def test_a_cancellation_that_is_not_the_drains_goes_through() -> None:
    drain = Drain()
    entered = asyncio.Event()

    async def waiting() -> None:
        with drain.interruptible(standalone=False):
            entered.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.ensure_future(waiting())
    await entered.wait()
    task.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    assert drain.end_views() == 0  # it left the drain's registry with its block


async def test_nested_blocks_are_interrupted_once_the_inner_one() -> None:
    drain = Drain()
    entered = asyncio.Event()
    seen: list[str] = []

    async def waiting() -> None:
        with drain.interruptible(standalone=False):  # as Drain.upstream_wait around a hop
            try:
                with drain.interruptible(standalone=False):  # the hop's relay
                    entered.set()
                    await asyncio.get_running_loop().create_future()
            except Interrupted:
                seen.append("inner")
            assert drain.end_views() == 0  # the outer block ended with the inner one
            seen.append("outer goes on")

    task = asyncio.ensure_future(waiting())
    await entered.wait()
    assert drain.end_views() == 1
    async with asyncio.timeout(HANG_GUARD):
        await task
    assert seen == ["inner", "outer goes on"]


async def test_an_upstream_wait_the_drain_ends_is_shutting_down() -> None:
    drain = Drain()
    entered = asyncio.Event()

    async def waiting() -> None:
        with drain.upstream_wait():
            entered.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.ensure_future(waiting())
    await entered.wait()
    drain.end_views()
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(task, HANG_GUARD)


def _recording_context(steps: list[str], drain: Drain, *, lease: bool, owns_store: bool) -> ProxyContext:
    """A real ``ProxyContext`` (what ``Drain.run`` closes, ``drain.Closing``) over parts that each note
    when they are called."""

    async def note(step: str, *_: Any, **__: Any) -> None:
        steps.append(step)

    part = types.SimpleNamespace
    return ProxyContext(
        settings=part(drain_timeout=0.0),  # type: ignore[arg-type]
        store=part(close=lambda: note("store closed")),  # type: ignore[arg-type]
        metrics=part(),  # type: ignore[arg-type]
        upstream=part(close=lambda: note("upstream closed")),  # type: ignore[arg-type]
        clock=lambda: 0.0,
        pumps=part(drain=lambda within, *, hand_over: note(f"pumps (hand over: {hand_over})")),  # type: ignore[arg-type]
        hop=part(close=lambda: note("hop closed")) if lease else None,  # type: ignore[arg-type]
        lease=part(stop=lambda: note("lease released")) if lease else None,  # type: ignore[arg-type]
        drain=drain,
        owns_store=owns_store,
    )


@pytest.mark.parametrize("shared", [False, True])
async def test_the_steps_run_in_order(shared: bool) -> None:
    drain = Drain()
    steps: list[str] = []
    ctx = _recording_context(steps, drain, lease=shared, owns_store=True)
    entered = asyncio.Event()

    async def waiting(standalone: bool) -> None:
        try:
            with drain.interruptible(standalone):
                entered.set()
                await asyncio.get_running_loop().create_future()
        except Interrupted:
            steps.append("standalone ended" if standalone else "the rest ended")

    views = [asyncio.ensure_future(waiting(standalone)) for standalone in (True, False)]
    await entered.wait()
    await asyncio.sleep(0)  # both are inside

    async def serving() -> None:
        assert drain.started  # new work is refused before the listener closes
        steps.append("serving")
        await asyncio.gather(*views)  # aiohttp waits for its handlers

    async with asyncio.timeout(HANG_GUARD):
        await drain.run(ctx, serving)
    expected = ["standalone ended", "serving", "the rest ended"]
    expected += [f"pumps (hand over: {shared})"]
    expected += ["lease released", "hop closed"] if shared else []
    expected += ["upstream closed", "store closed"]
    assert steps == expected


async def test_a_task_of_the_replicas_own_ends_before_the_pumps() -> None:
    """A takeover started beside a re-attach (``Drain.spawn``) starts pumps: the drain ends it (within what
    is left of the deadline, here none) before it ends the pumps, so none it starts escapes them."""
    drain = Drain()
    steps: list[str] = []
    ctx = _recording_context(steps, drain, lease=True, owns_store=False)

    async def takeover() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            steps.append("takeover ended")
            raise

    drain.spawn(takeover(), name="mcpresume-takeover")
    await asyncio.sleep(0)  # it runs

    async def serving() -> None:
        steps.append("serving")

    async with asyncio.timeout(HANG_GUARD):
        await drain.run(ctx, serving)
    assert steps == [
        "serving",
        "takeover ended",
        "pumps (hand over: True)",
        "lease released",
        "hop closed",
        "upstream closed",
    ]  # the store not closed: not the app's own


async def test_a_view_is_registered_only_inside_its_block_and_woken_through_its_waker_with_its_key() -> None:
    drain = Drain()
    woken: list[str] = []

    class Waker:
        def wake(self, key: str) -> None:
            woken.append(key)

    with drain.view(True, Waker(), "s1") as view:
        assert not view.ending
    assert drain.end_views() == 0  # left its block: nothing to end
    with pytest.raises(RuntimeError), drain.view(True, Waker(), "s2"):
        raise RuntimeError("the view failed")
    assert drain.end_views() == 0  # left by an error: unregistered too
    with drain.view(True, Waker(), "s3") as view:
        assert drain.end_views(standalone_only=True) == 1
        assert view.ending and woken == ["s3"]
    assert drain.end_views() == 0
