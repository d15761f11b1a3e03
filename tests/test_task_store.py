"""store/tasks.py: one contract for the task records, run on both stores (memory, a real Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mcpresume.core import tasks as t
from mcpresume.core.tasks import Event, Status
from mcpresume.store.tasks import MemoryTasks, RedisTasks, TaskStore, task_key


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[TaskStore]:
    made: TaskStore
    if request.param == "memory":
        made = MemoryTasks()
    else:
        made = RedisTasks.from_url(request.getfixturevalue("redis_db"))
    yield made
    await made.close()


NOW = 1_800_000_000.0


def advanced(task: t.Task, event: Event, **fields: Any) -> t.Task:
    nxt = t.advance(task, event, NOW + 1, **fields)
    assert isinstance(nxt, t.Task)
    return nxt


async def test_a_created_task_reads_back_whole(store: TaskStore) -> None:
    task = t.new_task("id-1", "owner", b'{"a":1}', NOW, 60)
    await store.create(task, NOW)
    assert await store.get("id-1", NOW) == task
    assert await store.get("id-2", NOW) is None


async def test_advance_is_a_compare_and_set_on_the_status(store: TaskStore) -> None:
    task = t.new_task("id-1", "owner", b"{}", NOW, 60)
    await store.create(task, NOW)
    cancelled = advanced(task, Event.CANCEL, message="cancelled by the client")
    completed = advanced(task, Event.ANSWERED, result={"content": []})
    assert await store.advance(cancelled, Status.WORKING, NOW + 1)
    assert not await store.advance(completed, Status.WORKING, NOW + 2)  # the late answer loses
    assert await store.get("id-1", NOW + 2) == cancelled
    assert not await store.advance(completed, Status.WORKING, NOW + 2)
    assert not await store.advance(t.new_task("nope", "o", b"", NOW, 60), Status.WORKING, NOW)


async def test_a_task_expires_at_its_ttl(store: TaskStore) -> None:
    task = t.new_task("id-1", "owner", b"{}", NOW, 60)
    await store.create(task, NOW)
    assert await store.get("id-1", NOW + 59) is not None
    assert await store.get("id-1", NOW + 60) is None
    assert not await store.advance(advanced(task, Event.CANCEL), Status.WORKING, NOW + 61)


async def test_redis_keeps_a_task_no_longer_than_its_ttl(redis_db: str) -> None:
    store = RedisTasks.from_url(redis_db)
    try:
        import time

        now = time.time()
        await store.create(t.new_task("id-x", "o", b"{}", now, 30), now)
        ttl_ms = await store._client.pttl(task_key("id-x"))
        assert 0 < ttl_ms <= 30_000
        assert task_key("id-x").startswith("mcpresume:{task:")
    finally:
        await store.close()


async def test_memory_is_bounded() -> None:
    store = MemoryTasks(max_tasks=3)
    for n in range(5):
        await store.create(t.new_task(f"id-{n}", "o", b"", NOW + n, 60), NOW + n)
    assert len(store) == 3
    assert await store.get("id-0", NOW + 5) is None and await store.get("id-4", NOW + 5) is not None


async def test_memory_is_bounded_by_bytes_too() -> None:
    store = MemoryTasks(max_bytes=4000)
    big = {"content": [{"type": "text", "text": "x" * 1500}]}
    for n in range(4):
        task = t.new_task(f"id-{n}", "o", b"{}", NOW + n, 60)
        await store.create(task, NOW + n)
        assert await store.advance(advanced(task, Event.ANSWERED, result=big), Status.WORKING, NOW + n)
        assert store.bytes <= 4000
    assert await store.get("id-3", NOW + 5) is not None and await store.get("id-0", NOW + 5) is None
    assert store.expired >= 2


async def test_a_sweep_counts_each_expired_task_once(store: TaskStore) -> None:
    for n in range(3):
        await store.create(t.new_task(f"id-{n}", "o", b"{}", NOW, 60 + 10 * n), NOW)
    assert await store.sweep(NOW + 59) == 0
    assert await store.get("id-0", NOW + 60) is None  # read after its expiry: still counted once, below
    assert await store.sweep(NOW + 70) == 2
    assert await store.sweep(NOW + 70) == 0
    assert await store.sweep(NOW + 1000) == 1


async def test_with_redis_a_task_expiry_is_counted_by_one_replica_only(redis_db: str) -> None:
    one, two = RedisTasks.from_url(redis_db), RedisTasks.from_url(redis_db)
    try:
        for n in range(4):
            await one.create(t.new_task(f"id-{n}", "o", b"{}", NOW, 60), NOW)
        swept = await asyncio.gather(one.sweep(NOW + 60), two.sweep(NOW + 60))
        assert sorted(swept) == [0, 4]  # one script takes them all
        assert await one.sweep(NOW + 61) == await two.sweep(NOW + 61) == 0
    finally:
        await one.close()
        await two.close()
