"""Aggregate per-process results into medians, ratios against stock, goals, Markdown and a plot."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from benchmarks.configs import VARIANT_LABELS, Config, Shape

MIB = 2**20
SWEEP_TITLES = {"vocab": "vocabulary size V", "seq": "sequence length s", "mtp": "MTP depth N"}
GOALS = {
    "train_time": "training micro-batch time <= stock",
    "train_memory": "training peak memory <= stock - 0.9 * N * (s*b*V/tp*4 bytes)",
    "infer_time": "inference micro-batch within 3% of the model without MTP layers",
    "idle": "hooks attached but idle cost <= 1% of a forward",
}


def aggregate(config: Config, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per variant and shape over every round, ratios against stock / no-MTP, goals."""
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    losses: dict[str, dict[str, Any]] = {}
    idle: Optional[dict[str, Any]] = None
    for run in runs:
        if run["variant"] == "idle":
            idle = run["idle"]
            continue
        for point in run["points"]:
            key = Shape(**point["shape"]).key
            slot = samples.setdefault(run["variant"], {}).setdefault(key, {})
            for field in ("train_s", "infer_s", "train_mem", "infer_mem", "train_mem_abs", "infer_mem_abs"):
                slot.setdefault(field, []).extend(point[field])
            losses.setdefault(run["variant"], {})[key] = point.get("mtp_losses")
    medians = {
        variant: {key: {field: statistics.median(values) for field, values in slot.items()} for key, slot in by_shape.items()}
        for variant, by_shape in samples.items()
    }
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for variant, by_shape in medians.items():
        for key, m in by_shape.items():
            stock = medians.get("stock", {}).get(key)
            floor = medians.get("no_mtp", {}).get(key)
            r: dict[str, float] = {}
            if stock:
                r["train_time_vs_stock"] = m["train_s"] / stock["train_s"]
                r["infer_time_vs_stock"] = m["infer_s"] / stock["infer_s"]
                r["train_mem_minus_stock"] = m["train_mem"] - stock["train_mem"]
            if floor:
                r["infer_time_vs_no_mtp"] = m["infer_s"] / floor["infer_s"]
            ratios.setdefault(variant, {})[key] = r
    return {
        "config": config.name,
        "env": next((run["env"] for run in runs if "env" in run), {}),
        "medians": medians,
        "ratios": ratios,
        "mtp_losses": losses,
        "idle": idle,
        "goals": goals(config, medians, idle),
    }


