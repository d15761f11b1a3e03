"""OpenTelemetry traces: the only module that imports opentelemetry (the ``otel`` extra).

On when the extra is installed and the standard variables ask for traces: ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, or ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``: OTLP over HTTP/protobuf, the extra's; ``console``; ``none`` turns them off). Everything else is
the SDK's own reading of the ``OTEL_*`` variables: the service's name and resource attributes
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER``), the exporter's
endpoint, headers and time-out, the batch processor's sizes and delays (``OTEL_BSP_*``), the propagators
(``OTEL_PROPAGATORS``, W3C trace context by default).

A span per client request (``Proxy.handle``: begun when its handler starts, ended where the request is
counted), a child of the client's ``traceparent`` when it sent one; its context travels in ``traceparent``
on every request the proxy sends for it: to the upstream (``streams/upstream.py``, from the task of the
request and the tasks it started) and to the replica owning its session (``replicas/hop.py``), whose own
span is then its child. Off, each of those costs one attribute check.

No global state: each application has its own provider (several proxies in one process: the tests), shut
down (its last spans exported) when the application closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

log = logging.getLogger("mcpresume.tracing")

# The request headers that carry trace context (W3C): the proxy's own replace the client's on what it sends.
TRACE_HEADERS: Final = frozenset({"traceparent", "tracestate"})
# What the spans' instrumentation scope is called.
SCOPE: Final = "mcpresume"


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for traces."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none" or environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(exporter or endpoint)


class Span:
    """One request's span, and the context it is current in (ended by ``end``)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any, token: Any) -> None:
        self._span = span
        self._token = token

    def end(self, attributes: Mapping[str, str | int | bool], error: str | None) -> None:
        """Its attributes (None values left out), its status (``error``: the reason it failed), and its end;
        the context it was current in is left."""
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        span.set_attributes(attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        with contextlib.suppress(ValueError):  # a context left already (another task ended it): nothing
            context.detach(self._token)


class Tracing:
    """This application's tracer (``enabled``), or nothing at all."""

    def __init__(self, replica: str, version: str, environ: Mapping[str, str] | None = None) -> None:
        self.enabled = False
        self._provider: Any = None
        self._tracer: Any = None
        environ = os.environ if environ is None else environ
        if not wanted(environ):
            return
        try:
            self._setup(replica, version, environ)
        except ImportError as exc:
            log.warning(
                "OpenTelemetry variables are set but the otel extra is not installed (%s): no traces; "
                "pip install 'mcpresume[otel]'",
                exc.name,
            )
            return
        self.enabled = True

    def _setup(self, replica: str, version: str, environ: Mapping[str, str]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

        exporter_name = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
        exporter: SpanExporter
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        else:
            if exporter_name != "otlp":
                log.warning("OTEL_TRACES_EXPORTER=%s: otlp and console are built in; otlp", exporter_name)
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: the otel extra speaks http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        resource = Resource.create(
            {"service.name": "mcpresume", "service.version": version, "service.instance.id": replica}
        )
        if "OTEL_SERVICE_NAME" in environ:  # Resource.create lets the attribute above win: the variable wins
            resource = resource.merge(Resource({"service.name": environ["OTEL_SERVICE_NAME"]}))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE, version)

    def start(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, str | int]
    ) -> Span | None:
        """A server span for a request (a child of the trace context its ``headers`` carry), made the
        current context (so what is sent for the request carries it); None when off."""
        if not self.enabled:
            return None
        from opentelemetry import context, propagate, trace

        parent = propagate.extract(headers)
        span = self._tracer.start_span(name, parent, trace.SpanKind.SERVER, attributes)
        return Span(span, context.attach(trace.set_span_in_context(span, parent)))

    def inject(self, headers: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
        """``headers`` with the current trace context (``traceparent``, replacing any the client sent), when
        on and a span is current; else ``headers`` as they are."""
        if not self.enabled:
            return headers
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if not carrier:
            return headers
        kept = [(name, value) for name, value in headers if name.lower() not in TRACE_HEADERS]
        return kept + list(carrier.items())

    def flush(self) -> bool:
        """Export what is finished now (blocking: run it off the loop)."""
        return bool(self._provider.force_flush()) if self._provider is not None else True

    def shutdown(self) -> None:
        """Export the last spans, stop the exporter (blocking: run it off the loop)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.enabled = False


NO_TRACING: Final = Tracing("", "", {})
"""Off: what the parts that send requests hold until they are given this application's."""
