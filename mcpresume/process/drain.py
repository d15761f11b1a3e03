"""The drain: how a replica stops, in one method (``Drain.run``), against one deadline.

The steps, in order (the docs' shutdown timeline is this list):

1. Refuse new work: ``/readyz`` answers 503, every new request 503 ``shutting_down``.
2. End the standalone views at once (a GET stream may never complete: it would hold the drain to its end).
3. Let the others finish (a POST stream ends with its response) until the deadline, ``drain_timeout`` after
   step 1. Meanwhile the listener closes and aiohttp waits for the handlers (``serving``).
4. End what is left. A view's response ends cleanly, within ``DRAIN_GRACE`` or cut after it (its client
   re-attaches elsewhere with its cursor); a wait for the upstream's answer ends with 503 ``shutting_down``.
5. The replica's own tasks (``Drain.spawn``: a takeover started beside a re-attach, which starts pumps) get
   what is left of the deadline, then are cancelled. Then the pumps: those of POST streams get what is left
   of the deadline, then every pump is cancelled (its pending requests answered with an error) or, with a
   shared store (owner routing), handed over: stopped without ending its stream, which another replica
   resumes upstream.
6. Release the lease, so the other replicas take the sessions over at once, not a lease TTL later.
7. Close the hop, the upstream client and the store (the store only if this app made it).

What steps 2 and 4 end is registered with the drain while it runs, in one of two ways:

* A view (``http.view.follow``) holds a ``View``: the drain sets its flag, ``View.ending``, and wakes the
  view's wait; the view sees the flag and ends. No cancellation.
* An await that only a cancellation can interrupt (the upstream's answer head, a body relayed off a
  socket) runs inside ``Drain.interruptible``: the drain cancels its task, and the block raises
  ``Interrupted`` instead of ``CancelledError`` (the cancellation taken back). A cancellation that is not
  the drain's (the client left) goes through as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Protocol

from aiohttp import web

from mcpresume.core.errors import ShuttingDown

log = logging.getLogger("mcpresume")

# How long a view a drain ended may take to end its response (a client that takes nothing is cut then).
DRAIN_GRACE = 2.0


# The one cancellation message: a drain that hands its streams over to the other replicas (a shared store,
# step 5) cancels each pump with it, and the pump stops without ending its stream, which another replica then
# resumes upstream (``SessionStore.orphans``). A pump's upstream read can only be interrupted by a
# cancellation, and the pump must tell this one from the others (the session ended, the shutdown of a lone
# replica), which end its stream.
HAND_OVER = "mcpresume-hand-over"


class Interrupted(Exception):
    """The drain ended the ``Drain.interruptible`` block this is raised out of."""


class Closing(Protocol):
    """What the drain closes once the views are done (steps 5-7), in this order: the pumps, then the rest.
    ``http.context.ProxyContext`` is one; the drain needs nothing else of it."""

    @property
    def drain_timeout(self) -> float:
        """Step 4 comes this long after step 1."""
        ...

    async def end_pumps(self, within: float) -> None:
        """Step 5's pumps: POST streams' within ``within`` seconds, then cancelled or handed over."""
        ...

    async def close(self) -> None:
        """Steps 6 and 7: release the lease, then close the hop, the upstream client and the store."""
        ...


class Waker(Protocol):
    """What wakes a view's wait (``process.local.News``): ``wake(key)`` wakes whatever waits on ``key``."""

    def wake(self, key: str, /) -> None: ...


class View:
    """One thing a drain ends: ``standalone`` (a GET stream: ended at the drain's start) or not (ended at
    its deadline). ``ending``: the drain ended it. ``waker``: how the drain wakes its wait,
    ``waker.wake(key)`` (None: its task is cancelled, ``Drain.interruptible``).

    Its own context manager (``Drain.view``): registered with the drain while inside. An idle view holds
    this one object for it, not a generator, its context manager and a bound callback (~600 bytes)."""

    __slots__ = ("_registry", "ending", "key", "standalone", "waker")

    def __init__(
        self,
        standalone: bool,
        waker: Waker | None = None,
        key: str = "",
        registry: dict[View, None] | None = None,
    ) -> None:
        self.standalone = standalone
        self.waker = waker
        self.key = key
        self.ending = False
        self._registry = registry  # where it is registered while inside (None: never, it is ending)

    def __enter__(self) -> View:
        if self._registry is not None:
            self._registry[self] = None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._registry is not None:
            self._registry.pop(self, None)


