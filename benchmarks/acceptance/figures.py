"""The seeds' spread of one figure and how the acceptance reports write it (shared by both reports)."""

from __future__ import annotations

import math


def fmt(x: float) -> str:
    """Three decimals; ``nan`` for a figure no seed had."""
    return "nan" if x != x else f"{x:.3f}"


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample sd, min, max and count of ``values``; NaN (no such rollout in a seed) is left out."""
    values = [v for v in values if v == v]
    if not values:
        return {"mean": math.nan, "sd": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": len(values)}


def mean_range(d: dict[str, float]) -> str:
    """A ``spread`` as mean (min–max) over seeds."""
    return f"{fmt(d['mean'])} ({fmt(d['min'])}–{fmt(d['max'])})"
