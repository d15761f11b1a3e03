"""What every handler shares: the context built once per application, and how the proxy says no.

``ProxyContext`` holds the settings, the store, the metrics, the upstream client, the clock and the pump
registry (no module-level state: ``app.build_app`` builds one per application). ``reject`` is the one way
a refusal is made: a JSON-RPC error body with the stable reason, one log line, the metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from mcpresume.config import Settings
from mcpresume.errors import ProxyError, ShuttingDown, jsonrpc_error_body
from mcpresume.headers import SESSION_HEADER
from mcpresume.local import LocalSessions
from mcpresume.metrics import Metrics
from mcpresume.pump import Pumps
from mcpresume.store import SessionStore
from mcpresume.upstream import Upstream

if TYPE_CHECKING:  # both import this module
    from mcpresume.hop import Hop
    from mcpresume.lease import Lease

log = logging.getLogger("mcpresume.proxy")

# The message of the cancellation that ends a client view for a drain (any other is the client leaving).
DRAIN = "mcpresume: draining"


def ended_for_drain(exc: asyncio.CancelledError) -> bool:
    """The cancellation is a drain's (``ProxyContext.end_views``): taken back, so the task ends cleanly."""
    if exc.args != (DRAIN,):
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


def log_id(session_id: str) -> str:
    """A short, stable hash of a session id: full session ids stay out of logs (they are bearer-like)."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()[:10]


@dataclass
class ProxyContext:
    """Everything the handlers share, built once in ``app.build_app`` (no module-level state)."""

    settings: Settings
    store: SessionStore
    metrics: Metrics
    upstream: Upstream
    clock: Callable[[], float]
    pumps: Pumps = field(default_factory=Pumps)
    local: LocalSessions = field(default_factory=LocalSessions)  # this process's views and readers
    # Owner routing (several replicas over one shared store: ``advertise_url`` set): the hop to the other
    # replicas, and this replica's lease in the store's registry. None: one replica, nothing is routed.
    hop: Hop | None = None
    lease: Lease | None = None
    draining: bool = False
    drain_deadline: float = 0.0  # on the event loop's clock
    # What a drain ends (``end_views``): the tasks serving a client view or a relayed SSE stream, or waiting
    # for the upstream's answer, each with whether it is standalone (a GET stream, that may never complete:
    # ended when the drain begins; the others at its deadline).
    views: dict[asyncio.Task[Any], bool] = field(default_factory=dict)
    views_ended: bool = False  # the drain's deadline came: every view then open was ended

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout

    def view_ends_at_once(self, standalone: bool) -> bool:
        """A view opening now has nothing to wait for: it is standalone and a drain began, or the drain's
        deadline came (``end_views`` ended the ones open then; this one came after)."""
        return self.draining and (standalone or self.views_ended)

    @contextlib.contextmanager
    def drainable(self, standalone: bool, *, register: bool = True) -> Iterator[None]:
        """While inside (and ``register``), the current task is one ``end_views`` ends: cancelled with the
        ``DRAIN`` message, which the task takes back with ``ended_for_drain``."""
        task = asyncio.current_task()
        if task is not None and register:
            self.views[task] = standalone
        try:
            yield
        finally:
            if task is not None:
                self.views.pop(task, None)

    @contextlib.contextmanager
    def upstream_wait(self, *, standalone: bool = False) -> Iterator[None]:
        """Around a wait for the upstream's answer: a drain ends it like a view (at its start if
        ``standalone``, else at its deadline) with 503 ``shutting_down``, so it does not hold the drain."""
        try:
            with self.drainable(standalone):
                yield
        except asyncio.CancelledError as exc:
            if not ended_for_drain(exc):
                raise
            raise ShuttingDown(
                "the proxy shut down before the upstream answered; the request may still run"
            ) from None

    def end_views(self, *, standalone_only: bool = False) -> int:
        """End what ``views`` holds: a view's response ends cleanly (its client re-attaches with its cursor,
        elsewhere), a wait for the upstream's answer with 503 ``shutting_down``. At the start of a drain the
        standalone ones, which could hold it to the end; at its deadline the rest. Each is ended once;
        returns how many were."""
        if not standalone_only:
            self.views_ended = True
        ending = [task for task, standalone in self.views.items() if standalone or not standalone_only]
        for task in ending:
            del self.views[task]
            task.cancel(DRAIN)
        return len(ending)

    def drain_remaining(self) -> float:
        return max(0.0, self.drain_deadline - asyncio.get_running_loop().time())

    def reject(self, request: web.Request, error: ProxyError, request_id: Any = None) -> web.Response:
        """The answer to a refusal: status, JSON-RPC error body with a stable reason, one log line."""
        session = request.headers.get(SESSION_HEADER)
        log.warning(
            "%s %s -> %d %s: %s%s",
            request.method,
            request.path,
            error.status,
            error.reason,
            error.message,
            f" (session {log_id(session)})" if session else "",
        )
        if error.reason.startswith("upstream_"):
            self.metrics.upstream_errors.labels(error.reason).inc()
        return web.Response(
            status=error.status,
            body=orjson.dumps(jsonrpc_error_body(error, request_id)),
            content_type="application/json",
        )
