"""From raw measurements to ratios, goal verdicts, Markdown tables and a plot.

Verdicts come from exact columns (FLOPs, peak live bytes, host syncs) where the goal is about them.
The one wall-time goal is judged on the per-round ratios of interleaved rounds: ``met`` when even the
slowest round meets it, ``missed`` when even the fastest does not, ``within noise`` otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from benchmarks.configs import Config, Shape
from benchmarks.variants import DEFAULT_HOOKS, DETACH_HEAD

MIB = 2**20
TP = 1  # the benchmarks run one rank
SWEEP_TITLES = {"vocab": "vocabulary size V", "seq": "sequence length s", "mtp": "MTP depth N"}
SWEEP_SYMBOLS = {"vocab": "V", "seq": "s", "mtp": "N"}
GOALS = {
    "flops": "training FLOPs, lean ≤ stock",
    "detach_flops": "training FLOPs, lean + `detach_head` ≤ stock − N·2·T·h·V/tp",
    "memory": "training peak live memory ≤ stock − 0.9·N·T·V/tp·4 bytes (+ V/tp·h·4 accumulator on the fused path)",
    "inference": "inference micro-batch: FLOPs and peak equal the model without MTP layers",
    "syncs": "host syncs per training + inference micro-batch: 0",
    "time": "training wall time lean / stock ≤ 1.00 (median of interleaved rounds)",
}
MET, MISSED, NOISE, NA = "met", "**missed**", "within noise", "n/a"


def _verdict(ok: Optional[bool]) -> str:
    return NA if ok is None else (MET if ok else MISSED)


def time_ratio(numerator: list[float], denominator: list[float]) -> Optional[dict[str, float]]:
    """Median, min and max of per-round ratios (round i of one variant over round i of the other)."""
    ratios = [a / b for a, b in zip(numerator, denominator) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def time_verdict(ratio: Optional[dict[str, float]], goal: float = 1.0) -> str:
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


def goals_at(shape: Shape, variants: dict[str, Any]) -> dict[str, Any]:
    """Every goal's measured figure and verdict at one shape, for the default hooks variant."""
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
        out["memory_ok"] = out["memory"] <= out["memory_target"]
        out["time"] = time_ratio(lean["train_s"], stock["train_s"])
        out["time_verdict"] = time_verdict(out["time"])
    if stock and detach:
        bound = stock["train"]["flops"] - n * 2 * tokens * shape.hidden * (shape.vocab // TP)
        out["detach_flops"] = detach["train"]["flops"]
        out["detach_flops_bound"] = bound
        out["detach_flops_ok"] = detach["train"]["flops"] <= bound
    if lean:
        out["syncs"] = lean["train"]["syncs"] + lean["infer"]["syncs"]
        out["syncs_ok"] = out["syncs"] == 0
    if lean and floor:
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
        for v in variants.values():
            v["train_time"] = _seconds(v["train_s"])
            v["infer_time"] = _seconds(v["infer_s"])
        stock = variants.get("stock")
        for v in variants.values():
            v["train_time_vs_stock"] = time_ratio(v["train_s"], stock["train_s"]) if stock else None
        by_key[shape.key] = {"shape": point["shape"], "variants": variants, "goals": goals_at(shape, variants)}
    return {
        "config": config.name,
        "env": raw["env"],
        "variants": raw["variants"],
        "refused": raw["refused"],
        "rounds": config.rounds,
        "seconds": raw.get("seconds"),
        "points": by_key,
    }


# ------------------------------------------------------------------------------ Markdown


def _mib(nbytes: Optional[float]) -> str:
    return "–" if nbytes is None else f"{nbytes / MIB:,.1f}"


def _gflop(flops: Optional[float]) -> str:
    return "–" if flops is None else f"{flops / 1e9:,.2f}"


def _ms_range(t: Optional[dict[str, float]]) -> str:
    if t is None:
        return "–"
    return f"{t['median'] * 1e3:,.0f} ({t['min'] * 1e3:,.0f}–{t['max'] * 1e3:,.0f})"


def _ratio_range(r: Optional[dict[str, float]]) -> str:
    if r is None:
        return "–"
    return f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})"


def _syncs(counts: dict[str, Any]) -> str:
    """Host syncs of one micro-batch, with the ops behind them."""
    ops = ", ".join(f"`{op.replace('aten::', '')}` × {n}" for op, n in sorted(counts["syncs_by_op"].items()))
    return str(counts["syncs"]) + (f" ({ops})" if ops else "")


def _headline(config: Config, result: dict[str, Any]) -> str:
    g = result["points"].get(config.base.key, {}).get("goals", {})
    if "flops_ratio" not in g:
        return "lean vs stock: not measured (stock or lean missing)."
    t = g.get("time")
    time_part = "–× time" if t is None else f"{t['median']:.2f}× time"
    spread = "" if t is None else f", time = median of {t['rounds']} interleaved rounds, range {t['min']:.2f}–{t['max']:.2f}"
    return (f"**lean vs stock: {g['flops_ratio']:.2f}× FLOPs, {g['memory_ratio']:.2f}× memory, {time_part}** "
            f"(training micro-batch at the base shape; FLOPs and peak live memory counted exactly{spread}).")


