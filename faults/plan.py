"""A fault plan: which faults, on what, when and for how long (pure: no I/O, no clock; seeded).

A plan is a list of **episodes**, one after the other with a recovery gap between them: an episode is one
fault, or two faults on different parts that overlap (the second starts while the first still holds). Every
duration is a multiple of the replicas' ``owner_lease_ttl`` (``lease``), so "past its lease" and "shorter than
the lease" hold whatever lease a campaign runs with.

| kind | what the nemesis does (``hold``: how long the fault holds) |
|---|---|
| ``kill_pod`` | SIGKILL a pod (sidecar: proxy and upstream; shared: proxy); after ``hold``, start it again |
| ``pause_proxy`` | SIGSTOP a pod's proxy for ``hold`` (past its lease), then SIGCONT |
| ``pause_redis_short`` | SIGSTOP redis-server for ``hold`` (half the lease), then SIGCONT |
| ``pause_redis_long`` | SIGSTOP redis-server for ``hold`` (past the lease), then SIGCONT |
| ``restart_redis`` | stop redis-server (SIGTERM: AOF synced); after ``hold``, start it on its port and data |
| ``redis_full`` | ``CONFIG SET maxmemory`` to the memory in use (``noeviction``) for ``hold``, then none |
| ``cut`` | the balancer cuts every client connection at once, three times within ``hold`` |
| ``restart_upstream`` | SIGKILL an upstream (sidecar: a pod's; shared: the one), start it again at once |

A pod starts again on the same port with the same replica id.

``save``/``load`` write and read a plan as JSON (``plan.json`` in every run's directory), so a run that found
something can be replayed with the same faults at the same offsets (``python -m faults --replay``).
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class FaultKind(enum.StrEnum):
    KILL_POD = "kill_pod"
    PAUSE_PROXY = "pause_proxy"
    PAUSE_REDIS_SHORT = "pause_redis_short"
    PAUSE_REDIS_LONG = "pause_redis_long"
    RESTART_REDIS = "restart_redis"
    REDIS_FULL = "redis_full"
    CUT = "cut"
    RESTART_UPSTREAM = "restart_upstream"


STORE_FAULTS = frozenset(
    {FaultKind.PAUSE_REDIS_SHORT, FaultKind.PAUSE_REDIS_LONG, FaultKind.RESTART_REDIS, FaultKind.REDIS_FULL}
)
"""Faults that make the shared store unavailable (a 503 ``store_unavailable`` tells the truth then)."""
REPLICA_FAULTS = frozenset({FaultKind.KILL_POD, FaultKind.PAUSE_PROXY})
"""Faults that take a replica away (an ``owner_*`` or ``misrouted_hop`` answer tells the truth then)."""

LAYOUTS = ("sidecar", "shared")
PODS = ("a", "b", "c")

# Each fault's hold, in leases (a kill_pod's hold is how long the pod stays down; the restart's own time
# comes on top). "Past its lease" is 1.5 leases and a second: the takeover needs the lease to lapse, and the
# replicas renew every third of it.
HOLD_LEASES: dict[FaultKind, float] = {
    FaultKind.KILL_POD: 1.5,
    FaultKind.PAUSE_PROXY: 1.5,
    FaultKind.PAUSE_REDIS_SHORT: 0.5,
    FaultKind.PAUSE_REDIS_LONG: 1.5,
    FaultKind.RESTART_REDIS: 1.2,
    FaultKind.REDIS_FULL: 1.5,
    FaultKind.CUT: 0.5,
    FaultKind.RESTART_UPSTREAM: 0.0,
}
HOLD_EXTRA: dict[FaultKind, float] = {
    FaultKind.PAUSE_PROXY: 1.0,
    FaultKind.PAUSE_REDIS_LONG: 1.0,
    FaultKind.RESTART_REDIS: 1.0,
    FaultKind.REDIS_FULL: 1.0,
    FaultKind.CUT: 1.0,
}


def hold(kind: FaultKind, lease: float) -> float:
    return round(HOLD_LEASES[kind] * lease + HOLD_EXTRA.get(kind, 0.0), 3)


def resource(kind: FaultKind, target: str) -> str:
    """What a fault holds: two faults of one episode never hold the same thing."""
    if kind in STORE_FAULTS:
        return "redis"
    return "balancer" if kind is FaultKind.CUT else target


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    target: str  # a pod ("a", "b", "c"), "redis", "balancer", or "shared" (the shared upstream)
    offset: float  # seconds after the campaign's start
    hold: float


@dataclass(frozen=True, slots=True)
class Plan:
    layout: str
    seed: int
    lease: float
    faults: tuple[tuple[Fault, ...], ...]  # episodes
    warmup: float
    gap: float  # the recovery gap between episodes
    span: float  # when the last episode's recovery gap ends (the faults' phase)

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "seed": self.seed,
            "lease": self.lease,
            "warmup": self.warmup,
            "gap": self.gap,
            "span": self.span,
            "episodes": [[{**asdict(f), "kind": str(f.kind)} for f in ep] for ep in self.faults],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        episodes = tuple(
            tuple(
                Fault(FaultKind(f["kind"]), str(f["target"]), float(f["offset"]), float(f["hold"]))
                for f in episode
            )
            for episode in data["episodes"]
        )
        return cls(
            str(data["layout"]),
            int(data["seed"]),
            float(data["lease"]),
            episodes,
            float(data["warmup"]),
            float(data["gap"]),
            float(data["span"]),
        )


def save(plan: Plan, path: Path) -> None:
    path.write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def load(path: Path) -> Plan:
    return Plan.from_json(json.loads(path.read_text()))


def _target(kind: FaultKind, layout: str, rng: random.Random) -> str:
    if kind in STORE_FAULTS:
        return "redis"
    if kind is FaultKind.CUT:
        return "balancer"
    if kind is FaultKind.RESTART_UPSTREAM and layout == "shared":
        return "shared"
    return rng.choice(PODS)


def _episode(kinds: list[FaultKind], layout: str, lease: float, rng: random.Random, at: float) -> list[Fault]:
    """One fault at ``at``, or two: the second on another part, starting within the first's hold."""
    first_kind = kinds[0]
    first = Fault(first_kind, _target(first_kind, layout, rng), round(at, 3), hold(first_kind, lease))
    episode = [first]
    for kind in kinds[1:]:
        target = _target(kind, layout, rng)
        taken = {resource(f.kind, f.target) for f in episode}
        tries = 0
        while resource(kind, target) in taken and tries < 10:
            target, tries = _target(kind, layout, rng), tries + 1
        if resource(kind, target) in taken:
            continue
        offset = at + round(rng.uniform(0.2, 0.7) * max(first.hold, 1.0), 3)
        episode.append(Fault(kind, target, round(offset, 3), hold(kind, lease)))
    return episode


