"""Prometheus metrics: the only module that imports prometheus_client.

Everything is registered on a ``CollectorRegistry`` built at start-up and passed down (never the global
registry), so several proxies can live in one process (tests) and nothing leaks between them. Besides the
proxy's own: ``mcpresume_build_info{version}`` (always 1: which version runs where) and the standard
``process_*`` metrics of prometheus_client's process collector (CPU, memory, descriptors, start time).

No ``*_created`` series: prometheus_client adds one to every counter and histogram (their creation time, a
gauge nobody graphs, doubling the series count); the registry is rendered without them
(``WithoutCreated``), this registry only (``disable_created_metrics`` would change every registry of the
process).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from mcpresume import __version__
from mcpresume.core.errors import TooManyAttachments
from mcpresume.core.pump import Abandon
from mcpresume.core.resume import OUTCOMES
from mcpresume.core.route import FORWARD_OUTCOMES
from mcpresume.core.window import Evicted, EvictReason
from mcpresume.store import StoreStats

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


TAKEOVER_OUTCOMES: Final = ("taken", "nothing_left", "owner_alive", "too_soon")


class WithoutCreated(Collector):
    """A registry's metrics as it collects them, less every ``*_created`` sample."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self.registry.collect():  # fresh Metric objects at each collection: changed in place
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._exposed = WithoutCreated(r)
        Info("mcpresume_build", "The version of mcpresume running (the value is always 1).", registry=r).info(
            {"version": __version__}
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.requests = Counter(
            "mcpresume_requests",
            "Client requests, by method and the status they were answered (499: the client left, or the "
            "shutdown ended it, before any answer), each counted once when it ends.",
            ["method", "status"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "mcpresume_upstream_errors", "Upstream failures, by reason.", ["reason"], registry=r
        )
        self.upstream_reinitializations = Counter(
            "mcpresume_upstream_reinitializations",
            "Sessions begun again upstream after the upstream lost them (upstream_session_lost = "
            "reinitialize), by outcome (core.reinit.Outcome).",
            ["outcome"],
            registry=r,
        )
        self.open_streams = Gauge("mcpresume_open_streams", "Client SSE responses open now.", registry=r)
        self.client_connections = Gauge(
            "mcpresume_client_connections", "Client connections open now (max_connections).", registry=r
        )
        self.refused_connections = Counter(
            "mcpresume_refused_connections",
            "Client connections turned away at max_connections, by how: refused (a new one answered 503) "
            "or evicted (the oldest one still without a request head closed to make room).",
            ["how"],
            registry=r,
        )
        for how in ("refused", "evicted"):
            self.refused_connections.labels(how)
        self.resumptions = Counter(
            "mcpresume_resumptions",
            "Resume requests (Last-Event-ID), by outcome: reattach (its view admitted), or the rejection "
            "reason (the decision's, or too_many_attachments).",
            ["outcome"],
            registry=r,
        )
        # Exported at 0 from the start: a ratio or rate() sees the first one. A re-attach the decision
        # accepted is counted once its view is admitted: reattach, or too_many_attachments (429).
        for outcome in (*OUTCOMES, TooManyAttachments.reason):
            self.resumptions.labels(outcome)
        self.resume_latency = Histogram(
            "mcpresume_resume_latency_seconds",
            "Seconds from a re-attach's request to its view sending what the window holds after the cursor "
            "(its first events, or finding none to send).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.replayed_events = Counter(
            "mcpresume_replayed_events", "Events sent from the window on re-attach.", registry=r
        )
        self.sessions = Gauge("mcpresume_sessions", "Sessions tracked.", registry=r)
        self.window_events = Gauge("mcpresume_window_events", "Events retained, all sessions.", registry=r)
        self.window_bytes = Gauge(
            "mcpresume_window_bytes",
            "Bytes of events retained (SSE events, id lines aside), all sessions.",
            registry=r,
        )
        self.evicted_events = Counter(
            "mcpresume_evicted_events",
            "Events evicted from windows, by reason: count, bytes, ttl, global_bytes; and undelivered, "
            "the subset no client ever received.",
            ["reason"],
            registry=r,
        )
        self.evicted_bytes = Counter(
            "mcpresume_evicted_bytes", "Bytes evicted from windows, by reason.", ["reason"], registry=r
        )
        # Each reason's pair of children, made once (every series is exported from the start, at 0):
        # labels() costs about a microsecond, and every append to a full window evicts.
        self._evicted = {
            reason: (self.evicted_events.labels(reason), self.evicted_bytes.labels(reason))
            for reason in [*(r.value for r in EvictReason), "undelivered"]
        }
        self.duplicate_requests = Counter(
            "mcpresume_duplicate_requests",
            "Requests whose JSON-RPC id was already seen in the session (not forwarded again).",
            registry=r,
        )
        self.era_requests = Counter(
            "mcpresume_era_requests",
            "POSTs to the MCP endpoint by protocol era (handshake, modern) and what the proxy does for them "
            "(resumable, bridged, passed_through, task).",
            ["era", "treatment"],
            registry=r,
        )
        self.upstream_events = Counter(
            "mcpresume_upstream_events", "Events read from upstream streams.", registry=r
        )
        self.synthesized_errors = Counter(
            "mcpresume_synthesized_errors",
            "JSON-RPC error responses the proxy made for a request whose upstream stream was lost.",
            ["reason"],
            registry=r,
        )
        self.abandoned_streams = Counter(
            "mcpresume_abandoned_streams",
            "Upstream streams the proxy closed before their end because no client read them, by reason: "
            "cancelled (every request of it cancelled, unread for cancel_grace; no answer), unattended "
            "(unread, and no upstream event, for session_ttl; its requests get upstream_stream_lost).",
            ["reason"],
            registry=r,
        )
        for abandon in Abandon:
            self.abandoned_streams.labels(abandon.value)
        self.tasks = Counter(
            "mcpresume_tasks",
            "Durable long calls (2026-07-28 tools/call made a task), by event: created, completed, failed, "
            "cancelled, expired.",
            ["event"],
            registry=r,
        )
        for event in ("created", "completed", "failed", "cancelled", "expired"):
            self.tasks.labels(event)
        self.task_polls = Counter("mcpresume_task_polls", "tasks/get the proxy answered.", registry=r)
        self.upstream_resumptions = Counter(
            "mcpresume_upstream_resumptions",
            "Upstream streams the proxy tried to resume itself, by outcome: resumed, refused, exhausted, "
            "not_resumable (no event ids).",
            ["outcome"],
            registry=r,
        )
        self.upstream_duplicates = Counter(
            "mcpresume_upstream_duplicates",
            "Upstream events dropped because the upstream replayed an id already appended.",
            registry=r,
        )
        self.proxy_answers_dropped = Counter(
            "mcpresume_proxy_answers_dropped",
            "Answers to the proxy's own requests (a credential ping, a takeover's probe) that the upstream "
            "sent on a stream of the session, dropped there: never a client's.",
            registry=r,
        )
        self.backpressure_detaches = Counter(
            "mcpresume_backpressure_detaches",
            "Client views detached because the client did not drain within stall_timeout.",
            registry=r,
        )
        self.forwarded_requests = Counter(
            "mcpresume_forwarded_requests",
            "Requests forwarded to the replica that owns their session, by outcome: relayed (its whole "
            "answer), owner_unreachable (502), owner_broke (its answer ended early), client_gone (the "
            "client left or stopped reading first), drained (this replica's drain ended it cleanly).",
            ["outcome"],
            registry=r,
        )
        for outcome in FORWARD_OUTCOMES:
            self.forwarded_requests.labels(outcome)
        self.lease_renew_failures = Counter(
            "mcpresume_lease_renew_failures",
            "Renewals of this replica's lease in the store that failed (past owner_lease_ttl of them, "
            "other replicas may take its sessions over).",
            registry=r,
        )
        self.takeovers = Counter(
            "mcpresume_takeovers",
            "Takeovers of a replica whose lease was gone, by outcome: taken (its live streams are pumped "
            "here now), nothing_left (another replica took them, or it had none), owner_alive (not taken: "
            "the owner answered a direct liveness check, its requests go to it), too_soon (not taken: "
            "this replica has not seen the store answer for a whole lease yet, so a lapsed lease proves "
            "nothing).",
            ["outcome"],
            registry=r,
        )
        for outcome in TAKEOVER_OUTCOMES:
            self.takeovers.labels(outcome)
        self.fenced_writes = Counter(
            "mcpresume_fenced_writes",
            "Writes of a pump refused because another process took its session over since (the pump "
            "stepped down: the new owner resumes its stream).",
            registry=r,
        )
        self.pruned_replicas = Counter(
            "mcpresume_pruned_replicas",
            "Registry entries of replicas whose lease had ended long ago, removed.",
            registry=r,
        )
        self.replicas = Gauge(
            "mcpresume_replicas", "Replicas with a live lease in the store, as this one last saw.", registry=r
        )
        self.max_sessions = Gauge("mcpresume_max_sessions", "The max_sessions setting.", registry=r)
        self.expired_sessions = Counter("mcpresume_expired_sessions", "Idle sessions reaped.", registry=r)
        self.store_errors = Counter(
            "mcpresume_store_errors",
            "Calls to the shared store (Redis) that failed or timed out, by store operation.",
            ["op"],
            registry=r,
        )
        self.store_seconds = Histogram(
            "mcpresume_store_seconds",
            "Seconds a call to the shared store (Redis) took, by store operation.",
            ["op"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self._store_seconds: dict[str, Histogram] = {}

    def store_call(self, op: str, seconds: float) -> None:
        """A call to the shared store took ``seconds`` (the label's child looked up once per op: the
        lookup was 2% of the proxy's CPU at 1k events/s on the Redis store)."""
        child = self._store_seconds.get(op)
        if child is None:
            child = self._store_seconds[op] = self.store_seconds.labels(op)
        child.observe(seconds)

    def store_error(self, op: str) -> None:
        self.store_errors.labels(op).inc()

    def evicted(self, evicted: Evicted) -> None:
        children = self._evicted
        for reason, (count, size) in evicted.counts.items():
            events, size_total = children[reason.value]
            events.inc(count)
            size_total.inc(size)
        count, size = evicted.undelivered
        if count:
            # A subset of the above, by what it means: events no client ever received.
            events, size_total = children["undelivered"]
            events.inc(count)
            size_total.inc(size)

    def store_stats(self, stats: StoreStats) -> None:
        self.sessions.set(stats.sessions)
        self.window_events.set(stats.window_events)
        self.window_bytes.set(stats.window_bytes)

    def render(self) -> bytes:
        return generate_latest(self._exposed)
