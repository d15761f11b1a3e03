"""Reading the proxy's metrics as Prometheus scrapes them: through the registry's public API, by the
exported series name (``_total`` included), so a test also breaks when a name a dashboard relies on moves."""

from __future__ import annotations

from mcpresume.process.metrics import Metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """The value of series ``name{labels}``; 0 for a labelled series not touched yet. A name that no
    family of the registry exports is a test bug, so it fails rather than reads 0."""
    value = metrics.registry.get_sample_value(name, labels)
    if value is not None:
        return value
    families = {family.name for family in metrics.registry.collect()}
    base = name.removesuffix("_total")
    assert base in families or name in families, f"no metric family exports {name}"
    return 0.0
