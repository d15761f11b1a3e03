"""A view's loop (``http.view.follow``) against the memory store: what it reads, and when it waits."""

from __future__ import annotations

import asyncio
import gc
import types
from collections.abc import Callable, Coroutine
from typing import Any

from mcpresume.core.session import READ_MAX_EVENTS, NewEvent, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.http.view import VIEW_ENDINGS, ClientWriter, Finish, ViewEnd, follow
from mcpresume.process.local import LocalSessions
from mcpresume.store.memory import MemoryStore
from tests.support.transport import BufferedTransport

# Long enough that a test never meets a heartbeat: a view that parks when it should read again fails by
# timing out, not by being saved by its heartbeat.
PATIENCE = 5.0


def msg(n: int) -> NewEvent:
    return NewEvent(frame_body(b'{"jsonrpc":"2.0","method":"m","params":{"n":%d}}' % n), EventKind.MESSAGE)


class _Client:
    """A client response: takes every write at once, then runs ``on_write``."""

    def __init__(self, on_write: Callable[[], object] | None = None) -> None:
        self.writes: list[bytes] = []
        self.on_write = on_write

    async def write(self, data: bytes) -> None:
        self.writes.append(data)
        if self.on_write is not None:
            await self.on_write()  # type: ignore[misc]


# Each store's process-local half, its news wired as the shell does (app.build_app).
LOCAL: dict[int, LocalSessions] = {}


async def _store_with_stream() -> tuple[MemoryStore, int, int]:
    store = MemoryStore(
        WindowLimits(4096, 64 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None
    )
    local = LOCAL[id(store)] = LocalSessions()
    store.set_news(local.changed)
    await store.create_session("s", now=0.0)
    opened = await store.open_stream("s", StreamOrigin.GET, [], now=0.0)
    assert opened is not None
    return store, opened.number, opened.priming_seq - 1


async def test_a_read_cut_at_the_limits_is_followed_by_another_read_not_a_wait() -> None:
    store, stream, after = await _store_with_stream()
    total = 2 * READ_MAX_EVENTS + 10
    await store.append("s", stream, [msg(n) for n in range(total)], now=0.0)
    await store.end_stream("s", stream, now=0.0)  # nothing changes after this: a parked view would hang
    client = _Client()
    writer = ClientWriter(client, BufferedTransport(), 30.0)  # type: ignore[arg-type]
    async with asyncio.timeout(PATIENCE):
        outcome = await follow(writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0)
    assert outcome.complete and outcome.sent == total + 1  # the priming event too
    assert len(client.writes) == 3  # 512 + 512 + the rest, each one write


async def test_events_appended_during_a_write_are_read_without_waiting_for_a_later_change() -> None:
    """No read after a write: the view waits on the version of its last read, so an append made while it
    was writing makes the wait return at once."""
    store, stream, after = await _store_with_stream()
    appended = 0

    async def append_during_write() -> None:
        nonlocal appended
        if appended < 3:
            appended += 1
            await store.append("s", stream, [msg(appended)], now=0.0)
            if appended == 3:
                await store.end_stream("s", stream, now=0.0)

    client = _Client(append_during_write)
    writer = ClientWriter(client, BufferedTransport(), 30.0)  # type: ignore[arg-type]
    async with asyncio.timeout(PATIENCE):
        outcome = await follow(writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0)
    assert outcome.complete and outcome.sent == 4  # the priming event, then one event per write after it
    assert [w.count(b"\ndata: ") for w in client.writes] == [1, 1, 1, 1]


async def test_a_parked_view_keeps_no_events_alive() -> None:
    """While it waits, a view holds its position and the session's version, not the last read (up to a
    MiB of frames the window may evict meanwhile): no bytes of an event it sent are reachable from the
    parked view, except through the store itself (which owns the window) and the client (which got them)."""
    store, stream, after = await _store_with_stream()
    await store.append("s", stream, [marked(n) for n in range(100)], now=0.0)
    client = _Client()
    writer = ClientWriter(client, BufferedTransport(), 30.0)  # type: ignore[arg-type]
    coro = follow(writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0)
    view = asyncio.ensure_future(coro)
    async with asyncio.timeout(PATIENCE):
        while not client.writes or coro.cr_await is None:
            await asyncio.sleep(0)
    assert any(MARKER in write for write in client.writes)  # the view did send them
    held = _bytes_reachable(coro, skip=[store, client, client.writes])
    assert not [b for b in held if MARKER in b]
    view.cancel()


MARKER = b"sent-then-parked"


def marked(n: int) -> NewEvent:
    return NewEvent(
        frame_body(b'{"jsonrpc":"2.0","method":"%s","params":{"n":%d}}' % (MARKER, n)), EventKind.MESSAGE
    )


def _bytes_reachable(coro: Coroutine[Any, Any, Any], skip: list[object]) -> list[bytes]:
    """Every bytes-like object reachable from a suspended coroutine's locals (and those of what it awaits),
    not going through ``skip``, modules, classes or functions."""
    seen = {id(o) for o in skip}
    stack: list[object] = []
    awaited: Any = coro
    while hasattr(awaited, "cr_frame") and awaited.cr_frame is not None:
        stack.append(awaited.cr_frame.f_locals)
        awaited = awaited.cr_await
    stack.append(awaited)
    found: list[bytes] = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, bytes | bytearray | memoryview):
            found.append(bytes(obj))
        elif not isinstance(obj, types.ModuleType | type | types.FunctionType | types.CodeType):
            stack.extend(gc.get_referents(obj))
    return found


# -- why a view ends: every reason has a row in the table serve_view ends responses by -------------------


def test_every_view_end_has_a_row_and_every_finish_is_used() -> None:
    assert set(VIEW_ENDINGS) == set(ViewEnd)
    assert {ending.finish for ending in VIEW_ENDINGS.values()} == set(Finish)
    # Only a view that ends with its stream goes unlogged; only a stall is a backpressure detach.
    assert [end for end, ending in VIEW_ENDINGS.items() if not ending.log] == [ViewEnd.COMPLETE]
    assert [end for end, ending in VIEW_ENDINGS.items() if ending.detach] == [ViewEnd.STALLED]


def test_view_end_values_are_the_words_the_log_lines_say() -> None:
    assert {end.value for end in ViewEnd} == {
        "complete",
        "session_gone",
        "fell_behind_window",
        "stalled",
        "client_gone",
        "draining",
        "store_unavailable",
    }


async def test_follow_says_why_it_ended() -> None:
    store, stream, after = await _store_with_stream()
    writer = ClientWriter(_Client(), BufferedTransport(), 30.0)  # type: ignore[arg-type]
    async with asyncio.timeout(PATIENCE):
        outcome = await follow(
            writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0, wait=False
        )
        assert (outcome.reason, outcome.complete, outcome.sent) == (ViewEnd.DRAINING, False, 1)
        await store.end_stream("s", stream, now=0.0)
        outcome = await follow(writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0)
        assert (outcome.reason, outcome.complete) == (ViewEnd.COMPLETE, True)
        outcome = await follow(writer, store, LOCAL[id(store)], "s", [stream + 1], 0, replay_through=0)
        assert outcome.reason is ViewEnd.FELL_BEHIND_WINDOW  # a stream the session does not retain
        await store.delete_session("s")
        outcome = await follow(writer, store, LOCAL[id(store)], "s", [stream], after, replay_through=0)
        assert (outcome.reason, outcome.sent) == (ViewEnd.SESSION_GONE, 0)
