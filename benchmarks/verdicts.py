"""From raw measurements to ratios, floors and goal verdicts, per shape.

Verdicts come from exact columns (FLOPs, peak live bytes, host syncs, host-to-device tensors) where the
goal is about them. The one time goal is judged on the per-round ratios of interleaved rounds (process CPU
time on CPU, wall time on a GPU): ``met`` when even the slowest round meets it, ``missed`` when even the
fastest does not, ``inconclusive`` when the spread straddles the threshold.

Floors: each training row also gives its ratio to the FLOPs that must happen (stock's count, where every
product runs once; minus one head weight-gradient product per depth, N·2·T·h·V, for a variant whose MTP
losses do not train the head) and to the memory that must be held (the model without MTP layers' training
peak: a lower bound, the MTP layers' own saved activations come on top).

``summarize`` gives the result the tables (``tables``), sentences (``headlines``) and plot (``plot``) read.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from megatron.core.transformer import multi_token_prediction as _mtp

from benchmarks.configs import Config, Shape
from benchmarks.variants import DEFAULT_HOOKS, DETACH_HEAD, TRAINER_VARIANTS

TP = 1  # the benchmarks run one rank
MET, MISSED, NOISE, NA = "met", "**missed**", "inconclusive", "n/a"
UNJUDGED = "not measured at smoke shapes"  # the memory goal where ``Config.memory_goal`` is off
# Variants whose MTP losses do not train the output layer: their FLOP floor lacks N head weight gradients.
# verl's patch detaches the head only in its legacy loop, on megatron-core without ``process_mtp_loss``.
HEAD_DETACHED = {DETACH_HEAD} | (set() if hasattr(_mtp, "process_mtp_loss") else {"verl"})


def time_key(config: Config, kind: str = "train") -> str:
    """The timing series verdicts use: process CPU time on CPU (less sensitive to other processes), wall on GPU."""
    return f"{kind}_cpu_s" if config.device == "cpu" else f"{kind}_s"


def verdict(ok: Optional[bool]) -> str:
    """An exact goal's verdict: met, missed, or n/a where it was not measured."""
    return NA if ok is None else (MET if ok else MISSED)


def memory_verdict(g: dict[str, Any]) -> str:
    """The memory goal's verdict; ``UNJUDGED`` where the configuration does not judge it."""
    return UNJUDGED if g["memory_ok"] is None else verdict(g["memory_ok"])


