"""This replica's lease in the store's owner registry: registered at start, renewed every third of
``owner_lease_ttl``, released on stop.

While the lease is live the other replicas forward requests of this replica's sessions to its
``advertise_url``; once it lapses (the replica died, or its renewals failed for a whole TTL) they may take
its sessions over, on evidence (``http/route.py``: a lapsed lease alone proves nothing after a store
outage). Renewing three times per TTL lets two renewals in a row fail (a store hiccup, a long pause of the
event loop) without the lease lapsing. Releasing it on a drain starts the takeover at once instead of a TTL
later.

The lease also says how long the store has answered this replica without a break (``answered_for``): a
replica takes another's sessions over only after it has seen the store answer for a whole lease, the time
a live owner needs to renew once the store is back.

Each process registers with a token of its own (``instance``): at start, a live registration of the same
``replica_id`` by another process that still answers as that replica is a duplicate (``DuplicateReplica``),
two processes configured alike; a registration that does not answer is this replica's previous process.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final

from mcpresume.process.metrics import Metrics
from mcpresume.store import Registry

log = logging.getLogger("mcpresume.lease")

RENEWALS_PER_TTL: Final = 3
STOP_RECANCEL: Final = 0.05  # seconds between the cancellations of the renewals at stop, until they end

# Who answers at a replica's URL (``replicas.hop.Hop.probe``): its replica id, or None when nothing does.
Probe = Callable[[str], Awaitable[str | None]]


def renew_interval(ttl: float) -> float:
    """Seconds between two renewals of a lease that lives ``ttl`` seconds."""
    return ttl / RENEWALS_PER_TTL


class DuplicateReplica(Exception):
    """Another live process serves this ``replica_id``: two replicas must never share one."""


class Lease:
    """Holds ``replica_id``'s registration at ``url`` in ``registry``: ``start`` registers it and starts
    renewing, ``stop`` stops renewing and releases it. A failed renewal is logged and counted
    (``mcpresume_lease_renew_failures_total``) and the next one comes on time; nothing here ever ends the
    renewals but ``stop``. ``clock``: wall-clock seconds, the store's ``now``. ``probe``: asks who answers at
    a URL (the duplicate check at start; without it, none)."""

    def __init__(
        self,
        registry: Registry,
        replica_id: str,
        url: str,
        ttl: float,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        probe: Probe | None = None,
    ) -> None:
        self.registry = registry
        self.replica_id = replica_id
        self.url = url
        self.ttl = ttl
        self.interval = renew_interval(ttl)
        self.metrics = metrics
        self.clock = clock
        self.probe = probe
        self.instance = secrets.token_hex(8)  # this process's, in the registry beside the URL
        self.renewed_at: float | None = None  # the clock at the last registration that succeeded
        self.answering_since: float | None = None  # the first renewal of the store's current good spell
        self._task: asyncio.Task[None] | None = None

    def held(self, now: float) -> bool:
        """Whether the lease is live by this replica's last successful renewal."""
        return self.renewed_at is not None and now < self.renewed_at + self.ttl

    def answered_for(self, now: float) -> float:
        """Seconds the store has answered every renewal (0: the last one failed, or none ran yet)."""
        return 0.0 if self.answering_since is None else now - self.answering_since

    async def renew(self) -> bool:
        """Register (or renew) once; whether it succeeded."""
        now = self.clock()
        try:
            await self.registry.register_replica(self.replica_id, self.url, self.ttl, now, self.instance)
            self.renewed_at = now
            if self.answering_since is None:
                self.answering_since = now
            self.metrics.replicas.set(await self.registry.live_replicas(now))
        except Exception as exc:  # any failure of the store: the next renewal is the retry
            self.answering_since = None
            self.metrics.lease_renew_failures.inc()
            held = "still held" if self.held(self.clock()) else "lapsed in the store"
            log.warning("renewing the lease of replica %s failed (%s): %s", self.replica_id, held, exc)
            return False
        return True

    async def check_unique(self) -> None:
        """Raise ``DuplicateReplica`` when another live process holds this replica id (its registration is
        live, by another process, at another URL, and it answers there as this replica)."""
        entry = await self.registry.replica_entry(self.replica_id)
        if entry is None or entry.lease_until <= self.clock() or entry.instance == self.instance:
            return
        if entry.url == self.url or self.probe is None:
            return  # this URL is this process's now: the registration was its previous process's
        if await self.probe(entry.url) == self.replica_id:
            raise DuplicateReplica(
                f"replica id {self.replica_id!r} is already served by a live process at {entry.url}; "
                "give every replica its own replica_id (MCPRESUME_REPLICA_ID)"
            )

    async def start(self) -> None:
        """Check that no live process holds this replica id (``DuplicateReplica``), register now (a
        failure is counted, and the renewals retry it), then renew every interval."""
        await self.check_unique()
        await self.renew()
        self._task = asyncio.create_task(self._renewals(), name=f"lease {self.replica_id}")

    async def _renewals(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.renew()

    async def stop(self) -> None:
        """Stop renewing, then release the lease so the takeover of this replica's sessions starts now."""
        if self._task is not None:
            task, self._task = self._task, None
            # Cancelled again until it ends, without taking a cancellation of this call: a store call can
            # lose a cancellation (Python 3.11's ``asyncio.wait_for`` returns normally when its caller is
            # cancelled as the call completes), and the next one lands in the renewals' sleep. The release
            # comes only after their end: a renewal after it would hold the lease for as long as this
            # process lives, and no replica would take its sessions over.
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=STOP_RECANCEL)
        try:
            await self.registry.release_replica(self.replica_id)
        except Exception as exc:  # the lease then lapses by itself, a TTL later
            log.warning("releasing the lease of replica %s failed: %s", self.replica_id, exc)
        self.renewed_at = None
        self.answering_since = None
