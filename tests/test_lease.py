"""The lease (mcpresume/replicas/lease.py) and the settings it runs on (advertise_url, owner_lease_ttl).

The registry is a fake here: the real one is the Redis store's, and the contract suite tests that; what
this file tests is the renewer's own behaviour (when it calls, what it counts, what it releases).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from mcpresume.core.window import WindowLimits
from mcpresume.process.config import Settings, SettingsError, check_advertise_url, load_settings
from mcpresume.process.metrics import Metrics
from mcpresume.replicas.lease import DuplicateReplica, Lease, renew_interval
from mcpresume.store import ReplicaEntry
from mcpresume.store.memory import MemoryStore
from tests.support.metrics import sample

URL = "http://10.0.0.5:8080/mcp"
HANG_GUARD = 10.0  # seconds: only so that a broken renewer fails the test instead of hanging it


class FakeRegistry:
    """Records the calls; fails the registrations whose numbers are in ``failing`` (1 = the first)."""

    def __init__(self, failing: frozenset[int] = frozenset(), fail_release: bool = False) -> None:
        self.failing = failing
        self.fail_release = fail_release
        self.registrations: list[tuple[str, str, float, float]] = []
        self.released: list[str] = []
        self._counted: dict[int, asyncio.Event] = {}
        self.entry: ReplicaEntry | None = None  # what replica_entry answers: nobody registered before

    def reached(self, count: int) -> asyncio.Event:
        """Set once ``count`` registrations (failed ones included) were asked for."""
        event = self._counted.setdefault(count, asyncio.Event())
        if len(self.registrations) >= count:
            event.set()
        return event

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        self.registrations.append((replica_id, url, ttl, now))
        for count, event in self._counted.items():
            if len(self.registrations) >= count:
                event.set()
        if len(self.registrations) in self.failing:
            raise ConnectionError("store unavailable")

    async def release_replica(self, replica_id: str) -> None:
        self.released.append(replica_id)
        if self.fail_release:
            raise ConnectionError("store unavailable")

    async def live_replicas(self, now: float) -> int:
        return 3

    async def replica_entry(self, replica_id: str) -> ReplicaEntry | None:
        return self.entry


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading a second later: each registration has its own now
        return self.now


def test_renewals_come_three_times_per_ttl() -> None:
    assert renew_interval(10.0) == pytest.approx(10.0 / 3)
    assert Settings.model_fields["owner_lease_ttl"].default == 10.0


async def test_the_lease_registers_at_start_renews_and_releases_on_stop() -> None:
    registry, metrics, clock = FakeRegistry(), Metrics(), Clock()
    lease = Lease(registry, "pod-a", URL, 0.03, metrics, clock)
    await lease.start()
    assert registry.registrations == [("pod-a", URL, 0.03, 1001.0)]  # registered before start returns
    assert lease.held(1001.0) and not lease.held(1001.03)
    await asyncio.wait_for(registry.reached(4).wait(), HANG_GUARD)  # then renewed, again and again
    assert {r[:3] for r in registry.registrations} == {("pod-a", URL, 0.03)}
    nows = [r[3] for r in registry.registrations]
    assert nows == sorted(set(nows))  # each with the clock's now at its call
    assert sample(metrics, "mcpresume_replicas") == 3
    renewals = lease._task
    await lease.stop()
    assert renewals is not None and renewals.done()  # no renewal can come after the release
    assert registry.released == ["pod-a"]
    assert not lease.held(clock.now)
    assert sample(metrics, "mcpresume_lease_renew_failures_total") == 0


async def test_failed_renewals_are_counted_and_the_next_ones_still_come() -> None:
    registry, metrics = FakeRegistry(failing=frozenset({1, 2, 3})), Metrics()
    lease = Lease(registry, "pod-a", URL, 0.03, metrics, Clock())
    await lease.start()  # the first registration fails: start still returns, the renewals retry
    assert lease.renewed_at is None
    await asyncio.wait_for(registry.reached(5).wait(), HANG_GUARD)
    await lease.stop()
    assert sample(metrics, "mcpresume_lease_renew_failures_total") == 3
    assert lease.renewed_at is None  # released on stop
    assert registry.released == ["pod-a"]


async def test_a_release_that_fails_does_not_fail_the_stop() -> None:
    registry = FakeRegistry(fail_release=True)
    lease = Lease(registry, "pod-a", URL, 30.0, Metrics(), Clock())
    await lease.start()
    await lease.stop()  # logged; the lease lapses by itself a TTL later
    assert registry.released == ["pod-a"]


class SwallowingRegistry(FakeRegistry):
    """Its second registration returns normally when cancelled, as redis-py's send under ``asyncio.wait_for``
    can on Python 3.11 (cancelled as the send completes, ``wait_for`` returns its result): the cancellation
    is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.never = asyncio.Event(), asyncio.Event()

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        await super().register_replica(replica_id, url, ttl, now, instance)
        if len(self.registrations) == 2:
            self.inside.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self.never.wait()


async def test_a_renewal_that_loses_its_cancellation_ends_and_renews_no_more_after_the_stop() -> None:
    registry = SwallowingRegistry()
    lease = Lease(registry, "pod-a", URL, 0.3, Metrics(), Clock())
    await lease.start()
    await asyncio.wait_for(registry.inside.wait(), HANG_GUARD)
    renewals = lease._task
    await asyncio.wait_for(lease.stop(), HANG_GUARD)
    assert renewals is not None and renewals.done()
    assert registry.released == ["pod-a"]
    await asyncio.sleep(3 * renew_interval(0.3))  # three intervals: a renewal that went on would be seen
    assert len(registry.registrations) == 2  # none after the release


