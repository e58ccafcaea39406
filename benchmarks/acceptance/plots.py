"""Plots of the acceptance benchmark: acceptance by RL step with the policy beside it, and the chain's per step.

Every variant keeps one colour and one marker in every plot (``style``); line styles carry the other
dimension (draft depth, or realised against expected). Every axis is labelled, and a series with
no finite value (no such rollout in any seed) is neither drawn nor listed in a legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# One colour and one marker per variant; names not listed take the spare ones in order.
STYLES = {
    "frozen": ("tab:gray", "o"),
    "ce": ("tab:blue", "s"),
    "distill": ("tab:orange", "^"),
    "tv": ("tab:green", "D"),
    "accept": ("tab:purple", "v"),
    "ce+tf": ("tab:cyan", "P"),
    "ce+chain": ("tab:red", "X"),
    "accept+chain": ("tab:brown", "*"),
}
SPARE = (("tab:pink", "h"), ("tab:olive", "<"), ("black", ">"))
DEPTH_LINES = ("-", "--", ":", "-.")
POLICY = {"reward": ("black", "o", "reward (mean)"), "grammatical_share": ("tab:red", "s", "grammatical share"),
          "parses": ("tab:red", "s", "share that parses"), "double_quotes": ("tab:cyan", "^", "double-quote share")}


def style(name: str, names: list[str]) -> tuple[str, str]:
    """``(colour, marker)`` of the variant ``name`` among ``names``."""
    if name in STYLES:
        return STYLES[name]
    return SPARE[[n for n in names if n not in STYLES].index(name) % len(SPARE)]


def has_data(values: list[float]) -> bool:
    return any(v == v for v in values)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (imported here: reading a record needs no matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _key(**line: Any) -> Any:
    """A legend entry drawn as ``line`` describes it, standing for no data of its own."""
    from matplotlib.lines import Line2D

    return Line2D([], [], **line)


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot(result: dict[str, Any], path: Path, title: str = "") -> None:
    save(acceptance_figure(result, title), path)


def plot_chain(result: dict[str, Any], path: Path, title: str = "") -> None:
    save(chain_figure(result, title), path)


def acceptance_figure(result: dict[str, Any], title: str = "") -> Any:
    """Mean expected acceptance per variant (colour and marker) and depth (line style) over the seeds,
    with the seeds' min–max band at depth 1; beside it the policy's reward, measures and KL."""
    plt = pyplot()
    summary = result["summary"]
    steps, names = summary["steps"], list(summary["variants"])
    depths = sorted(int(key.split("_")[1]) for key in summary["variants"][names[0]] if key.startswith("accept_") and key[7:].isdigit())
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 1.5]})
    handles = []
    for name, d in summary["variants"].items():
        colour, marker = style(name, names)
        drawn = False
        for k, line in zip(depths, DEPTH_LINES):
            series = d[f"accept_{k}"]
            if not has_data([x["mean"] for x in series]):
                continue
            ax.plot(steps, [x["mean"] for x in series], line, color=colour, marker=marker, ms=4, mfc="white" if k > 1 else colour)
            if k == 1:
                ax.fill_between(steps, [x["min"] for x in series], [x["max"] for x in series], color=colour, alpha=0.10, lw=0)
            drawn = True
        if drawn:
            handles.append(_key(color=colour, marker=marker, ms=5, label=name))
    handles += [_key(color="black", linestyle=line, marker="o", ms=4, mfc="white" if k > 1 else "black", label=f"depth {k}")
                for k, line in zip(depths, DEPTH_LINES)]
    _integer_steps(ax)
    ax.set_xlabel("RL step")
    ax.set_ylabel("expected acceptance  Σ min(p, q)  (higher is better)")
    ax.set_title(f"{title}MTP draft acceptance on fresh rollouts: mean of {len(summary['seeds'])} seeds, "
                 "band = min–max at depth 1", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, ncol=2, loc="best")
    _policy(ax_r, summary, steps)
    return fig


def _policy(ax: Any, summary: dict[str, Any], steps: list[int]) -> None:
    """The policy on held-out rollouts: reward and shares on the left axis, KL to the pretrained policy on the right."""
    handles = []
    for key in ("reward", "grammatical_share", "parses", "double_quotes"):
        values = [x["mean"] for x in summary.get(key, [])]
        if has_data(values):
            colour, marker, label = POLICY[key]
            handles += ax.plot(steps, values, color=colour, marker=marker, ms=4, label=label)
    _integer_steps(ax)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward, share of rollouts")
    ax.set_title("policy (held-out rollouts, mean of seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    kl = [x["mean"] for x in summary.get("kl_to_pretrained", [])]
    if has_data(kl):
        ax_k = ax.twinx()
        handles += ax_k.plot(steps, kl, "--", color="tab:olive", marker="x", ms=5, label="KL to pretrained (right axis)")
        ax_k.set_ylabel("KL to the pretrained policy (nats/token)", color="tab:olive")
    ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))


def chain_figure(result: dict[str, Any], title: str = "") -> Any:
    """Realised (solid, min–max bars) and expected (dashed) acceptance per draft step at the last
    evaluation, each variant in its colour and marker."""
    plt = pyplot()
    summary = result["summary"]
    k, last = result["runs"][0]["setting"]["chain"], len(summary["steps"]) - 1
    names = list(summary["variants"])
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    steps = list(range(1, k + 1))
    handles = []
    for i, (name, d) in enumerate(summary["variants"].items()):
        colour, marker = style(name, names)
        x = [j + (i - (len(names) - 1) / 2) * 0.04 for j in steps]
        real = [d[f"realised_accept_{j}"][last] for j in steps]
        expected = [d[f"accept_{j}"][last]["mean"] for j in steps]
        if not has_data([c["mean"] for c in real] + expected):
            continue
        ax.errorbar(x, [c["mean"] for c in real], yerr=[[c["mean"] - c["min"] for c in real], [c["max"] - c["mean"] for c in real]],
                    color=colour, marker=marker, ms=5, capsize=2)
        ax.plot(x, expected, "--", color=colour, marker=marker, ms=4, mfc="white", alpha=0.7)
        handles.append(_key(color=colour, marker=marker, ms=5, label=name))
    handles += [_key(color="black", marker="o", ms=4, label="realised (bars: min–max)"),
                _key(color="black", linestyle="--", marker="o", ms=4, mfc="white", label="expected (hooks)")]
    ax.set_xticks(steps)
    ax.set_xlabel("draft step j (steps 2.. reuse the one MTP layer)")
    ax.set_ylabel("acceptance of step j's drafts")
    ax.set_title(f"{title}k = {k} chain from N = 1, RL step {summary['steps'][last]}: mean of {len(summary['seeds'])} seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, ncol=2, loc="best")
    return fig