class Drain:
    """A replica's drain: whether it began, its deadline, and what it ends (see the module docstring)."""

    def __init__(self) -> None:
        self.started = False
        self.deadline = 0.0  # on the event loop's clock
        self.deadline_came = False  # step 4 ran: a view opening now ends at once
        self._views: dict[View, None] = {}  # flagged and woken
        self._tasks: dict[asyncio.Task[object], View] = {}  # interrupted: their task cancelled
        self._own: set[asyncio.Task[None]] = set()  # tasks of the replica's own (Drain.spawn), step 5

    # -- the steps ---------------------------------------------------------------------------------------

    async def run(self, closing: Closing, serving: Callable[[], Awaitable[None]]) -> None:
        """The shutdown. ``serving``: closes the listener and waits for aiohttp's handlers (they end as
        their views are ended; aiohttp's own ``shutdown_timeout`` comes after the deadline, a hang guard)."""
        self.begin(closing.drain_timeout)  # 1. refuse new work
        if ended := self.end_views(standalone_only=True):  # 2. standalone views end at once
            log.info("draining: %d standalone views ended", ended)
        handlers = asyncio.ensure_future(serving())
        await asyncio.wait([handlers], timeout=self.remaining())  # 3. the others finish, until the deadline
        if not handlers.done() and (ended := self.end_views()):  # 4. what is left ends
            log.info("drain_timeout: %d client views still open ended", ended)
        await handlers
        await self._end_own()  # 5. the replica's own tasks (a takeover starts pumps), within what is left
        await closing.end_pumps(self.remaining())  # ... then the pumps, within what is left
        await closing.close()  # 6. the lease, released once nothing here pumps; 7. the rest

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a task of the replica's own (not a request's, not a pump): held here until it ends, waited
        for in step 5 until the deadline, then cancelled."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._own.add(task)
        task.add_done_callback(self._own.discard)
        return task

    async def _end_own(self) -> None:
        tasks = list(self._own)
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=self.remaining())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def begin(self, timeout: float) -> None:
        if not self.started:
            self.started = True
            self.deadline = asyncio.get_running_loop().time() + timeout

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def end_views(self, *, standalone_only: bool = False) -> int:
        """End the registered views: the standalone ones (step 2), or all (step 4). Each is ended once;
        returns how many were."""
        if not standalone_only:
            self.deadline_came = True
        views = [view for view in self._views if view.standalone or not standalone_only]
        tasks = [task for task, view in self._tasks.items() if view.standalone or not standalone_only]
        for view in views:
            del self._views[view]
            view.ending = True
            if view.waker is not None:
                view.waker.wake(view.key)
        for task in tasks:
            self._tasks.pop(task).ending = True
            task.cancel()  # the only interruption there is: Drain.interruptible takes it back
        return len(views) + len(tasks)

    # -- what a drain ends -------------------------------------------------------------------------------

    def ends_at_once(self, standalone: bool) -> bool:
        """A view opening now has nothing to wait for: it is standalone and the drain began, or the
        deadline came (step 4 ended the ones open then; this one came after)."""
        return self.started and (standalone or self.deadline_came)

    def view(self, standalone: bool, waker: Waker, key: str) -> View:
        """``with drain.view(...) as view``: while inside, the drain ends the view by setting
        ``View.ending`` and calling ``waker.wake(key)``. A view opened after the drain ended its kind is
        ending from the start."""
        if self.ends_at_once(standalone):
            view = View(standalone, waker, key)
            view.ending = True
            return view
        return View(standalone, waker, key, self._views)

    @contextlib.contextmanager
    def interruptible(self, standalone: bool, *, register: bool = True) -> Iterator[None]:
        """While inside (and ``register``), the drain ends the block by cancelling its task: the block
        raises ``Interrupted``. Nested in another block of the same task, the inner one is interrupted;
        the outer one counts as ended with it (a task is interrupted once)."""
        task = asyncio.current_task()
        if task is None or not register:
            yield
            return
        outer = self._tasks.get(task)
        view = self._tasks[task] = View(standalone)
        try:
            yield
        except asyncio.CancelledError:
            if not view.ending:
                raise  # not the drain's: the client left
            task.uncancel()
            raise Interrupted from None
        finally:
            if self._tasks.get(task) is view:
                del self._tasks[task]
            if outer is not None and not view.ending and self._tasks.get(task) is None:
                self._tasks[task] = outer

    @contextlib.contextmanager
    def upstream_wait(self, *, standalone: bool = False) -> Iterator[None]:
        """Around a wait for the upstream's answer: the drain ends it (at its start if ``standalone``,
        else at its deadline) with 503 ``shutting_down``, so it does not hold the drain."""
        try:
            with self.interruptible(standalone):
                yield
        except Interrupted:
            raise ShuttingDown(
                "the proxy shut down before the upstream answered; the request may still run"
            ) from None


async def end_for_drain(request: web.Request, response: web.StreamResponse) -> None:
    """End a response the drain ended: cleanly (its client re-attaches), or cut after DRAIN_GRACE."""
    try:
        async with asyncio.timeout(DRAIN_GRACE):
            await response.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:
        pass
