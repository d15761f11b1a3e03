"""A handshake-era client made with the 1.x Python SDK (``mcp<2``, what the OpenAI Agents SDK pins), run by
that SDK's interpreter: ``python mcp1_client.py <MCP endpoint URL>``. It calls a tool with progress, pings,
calls a tool whose upstream asks for input (an elicitation it answers), and prints one JSON line.

It imports nothing of this repository: tests/test_bridge.py runs it with a venv of its own
(``~/.cache/mcpresume/mcp1``: ``python -m venv`` there, then ``pip install "mcp<2"``)."""

import asyncio
import json
import sys

from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client


async def main(url: str) -> None:
    asked = []

    async def elicit(context, params):
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"word": "quince"})

    progress = []

    async def on_progress(value, total, message):
        progress.append(value)

    async with (
        streamablehttp_client(url) as (read, write, _),
        ClientSession(read, write, elicitation_callback=elicit) as session,
    ):
        initialized = await session.initialize()
        counted = await session.call_tool("count_slowly", {"n": 3}, progress_callback=on_progress)
        await session.send_ping()
        answered = await session.call_tool("ask", {"question": "A fruit?"})
    text = lambda result: "".join(getattr(block, "text", "") for block in result.content)  # noqa: E731
    print(
        json.dumps(
            {
                "version": initialized.protocolVersion,
                "counted": text(counted),
                "progress": progress,
                "answered": text(answered),
                "asked": asked,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
