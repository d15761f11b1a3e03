"""An official-SDK upstream that offers what the MCP conformance suite's server scenarios call.

The server scenarios of ``@modelcontextprotocol/conformance`` (``conformance server --url ...``) act as a
client and expect named tools, resources and prompts (``test_simple_text``, ``test://static-text``,
``test_prompt_with_arguments``, ...), each answering in a stated shape. The bundled example upstream
(`mcpresume.examples.upstream`) has none of them, so this module builds one with the official Python SDK's
low-level `Server`: every handler returns exactly what its scenario asks for, schemas are passed through
as raw JSON (the SEP-1613 tool keeps its ``$schema``/``$defs``), and the Streamable HTTP transport and
session handling are the SDK's own, unmodified.

Server-to-client requests (sampling, elicitation) go, by ``server_requests``:
    ``"call"``: on the triggering call's own SSE stream (``related_request_id``), as the Python SDK's
        high-level ``Context`` sends them;
    ``"standalone"``: on the session's standalone GET stream, as the suite's reference server does (its
        ``server.request()`` has no related request). The SDK drops such a request when no GET stream is
        open, so the upstream depends on the client's GET reaching it before the call.

DNS-rebinding protection is the SDK's own by default; ``host_check="host-only"`` swaps it for a check that
reads ``Host`` alone, as the TypeScript SDK's does, the kind a proxy that rewrites ``Host`` defeats.

It lives under tests/ and not in `mcpresume.examples`: it exists only for the conformance test and is no
example of using the proxy. ``python -m tests.support.conformance_upstream --port 3001`` serves it alone,
for running the suite by hand; `upstream_process` starts it so for a test, in a process of its own. Run in
the proxy's own event loop it would hide races a real upstream shows: the loop takes the proxy's writes and
the upstream's reads in one order, where a server of its own reads each connection when its data arrives
(the standalone GET on a new connection and the call after it on an open one: read in either order).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.message import ServerMessageMetadata
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mcpresume.examples.event_store import InMemoryEventStore
from mcpresume.examples.upstream import MCP_PATH, RunningUpstream

__all__ = [
    "HostCheck",
    "HostOnlyCheck",
    "ServerRequests",
    "build_conformance_app",
    "build_conformance_server",
    "upstream_process",
]

ServerRequests = Literal["call", "standalone"]
HostCheck = Literal["sdk", "host-only"]

# A 1x1 PNG and a minimal WAV, base64, the sizes the suite's reference server uses.
TEST_IMAGE_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
TEST_AUDIO_BASE64 = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAAB9AAACABAAZGF0YQIAAAA="

# ``retry`` (ms) sent with priming events: short, so a client that polls (``test_reconnection``) is quick.
RETRY_INTERVAL_MS = 500

# How long a sampling or elicitation request waits for the client's answer. The SDK drops a request for the
# standalone stream while none is open; without a bound the call would hang until the client's own request
# timeout (60 s in the TS SDK). Far above a round trip on loopback, even on a loaded machine.
SERVER_REQUEST_TIMEOUT = 5.0

_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}}

# SEP-1613: the tool's input schema as raw JSON Schema 2020-12; the scenario checks it is listed unchanged.
JSON_SCHEMA_2020_12: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
    "additionalProperties": False,
}

# SEP-1034: a default for every primitive type.
ELICIT_DEFAULTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "User name", "default": "John Doe"},
        "age": {"type": "integer", "description": "User age", "default": 30},
        "score": {"type": "number", "description": "User score", "default": 95.5},
        "status": {
            "type": "string",
            "description": "User status",
            "enum": ["active", "inactive", "pending"],
            "default": "active",
        },
        "verified": {"type": "boolean", "description": "Verification status", "default": True},
    },
    "required": [],
}

# SEP-1330: the five enum shapes.
ELICIT_ENUMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "untitledSingle": {"type": "string", "enum": ["option1", "option2", "option3"]},
        "titledSingle": {
            "type": "string",
            "oneOf": [
                {"const": "value1", "title": "First Option"},
                {"const": "value2", "title": "Second Option"},
                {"const": "value3", "title": "Third Option"},
            ],
        },
        "legacyEnum": {
            "type": "string",
            "enum": ["opt1", "opt2", "opt3"],
            "enumNames": ["Option One", "Option Two", "Option Three"],
        },
        "untitledMulti": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {"type": "string", "enum": ["option1", "option2", "option3"]},
        },
        "titledMulti": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "anyOf": [
                    {"const": "value1", "title": "First Choice"},
                    {"const": "value2", "title": "Second Choice"},
                    {"const": "value3", "title": "Third Choice"},
                ]
            },
        },
    },
    "required": [],
}

ELICIT_SIMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "username": {"type": "string", "description": "User's response"},
        "email": {"type": "string", "description": "User's email address"},
    },
    "required": ["username", "email"],
}

TOOLS: tuple[types.Tool, ...] = (
    types.Tool(name="test_simple_text", description="Returns simple text content", input_schema=_NO_ARGS),
    types.Tool(name="test_image_content", description="Returns image content", input_schema=_NO_ARGS),
    types.Tool(name="test_audio_content", description="Returns audio content", input_schema=_NO_ARGS),
    types.Tool(
        name="test_embedded_resource", description="Returns an embedded resource", input_schema=_NO_ARGS
    ),
    types.Tool(
        name="test_multiple_content_types",
        description="Returns text, image and resource",
        input_schema=_NO_ARGS,
    ),
    types.Tool(name="test_tool_with_logging", description="Logs three messages", input_schema=_NO_ARGS),
    types.Tool(
        name="test_tool_with_progress", description="Reports progress 0, 50, 100", input_schema=_NO_ARGS
    ),
    types.Tool(name="test_error_handling", description="Returns a tool error", input_schema=_NO_ARGS),
    types.Tool(
        name="test_reconnection",
        description="Closes its SSE stream before answering (SEP-1699 polling)",
        input_schema=_NO_ARGS,
    ),
    types.Tool(
        name="test_sampling",
        description="Asks the client for an LLM completion",
        input_schema={"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
    ),
    types.Tool(
        name="test_elicitation",
        description="Asks the client for user input",
        input_schema={
            "type": "object",
            "properties": {"message": {"type": "string"}},
            "required": ["message"],
        },
    ),
    types.Tool(
        name="test_elicitation_sep1034_defaults",
        description="Elicitation with defaults (SEP-1034)",
        input_schema=_NO_ARGS,
    ),
    types.Tool(
        name="test_elicitation_sep1330_enums",
        description="Elicitation with enums (SEP-1330)",
        input_schema=_NO_ARGS,
    ),
    types.Tool(
        name="json_schema_2020_12_tool",
        description="A JSON Schema 2020-12 input schema (SEP-1613)",
        input_schema=JSON_SCHEMA_2020_12,
    ),
)

RESOURCES: tuple[types.Resource, ...] = (
    types.Resource(
        name="static-text", uri="test://static-text", description="Static text", mime_type="text/plain"
    ),
    types.Resource(
        name="static-binary", uri="test://static-binary", description="Static PNG", mime_type="image/png"
    ),
    types.Resource(
        name="watched-resource",
        uri="test://watched-resource",
        description="A resource to subscribe to",
        mime_type="text/plain",
    ),
)

RESOURCE_TEMPLATES: tuple[types.ResourceTemplate, ...] = (
    types.ResourceTemplate(
        name="template",
        uri_template="test://template/{id}/data",
        description="A template with an id",
        mime_type="application/json",
    ),
)

PROMPTS: tuple[types.Prompt, ...] = (
    types.Prompt(name="test_simple_prompt", description="A prompt without arguments"),
    types.Prompt(
        name="test_prompt_with_arguments",
        description="A prompt with two required arguments",
        arguments=[
            types.PromptArgument(name="arg1", description="First argument", required=True),
            types.PromptArgument(name="arg2", description="Second argument", required=True),
        ],
    ),
    types.Prompt(
        name="test_prompt_with_embedded_resource",
        description="A prompt that embeds a resource",
        arguments=[types.PromptArgument(name="resourceUri", description="URI to embed", required=True)],
    ),
    types.Prompt(name="test_prompt_with_image", description="A prompt with an image"),
)


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _image() -> types.ImageContent:
    return types.ImageContent(type="image", data=TEST_IMAGE_BASE64, mime_type="image/png")


def build_conformance_server(
    *, server_requests: ServerRequests = "call", listen: bool = False
) -> Server[Any]:
    """A low-level SDK `Server` whose handlers answer the conformance scenarios (see the module docstring).
    ``listen``: it serves 2026-07-28's ``subscriptions/listen`` too (the SDK's ``ListenHandler``), as a
    2026-07-28 server offering resource subscriptions does (its discover then says ``subscribe``)."""

    def request_metadata(ctx: ServerRequestContext[Any]) -> ServerMessageMetadata | None:
        if server_requests == "standalone":
            return None
        return ServerMessageMetadata(related_request_id=ctx.request_id)

    async def elicit(ctx: ServerRequestContext[Any], message: str, schema: dict[str, Any]) -> str:
        request = types.ElicitRequest(
            params=types.ElicitRequestFormParams(message=message, requested_schema=schema)
        )
        try:
            result = await ctx.session.send_request(
                request,
                types.ElicitResult,
                request_read_timeout_seconds=SERVER_REQUEST_TIMEOUT,
                metadata=request_metadata(ctx),
            )
        except Exception as exc:  # the scenario then reports that no elicitation reached the client
            return f"error: {exc!r}"
        return f"action={result.action}, content={json.dumps(result.content or {})}"

    async def sample(ctx: ServerRequestContext[Any], prompt: str) -> str:
        request = types.CreateMessageRequest(
            params=types.CreateMessageRequestParams(
                messages=[types.SamplingMessage(role="user", content=_text(prompt))], max_tokens=100
            )
        )
        try:
            result = await ctx.session.send_request(
                request,
                types.CreateMessageResult,
                request_read_timeout_seconds=SERVER_REQUEST_TIMEOUT,
                metadata=request_metadata(ctx),
            )
        except Exception as exc:
            return f"error: {exc!r}"
        content = result.content
        return content.text if isinstance(content, types.TextContent) else "No response"

    async def log(ctx: ServerRequestContext[Any], message: str) -> None:
        notification = types.LoggingMessageNotification(
            params=types.LoggingMessageNotificationParams(level="info", data=message)
        )
        await ctx.session.send_notification(notification, related_request_id=ctx.request_id)

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(TOOLS))

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        args = params.arguments or {}
        content: list[types.ContentBlock]
        match params.name:
            case "test_simple_text":
                content = [_text("This is a simple text response for testing.")]
            case "test_image_content":
                content = [_image()]
            case "test_audio_content":
                content = [types.AudioContent(type="audio", data=TEST_AUDIO_BASE64, mime_type="audio/wav")]
            case "test_embedded_resource":
                resource = types.TextResourceContents(
                    uri="test://embedded-resource",
                    mime_type="text/plain",
                    text="This is an embedded resource content.",
                )
                content = [types.EmbeddedResource(type="resource", resource=resource)]
            case "test_multiple_content_types":
                resource = types.TextResourceContents(
                    uri="test://mixed-content-resource",
                    mime_type="application/json",
                    text=json.dumps({"test": "data", "value": 123}),
                )
                content = [
                    _text("Multiple content types test:"),
                    _image(),
                    types.EmbeddedResource(type="resource", resource=resource),
                ]
            case "test_tool_with_logging":
                for step, message in enumerate(
                    ("Tool execution started", "Tool processing data", "Tool execution completed")
                ):
                    if step:
                        await asyncio.sleep(0.05)
                    await log(ctx, message)
                content = [_text("Tool with logging executed successfully")]
            case "test_tool_with_progress":
                for step, progress in enumerate((0, 50, 100)):
                    if step:
                        await asyncio.sleep(0.05)
                    await ctx.session.report_progress(progress, 100, f"Completed step {progress} of 100")
                token = ctx.meta.get("progress_token") if ctx.meta is not None else None
                content = [_text(str(token))]
            case "test_error_handling":
                return types.CallToolResult(
                    content=[_text("This tool intentionally returns an error for testing")], is_error=True
                )
            case "test_reconnection":
                # SEP-1699: end this request's SSE stream now; the answer follows on the client's re-attach.
                if ctx.close_sse_stream is not None:
                    await ctx.close_sse_stream()
                await asyncio.sleep(0.1)
                content = [_text("Reconnection test completed successfully.")]
            case "test_sampling":
                content = [_text(f"LLM response: {await sample(ctx, str(args.get('prompt', '')))}")]
            case "test_elicitation":
                answer = await elicit(ctx, str(args.get("message", "")), ELICIT_SIMPLE_SCHEMA)
                content = [_text(f"User response: {answer}")]
            case "test_elicitation_sep1034_defaults":
                answer = await elicit(ctx, "Please review the fields with defaults", ELICIT_DEFAULTS_SCHEMA)
                content = [_text(f"Elicitation completed: {answer}")]
            case "test_elicitation_sep1330_enums":
                answer = await elicit(ctx, "Please select options from the enum fields", ELICIT_ENUMS_SCHEMA)
                content = [_text(f"Elicitation completed: {answer}")]
            case "json_schema_2020_12_tool":
                content = [_text(f"JSON Schema 2020-12 tool called with: {json.dumps(args)}")]
            case _:
                return types.CallToolResult(content=[_text(f"Unknown tool: {params.name}")], is_error=True)
        return types.CallToolResult(content=content)

    async def list_resources(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=list(RESOURCES))

    async def list_resource_templates(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=list(RESOURCE_TEMPLATES))

    async def read_resource(
        ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        uri = str(params.uri)
        contents: list[types.TextResourceContents | types.BlobResourceContents]
        if uri == "test://static-text":
            text = "This is the content of the static text resource."
            contents = [types.TextResourceContents(uri=uri, mime_type="text/plain", text=text)]
        elif uri == "test://static-binary":
            contents = [types.BlobResourceContents(uri=uri, mime_type="image/png", blob=TEST_IMAGE_BASE64)]
        elif uri == "test://watched-resource":
            contents = [
                types.TextResourceContents(uri=uri, mime_type="text/plain", text="Watched resource content")
            ]
        elif uri.startswith("test://template/") and uri.endswith("/data"):
            item = uri.removeprefix("test://template/").removesuffix("/data")
            body = json.dumps({"id": item, "templateTest": True, "data": f"Data for ID: {item}"})
            contents = [types.TextResourceContents(uri=uri, mime_type="application/json", text=body)]
        else:
            contents = []
        return types.ReadResourceResult(contents=contents)

    async def subscribe(
        ctx: ServerRequestContext[Any], params: types.SubscribeRequestParams
    ) -> types.EmptyResult:
        return types.EmptyResult()

    async def unsubscribe(
        ctx: ServerRequestContext[Any], params: types.UnsubscribeRequestParams
    ) -> types.EmptyResult:
        return types.EmptyResult()

    async def list_prompts(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=list(PROMPTS))

    async def get_prompt(
        ctx: ServerRequestContext[Any], params: types.GetPromptRequestParams
    ) -> types.GetPromptResult:
        args = params.arguments or {}
        messages: list[types.PromptMessage]
        match params.name:
            case "test_simple_prompt":
                messages = [
                    types.PromptMessage(role="user", content=_text("This is a simple prompt for testing."))
                ]
            case "test_prompt_with_arguments":
                text = f"Prompt with arguments: arg1='{args.get('arg1')}', arg2='{args.get('arg2')}'"
                messages = [types.PromptMessage(role="user", content=_text(text))]
            case "test_prompt_with_embedded_resource":
                resource = types.TextResourceContents(
                    uri=args.get("resourceUri", "test://example-resource"),
                    mime_type="text/plain",
                    text="Embedded resource content for testing.",
                )
                messages = [
                    types.PromptMessage(
                        role="user", content=types.EmbeddedResource(type="resource", resource=resource)
                    ),
                    types.PromptMessage(
                        role="user", content=_text("Please process the embedded resource above.")
                    ),
                ]
            case "test_prompt_with_image":
                messages = [
                    types.PromptMessage(role="user", content=_image()),
                    types.PromptMessage(role="user", content=_text("Please analyze the image above.")),
                ]
            case _:
                messages = []
        return types.GetPromptResult(messages=messages)

    async def complete(
        ctx: ServerRequestContext[Any], params: types.CompleteRequestParams
    ) -> types.CompleteResult:
        return types.CompleteResult(completion=types.Completion(values=[], total=0, has_more=False))

    async def set_logging_level(
        ctx: ServerRequestContext[Any], params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        return types.EmptyResult()

    with warnings.catch_warnings():
        # Logging is deprecated in the 2026-07-28 revision; the scenarios speak 2025-11-25, where it is not.
        warnings.simplefilter("ignore")
        return Server(
            "mcpresume-conformance-upstream",
            version="1.0.0",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
            on_list_resources=list_resources,
            on_list_resource_templates=list_resource_templates,
            on_read_resource=read_resource,
            on_subscribe_resource=subscribe,
            on_unsubscribe_resource=unsubscribe,
            on_list_prompts=list_prompts,
            on_get_prompt=get_prompt,
            on_completion=complete,
            on_set_logging_level=set_logging_level,
            on_subscriptions_listen=ListenHandler(InMemorySubscriptionBus()) if listen else None,
        )


LOOPBACK_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


class HostOnlyCheck:
    """DNS-rebinding protection that reads ``Host`` alone: 403 unless its name is a loopback name (any
    port). That is the check the TypeScript SDK's loopback servers make (``Origin`` is not read); the
    Python SDK's also rejects a foreign ``Origin``, which hides a proxy that rewrites ``Host``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.lower() not in LOOPBACK_HOST_NAMES:
                await PlainTextResponse("Invalid Host header", status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_conformance_app(
    *, server_requests: ServerRequests = "call", host_check: HostCheck = "sdk", listen: bool = False
) -> ASGIApp:
    """The conformance upstream's Streamable HTTP app at ``/mcp``, with an event store (priming events,
    ``Last-Event-ID`` replay). DNS-rebinding protection, by ``host_check``: ``"sdk"``, the SDK's default for
    a loopback server (only loopback ``Host`` and ``Origin`` values, any port); ``"host-only"``,
    `HostOnlyCheck` in its place."""
    server = build_conformance_server(server_requests=server_requests, listen=listen)
    security = (
        None if host_check == "sdk" else TransportSecuritySettings(enable_dns_rebinding_protection=False)
    )
    app: Starlette = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        event_store=InMemoryEventStore(),
        retry_interval=RETRY_INTERVAL_MS,
        session_idle_timeout=None,
        transport_security=security,
        host="127.0.0.1",
    )
    return app if host_check == "sdk" else HostOnlyCheck(app)


