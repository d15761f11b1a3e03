"""An official-SDK upstream (the low-level ``Server``) that keeps per-session state set by the session-shaping
requests and tells it: ``logging/setLevel`` and ``resources/subscribe``/``unsubscribe`` change the
session's state, and the tool ``state`` answers it as JSON (``{"level": ..., "subscriptions": [...]}``);
the tool ``touch`` sends ``notifications/resources/updated`` for each URI the session subscribes to, on the
session's standalone stream (as a server does when a resource changes).

What ``upstream_session_lost = "reinitialize"`` must bring back after the upstream lost a session, made
visible: a session begun again upstream with its shaping requests replayed tells the same state. Served by a
process of its own (``python -m tests.support.shaped_upstream --port N``), so a test can kill it -9 and
start it again on the same port; it prints ``shaped upstream at <url>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import warnings
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server

from mcpresume.examples.upstream import MCP_PATH, RunningUpstream

READY = "shaped upstream at "

_STATE_TOOL = types.Tool(
    name="state", description="This session's level and subscriptions", input_schema={"type": "object"}
)
_TOUCH_TOOL = types.Tool(
    name="touch",
    description="notifications/resources/updated for each subscribed URI, on the standalone stream",
    input_schema={"type": "object"},
)
_ADD_TOOL = types.Tool(
    name="add",
    description="a + b",
    input_schema={"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
)


class _ListChanging(Server[Any]):
    """Announces ``tools.listChanged`` (the low-level server's default is false): a session begun again
    upstream is followed by ``notifications/tools/list_changed`` to the client."""

    def create_initialization_options(
        self, notification_options: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        return super().create_initialization_options(NotificationOptions(tools_changed=True), *args, **kwargs)


def build_server() -> Server[Any]:
    sessions: dict[str, dict[str, Any]] = {}  # the session's id (its requests' Mcp-Session-Id) -> its state

    def state(ctx: ServerRequestContext[Any]) -> dict[str, Any]:
        request: Any = ctx.request
        session_id = str(request.headers.get("mcp-session-id")) if request is not None else ""
        return sessions.setdefault(session_id, {"level": None, "subscriptions": set()})

    async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[_STATE_TOOL, _TOUCH_TOOL, _ADD_TOOL])

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name == "add":
            args = params.arguments or {}
            text = str(int(args.get("a", 0)) + int(args.get("b", 0)))
        elif params.name == "touch":
            uris = sorted(state(ctx)["subscriptions"])
            for uri in uris:  # no related request: the session's standalone stream carries them
                await ctx.session.send_resource_updated(uri)
            text = str(len(uris))
        else:
            kept = state(ctx)
            text = json.dumps({"level": kept["level"], "subscriptions": sorted(kept["subscriptions"])})
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])

    async def list_resources(ctx: ServerRequestContext[Any], params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])

    async def subscribe(
        ctx: ServerRequestContext[Any], params: types.SubscribeRequestParams
    ) -> types.EmptyResult:
        state(ctx)["subscriptions"].add(str(params.uri))
        return types.EmptyResult()

    async def unsubscribe(
        ctx: ServerRequestContext[Any], params: types.UnsubscribeRequestParams
    ) -> types.EmptyResult:
        state(ctx)["subscriptions"].discard(str(params.uri))
        return types.EmptyResult()

    async def set_level(
        ctx: ServerRequestContext[Any], params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        state(ctx)["level"] = str(params.level)
        return types.EmptyResult()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # logging is deprecated in a later revision; 2025-11-25 has it
        return _ListChanging(
            "mcpresume-shaped-upstream",
            version="1.0.0",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
            on_list_resources=list_resources,
            on_subscribe_resource=subscribe,
            on_unsubscribe_resource=unsubscribe,
            on_set_logging_level=set_level,
        )


async def _serve(port: int) -> None:
    app = build_server().streamable_http_app(streamable_http_path=MCP_PATH, session_idle_timeout=None)
    async with RunningUpstream(app, port=port) as upstream:
        print(f"{READY}{upstream.url}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="an SDK upstream that tells its session's shaped state")
    parser.add_argument("--port", type=int, default=3002)
    asyncio.run(_serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