async def test_the_lease_in_the_memory_stores_registry() -> None:
    store = MemoryStore(WindowLimits(64, 1 << 20, 300.0), session_ttl=300.0, max_sessions=10, retry_ms=None)
    clock = Clock()
    lease = Lease(store, "pod-a", URL, 10.0, Metrics(), clock)
    await lease.start()
    assert await store.replica_url("pod-a", clock.now) == URL
    assert await store.live_replicas(clock.now) == 1
    assert await store.replica_url("pod-a", clock.now + 10.0) is None  # unrenewed, it lapses by itself
    await lease.stop()
    assert await store.replica_url("pod-a", clock.now) is None  # released: no waiting for the TTL
    assert await store.live_replicas(clock.now) == 0


# -- the settings ----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MCPRESUME_"):
            monkeypatch.delenv(name)


def test_a_redis_store_requires_advertise_url() -> None:
    check_advertise_url("memory", None)  # one replica: nothing to advertise
    check_advertise_url("redis://127.0.0.1:6379/0", URL)
    for store in ("redis://127.0.0.1:6379/0", "rediss://redis:6380/0", "unix:///run/redis.sock"):
        with pytest.raises(SettingsError, match=r"^advertise_url: required when store is a Redis URL"):
            check_advertise_url(store, None)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("10.0.0.5:8080/mcp", "http:// or https:// URL"),
        ("ftp://10.0.0.5/mcp", "http:// or https:// URL"),
        ("http:///mcp", "http:// or https:// URL"),
        ("http://10.0.0.5:8080/mcp?a=1", "no query or fragment"),
        ("http://0.0.0.0:8080/mcp", "not a wildcard listen address"),
        ("http://[::]:8080/mcp", "not a wildcard listen address"),
    ],
)
def test_advertise_url_must_be_reachable(value: str, problem: str) -> None:
    with pytest.raises(SettingsError, match=f"advertise_url: .*{problem}"):
        load_settings({"advertise_url": value, "upstream": "http://127.0.0.1:8000/mcp"})


def test_advertise_url_and_lease_ttl_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCPRESUME_ADVERTISE_URL", "https://[fd00::5]:8443/mcp")
    monkeypatch.setenv("MCPRESUME_OWNER_LEASE_TTL", "4.5")
    settings = load_settings({})
    assert settings.advertise_url == "https://[fd00::5]:8443/mcp"
    assert settings.owner_lease_ttl == 4.5
    with pytest.raises(SettingsError, match="owner_lease_ttl"):
        load_settings({"owner_lease_ttl": 0})


async def test_the_store_has_answered_for_as_long_as_renewals_kept_succeeding() -> None:
    """What a takeover waits for (http/route.py): a whole lease of renewals that all succeeded. A failed
    renewal starts the count again."""
    registry, metrics, clock = FakeRegistry(failing=frozenset({2})), Metrics(), Clock()
    lease = Lease(registry, "pod-a", URL, 10.0, metrics, clock)
    assert lease.answered_for(clock.now) == 0.0  # nothing renewed yet: no evidence at all
    assert await lease.renew()
    first = lease.answering_since
    assert first is not None
    assert lease.answered_for(first + 12.0) == pytest.approx(12.0)
    assert not await lease.renew()  # the second fails: the good spell ends
    assert lease.answered_for(clock.now + 100.0) == 0.0
    assert await lease.renew()
    assert lease.answering_since is not None and lease.answering_since > first
    assert lease.answered_for(lease.answering_since + 3.0) == pytest.approx(3.0)


async def test_a_live_registration_of_the_same_replica_id_that_answers_as_it_is_a_duplicate() -> None:
    registry, metrics, clock = FakeRegistry(), Metrics(), Clock()
    asked: list[str] = []

    async def answers_as_pod_a(url: str) -> str | None:
        asked.append(url)
        return "pod-a"

    registry.entry = ReplicaEntry("http://10.0.0.6:8080/mcp", "other-process", clock.now + 60.0)
    lease = Lease(registry, "pod-a", URL, 10.0, metrics, clock, probe=answers_as_pod_a)
    with pytest.raises(DuplicateReplica, match=r"pod-a.*10\.0\.0\.6"):
        await lease.start()
    assert asked == ["http://10.0.0.6:8080/mcp"]
    assert registry.registrations == []  # the other process's registration is left alone


@pytest.mark.parametrize(
    "entry, answer",
    [
        (ReplicaEntry("http://10.0.0.6:8080/mcp", "old", 1e12), None),  # its previous process: silent
        (ReplicaEntry("http://10.0.0.6:8080/mcp", "old", 1e12), "pod-b"),  # the URL is another replica's now
        (ReplicaEntry("http://10.0.0.6:8080/mcp", "old", 0.0), "pod-a"),  # its lease ended: not checked
        (ReplicaEntry(URL, "old", 1e12), "pod-a"),  # this URL: this process's own address now
    ],
)
async def test_a_registration_that_is_not_a_live_twin_does_not_stop_the_start(
    entry: ReplicaEntry, answer: str | None
) -> None:
    registry, metrics, clock = FakeRegistry(), Metrics(), Clock()

    async def probe(url: str) -> str | None:
        return answer

    registry.entry = entry
    lease = Lease(registry, "pod-a", URL, 10.0, metrics, clock, probe=probe)
    await lease.start()
    try:
        assert len(registry.registrations) == 1
    finally:
        await lease.stop()
