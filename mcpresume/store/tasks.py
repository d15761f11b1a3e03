"""Task records (``core/tasks.py``): the port, and its two stores, in memory and in Redis.

A task is written whole when it is created and then only moved on by a compare-and-set on its status
(``advance``: applied only when the stored status is still the one the caller read), so two replicas that
race (the upstream's answer arriving on one, the client's ``tasks/cancel`` on another) cannot both win:
a cancelled task stays cancelled, a completed one completed.

Redis layout: one hash per task, ``mcpresume:{task:<sha256 of the id, 32 hex>}:t`` (its own hash tag: a
task is one key, on one cluster slot), fields ``s`` (the status), ``e`` (when it expires) and ``j`` (the
record, ``Task.to_json``), expiring with the task (``PEXPIREAT`` its ``expires_at``): nothing of a task
outlives ``task_ttl``. Beside them one sorted set, ``mcpresume:{tasks}:expiry`` (``EXPIRY_KEY``): each
live task's key digest scored by its ``expires_at``, so that its expiry, which Redis carries out silently,
is counted: ``sweep`` takes the expired out of it (``lua/task_sweep.lua``, one step: each counted once,
by one replica). It holds one short member per live task, taken out at the housekeeping round after its
expiry.
The compare-and-set is ``lua/task_advance.lua``; its twin is ``MemoryTasks.advance``.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any, Final, Protocol

from mcpresume.core.tasks import Status, Task, expired

# The memory store's bound on the tasks it keeps at once (the oldest-expiring go first beyond it): a task
# holds its call and its result, so this with max_event_bytes bounds what tasks hold.
MAX_MEMORY_TASKS: Final = 10_000
# ... and on the bytes their records hold (calls, results), whatever their count: 256 MiB, half the default
# max_total_window_bytes (the sessions' windows' bound), so a replica's tasks cannot outgrow its windows.
MAX_MEMORY_TASK_BYTES: Final = 256 << 20


class TaskStore(Protocol):
    async def create(self, task: Task, now: float) -> None:
        """Stored durably before the call returns (the client may poll it from any replica at once)."""

    async def get(self, task_id: str, now: float) -> Task | None:
        """The task, or None when it is unknown or expired."""

    async def advance(self, task: Task, expected: Status, now: float) -> bool:
        """Replace the record with ``task`` if its stored status is still ``expected`` (and it has not
        expired); whether it was."""

    async def sweep(self, now: float) -> int:
        """How many tasks expired (``now`` past their ``expires_at``, or, in memory, dropped for room)
        since the last sweep of any replica sharing the store: each counted by one sweep only."""

    async def close(self) -> None: ...


# The most expired tasks one sweep takes (the rest wait for the next round): one Redis call stays short.
SWEEP_BATCH: Final = 1000


class MemoryTasks:
    """Tasks in this process (the memory store's replicas are one process), bounded by count
    (``max_tasks``) and by the bytes of their records (``max_bytes``: a task holds its call and its result,
    each up to a few MiB). Beyond either, the tasks nearest their expiry go first (counted as expired)."""

    def __init__(self, max_tasks: int = MAX_MEMORY_TASKS, max_bytes: int = MAX_MEMORY_TASK_BYTES) -> None:
        self.max_tasks = max_tasks
        self.max_bytes = max_bytes
        self._tasks: dict[str, Task] = {}
        self._sizes: dict[str, int] = {}
        self.bytes = 0  # the records' bytes, as Task.to_json has them
        self.expired = 0  # tasks dropped at their expiry or for room, in all
        self._unswept = 0  # of which ``sweep`` has not reported yet

    def __len__(self) -> int:
        return len(self._tasks)

    def _drop(self, task_id: str) -> None:
        del self._tasks[task_id]
        self.bytes -= self._sizes.pop(task_id)
        self.expired += 1
        self._unswept += 1

    def _put(self, task: Task, now: float) -> None:
        """Keep ``task``, making room: the expired first, then those nearest their expiry."""
        size = len(task.to_json())
        if task.task_id in self._tasks:
            self.bytes -= self._sizes.pop(task.task_id)
            del self._tasks[task.task_id]
        if len(self._tasks) >= self.max_tasks or self.bytes + size > self.max_bytes:
            for tid in [tid for tid, t in self._tasks.items() if expired(t, now)]:
                self._drop(tid)
        while self._tasks and (len(self._tasks) >= self.max_tasks or self.bytes + size > self.max_bytes):
            self._drop(min(self._tasks.values(), key=lambda t: t.expires_at).task_id)
        self._tasks[task.task_id] = task
        self._sizes[task.task_id] = size
        self.bytes += size

    async def create(self, task: Task, now: float) -> None:
        self._put(task, now)

    async def get(self, task_id: str, now: float) -> Task | None:
        task = self._tasks.get(task_id)
        if task is not None and expired(task, now):
            self._drop(task_id)
            return None
        return task

    async def advance(self, task: Task, expected: Status, now: float) -> bool:
        stored = await self.get(task.task_id, now)
        if stored is None or stored.status is not expected:
            return False
        self._put(task, now)
        return True

    async def sweep(self, now: float) -> int:
        for tid in [tid for tid, t in self._tasks.items() if expired(t, now)]:
            self._drop(tid)
        swept, self._unswept = self._unswept, 0
        return swept

    async def close(self) -> None:
        self._tasks.clear()
        self._sizes.clear()
        self.bytes = 0


EXPIRY_KEY: Final = "mcpresume:{tasks}:expiry"


def task_digest(task_id: str) -> str:
    return hashlib.sha256(task_id.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def task_key(task_id: str) -> str:
    return f"mcpresume:{{task:{task_digest(task_id)}}}:t"


class RedisTasks:
    """Tasks in Redis, shared by every replica. ``client``: a redis-py asyncio client of its own (tasks
    are few and polled seconds apart: the plain client is enough)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        source = (resources.files("mcpresume.store") / "lua" / "task_advance.lua").read_text()
        self._advance = client.register_script(source)
        self._sweep = client.register_script(
            (resources.files("mcpresume.store") / "lua" / "task_sweep.lua").read_text()
        )

    @classmethod
    def from_url(cls, url: str) -> RedisTasks:
        from redis.asyncio import Redis

        return cls(Redis.from_url(url))

    async def create(self, task: Task, now: float) -> None:
        key = task_key(task.task_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"s": task.status.value, "e": repr(task.expires_at), "j": task.to_json()})
            pipe.pexpireat(key, max(1, round(task.expires_at * 1000)))
            await pipe.execute()
        # After the task: the index never names one that was not stored. A key of its own slot (not in the
        # task's MULTI), as Redis Cluster requires.
        await self._client.zadd(EXPIRY_KEY, {task_digest(task.task_id): task.expires_at})

    async def get(self, task_id: str, now: float) -> Task | None:
        raw = await self._client.hget(task_key(task_id), "j")
        if raw is None:
            return None
        task = Task.from_json(raw)
        # The key's expiry is the backstop; the record's own says the same with the callers' clock.
        return None if task.task_id != task_id or expired(task, now) else task

    async def advance(self, task: Task, expected: Status, now: float) -> bool:
        done = await self._advance(
            keys=[task_key(task.task_id)], args=[expected.value, task.status.value, task.to_json(), repr(now)]
        )
        return bool(done)

    async def sweep(self, now: float) -> int:
        return int(await self._sweep(keys=[EXPIRY_KEY], args=[repr(now), SWEEP_BATCH]))

    async def close(self) -> None:
        await self._client.aclose()
