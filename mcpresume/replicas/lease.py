"""This replica's lease in the store's owner registry: registered at start, renewed every third of
``owner_lease_ttl``, released on stop.

While the lease is live the other replicas forward requests of this replica's sessions to its
``advertise_url``; once it lapses (the replica died, or its renewals failed for a whole TTL) they take its
sessions over. Renewing three times per TTL lets two renewals in a row fail (a store hiccup, a long pause
of the event loop) without the lease lapsing. Releasing it on a drain starts the takeover at once instead
of a TTL later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final

from mcpresume.process.metrics import Metrics
from mcpresume.store import Registry

log = logging.getLogger("mcpresume.lease")

RENEWALS_PER_TTL: Final = 3


def renew_interval(ttl: float) -> float:
    """Seconds between two renewals of a lease that lives ``ttl`` seconds."""
    return ttl / RENEWALS_PER_TTL


class Lease:
    """Holds ``replica_id``'s registration at ``url`` in ``registry``: ``start`` registers it and starts
    renewing, ``stop`` stops renewing and releases it. A failed renewal is logged and counted
    (``mcpresume_lease_renew_failures_total``) and the next one comes on time; nothing here ever ends the
    renewals but ``stop``. ``clock``: wall-clock seconds, the store's ``now``."""

    def __init__(
        self,
        registry: Registry,
        replica_id: str,
        url: str,
        ttl: float,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.replica_id = replica_id
        self.url = url
        self.ttl = ttl
        self.interval = renew_interval(ttl)
        self.metrics = metrics
        self.clock = clock
        self.renewed_at: float | None = None  # the clock at the last registration that succeeded
        self._task: asyncio.Task[None] | None = None

    def held(self, now: float) -> bool:
        """Whether the lease is live by this replica's last successful renewal."""
        return self.renewed_at is not None and now < self.renewed_at + self.ttl

    async def renew(self) -> bool:
        """Register (or renew) once; whether it succeeded."""
        now = self.clock()
        try:
            await self.registry.register_replica(self.replica_id, self.url, self.ttl, now)
            self.renewed_at = now
            self.metrics.replicas.set(await self.registry.live_replicas(now))
        except Exception as exc:  # any failure of the store: the next renewal is the retry
            self.metrics.lease_renew_failures.inc()
            held = "still held" if self.held(self.clock()) else "lapsed: others may take this one's sessions"
            log.warning("renewing the lease of replica %s failed (%s): %s", self.replica_id, held, exc)
            return False
        return True

    async def start(self) -> None:
        """Register now (a failure is counted, and the renewals retry it), then renew every interval."""
        await self.renew()
        self._task = asyncio.create_task(self._renewals(), name=f"lease {self.replica_id}")

    async def _renewals(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.renew()

    async def stop(self) -> None:
        """Stop renewing, then release the lease so the takeover of this replica's sessions starts now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # its end, without taking a cancellation of this call
            self._task = None
        try:
            await self.registry.release_replica(self.replica_id)
        except Exception as exc:  # the lease then lapses by itself, a TTL later
            log.warning("releasing the lease of replica %s failed: %s", self.replica_id, exc)
        self.renewed_at = None