def markdown(config: Config, result: dict[str, Any], plot_name: Optional[str] = None) -> str:
    """Headline, base-shape tables (training, inference), goals, one table per sweep."""
    env, base = result["env"], config.base
    point = result["points"].get(base.key, {"variants": {}, "goals": {}})
    where = env.get("gpu") or f"CPU, {env.get('cpu_threads')} threads"
    memory_how = "LiveBytes: bytes of live tensor storages" if config.device == "cpu" else "torch.cuda.max_memory_allocated"
    lines = [
        _headline(config, result),
        "",
        f"Config `{config.name}` ({where}; torch {env.get('torch')}, megatron-core {env.get('megatron_core')}, "
        f"mtp_hooks {env.get('mtp_hooks')}, {str(config.dtype).replace('torch.', '')}, {env.get('date', '')[:10]}). "
        f"Base shape: V = {base.vocab:,}, s = {base.seq:,}, b = {base.batch}, h = {base.hidden:,}, "
        f"transformer layers = {base.layers}, N = {base.mtp}. FLOPs: `FlopCounterMode`; peak: the most bytes live above those live before the micro-batch "
        f"({memory_how}); host syncs: `_local_scalar_dense` / `is_nonzero` / `nonzero` / `item` / device→host copies; "
        f"time: median (min–max) of {config.rounds} interleaved rounds."
        + ("" if result.get("seconds") is None else f" Whole run: {result['seconds']:.0f} s."),
    ]
    for name, why in result["refused"].items():
        lines += ["", f"Variant `{name}` skipped: the installed mtp_hooks refuses it ({why})."]
    lines += ["", "Training micro-batch (forward + main loss + backward), base shape:", "",
              "| variant | loss path | GFLOP | × stock | peak MiB | × stock | host syncs | ms | × stock (per round) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    stock = point["variants"].get("stock")
    for name in result["variants"]:
        v = point["variants"].get(name)
        if v is None:
            continue
        tr = v["train"]
        flops_x = f"{tr['flops'] / stock['train']['flops']:.3f}" if stock else "–"
        peak_x = f"{tr['peak_bytes'] / stock['train']['peak_bytes']:.3f}" if stock else "–"
        lines.append(
            f"| {v['label']} | {v.get('loss_path') or '–'} | {_gflop(tr['flops'])} | {flops_x} | {_mib(tr['peak_bytes'])} | "
            f"{peak_x} | {_syncs(tr)} | {_ms_range(v['train_time'])} | {_ratio_range(v['train_time_vs_stock'])} |"
        )
    lines += ["", "Inference micro-batch (forward under `no_grad`), base shape:", "",
              "| variant | GFLOP | − no-MTP GFLOP | peak MiB | − no-MTP MiB | host syncs | ms |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    floor = point["variants"].get("no_mtp")
    for name in result["variants"]:
        v = point["variants"].get(name)
        if v is None:
            continue
        inf = v["infer"]
        d_flops = _gflop(inf["flops"] - floor["infer"]["flops"]) if floor else "–"
        d_peak = _mib(inf["peak_bytes"] - floor["infer"]["peak_bytes"]) if floor else "–"
        lines.append(f"| {v['label']} | {_gflop(inf['flops'])} | {d_flops} | {_mib(inf['peak_bytes'])} | {d_peak} | "
                     f"{_syncs(inf)} | {_ms_range(v['infer_time'])} |")
    lines += ["", "Stock mcore cannot run a forward without labels, so its inference row runs with labels under "
              "`torch.no_grad` (MTP block, MTP heads and cross-entropy included) and returns losses, not logits."]
    lines += ["", *_goal_lines(config, point["goals"])]
    for sweep, title in SWEEP_TITLES.items():
        lines += ["", *_sweep_lines(config, result, sweep, title)]
    if plot_name:
        lines += ["", f"![FLOPs, peak live memory and time by variant]({plot_name})"]
    return "\n".join(lines) + "\n"


def _goal_lines(config: Config, g: dict[str, Any]) -> list[str]:
    lines = [f"Goals for `mtp_hooks` lean (`attach(model)`, the default), base shape; every sweep point below.", "",
             "| goal | measured | verdict |", "|---|---|---|"]
    if "flops_ratio" in g:
        lines.append(f"| {GOALS['flops']} | {g['flops_ratio']:.3f} × stock | {_verdict(g['flops_ok'])} |")
    if "detach_flops" in g:
        lines.append(f"| {GOALS['detach_flops']} | {_x_stock(g['detach_flops'], g)} vs bound {_x_stock(g['detach_flops_bound'], g)} "
                     f"({g['detach_flops']:,} vs {g['detach_flops_bound']:,} FLOPs) | {_verdict(g['detach_flops_ok'])} |")
    if "memory" in g:
        acc = f" (accumulator {_mib(g['memory_accumulator'])} MiB included)" if g["memory_accumulator"] else ""
        lines.append(f"| {GOALS['memory']} | {_mib(g['memory'])} MiB vs target {_mib(g['memory_target'])} MiB{acc}; "
                     f"stock {_mib(g['memory_stock'])} MiB | {_verdict(g['memory_ok'])} |")
    if "inference_ok" in g:
        lines.append(f"| {GOALS['inference']} | {g['infer_flops']:,} vs {g['infer_flops_floor']:,} FLOPs; "
                     f"{g['infer_peak']:,} vs {g['infer_peak_floor']:,} bytes | {_verdict(g['inference_ok'])} |")
    if "syncs" in g:
        lines.append(f"| {GOALS['syncs']} | {g['syncs']} | {_verdict(g['syncs_ok'])} |")
    if "time" in g:
        lines.append(f"| {GOALS['time']} | {_ratio_range(g['time'])} | {g['time_verdict']} |")
    return lines


def _x_stock(flops: float, g: dict[str, Any]) -> str:
    return f"{flops / g['flops_stock']:.4f} × stock"


def _cell(text: str, ok: Optional[bool]) -> str:
    return f"{text} {_verdict(ok)}" if ok is not None else text


def _sweep_lines(config: Config, result: dict[str, Any], sweep: str, title: str) -> list[str]:
    symbol = SWEEP_SYMBOLS[sweep]
    lines = [
        f"Sweep over {title} (other dimensions at the base shape); each cell: lean's figure and its verdict.",
        "",
        f"| {symbol} | stock GFLOP | lean FLOPs × stock | detach_head FLOPs / bound | lean peak / target MiB | host syncs "
        "| inference = no-MTP | time lean / stock |",
        "|---:|---:|---|---|---|---|---|---|",
    ]
    for name, shape in config.points():
        if name != sweep:
            continue
        point = result["points"].get(shape.key)
        if point is None:
            continue
        g, stock = point["goals"], point["variants"].get("stock")
        flops = _cell(f"{g['flops_ratio']:.3f}", g["flops_ok"]) if "flops_ratio" in g else "–"
        detach = (_cell(f"{_x_stock(g['detach_flops'], g)} / {_x_stock(g['detach_flops_bound'], g)}", g["detach_flops_ok"])
                  if "detach_flops" in g else "–")
        memory = _cell(f"{_mib(g['memory'])} / {_mib(g['memory_target'])}", g["memory_ok"]) if "memory" in g else "–"
        syncs = _cell(str(g["syncs"]), g["syncs_ok"]) if "syncs" in g else "–"
        infer = _verdict(g.get("inference_ok"))
        time_cell = f"{_ratio_range(g.get('time'))} {g.get('time_verdict', NA)}" if g.get("time") else NA
        lines.append(f"| {getattr(shape, sweep):,} | {_gflop(stock['train']['flops']) if stock else '–'} | {flops} | {detach} | "
                     f"{memory} | {syncs} | {infer} | {time_cell} |")
    return lines


# ---------------------------------------------------------------------------------- plot


def plot(config: Config, result: dict[str, Any], path: str) -> None:
    """3 x 3 grid: training GFLOP, training peak live MiB, lean/stock time, by vocab / sequence / N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(SWEEP_TITLES), figsize=(14, 10), squeeze=False)
    for col, (sweep, title) in enumerate(SWEEP_TITLES.items()):
        shapes = [shape for name, shape in config.points() if name == sweep and shape.key in result["points"]]
        xs = [getattr(shape, sweep) for shape in shapes]
        points = [result["points"][shape.key] for shape in shapes]
        for name in result["variants"]:
            label = next((p["variants"][name]["label"] for p in points if name in p["variants"]), name)
            flops = [p["variants"][name]["train"]["flops"] / 1e9 if name in p["variants"] else float("nan") for p in points]
            peaks = [p["variants"][name]["train"]["peak_bytes"] / MIB if name in p["variants"] else float("nan") for p in points]
            axes[0][col].plot(xs, flops, marker="o", label=label)
            axes[1][col].plot(xs, peaks, marker="o", label=label)
        targets = [p["goals"].get("memory_target", float("nan")) / MIB for p in points]
        axes[1][col].plot(xs, targets, "k--", label="lean memory goal")
        bounds = [p["goals"].get("detach_flops_bound", float("nan")) / 1e9 for p in points]
        axes[0][col].plot(xs, bounds, "k:", label="detach_head FLOPs goal")
        times = [p["goals"].get("time") for p in points]
        med = [t["median"] if t else float("nan") for t in times]
        low = [t["median"] - t["min"] if t else 0.0 for t in times]
        high = [t["max"] - t["median"] if t else 0.0 for t in times]
        axes[2][col].errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label="lean / stock (median, min–max)")
        axes[2][col].axhline(1.0, color="k", linestyle="--", label="goal")
        for row, ylabel in enumerate(("training GFLOP", "training peak live MiB", "training time lean / stock")):
            ax = axes[row][col]
            ax.set_xlabel(title)
            ax.set_ylabel(ylabel)
            if sweep != "mtp":
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:,}" for x in xs])
            ax.grid(alpha=0.3)
    for row in range(3):
        axes[row][0].legend(fontsize=7)
    fig.suptitle(f"mtp_hooks vs stock mcore: config {config.name} ({result['env'].get('gpu') or 'CPU'})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
