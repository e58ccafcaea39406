"""The acceptance benchmark's plots: every axis labelled, no legend entry without data, and every variant
in a colour and a marker of its own (records made up here, no run needed)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib", reason="the plots need matplotlib (requirements/py311.txt pins it)")

from benchmarks.acceptance.plots import acceptance_figure, chain_figure, style  # noqa: E402
from benchmarks.acceptance.settings import CHAIN_VARIANTS, CODE_VARIANTS  # noqa: E402


def cell(value: float) -> dict[str, float]:
    return {"mean": value, "sd": 0.0, "min": value - 0.01, "max": value + 0.01, "n": 2}


NAN = cell(math.nan)


def series(*values: float) -> list[dict[str, float]]:
    return [cell(v) for v in values]


def depths_record() -> dict:
    """Two evaluations; ``tv`` has no data (no such rollout in any seed), nor has the double-quote share."""
    variants = {name: {"accept_1": series(0.8, 0.7 + 0.01 * i), "accept_2": series(0.75, 0.6 + 0.01 * i), "accept_len": series(1.2, 1.1)}
                for i, name in enumerate(("frozen", "ce", "distill", "accept"))}
    variants["tv"] = {"accept_1": [NAN, NAN], "accept_2": [NAN, NAN], "accept_len": [NAN, NAN]}
    summary = {"steps": [0, 8], "seeds": [0, 1], "variants": variants, "reward": series(0.1, 0.3), "parses": series(0.3, 0.5),
               "double_quotes": [NAN, NAN], "kl_to_pretrained": series(0.0, 1.5)}
    return {"summary": summary}


def chain_record() -> dict:
    variants = {name: {**{f"accept_{j}": series(0.8, 0.7) for j in (1, 2, 3)}, **{f"realised_accept_{j}": series(0.8, 0.75) for j in (1, 2, 3)}}
                for name in CHAIN_VARIANTS}
    variants["accept+chain"] = {key: [NAN, NAN] for key in variants["ce"]}
    return {"summary": {"steps": [0, 8], "seeds": [0, 1], "variants": variants}, "runs": [{"setting": {"chain": 3}}]}


def labels_and_legends(fig) -> tuple[list[tuple[str, str]], list[str], dict[str, tuple[str, str]]]:
    """Each visible axis's label; every legend entry; each entry's (colour, marker)."""
    import matplotlib.colors as colors

    axes = [(ax.get_xlabel() if ax.xaxis.get_visible() else "-", ax.get_ylabel()) for ax in fig.axes]
    texts, styles = [], {}
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        for text, handle in zip(legend.get_texts(), legend.legend_handles):
            texts.append(text.get_text())
            styles[text.get_text()] = (colors.to_hex(handle.get_color()), handle.get_marker())
    return axes, texts, styles


def test_acceptance_plot_labels_every_axis_and_lists_only_series_with_data() -> None:
    fig = acceptance_figure(depths_record(), title="quick run, T = 1.0: ")
    axes, texts, styles = labels_and_legends(fig)
    assert len(axes) == 3 and all(x and y for x, y in axes), axes  # acceptance, policy, and the KL axis on the right
    assert "quick run" in fig.axes[0].get_title()
    assert {"frozen", "ce", "distill", "accept", "depth 1", "depth 2", "reward (mean)", "share that parses"} <= set(texts)
    assert "tv" not in texts and not any("double" in text for text in texts), texts
    variants = [styles[name] for name in ("frozen", "ce", "distill", "accept")]
    assert len({c for c, _ in variants}) == 4 and len({m for _, m in variants}) == 4, variants


def test_chain_plot_labels_every_axis_and_lists_only_variants_with_data() -> None:
    fig = chain_figure(chain_record(), title="chain run: ")
    axes, texts, styles = labels_and_legends(fig)
    assert all(x and y for x, y in axes), axes
    assert [t for t in texts if t in CHAIN_VARIANTS] == [n for n in CHAIN_VARIANTS if n != "accept+chain"]
    variants = [styles[name] for name in CHAIN_VARIANTS if name != "accept+chain"]
    assert len(set(variants)) == len(variants) and len({m for _, m in variants}) == len(variants), variants


def test_every_variant_of_every_setting_has_its_own_colour_and_marker() -> None:
    names = list(dict.fromkeys(CODE_VARIANTS + CHAIN_VARIANTS + ("new", "newer")))
    picked = [style(name, names) for name in names]
    assert len({c for c, _ in picked}) == len(names) and len({m for _, m in picked}) == len(names), picked
