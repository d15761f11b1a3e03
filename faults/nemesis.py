"""The nemesis: carries a `faults.plan.Plan` out against a `faults.cluster.Cluster`, each fault at its offset
from the campaign's start, recording its window (``fault`` records, phase ``start`` then ``end``) around what
it does; the processes it touches are recorded by the cluster (``proc`` records, with their pids).

A fault always ends what it began (a stopped process is continued, a killed pod started again, Redis's
``maxmemory`` restored), even when the campaign is interrupted.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from faults.cluster import Cluster
from faults.history import JsonLines
from faults.plan import Fault, FaultKind, Plan

CUTS = 3  # a cut fault cuts every client connection this many times within its hold


async def _fault(cluster: Cluster, fault: Fault) -> None:
    kind, target, hold = fault.kind, fault.target, fault.hold
    if kind is FaultKind.KILL_POD:
        cluster.kill_pod(target)
        try:
            await asyncio.sleep(hold)
        finally:
            await cluster.start_pod(target)
    elif kind is FaultKind.PAUSE_PROXY:
        proxy = cluster.proxies[target]
        cluster.pause(proxy)
        try:
            await asyncio.sleep(hold)
        finally:
            cluster.resume(proxy)
    elif kind in (FaultKind.PAUSE_REDIS_SHORT, FaultKind.PAUSE_REDIS_LONG):
        cluster.pause(cluster.redis)
        try:
            await asyncio.sleep(hold)
        finally:
            cluster.resume(cluster.redis)
    elif kind is FaultKind.RESTART_REDIS:
        await cluster.stop_redis()
        try:
            await asyncio.sleep(hold)
        finally:
            await cluster.start_proc(cluster.redis)
    elif kind is FaultKind.REDIS_FULL:
        used = await cluster.fill_redis()
        cluster.log.write("redis_full", maxmemory=used)
        try:
            await asyncio.sleep(hold)
        finally:
            await cluster.unfill_redis()
    elif kind is FaultKind.CUT:
        for index in range(CUTS):
            cluster.log.write("cut", connections=cluster.balancer.cut())
            if index < CUTS - 1:
                await asyncio.sleep(hold / (CUTS - 1))
    elif kind is FaultKind.RESTART_UPSTREAM:
        upstream = cluster.upstream_of(target)
        cluster.kill(upstream)
        await asyncio.sleep(hold)
        await cluster.start_proc(upstream)
    else:  # pragma: no cover - every kind is above
        raise ValueError(f"unknown fault kind {kind}")


async def run(plan: Plan, cluster: Cluster, log: JsonLines, t0: float) -> None:
    """Every episode of ``plan`` at ``t0`` + its offset, or a recovery gap after the one before ended if
    that one ran late (a slow restart); returns when the last fault has ended."""
    ids = itertools.count(1)

    async def one(fault: Fault, episode: int, at: float) -> None:
        fault_id = next(ids)
        await asyncio.sleep(max(0.0, at - time.time()))
        fields = {"id": fault_id, "kind": str(fault.kind), "target": fault.target, "episode": episode}
        log.write("fault", phase="start", hold=fault.hold, **fields)
        try:
            await _fault(cluster, fault)
        finally:
            log.write("fault", phase="end", **fields)

    ended = t0
    for episode, faults in enumerate(plan.faults, start=1):
        start = max(t0 + faults[0].offset, ended + plan.gap)
        await asyncio.gather(*(one(f, episode, start + f.offset - faults[0].offset) for f in faults))
        ended = time.time()
