"""The cost benchmark's plot: training FLOPs, peak live memory and time against stock, by sweep and variant."""

from __future__ import annotations

from typing import Any

from benchmarks.cells import MIB
from benchmarks.configs import SWEEP_ATTRIBUTES, Config, sweep_title, sweeps
from benchmarks.variants import TRAINER_VARIANTS
from benchmarks.verdicts import time_key

MARKERS = "osD^vP*Xh<>"


def save(config: Config, result: dict[str, Any], path: str) -> None:
    """3 x 3 grid: training GFLOP, training peak live MiB, time / stock, by vocab / sequence / N.

    Every variant has its own marker and a small horizontal offset, so equal values stay visible; time is
    on a log scale, median with min–max bars over the interleaved rounds. Lower is better on every panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = time_key(config)
    basis = result.get("time_basis", "wall time")
    columns = sweeps(config)
    fig, axes = plt.subplots(3, len(columns), figsize=(5 * len(columns), 11), squeeze=False)
    names = [n for n in result["variants"] if n not in TRAINER_VARIANTS]
    for col, sweep in enumerate(columns):
        title = sweep_title(config, sweep)
        shapes = [shape for name, shape in config.points() if name == sweep and shape.key in result["points"]]
        xs = [getattr(shape, SWEEP_ATTRIBUTES[sweep]) for shape in shapes]
        points = [result["points"][shape.key] for shape in shapes]
        log_x = sweep != "mtp"
        for index, name in enumerate(names):
            label = next((p["variants"][name]["label"] for p in points if name in p["variants"]), name)
            offset = (index - (len(names) - 1) / 2) * 0.025
            shifted = [x * 2 ** offset if log_x else x + offset * 4 for x in xs]
            style = dict(marker=MARKERS[index % len(MARKERS)], color=f"C{index % 10}", label=label, alpha=0.85, markersize=6)
            flops = [p["variants"][name]["train"]["flops"] / 1e9 if name in p["variants"] else float("nan") for p in points]
            peaks = [p["variants"][name]["train"]["peak_bytes"] / MIB if name in p["variants"] else float("nan") for p in points]
            axes[0][col].plot(shifted, flops, **style)
            axes[1][col].plot(shifted, peaks, **style)
            ratios = [p["variants"][name].get("train_time_vs_stock") if name in p["variants"] else None for p in points]
            if any(ratios) and name != "stock":
                med = [r["median"] if r else float("nan") for r in ratios]
                low = [r["median"] - r["min"] if r else 0.0 for r in ratios]
                high = [r["max"] - r["median"] if r else 0.0 for r in ratios]
                axes[2][col].errorbar(shifted, med, yerr=[low, high], capsize=3, **style)
        axes[2][col].axhline(1.0, color="k", linestyle="--", label="stock (goal: ≤ 1)")
        axes[2][col].set_yscale("log")
        for row, ylabel in enumerate(("training GFLOP", "training peak live MiB", f"training {basis} / stock")):
            ax = axes[row][col]
            ax.set_xlabel(title)
            ax.set_ylabel(f"{ylabel} (lower is better)")
            if log_x:
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            if row < 2:
                ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:,}" for x in xs], rotation=30 if log_x else 0)
            ax.grid(alpha=0.3)
    for row in range(3):
        axes[row][0].legend(fontsize=7)
    fig.suptitle(f"mtp_hooks vs stock mcore and verl: config {config.name} "
                 f"({result['env'].get('gpu') or 'CPU'}); lower is better everywhere; time: median, min–max bars")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
