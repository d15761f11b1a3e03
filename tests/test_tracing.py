"""OpenTelemetry traces (the otel extra), exported by the real SDK and OTLP/HTTP exporter to a real receiver
started here: an aiohttp server that decodes the protobuf requests with opentelemetry-proto, as a collector
would. A span per request with its MCP attributes; ``traceparent`` to the upstream and across the hop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mcpresume.core.window import WindowLimits
from mcpresume.process.logs import log_id
from mcpresume.process.tracing import wanted
from mcpresume.store.memory import MemoryStore
from tests.support import playbook as pb
from tests.support.pods import pods
from tests.support.proxy import ScriptedClient, collect, running_proxy

pytest.importorskip("opentelemetry.sdk", reason="the otel extra")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ServeApp = Callable[[web.Application], Coroutine[Any, Any, str]]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _values(attributes: Any) -> dict[str, Any]:
    out = {}
    for kv in attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, list[ReceivedSpan]]]:
    """An OTLP/HTTP trace receiver on a free port: its base URL (OTEL_EXPORTER_OTLP_ENDPOINT) and the spans
    it decoded."""
    spans: list[ReceivedSpan] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = _values(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            _values(span.attributes),
                            resource,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", spans
    finally:
        await runner.cleanup()


def _traceparent(value: str | None) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent."""
    assert value is not None
    version, trace_id, parent_id, _flags = value.split("-")
    assert version == "00"
    return trace_id, parent_id


SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


def test_traces_are_on_only_when_the_standard_variables_ask() -> None:
    assert not wanted({})
    assert wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not wanted({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})


async def test_a_span_per_request_with_its_mcp_attributes_and_traceparent_to_the_upstream(
    serve: ServeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.sse(pb.event(pb.progress(1)), pb.event(pb.result({"ok": True}))))
    url = await serve(upstream.app())
    async with otlp_receiver() as (endpoint, spans):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "mcp-gateway")
        async with running_proxy(url, replica_id="pod-a") as proxy, aiohttp.ClientSession() as http:
            assert proxy.ctx.tracing.enabled
            client = ScriptedClient(http, proxy.url)
            # The client's own trace context: the proxy's span is its child.
            client_parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            async with http.post(
                client.url, data=_initialize(), headers=client.headers(**client_parent)
            ) as response:
                client.session_id = response.headers["Mcp-Session-Id"]
                await response.read()
            _, body = client.tool_call("slow", {})
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                events = await collect(response)
            cursor = next(e.id for e in events if e.id).decode()
            resume = client.headers(**{"Last-Event-ID": cursor, "Accept": "text/event-stream"})
            async with http.get(client.url, headers=resume) as response:
                await response.read()
            async with http.get(client.url, headers=resume | {"Last-Event-ID": "garbage"}) as response:
                assert response.status == 400
        # Stopped: the application's provider was shut down, its last spans exported.
    assert [(s.name, s.kind) for s in spans] == [("POST /mcp", SERVER)] * 2 + [("GET /mcp", SERVER)] * 2
    initialize, call, reattach, refused = spans
    session = log_id(pb.SESSION)
    assert initialize.resource["service.name"] == "mcp-gateway"
    assert initialize.resource["service.instance.id"] == "pod-a"
    assert (initialize.trace_id, initialize.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert initialize.attributes["mcp.method.name"] == "initialize"
    assert call.attributes["mcp.method.name"] == "tools/call"
    for span in spans:
        assert span.attributes["mcpresume.session"] == session
        assert span.attributes["mcpresume.replica"] == "pod-a"
        assert span.attributes["http.request.method"] in ("GET", "POST")
    assert [s.attributes["mcpresume.action"] for s in spans] == [
        "forwarded",
        "forwarded",
        "reattached",
        "refused",
    ]
    assert [s.attributes["http.response.status_code"] for s in spans] == [200, 200, 200, 400]
    assert reattach.attributes["mcpresume.resume.outcome"] == "reattach"
    assert refused.attributes["mcpresume.resume.outcome"] == "malformed_cursor"
    assert refused.attributes["error.type"] == "malformed_cursor"
    assert "mcpresume.resume.outcome" not in call.attributes
    assert pb.SESSION not in str([s.attributes for s in spans])  # the hash, never the id
    # The upstream saw each forwarded request with the proxy's span as its parent (the client's replaced).
    seen = {s.method: s for s in upstream.requests(http="POST")}
    assert _traceparent(seen["initialize"].header("traceparent")) == (CLIENT_TRACE, initialize.span_id)
    assert _traceparent(seen["tools/call"].header("traceparent")) == (call.trace_id, call.span_id)


async def test_traceparent_crosses_the_hop_to_the_owner_replica(
    serve: ServeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b forwards a call of a's session to a: a's span is the child of b's, a's upstream request the child
    of a's; one trace."""
    upstream = pb.Playbook()
    upstream.on("tools/call", pb.sse(pb.event(pb.result({"ok": True}))))
    url = await serve(upstream.app())
    store = MemoryStore(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=100, retry_ms=100)
    async with otlp_receiver() as (endpoint, spans):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with pods(store, 2, shared_upstream=url) as (a, b), aiohttp.ClientSession() as http:
            client = ScriptedClient(http, a.url)
            async with http.post(client.url, data=_initialize(), headers=client.headers()) as response:
                client.session_id = response.headers["Mcp-Session-Id"]
                await response.read()
            spans_before = len(spans)
            _, body = client.tool_call("on-b", {})
            async with http.post(b.url, data=body, headers=client.headers()) as response:
                assert response.status == 200
                await response.read()
    calls = [s for s in spans if s.attributes.get("mcp.method.name") == "tools/call"]
    assert spans_before == 0 and len(calls) == 2
    (on_b,) = [s for s in calls if s.attributes["mcpresume.replica"] == "pod-b"]
    (on_a,) = [s for s in calls if s.attributes["mcpresume.replica"] == "pod-a"]
    assert on_b.attributes["mcpresume.action"] == "hopped" and on_b.attributes["mcpresume.hop"] == a.url
    assert on_a.attributes["mcpresume.action"] == "forwarded"
    assert on_a.trace_id == on_b.trace_id and on_a.parent_id == on_b.span_id
    (sent,) = upstream.requests("tools/call")
    assert _traceparent(sent.header("traceparent")) == (on_a.trace_id, on_a.span_id)


def _initialize() -> bytes:
    import orjson

    return orjson.dumps(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t"}},
        }
    )
