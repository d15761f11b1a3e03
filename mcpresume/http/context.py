"""What every handler shares: the context built once per application, and how the proxy says no.

``ProxyContext`` holds the settings, the store, the metrics, the upstream client, the clock, the pump
registry and the drain (no module-level state: ``app.build_app`` builds one per application). ``reject``
is the one way a refusal is made (a JSON-RPC error body with the stable reason, one log line, the metric),
``drop_session`` the one way the proxy forgets a session.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

from mcpresume.core.errors import ProxyError, jsonrpc_error_body
from mcpresume.core.headers import SESSION_HEADER
from mcpresume.process.config import Settings
from mcpresume.process.drain import Drain
from mcpresume.process.local import LocalSessions
from mcpresume.process.logs import log_id
from mcpresume.process.metrics import Metrics
from mcpresume.process.tracing import NO_TRACING, Tracing
from mcpresume.replicas.hop import Hop
from mcpresume.replicas.lease import Lease
from mcpresume.store import SessionStore
from mcpresume.streams.pump import Pumps
from mcpresume.streams.upstream import Upstream

log = logging.getLogger("mcpresume.proxy")

# What a request carries for the metrics: when its handler began (the loop's clock: a re-attach's latency
# runs from there), and the status of the answer it was sent, once its head is prepared (a handler cancelled
# later, its client gone, is counted with it: ``Proxy.handle``).
ARRIVED: Final = web.RequestKey("mcpresume_arrived", float)
ANSWERED: Final = web.RequestKey("mcpresume_answered", int)


class Action(enum.StrEnum):
    """What the proxy did with a request, as its access line says (``http/access.py``). Marked on the request
    where it happens (``DID``); a request marked nothing was forwarded (the MCP endpoint) or relayed."""

    FORWARDED = "forwarded"  # sent upstream; the proxy made its answer a stream of the session (or kept it)
    RELAYED = "relayed"  # passed through as it came, its answer relayed as it came (no session kept)
    REATTACHED = "reattached"  # a view of a stream the session holds: a cursor's, or a re-sent request id's
    JOINED = "joined"  # a view of the session's live standalone stream, opened upstream by another GET
    REFUSED = "refused"  # answered by the proxy itself with an error (its data.reason)
    HOPPED = "hopped"  # forwarded to the replica that owns the session (several replicas)
    ANSWERED = "answered"  # answered by the proxy itself, nothing sent upstream (a bridged session's)
    TASK = "task"  # a long 2026-07-28 call made a task, or a tasks/* answered from the store (tasks.py)


# What a request carries for its access line: what the proxy did (unless refused before anything else), the
# data.reason it was refused with, and the replica's URL it was forwarded to.
DID: Final = web.RequestKey("mcpresume_did", Action)
REFUSED: Final = web.RequestKey("mcpresume_refused", str)
HOPPED_TO: Final = web.RequestKey("mcpresume_hopped_to", str)
# The answer prepared for a request (with the access log on): the size of its head, for a handler cancelled
# after it, whose answer is not returned.
PREPARED: Final = web.RequestKey("mcpresume_prepared", web.StreamResponse)


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
    drain: Drain = field(default_factory=Drain)  # how this replica stops (process/drain.py)
    tracing: Tracing = NO_TRACING  # OpenTelemetry, when the OTEL_* variables ask for it (process/tracing.py)
    # The store has not answered since start-up (a sidecar's Redis not up yet): until it does, and the lease
    # and the orphans' adoption are done (``daemon/app.py``), requests on the MCP endpoint get 503
    # ``store_unavailable`` and ``/readyz`` 503.
    awaiting_store: bool = False
    # The store is this app's, closed when it stops (False: shared with other proxies of this process, as
    # in tests, and closed by whoever made it).
    owns_store: bool = True
    # Sessions begun again upstream here (upstream_session_lost = "reinitialize") whose */list_changed
    # notifications wait for a standalone stream to carry them to the client (``http/reinit.py``).
    list_changes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The re-initializations running here, by session: a request of the session that meets the upstream's
    # 404 meanwhile waits for the one running (``http.reinit.recover``) rather than begin another.
    reinitializing: dict[str, Any] = field(default_factory=dict)

    # -- what the drain closes (``drain.Closing``) -----------------------------------------------------------

    @property
    def drain_timeout(self) -> float:
        return self.settings.drain_timeout

    async def end_pumps(self, within: float) -> None:
        """POST streams' pumps within ``within``, then every pump cancelled or, with a shared store (a
        lease), handed over."""
        await self.pumps.drain(within, hand_over=self.lease is not None)

    async def close(self) -> None:
        """The lease released, then the hop, the upstream client and the store (this app's only) closed."""
        if self.lease is not None:  # released once nothing here pumps
            await self.lease.stop()
        if self.hop is not None:
            await self.hop.close()
        await self.upstream.close()
        if self.owns_store:
            await self.store.close()
        if self.tracing.enabled:  # the last spans exported (a blocking call: off the loop)
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    async def drop_session(self, session_id: str, epoch: str | None = None) -> None:
        """Forget the session (only its incarnation ``epoch``, when given) and stop its pumps."""
        if await self.store.delete_session(session_id, epoch) or epoch is None:
            self.pumps.cancel_session(session_id)
            self.upstream.aliases.pop(session_id, None)  # begun again upstream (reinitialize): no more
            self.list_changes.pop(session_id, None)

    def reject(self, request: web.Request, error: ProxyError, request_id: Any = None) -> web.Response:
        """The answer to a refusal: status, JSON-RPC error body with a stable reason, one log line."""
        session = request.headers.get(SESSION_HEADER)
        request[REFUSED] = error.reason
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
