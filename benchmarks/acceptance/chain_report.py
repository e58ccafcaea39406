"""Report of the acceptance benchmark's chain setting (``--config chain``): per variant and draft step
the expected and realised acceptance of a k-step chain drafted as an engine does, tokens per
verification step, the training cost, and the verdict chain-trained against teacher-forced."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.acceptance.figures import fmt, mean_range, spread

# (chain-trained, its teacher-forced counterpart) pairs the verdict compares.
PAIRS = (("ce+chain", "ce+tf"), ("accept+chain", "accept"), ("ce+chain", "ce"))


def _last(run: dict[str, Any], name: str, key: str) -> float:
    return run["variants"][name][key][-1]


def _pooled(runs: list[dict[str, Any]], name: str, key: str, j: int) -> float:
    """``key``'s per-evaluation shares at step j, weighted by the drafts tried, over every seed and evaluation."""
    tried = sum(sum(r["variants"][name][f"tried_{j}"]) for r in runs)
    total = sum(sum(v * t for v, t in zip(r["variants"][name][f"{key}_{j}"], r["variants"][name][f"tried_{j}"]) if t) for r in runs)
    return total / tried if tried else math.nan


def verdict(runs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Per pair and draft step: seeds where the chain-trained variant's realised (and expected)
    acceptance at the last evaluation beats its counterpart's, and the gain's spread."""
    out = []
    names = set(runs[0]["variants"])
    for chained, base in PAIRS:
        if chained not in names or base not in names:
            continue
        for j in range(1, steps + 1):
            realised = [_last(r, chained, f"realised_accept_{j}") - _last(r, base, f"realised_accept_{j}") for r in runs]
            expected = [_last(r, chained, f"accept_{j}") - _last(r, base, f"accept_{j}") for r in runs]
            out.append({"pair": f"{chained} vs {base}", "step": j,
                        "seeds_realised_above": sum(g > 0 for g in realised), "realised_gain": spread(realised),
                        "seeds_expected_above": sum(g > 0 for g in expected), "expected_gain": spread(expected)})
        tokens = [_last(r, chained, "realised_tokens_per_step") - _last(r, base, "realised_tokens_per_step") for r in runs]
        out.append({"pair": f"{chained} vs {base}", "step": "tokens/step", "seeds_realised_above": sum(g > 0 for g in tokens),
                    "realised_gain": spread(tokens), "seeds_expected_above": math.nan, "expected_gain": spread([math.nan])})
    return out


def markdown_chain(result: dict[str, Any]) -> str:
    summary, runs = result["summary"], result["runs"]
    s, v, c = runs[0]["setting"], runs[0]["versions"], runs[0]["corpus"]
    k, last, n = s["chain"], len(summary["steps"]) - 1, len(runs)
    names = list(summary["variants"])
    lines = [
        f"{s['device'].upper()}, fp32; torch {v['torch']}, megatron-core {v['megatron-core']}, Python {v['python']}. Code task "
        f"(V = {c['vocab']:,}), GPTModel h={s['hidden']}, {s['layers']} layers, N={s['mtp']} MTP layer; pretraining "
        + ", ".join(f"{r['pretrain']['steps']} steps" for r in runs)
        + f". RL: {s['rl_steps']} GRPO steps of {s['prompts']}x{s['group']} rollouts at T = {runs[0]['temperature']}; evaluated at steps "
        f"{', '.join(map(str, summary['steps']))} on {s['eval_rollouts']} fresh rollouts, every variant drafting k = {k} steps as an "
        f"engine does (step 1: MTP layer 1 on the main hidden state and the last target token; steps 2..{k}: the layer again on the "
        f"previous step's hidden state and its own sampled draft). Main parameters bit-identical across variants. "
        f"{n} seeds ({', '.join(map(str, summary['seeds']))}); runs took {', '.join(str(round(r['seconds'])) for r in runs)} s.",
        "",
        f"Mean (min–max) over the seeds at RL step {summary['steps'][last]}. Expected: the hooks' `mtp_j/accept` along the own-draft "
        "chain on the evaluation rollouts; realised: the share of drafts the k-step speculative loop accepted at step j (in brackets "
        "the exact `sum_v min(p, q)` of the drafts it tried); train s/step: wall time of one RL update (mean over steps and seeds).",
        "",
        "| variant | " + " | ".join(f"step {j} expected | step {j} realised (exp. at tried)" for j in range(1, k + 1))
        + " | realised tokens/step | `mtp/accept_len` | train s/step |",
        "|---|" + "---:|---:|" * k + "---:|---:|---:|",
    ]
    for name in names:
        d = summary["variants"][name]
        cells = [f"{mean_range(d[f'accept_{j}'][last])} | {mean_range(d[f'realised_accept_{j}'][last])} ({fmt(d[f'expected_at_tried_{j}'][last]['mean'])})"
                 for j in range(1, k + 1)]
        cost = spread([r["variants"][name]["train_seconds_per_step"] for r in runs])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean_range(d['realised_tokens_per_step'][last])} | {mean_range(d['accept_len'][last])} | "
                     f"{cost['mean']:.3f} |")
    lines += ["", "Verdict at the last evaluation, chain-trained − counterpart (seeds above: of "
              f"{n}; gain mean ± sd (min–max)):", "",
              "| pair | step | realised: seeds above | realised gain | expected: seeds above | expected gain |", "|---|---:|---:|---:|---:|---:|"]
    for row in verdict(runs, k):
        g, e = row["realised_gain"], row["expected_gain"]
        exp = "— | —" if row["step"] == "tokens/step" else f"{row['seeds_expected_above']} | {e['mean']:+.3f} ± {e['sd']:.3f} ({e['min']:+.3f} to {e['max']:+.3f})"
        lines.append(f"| {row['pair']} | {row['step']} | {row['seeds_realised_above']} | {g['mean']:+.3f} ± {g['sd']:.3f} "
                     f"({g['min']:+.3f} to {g['max']:+.3f}) | {exp} |")
    pooled = [", ".join(f"{name} {fmt(_pooled(runs, name, 'realised_accept', j))}/{fmt(_pooled(runs, name, 'expected_at_tried', j))}"
                        f" of {sum(sum(r['variants'][name][f'tried_{j}']) for r in runs)}" for name in names) for j in range(1, k + 1)]
    worst = max(r["variants"][m]["accept_recomputed_max_diff"] for r in runs for m in r["variants"])
    lines += ["", "Loop check, every evaluation and seed pooled (realised / expected at the tried drafts, of drafts tried): "
              + "; ".join(f"step {j}: {text}" for j, text in enumerate(pooled, start=1))
              + f". Largest difference between the hooks' `mtp_j/accept` and the same quantity recomputed from the probed states: {worst:.1e}.", ""]
    return "\n".join(lines)
