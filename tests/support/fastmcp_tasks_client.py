"""Run by a venv holding FastMCP 4 and fastmcp-tasks (tests/test_tasks.py builds it), not by pytest: a real
client that declares the tasks extension calls a slow tool through the proxy with ``call_tool_task`` and
prints, as one JSON line, the handle's task id and status and the result it polls to."""

from __future__ import annotations

import asyncio
import json
import sys

from fastmcp import Client
from fastmcp_tasks import call_tool_task


async def main(url: str, n: int, delay: float) -> None:
    async with Client(url, auth="alice-token") as client:
        task = await call_tool_task(client, "count_slowly", {"n": n, "delay": delay})
        handle = task.create_result
        result = await task.result()
        print(
            json.dumps(
                {
                    "task_id": task.task_id,
                    "status": handle.status,
                    "poll_interval_ms": handle.poll_interval_ms,
                    "result": result.structured_content,
                }
            )
        )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
