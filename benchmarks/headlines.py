"""The cost benchmark's published sentences: the headline (README, BENCHMARKS.md), the trainer paragraph (docs/api.md).

``run.py --publish`` writes them between their markers; both read ``verdicts.summarize``'s result.
"""

from __future__ import annotations

from typing import Any

from benchmarks.cells import mib, ratio_range
from benchmarks.configs import Config
from benchmarks.verdicts import time_key, time_ratio, time_verdict


def headline(config: Config, result: dict[str, Any]) -> str:
    """The one bold line, lean against stock at the base shape: the first line of the results, and the README's."""
    g = result["points"].get(config.base.key, {}).get("goals", {})
    if "flops_ratio" not in g:
        return "lean vs stock: not measured (stock or lean missing)."
    t = g.get("time")
    basis = result.get("time_basis", "wall time")
    time_part = "–× time" if t is None else f"{t['median']:.2f}× {basis} ({g['time_verdict']})"
    spread = "" if t is None else f"; time = median of {t['rounds']} interleaved rounds, range {t['min']:.2f}–{t['max']:.2f}"
    return (f"**lean vs stock: {g['flops_ratio']:.2f}× FLOPs, {g['memory_ratio']:.2f}× memory, {g['syncs']} host syncs, {time_part}** "
            f"(training micro-batch at the base shape; FLOPs, peak live memory and host syncs counted exactly{spread}).")


def trainer_summary(config: Config, result: dict[str, Any]) -> str:
    """One paragraph for docs/api.md: what ``output="logprobs"`` saves against the trainer's own log-softmax."""
    rows = []
    for shape_key, point in result["points"].items():
        a, b = point["variants"].get("trainer_logits"), point["variants"].get("trainer_logprobs")
        if a and b:
            rows.append((shape_key, a, b, point["shape"]))
    if not rows:
        return ""
    ratios = [(b["train"]["peak_bytes"] / a["train"]["peak_bytes"], key, a, b, shape) for key, a, b, shape in rows]
    best = min(ratios, key=lambda r: r[0])
    worst = max(ratios, key=lambda r: r[0])
    flops = [b["train"]["flops"] / a["train"]["flops"] for _, a, b, _ in rows]
    base = result["points"].get(config.base.key, {}).get("variants", {})
    t = time_ratio(base["trainer_logprobs"][time_key(config)], base["trainer_logits"][time_key(config)]) if (
        "trainer_logprobs" in base and "trainer_logits" in base) else None
    env = result["env"]
    shape = best[4]
    text = (f'Measured by `make bench` ({env.get("date", "")[:10]}, {env.get("cpu_model", "CPU")}, fp32; exact counts): an RL '
            f'trainer\'s policy-gradient + entropy loss from `output="logprobs", entropy=True` peaks at '
            f'{best[0]:.2f}–{worst[0]:.2f}× the memory of the same loss computed from the returned logits '
            f'(`log_softmax`, `gather`, entropy), MTP training in both; the largest saving at V = {shape["vocab"]:,}, '
            f's = {shape["seq"]:,}, N = {shape["mtp"]} ({mib(best[3]["train"]["peak_bytes"])} vs {mib(best[2]["train"]["peak_bytes"])} MiB), '
            f'for {min(flops):.2f}–{max(flops):.2f}× the FLOPs')
    if t:
        text += f"; {result.get('time_basis', 'time')} {ratio_range(t)}× at the base shape ({t['rounds']} interleaved rounds, {time_verdict(t)} against 1.00)"
    text += ". "
    if worst[0] < 1.0:
        text += 'When the RL loss needs only per-token log-probs and entropy, use `output="logprobs"`.'
    else:
        text += f'At {worst[1]} it holds more than the logits path: there keep `output="logits"`.'
    return text + "\n"
