"""Starting pumps: one for a stream a request just opened, and one for each stream another process left.

Every pump of this replica is started here, with the one ``PumpSettings`` built from the settings, and
registered in ``ctx.pumps`` (the drain's step 5 ends them). ``adopt`` takes the streams another process was
pumping (this replica's before a restart, or a dead replica's after a takeover, ``routing.py``): each is
resumed upstream from its last upstream id, or ended with an error for each pending request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mcpresume.context import ProxyContext, log_id
from mcpresume.pump import Pump, PumpJob, PumpSettings
from mcpresume.session import Orphan, StreamOrigin
from mcpresume.upstream import UpstreamAnswer

log = logging.getLogger("mcpresume.proxy")


class PumpStarter:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        settings = ctx.settings
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
        )

    def _pump(self, job: PumpJob) -> Pump:
        ctx = self.ctx
        return Pump(job, ctx.store, ctx.local, ctx.metrics, ctx.upstream, ctx.clock, self.settings)

    def start(self, job: PumpJob, upstream: UpstreamAnswer, *, standalone: bool = False) -> None:
        """Pump a stream just opened from ``upstream``'s body (the pump owns the answer now)."""
        self.ctx.pumps.spawn(job.session_id, self._pump(job).run(upstream), standalone=standalone)

    def adopt(self, orphans: Sequence[Orphan], *, taken_from: str | None = None) -> None:
        """Pump the streams another process was pumping (this replica's before a restart, or a dead
        replica's: ``taken_from``): each resumed upstream from its last upstream id, or ended with an
        error for each pending request. Where this replica's upstream does not know the session (a dead
        replica's, in the sidecar layout), the session is then retired: its clients re-initialize."""
        for orphan in orphans:
            job = PumpJob.of(orphan.session_id, orphan.stream, orphan.pump, log_id(orphan.session_id))
            pump = self._pump(job)
            pump.restore(orphan.upstream_cursor, orphan.answered)
            standalone = orphan.origin is StreamOrigin.GET
            self.ctx.pumps.spawn(orphan.session_id, self._adopted(pump, orphan), standalone=standalone)
        if orphans:
            whose = "this replica's previous process" if taken_from is None else f"replica {taken_from}"
            log.info("took over %d stream(s) left by %s", len(orphans), whose)

    async def _adopted(self, pump: Pump, orphan: Orphan) -> None:
        await pump.run(None)
        if pump.upstream_forgot:
            await self.ctx.store.retire(orphan.session_id, orphan.epoch)
            log.info("session %s: its upstream does not know it; new requests get 404", pump.job.log_id)
