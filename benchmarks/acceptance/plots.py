"""Plots of the acceptance benchmark: acceptance by RL step with the policy beside it, and the chain's per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path, title: str = "") -> None:
    """Mean expected acceptance per variant and depth over the seeds, with the min–max band; the policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    steps = summary["steps"]
    colours = {"frozen": "tab:gray", "ce": "tab:blue", "distill": "tab:orange", "tv": "tab:green", "accept": "tab:purple"}
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.4]})
    for name, d in summary["variants"].items():
        for k, style in ((1, "-"), (2, "--")):
            series = d[f"accept_{k}"]
            ax.plot(steps, [x["mean"] for x in series], style, color=colours.get(name), marker="o", ms=3, label=f"{name}, depth {k}")
            ax.fill_between(steps, [x["min"] for x in series], [x["max"] for x in series], color=colours.get(name), alpha=0.12)
    ax.set_xlabel("RL step")
    ax.set_ylabel("expected acceptance  Σ min(p, q)  (higher is better)")
    ax.set_title(f"{title}MTP draft acceptance on fresh rollouts: mean of {len(summary['seeds'])} seeds, band = min–max", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax_r.plot(steps, [x["mean"] for x in summary["reward"]], color="black", marker="o", ms=3, label="reward")
    for name, colour in zip([k for k in ("grammatical_share", "parses", "double_quotes") if k in summary], ("tab:red", "tab:brown", "tab:cyan")):
        ax_r.plot(steps, [x["mean"] for x in summary[name]], color=colour, marker="o", ms=3, label=name.replace("_", " "))
    if "kl_to_pretrained" in summary:
        ax_k = ax_r.twinx()
        ax_k.plot(steps, [x["mean"] for x in summary["kl_to_pretrained"]], "--", color="tab:olive", marker="s", ms=3, label="KL to pretrained (right)")
        ax_k.legend(fontsize=7, loc="lower right")
    ax_r.set_xlabel("RL step")
    ax_r.set_title("policy (held-out rollouts, mean)")
    ax_r.legend(fontsize=7)
    ax_r.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_chain(result: dict[str, Any], path: Path) -> None:
    """Realised (solid) and expected (dashed) acceptance per draft step at the last evaluation, min–max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    k, last = result["runs"][0]["setting"]["chain"], len(summary["steps"]) - 1
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = list(range(1, k + 1))
    for i, (name, d) in enumerate(summary["variants"].items()):
        x = [j + (i - 2.5) * 0.04 for j in steps]
        real = [d[f"realised_accept_{j}"][last] for j in steps]
        line = ax.errorbar(x, [c["mean"] for c in real], yerr=[[c["mean"] - c["min"] for c in real], [c["max"] - c["mean"] for c in real]],
                           marker="o", ms=4, capsize=2, label=f"{name} realised")
        ax.plot(x, [d[f"accept_{j}"][last]["mean"] for j in steps], "--", color=line[0].get_color(), alpha=0.6)
    ax.set_xticks(steps)
    ax.set_xlabel("draft step j (steps 2.. reuse the one MTP layer)")
    ax.set_ylabel("acceptance at step j (dashed: expected)")
    ax.set_title(f"k = {k} chain from N = 1, RL step {summary['steps'][last]}: mean of {len(summary['seeds'])} seeds, bars min–max", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