def goals(config: Config, medians: dict[str, Any], idle: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The issue's four goals for the lean (default) hooks, at every shape measured."""
    out: dict[str, Any] = {}
    lean, stock, floor = medians.get("hooks_lean", {}), medians.get("stock", {}), medians.get("no_mtp", {})
    patched = medians.get("patched", {})
    per_shape = []
    for shape in config.shapes():
        key = shape.key
        if key not in lean or key not in stock:
            continue
        row: dict[str, Any] = {"shape": key}
        row["train_time_ratio"] = lean[key]["train_s"] / stock[key]["train_s"]
        row["train_time_ok"] = row["train_time_ratio"] <= 1.0
        target = stock[key]["train_mem"] - 0.9 * shape.mtp * shape.logits_bytes()
        row["train_mem_target"] = target
        row["train_mem"] = lean[key]["train_mem"]
        row["train_mem_ok"] = lean[key]["train_mem"] <= target
        row["mtp_logits_bytes"] = shape.mtp * shape.logits_bytes()
        if key in patched:  # also returns logits, so it pays the same main-head logits copy
            row["train_mem_saved_vs_patched"] = patched[key]["train_mem"] - lean[key]["train_mem"]
        if key in floor:
            row["infer_time_ratio"] = lean[key]["infer_s"] / floor[key]["infer_s"]
            row["infer_time_ok"] = row["infer_time_ratio"] <= 1.03
        per_shape.append(row)
    out["per_shape"] = per_shape
    base_forward = floor.get(config.base.key, {}).get("infer_s")
    if idle is not None and base_forward:
        out["idle_fraction"] = idle["idle_s"] / base_forward
        out["idle_ok"] = out["idle_fraction"] <= 0.01
    return out


# ------------------------------------------------------------------------------ Markdown


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _mib(nbytes: float) -> str:
    if nbytes != nbytes:  # NaN: the comparison point was not measured
        return "–"
    return f"{round(nbytes / MIB):,}"


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def markdown(config: Config, result: dict[str, Any], plot_name: Optional[str] = None) -> str:
    """Tables: base shape by variant, the goals, and each sweep."""
    medians, ratios = result["medians"], result["ratios"]
    env = result["env"]
    base = config.base
    where = env.get("gpu") or f"CPU, {env.get('cpu_threads')} threads"
    lines = [
        f"Config `{config.name}` ({where}; torch {env.get('torch')}, megatron-core {env.get('megatron_core')}, "
        f"{str(config.dtype).replace('torch.', '')}, {env.get('date', '')[:10]}). Base shape: V={base.vocab:,}, "
        f"s={base.seq:,}, b={base.batch}, h={base.hidden:,}, {base.layers} layers, N={base.mtp}. "
        f"Medians of {config.repeats * config.rounds} timed runs; peak memory is the growth over the "
        f"live memory before the micro-batch ({'RSS' if config.device == 'cpu' else 'max_memory_allocated'}).",
        "",
        "| variant | train ms | × stock | train peak MiB | Δ vs stock MiB | infer ms | × no-MTP | infer peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in VARIANT_LABELS.items():
        m = medians.get(name, {}).get(base.key)
        if m is None:
            continue
        r = ratios[name][base.key]
        lines.append(
            f"| {label} | {_ms(m['train_s'])} | {r.get('train_time_vs_stock', float('nan')):.2f} | "
            f"{_mib(m['train_mem'])} | {_mib(r.get('train_mem_minus_stock', float('nan')))} | {_ms(m['infer_s'])} | "
            f"{r.get('infer_time_vs_no_mtp', float('nan')):.3f} | {_mib(m['infer_mem'])} |"
        )
    lines += ["", "Stock mcore 0.16 cannot run a forward without labels, so its inference row runs with labels under "
              "`torch.no_grad` (MTP block, MTP heads and cross-entropy included) and returns losses, not logits.", ""]
    lines += _goal_lines(config, result)
    for sweep, title in SWEEP_TITLES.items():
        lines += ["", *_sweep_lines(config, result, sweep, title)]
    if plot_name:
        lines += ["", f"![time and memory by variant]({plot_name})"]
    return "\n".join(lines) + "\n"


def _goal_lines(config: Config, result: dict[str, Any]) -> list[str]:
    g = result["goals"]
    base = next((row for row in g["per_shape"] if row["shape"] == config.base.key), None)
    lines = ["Goals for `mtp_hooks` lean (the default), at the base shape; all shapes in the sweeps below.", "",
             "| goal | measured | verdict |", "|---|---|---|"]
    if base:
        lines.append(f"| {GOALS['train_time']} | {base['train_time_ratio']:.2f} × stock | {_verdict(base['train_time_ok'])} |")
        lines.append(
            f"| {GOALS['train_memory']} | {_mib(base['train_mem'])} MiB vs target {_mib(base['train_mem_target'])} MiB "
            f"| {_verdict(base['train_mem_ok'])} |"
        )
        if "train_mem_saved_vs_patched" in base:
            saved = base["train_mem_saved_vs_patched"]
            lines.append(
                f"| (the same saving, against the instance patch, which also returns logits: "
                f">= 0.9 * N * s*b*V*4 = {_mib(0.9 * base['mtp_logits_bytes'])} MiB) | {_mib(saved)} MiB saved | "
                f"{_verdict(saved >= 0.9 * base['mtp_logits_bytes'])} |"
            )
        if "infer_time_ratio" in base:
            lines.append(f"| {GOALS['infer_time']} | {base['infer_time_ratio']:.3f} × no-MTP | {_verdict(base['infer_time_ok'])} |")
    idle = result.get("idle")
    if idle and "idle_fraction" in g:
        lines.append(
            f"| {GOALS['idle']} | {idle['idle_s'] * 1e6:,.0f} µs per forward (fastest of {idle['calls']} tiny forwards, "
            f"hooked vs no-MTP) = {g['idle_fraction'] * 100:.2f}% of the base shape's no-MTP forward | {_verdict(g['idle_ok'])} |"
        )
    return lines


def _sweep_lines(config: Config, result: dict[str, Any], sweep: str, title: str) -> list[str]:
    medians, ratios = result["medians"], result["ratios"]
    goal_rows = {row["shape"]: row for row in result["goals"]["per_shape"]}
    lines = [
        f"Sweep over {title} (other dimensions at the base shape):",
        "",
        f"| {sweep} | stock train ms | lean × stock | dense × stock | patch × stock | stock peak MiB | lean peak MiB "
        "| memory target MiB | lean infer × no-MTP | patch infer × no-MTP |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, shape in config.points():
        if name != sweep:
            continue
        key = shape.key
        stock = medians.get("stock", {}).get(key)
        if stock is None:
            continue

        def ratio(variant: str, field: str) -> str:
            value = ratios.get(variant, {}).get(key, {}).get(field)
            return "–" if value is None else f"{value:.2f}"

        lean_mem = medians.get("hooks_lean", {}).get(key, {}).get("train_mem")
        target = goal_rows.get(key, {}).get("train_mem_target")
        lines.append(
            f"| {getattr(shape, sweep):,} | {_ms(stock['train_s'])} | {ratio('hooks_lean', 'train_time_vs_stock')} | "
            f"{ratio('hooks_dense', 'train_time_vs_stock')} | {ratio('patched', 'train_time_vs_stock')} | "
            f"{_mib(stock['train_mem'])} | {'–' if lean_mem is None else _mib(lean_mem)} | "
            f"{'–' if target is None else _mib(target)} | {ratio('hooks_lean', 'infer_time_vs_no_mtp')} | "
            f"{ratio('patched', 'infer_time_vs_no_mtp')} |"
        )
    return lines


# ---------------------------------------------------------------------------------- plot


def plot(config: Config, result: dict[str, Any], path: str) -> None:
    """3 x 3 grid: train time, inference time, train peak memory, by vocab / sequence / N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = result["medians"]
    rows = [("train_s", "training micro-batch (s)"), ("infer_s", "inference micro-batch (s)"), ("train_mem", "training peak (MiB)")]
    fig, axes = plt.subplots(len(rows), len(SWEEP_TITLES), figsize=(14, 10), squeeze=False)
    goal_rows = {row["shape"]: row for row in result["goals"]["per_shape"]}
    for col, (sweep, title) in enumerate(SWEEP_TITLES.items()):
        shapes = [shape for name, shape in config.points() if name == sweep]
        xs = [getattr(shape, sweep) for shape in shapes]
        for row, (field, ylabel) in enumerate(rows):
            ax = axes[row][col]
            for name, label in VARIANT_LABELS.items():
                ys = [medians.get(name, {}).get(shape.key, {}).get(field) for shape in shapes]
                if all(y is None for y in ys):
                    continue
                ys = [float("nan") if y is None else (y / MIB if field.endswith("mem") else y) for y in ys]
                ax.plot(xs, ys, marker="o", label=label)
            if field == "train_mem":
                targets = [goal_rows.get(shape.key, {}).get("train_mem_target") for shape in shapes]
                if any(t is not None for t in targets):
                    ax.plot(xs, [float("nan") if t is None else t / MIB for t in targets], "k--", label="memory goal")
            ax.set_xlabel(title)
            ax.set_ylabel(ylabel)
            if sweep != "mtp":
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:,}" for x in xs])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[2][0].legend(fontsize=8)
    fig.suptitle(f"mtp_hooks vs stock mcore: config {config.name} ({result['env'].get('gpu') or 'CPU'})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
