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


# Student's t at 97.5 % by degrees of freedom (n - 1): a mean over n seeds +- t * sd / sqrt(n) is its 95 % interval.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval95(values: list[float]) -> tuple[float, float]:
    """The 95 % interval of the mean of ``values`` (Student's t over the seeds; NaN for fewer than two values)."""
    d = spread(values)
    if d["n"] < 2:
        return math.nan, math.nan
    half = _T975.get(int(d["n"]) - 1, 1.96) * d["sd"] / math.sqrt(d["n"])
    return d["mean"] - half, d["mean"] + half


def mean_interval(values: list[float]) -> str:
    """Mean [95 % interval] over seeds (one seed: the mean alone)."""
    low, high = interval95(values)
    mean = spread(values)["mean"]
    return fmt(mean) if low != low else f"{fmt(mean)} [{fmt(low)}, {fmt(high)}]"