def time_ratio(numerator: list[float], denominator: list[float]) -> Optional[dict[str, float]]:
    """Median, min and max of per-round ratios (round i of one variant over round i of the other)."""
    ratios = [a / b for a, b in zip(numerator, denominator) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def time_verdict(ratio: Optional[dict[str, float]], goal: float = 1.0) -> str:
    """The time goal's verdict on per-round ratios: met, missed, or inconclusive where they straddle ``goal``."""
    if ratio is None:
        return NA
    if ratio["max"] <= goal:
        return MET
    if ratio["min"] > goal:
        return MISSED
    return NOISE


def _seconds(samples: list[float]) -> Optional[dict[str, float]]:
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def floors_at(shape: Shape, variants: dict[str, Any]) -> None:
    """Each training row's FLOP and memory floors and its ratios to them (module docstring), in place."""
    stock, plain = variants.get("stock"), variants.get("no_mtp")
    head_wgrad = shape.mtp * 2 * shape.seq * shape.batch * shape.hidden * (shape.vocab // TP)
    for name, v in variants.items():
        if name in TRAINER_VARIANTS or name == "no_mtp":
            continue
        if stock:
            v["flops_floor"] = stock["train"]["flops"] - (head_wgrad if name in HEAD_DETACHED else 0)
            v["flops_vs_floor"] = v["train"]["flops"] / v["flops_floor"]
        if plain:
            v["memory_floor"] = plain["train"]["peak_bytes"]
            v["memory_vs_floor"] = v["train"]["peak_bytes"] / v["memory_floor"]


def goals_at(shape: Shape, variants: dict[str, Any], key: str = "train_cpu_s", memory_goal: bool = True) -> dict[str, Any]:
    """Every goal's measured figure and verdict at one shape, for the default hooks variant; without
    ``memory_goal`` the peak is reported but the memory goal is not judged (``memory_ok`` is None)."""
    stock, lean = variants.get("stock"), variants.get(DEFAULT_HOOKS)
    detach, floor = variants.get(DETACH_HEAD), variants.get("no_mtp")
    tokens, n = shape.seq * shape.batch, shape.mtp
    out: dict[str, Any] = {"shape": shape.key}
    if stock:
        out["flops_stock"] = stock["train"]["flops"]
    if stock and lean:
        out["flops_ratio"] = lean["train"]["flops"] / stock["train"]["flops"]
        out["flops_ok"] = lean["train"]["flops"] <= stock["train"]["flops"]
        accumulator = (shape.vocab // TP) * shape.hidden * 4 if lean.get("loss_path") == "fused" else 0
        out["memory"] = lean["train"]["peak_bytes"]
        out["memory_stock"] = stock["train"]["peak_bytes"]
        out["memory_ratio"] = out["memory"] / out["memory_stock"]
        out["memory_target"] = stock["train"]["peak_bytes"] - 0.9 * n * shape.logits_bytes(TP) + accumulator
        out["memory_accumulator"] = accumulator
        out["memory_ok"] = out["memory"] <= out["memory_target"] if memory_goal else None
        out["time"] = time_ratio(lean[key], stock[key])
        out["time_verdict"] = time_verdict(out["time"])
        out["wall"] = time_ratio(lean["train_s"], stock["train_s"])
        out["h2d"] = lean["train"]["h2d"] + lean["infer"]["h2d"]
        out["h2d_stock"] = stock["train"]["h2d"] + stock["infer"]["h2d"]
        out["h2d_ok"] = out["h2d"] <= out["h2d_stock"]
    if stock and detach:
        bound = stock["train"]["flops"] - n * 2 * tokens * shape.hidden * (shape.vocab // TP)
        out["detach_flops"] = detach["train"]["flops"]
        out["detach_flops_bound"] = bound
        out["detach_flops_ok"] = detach["train"]["flops"] <= bound
    if lean:
        out["syncs"] = lean["train"]["syncs"] + lean["infer"]["syncs"]
        out["syncs_ok"] = out["syncs"] == 0
    if lean and floor:
        out["infer_flops_ok"] = lean["infer"]["flops"] == floor["infer"]["flops"]
        out["infer_flops"], out["infer_flops_floor"] = lean["infer"]["flops"], floor["infer"]["flops"]
        out["infer_peak"], out["infer_peak_floor"] = lean["infer"]["peak_bytes"], floor["infer"]["peak_bytes"]
        out["inference_ok"] = out["infer_flops"] == out["infer_flops_floor"] and out["infer_peak"] == out["infer_peak_floor"]
    return out


def summarize(config: Config, raw: dict[str, Any]) -> dict[str, Any]:
    """Per shape: every variant's counts and timing summaries, and the goals with their verdicts."""
    by_key: dict[str, Any] = {}
    for point in raw["points"]:
        shape = Shape(**point["shape"])
        variants = point["variants"]
        key = time_key(config)
        for v in variants.values():
            v.setdefault("train_cpu_s", [])
            v.setdefault("infer_cpu_s", [])
            v.setdefault("load", [])
            v["train_time"] = _seconds(v["train_s"])
            v["infer_time"] = _seconds(v["infer_s"])
            v["train_cpu_time"] = _seconds(v["train_cpu_s"])
            v["infer_cpu_time"] = _seconds(v["infer_cpu_s"])
        stock = variants.get("stock")
        for v in variants.values():
            v["train_time_vs_stock"] = time_ratio(v[key], stock[key]) if stock else None
        floors_at(shape, variants)
        loads = [x for v in variants.values() for x in v["load"]]
        by_key[shape.key] = {"shape": point["shape"], "variants": variants, "goals": goals_at(shape, variants, key, config.memory_goal),
                             "load": _seconds(loads)}
    return {
        "config": config.name,
        "env": raw["env"],
        "variants": raw["variants"],
        "refused": raw["refused"],
        "rounds": config.rounds,
        "time_basis": "process CPU time" if config.device == "cpu" else "wall time",
        "complete": raw.get("complete", True),
        "seconds": raw.get("seconds"),
        "points": by_key,
    }
