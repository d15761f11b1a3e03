"""Starting pumps: one for a stream a request just opened, and one for each stream another process left.

Every pump of this replica is started here, with the one ``PumpSettings`` built from the settings, and
registered in ``Pumps`` (the drain's step 5 ends them). ``adopt`` takes the streams another process was
pumping (this replica's before a restart, or a dead replica's after a takeover, ``http/route.py``): each is
resumed upstream from its last upstream id, or ended with an error for each pending request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from mcpresume.core.session import Orphan, StreamOrigin
from mcpresume.process.config import Settings
from mcpresume.process.local import LocalSessions
from mcpresume.process.logs import log_id
from mcpresume.process.metrics import Metrics
from mcpresume.store import Sessions, Streams
from mcpresume.streams.pump import Pump, PumpJob, Pumps, PumpSettings
from mcpresume.streams.upstream import Upstream, UpstreamAnswer

log = logging.getLogger("mcpresume.proxy")


class PumpStore(Streams, Sessions, Protocol):
    """What the starter needs of the store: the streams, for its pumps, and retiring a session whose
    upstream forgot it."""


class PumpStarter:
    def __init__(
        self,
        settings: Settings,
        pumps: Pumps,
        store: PumpStore,
        local: LocalSessions,
        metrics: Metrics,
        upstream: Upstream,
        clock: Callable[[], float],
    ) -> None:
        self.pumps = pumps  # where every pump is registered (the drain ends them)
        self.store = store
        self._parts = (store, local, metrics, upstream, clock)  # what every pump is given
        # A session its upstream does not know is kept, not retired: its next POST begins it again there.
        self.retire_forgotten = settings.upstream_session_lost == "end"
        self.settings = PumpSettings(  # one for every pump
            max_event_bytes=settings.max_event_bytes,
            stall_timeout=settings.stall_timeout,
            window_events=settings.window_events,
            retry_ms=settings.retry_ms,
            resume_attempts=settings.upstream_resume_attempts,
            pause=settings.overflow == "pause",
            session_ttl=settings.session_ttl,
            store_outage_grace=settings.store_outage_grace,
            window_bytes=settings.window_bytes,
            cancel_grace=settings.cancel_grace,
            credential_wait=settings.credential_wait,
            reopen_wait=0.0 if self.retire_forgotten else settings.credential_wait,
        )

    def _pump(self, job: PumpJob) -> Pump:
        return Pump(job, *self._parts, self.settings)

    def start(self, job: PumpJob, upstream: UpstreamAnswer, *, standalone: bool = False) -> None:
        """Pump a stream just opened from ``upstream``'s body (the pump owns the answer now)."""
        pump = self._pump(job)
        self.pumps.spawn(job.session_id, pump.run(upstream), standalone=standalone, pump=pump)

    async def start_post(self, job: PumpJob, upstream: UpstreamAnswer) -> None:
        """Pump a POST stream just opened from ``upstream``'s body: at once, in the caller's task, when the
        whole answer is here already and appending it waits for nothing (``Pump.at_once``: a one-event
        answer, most calls); else in a task of its own, from what was read."""
        pump = self._pump(job)
        first = await pump.at_once(upstream)
        if first is not None:
            self.pumps.spawn(job.session_id, pump.run(upstream, first), pump=pump)

    def adopt(self, orphans: Sequence[Orphan], *, taken_from: str | None = None) -> None:
        """Pump the streams another process was pumping (this replica's before a restart, or a dead
        replica's: ``taken_from``): each resumed upstream from its last upstream id, or ended with an
        error for each pending request. Where this replica's upstream does not know the session (a dead
        replica's, in the sidecar layout), the session is then retired: its clients re-initialize."""
        for orphan in orphans:
            job = PumpJob.of(
                orphan.session_id, orphan.stream, orphan.pump, log_id(orphan.session_id), orphan.fence
            )
            pump = self._pump(job)
            pump.restore(orphan.upstream_cursor, orphan.answered)
            standalone = orphan.origin is StreamOrigin.GET
            self.pumps.spawn(orphan.session_id, self._adopted(pump, orphan), standalone=standalone, pump=pump)
        if orphans:
            whose = "this replica's previous process" if taken_from is None else f"replica {taken_from}"
            log.info("took over %d stream(s) left by %s", len(orphans), whose)

    async def _adopted(self, pump: Pump, orphan: Orphan) -> None:
        await pump.run(None)
        if pump.upstream_forgot and self.retire_forgotten:
            await self.store.retire(orphan.session_id, orphan.epoch, orphan.fence)
            log.info("session %s: its upstream does not know it; new requests get 404", pump.job.log_id)