def _pair(kinds: list[FaultKind], rng: random.Random, first: FaultKind | None = None) -> list[FaultKind]:
    """Two kinds that can overlap: not two faults of the store, not the same kind twice."""
    while True:
        one = first or rng.choice(kinds)
        two = rng.choice(kinds)
        if one is not two and not (one in STORE_FAULTS and two in STORE_FAULTS):
            return [one, two]


def _episode_end(episode: list[Fault], lease: float) -> float:
    # A kill_pod's pod takes about a lease to start again on a loaded machine; a restart_upstream's too.
    slack = {FaultKind.KILL_POD: lease, FaultKind.RESTART_UPSTREAM: lease}
    return max(f.offset + f.hold + slack.get(f.kind, 0.0) for f in episode)


def make_plan(
    layout: str,
    seed: int,
    lease: float,
    *,
    fault_seconds: float | None = None,
    overlaps: int = 2,
    warmup: float = 4.0,
    gap: float | None = None,
) -> Plan:
    """A seeded plan for ``layout``. ``fault_seconds`` None: the short plan, every kind once alone and
    ``overlaps`` episodes of two, in an order the seed shuffles. Else episodes drawn until the faults'
    phase lasts ``fault_seconds``: a third of them overlapping pairs, every kind about as often.
    ``gap``: the recovery gap between episodes (default: a lease)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    rng = random.Random(f"{seed}:{layout}")
    gap = lease if gap is None else gap
    kinds = list(FaultKind)
    groups: list[list[FaultKind]] = []
    if fault_seconds is None:
        groups = [[kind] for kind in kinds]
        for _ in range(overlaps):
            groups.append(_pair(kinds, rng))
        rng.shuffle(groups)
    episodes: list[list[Fault]] = []
    at = warmup
    index = 0
    while True:
        if fault_seconds is None:
            if index >= len(groups):
                break
            group = groups[index]
        else:
            if at - warmup >= fault_seconds:
                break
            if index % len(kinds) == 0:
                rng.shuffle(kinds)
            group = [kinds[index % len(kinds)]]
            if rng.random() < 1 / 3:
                group = _pair(kinds, rng, group[0])
        episode = _episode(group, layout, lease, rng, at)
        episodes.append(episode)
        at = _episode_end(episode, lease) + gap
        index += 1
    return Plan(layout, seed, lease, tuple(tuple(e) for e in episodes), warmup, gap, round(at, 3))