_READY = "conformance upstream at "

# How long the upstream's process may take to print its URL: an interpreter importing the SDK, Starlette
# and uvicorn (about a second), on a loaded machine.
START_TIMEOUT = 60.0

# The repository's root: the process runs ``-m tests.support.conformance_upstream`` from there.
_ROOT = Path(__file__).resolve().parents[2]


async def _serve(
    port: int, server_requests: ServerRequests, host_check: HostCheck, modern_only: bool = False
) -> None:
    app = build_conformance_app(server_requests=server_requests, host_check=host_check, listen=modern_only)
    if modern_only:  # the handshake era refused as a 2026-07-28-only server does (the era bridge's upstream)
        from tests.support.modern_upstream import ModernOnly

        app = ModernOnly(app)
    async with RunningUpstream(app, port=port) as upstream:
        print(f"{_READY}{upstream.url}", flush=True)
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def upstream_process(
    *, server_requests: ServerRequests = "call", host_check: HostCheck = "sdk", modern_only: bool = False
) -> AsyncIterator[str]:
    """The conformance upstream served by a Python process of its own, on a free port; yields its MCP
    endpoint's URL, and kills the process on exit (see the module docstring for why not in the test's
    loop)."""
    args = ["--port", "0", "--server-requests", server_requests, "--host-check", host_check]
    if modern_only:
        args.append("--modern-only")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.conformance_upstream",
        *args,
        cwd=_ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(START_TIMEOUT):
            line = (await proc.stdout.readline()).decode(errors="replace").strip()
        if not line.startswith(_READY):
            raise RuntimeError(f"the conformance upstream did not start (exit {await proc.wait()}): {line!r}")
        yield line.removeprefix(_READY)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=3001)
    parser.add_argument("--server-requests", choices=["call", "standalone"], default="call")
    parser.add_argument("--host-check", choices=["sdk", "host-only"], default="sdk")
    parser.add_argument(
        "--modern-only", action="store_true", help="refuse the handshake era (2026-07-28 only)"
    )
    args = parser.parse_args()
    asyncio.run(_serve(args.port, args.server_requests, args.host_check, args.modern_only))


if __name__ == "__main__":
    main()
