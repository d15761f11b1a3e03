"""Percentiles and quantile curves (pure, no numpy: the client and the report both use them)."""

from __future__ import annotations

import statistics


def percentiles(values: list[float], points: tuple[float, ...] = (50, 90, 99, 99.9)) -> dict[str, float]:
    """Nearest-rank percentiles, plus min, max, mean and n."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for p in points:
        index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
        out[f"p{p:g}"] = ordered[index]
    out["min"] = ordered[0]
    out["max"] = ordered[-1]
    out["mean"] = statistics.fmean(ordered)
    out["n"] = len(ordered)
    return out


def quantile_curve(values: list[float], points: int = 200) -> list[float]:
    """``points`` evenly spaced quantiles, for plotting a CDF without shipping every sample."""
    if not values:
        return []
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(i / (points - 1) * (len(ordered) - 1)))] for i in range(points)]
