"""Reports of the acceptance benchmark: the summary over seeds, Markdown tables, plots, outputs."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

import torch

from benchmarks.acceptance.chain_report import markdown_chain
from benchmarks.acceptance.figures import fmt, mean_range, spread
from benchmarks.acceptance.plots import plot, plot_chain


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"torch": torch.__version__, "megatron-core": version("megatron-core"), "python": platform.python_version()}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant, series and step: mean, sd, min and max over the seeds' runs (same evaluation steps)."""
    steps = runs[0]["steps"]
    if any(r["steps"] != steps for r in runs):
        raise ValueError("the seeds' runs were evaluated at different steps")
    series = [k for k in runs[0]["variants"]["frozen"] if isinstance(runs[0]["variants"]["frozen"][k], list) and not k.startswith("tried")]
    out: dict[str, Any] = {"steps": steps, "seeds": [r["setting"]["seed"] for r in runs], "variants": {}}
    for name in runs[0]["variants"]:
        out["variants"][name] = {
            key: [spread([r["variants"][name][key][i] for r in runs]) for i in range(len(steps))] for key in series
        }
    out["reward"] = [spread([r["reward"]["held_out_mean"][i] for r in runs]) for i in range(len(steps))]
    for name in runs[0].get("policy_metrics", ["grammatical_share"]):
        out[name] = [spread([r[name][i] for r in runs]) for i in range(len(steps))]
    if "kl_to_pretrained" in runs[0]:
        out["kl_to_pretrained"] = [spread([r["kl_to_pretrained"]["held_out"][i] for r in runs]) for i in range(len(steps))]
        out["train_reward"] = [spread(list(col)) for col in zip(*(r["reward"]["train_mean_per_step"] for r in runs))]
        out["train_kl"] = [spread(list(col)) for col in zip(*(r["kl_to_pretrained"]["train_per_step"] for r in runs))]
    last = {name: [r["variants"][name]["accept_1"][-1] + r["variants"][name]["accept_2"][-1] for r in runs] for name in runs[0]["variants"]}
    length = {name: [r["variants"][name].get("accept_len", [math.nan])[-1] for r in runs] for name in runs[0]["variants"]}
    out["verdict"] = {
        name: {"seeds_above_frozen": sum(a > f for a, f in zip(last[name], last["frozen"])),
               "mean_gain_over_frozen": spread([(a - f) / 2 for a, f in zip(last[name], last["frozen"])]),
               "seeds_accept_len_above_frozen": sum(a > f for a, f in zip(length[name], length["frozen"])),
               "accept_len_gain_over_frozen": spread([a - f for a, f in zip(length[name], length["frozen"])])}
        for name in last if name != "frozen"
    }
    return out


def merge_seeds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from runs of the same task and setting over separate seeds (``--merge``: seeds run
    as separate processes, e.g. in parallel on separate cores): the runs joined, the summary anew."""
    def joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
        runs = sorted((run for part in parts for run in part["runs"]), key=lambda run: run["setting"]["seed"])
        return {"seeds": [run["setting"]["seed"] for run in runs], "runs": runs, "summary": summarize(runs)}

    if "temperatures" not in records[0]:
        out = joined(records)
    else:
        out = {"task": records[0]["task"], "temperatures": {t: joined([r["temperatures"][t] for r in records]) for t in records[0]["temperatures"]}}
    out["wall_seconds"] = max(record["wall_seconds"] for record in records)  # the processes ran side by side
    if "mode" in records[0]:
        out["mode"] = records[0]["mode"]
    return out


def markdown_words(result: dict[str, Any]) -> str:
    """Tables over seeds (the words task): per variant at the last evaluation, the verdict, and per step."""
    summary, runs = result["summary"], result["runs"]
    steps, last = summary["steps"], len(summary["steps"]) - 1
    v, s = runs[0]["versions"], runs[0]["setting"]
    n = len(runs)
    lines = [
        f"CPU, fp32; torch {v['torch']}, megatron-core {v['megatron-core']}. GPTModel h={s['hidden']}, {s['layers']} layers, "
        f"V={s['vocab']}, N={s['mtp']}, rollouts of {s['seq']} tokens. {n} seeds ({', '.join(map(str, summary['seeds']))}): each its "
        f"own word language, pretraining ({', '.join(str(r['pretrain']['steps']) for r in runs)} steps), GRPO trajectory and "
        f"evaluation rollouts. RL: {s['rl_steps']} GRPO steps of {s['prompts']}x{s['group']} rollouts; evaluated on "
        f"{s['eval_rollouts']} fresh rollouts every {s['eval_every']} steps. Main parameters bit-identical across variants at "
        f"every step of every seed. Runs took {', '.join(str(round(r['seconds'])) for r in runs)} s.",
        "",
        f"Mean (min–max) over the {n} seeds, at RL step {steps[last]}:",
        "",
        f"| variant | accept_1 step 0 → {steps[last]} | accept_2 step 0 → {steps[last]} | agree_1 / agree_2 | "
        "expected tokens/step | realised tokens/step | realised accept_1 / accept_2 (expected at the tried drafts) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, d in summary["variants"].items():
        lines.append(
            f"| {name} | {fmt(d['accept_1'][0]['mean'])} → **{mean_range(d['accept_1'][last])}** | "
            f"{fmt(d['accept_2'][0]['mean'])} → **{mean_range(d['accept_2'][last])}** | "
            f"{fmt(d['agree_1'][last]['mean'])} / {fmt(d['agree_2'][last]['mean'])} | {mean_range(d['tokens_per_step'][last])} | "
            f"{mean_range(d['realised_tokens_per_step'][last])} | {fmt(d['realised_accept_1'][last]['mean'])} "
            f"({fmt(d['expected_at_tried_1'][last]['mean'])}) / {fmt(d['realised_accept_2'][last]['mean'])} "
            f"({fmt(d['expected_at_tried_2'][last]['mean'])}) |"
        )
    lines += ["", f"Verdict from the seeds (mean expected acceptance over both depths at step {steps[last]}, trained draft − frozen):", "",
              "| variant | seeds above frozen | gain: mean ± sd (min–max) |", "|---|---:|---:|"]
    for name, d in summary["verdict"].items():
        g = d["mean_gain_over_frozen"]
        lines.append(f"| {name} | {d['seeds_above_frozen']} of {n} | {g['mean']:+.3f} ± {g['sd']:.3f} ({g['min']:+.3f} to {g['max']:+.3f}) |")
    tried = {k: sum(sum(r["variants"][m][f"tried_{k}"]) for r in runs for m in r["variants"]) for k in (1, 2)}
    realised = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"realised_accept_{k}"], r["variants"][m][f"tried_{k}"]))
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    expected = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"expected_at_tried_{k}"], r["variants"][m][f"tried_{k}"]))
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    worst = max(r["variants"][m]["accept_recomputed_max_diff"] for r in runs for m in r["variants"])
    lines += [
        "",
        "Expected tokens per verification step: `1 + a_1 + a_1·a_2` (the target's own token included; depths treated as "
        "independent). Speculative sampling over all seeds, evaluations and variants: depth 1 accepted "
        f"{realised[1]:.4f} of {tried[1]} drafts against an expected {expected[1]:.4f}; depth 2 {realised[2]:.4f} of {tried[2]} "
        f"against {expected[2]:.4f}. Largest difference between the hooks' `mtp_k/accept` and the same quantity recomputed "
        f"from the captured distributions: {worst:.1e}.",
        "",
        f"Expected acceptance `a1 / a2` by RL step on held-out rollouts, mean over the {n} seeds (min–max of a1 in brackets), "
        "with the policy's held-out reward and grammatical share (means):",
        "",
        "| step | reward | grammatical | " + " | ".join(f"{m} a1 / a2" for m in summary["variants"]) + " |",
        "|---:|---:|---:|" + "---:|" * len(summary["variants"]),
    ]
    for i, step in enumerate(steps):
        cells = [f"{fmt(d['accept_1'][i]['mean'])} / {fmt(d['accept_2'][i]['mean'])} ({fmt(d['accept_1'][i]['min'])}–{fmt(d['accept_1'][i]['max'])})"
                 for d in summary["variants"].values()]
        lines.append(f"| {step} | {fmt(summary['reward'][i]['mean'])} | {fmt(summary['grammatical_share'][i]['mean'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _speculative_line(runs: list[dict[str, Any]]) -> str:
    tried = {k: sum(sum(r["variants"][m][f"tried_{k}"]) for r in runs for m in r["variants"]) for k in (1, 2)}
    realised = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"realised_accept_{k}"], r["variants"][m][f"tried_{k}"]) if t)
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    expected = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"expected_at_tried_{k}"], r["variants"][m][f"tried_{k}"]) if t)
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    worst = max(r["variants"][m]["accept_recomputed_max_diff"] for r in runs for m in r["variants"])
    return (f"Speculative sampling over all seeds, evaluations and variants: depth 1 accepted {realised[1]:.4f} of {tried[1]} drafts "
            f"against an expected {expected[1]:.4f}; depth 2 {realised[2]:.4f} of {tried[2]} against {expected[2]:.4f}. Largest "
            f"difference between the hooks' `mtp_k/accept` and the same quantity recomputed from the captured distributions: {worst:.1e}.")


def _series(values: list[dict[str, float]], every: int) -> str:
    picked = [(i + 1, v) for i, v in enumerate(values) if (i + 1) % every == 0 or i == 0 or i + 1 == len(values)]
    return ", ".join(f"{i}: {fmt(v['mean'])}" for i, v in picked)


def markdown_code(result: dict[str, Any]) -> str:
    """Per rollout temperature: the variants at the last evaluation, the verdict, the policy per step."""
    lines: list[str] = []
    for temperature, record in result["temperatures"].items():
        summary, runs = record["summary"], record["runs"]
        steps, last, n = summary["steps"], len(summary["steps"]) - 1, len(runs)
        v, s, c = runs[0]["versions"], runs[0]["setting"], runs[0]["corpus"]
        sft = [r["pretrain"] for r in runs]
        lines += [
            f"### Rollout temperature T = {temperature} (drafts trained and scored at `draft_temperature={temperature}`)",
            "",
            f"{s['device'].upper()}, fp32; torch {v['torch']}, megatron-core {v['megatron-core']}, Python {v['python']}. Corpus: the "
            f"standard library's own `*.py` files ({c['files']['train']} train, {c['files']['rl']} RL-prompt and {c['files']['eval']} "
            f"evaluation files; {runs[0]['corpus']['train_tokens']:,} training tokens), byte-level BPE with V = {c['vocab']:,}. GPTModel "
            f"h={s['hidden']}, {s['layers']} layers, {s['heads']} heads, RoPE, N={s['mtp']} MTP layers. Pretraining (joint main + MTP, "
            f"{s['sft_batch']} x {s['pretrain_seq'] if 'pretrain_seq' in s else s['sft_seq']} tokens per step): "
            + ", ".join(f"{p['steps']} steps (held-out CE {fmt(p.get('held_out_loss', [math.nan])[-1])}, "
                        f"{'flattened' if p['plateau'] else 'still falling: capped'})" for p in sft)
            + f". RL: {s['rl_steps']} GRPO steps of {s['prompts']}x{s['group']} rollouts of {s['seq']} tokens ({s['prompt']}-token prompt: "
            f"the start of a held-out function); evaluated on {s['eval_rollouts']} fresh rollouts from evaluation-file prompts every "
            f"{s['eval_every']} steps. Main parameters bit-identical across variants at every step of every seed. Runs took "
            f"{', '.join(str(round(r['seconds'])) for r in runs)} s ({n} seeds: {', '.join(map(str, summary['seeds']))}).",
            "",
            f"Mean (min–max) over the {n} seeds, at RL step {steps[last]}:",
            "",
            f"| variant | accept_1 step 0 → {steps[last]} | accept_2 step 0 → {steps[last]} | `mtp/accept_len` step 0 → {steps[last]} | "
            "realised tokens/step | realised accept_1 / accept_2 (expected at the tried drafts) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, d in summary["variants"].items():
            lines.append(
                f"| {name} | {fmt(d['accept_1'][0]['mean'])} → **{mean_range(d['accept_1'][last])}** | "
                f"{fmt(d['accept_2'][0]['mean'])} → **{mean_range(d['accept_2'][last])}** | "
                f"{fmt(d['accept_len'][0]['mean'])} → **{mean_range(d['accept_len'][last])}** | {mean_range(d['realised_tokens_per_step'][last])} | "
                f"{fmt(d['realised_accept_1'][last]['mean'])} ({fmt(d['expected_at_tried_1'][last]['mean'])}) / "
                f"{fmt(d['realised_accept_2'][last]['mean'])} ({fmt(d['expected_at_tried_2'][last]['mean'])}) |"
            )
        lines += ["", f"Verdict from the seeds at step {steps[last]} (trained draft − frozen):", "",
                  "| variant | mean acceptance of both depths: seeds above frozen | gain mean ± sd (min–max) | "
                  "`mtp/accept_len`: seeds above frozen | gain mean ± sd (min–max) |", "|---|---:|---:|---:|---:|"]
        for name, d in summary["verdict"].items():
            g, h = d["mean_gain_over_frozen"], d["accept_len_gain_over_frozen"]
            lines.append(f"| {name} | {d['seeds_above_frozen']} of {n} | {g['mean']:+.3f} ± {g['sd']:.3f} ({g['min']:+.3f} to {g['max']:+.3f}) | "
                         f"{d['seeds_accept_len_above_frozen']} of {n} | {h['mean']:+.3f} ± {h['sd']:.3f} ({h['min']:+.3f} to {h['max']:+.3f}) |")
        lines += [
            "",
            "`mtp/accept_len`: the hooks' expected number of accepted draft tokens per verification step, per position "
            "`sum_k prod_{j<=k} alpha_j` (teacher-forced); realised tokens per step count the target's own token too. " + _speculative_line(runs),
            "",
            f"By RL step on held-out rollouts, mean over the {n} seeds: the policy (reward; share whose function lines parse; "
            "double-quote share of their string literals; per-token KL to the pretrained policy, both at T) and each variant's "
            "expected acceptance `a1 / a2`:",
            "",
            "| step | reward | parses | double quotes | KL | " + " | ".join(f"{m} a1 / a2" for m in summary["variants"]) + " |",
            "|---:|---:|---:|---:|---:|" + "---:|" * len(summary["variants"]),
        ]
        for i, step in enumerate(steps):
            cells = [f"{fmt(d['accept_1'][i]['mean'])} / {fmt(d['accept_2'][i]['mean'])}" for d in summary["variants"].values()]
            lines.append(f"| {step} | {fmt(summary['reward'][i]['mean'])} | {fmt(summary['parses'][i]['mean'])} | "
                         f"{fmt(summary['double_quotes'][i]['mean'])} | {summary['kl_to_pretrained'][i]['mean']:.4f} | " + " | ".join(cells) + " |")
        every = max(1, len(summary["train_reward"]) // 8)
        lines += ["", f"GRPO training batches, mean over seeds, by step: reward {_series(summary['train_reward'], every)}; "
                      f"KL to the pretrained policy {_series(summary['train_kl'], every)}.", ""]
    return "\n".join(lines)


def _is_chain(result: dict[str, Any]) -> bool:
    return "runs" in result and bool(result["runs"][0]["setting"].get("chain"))


def markdown(result: dict[str, Any]) -> str:
    if _is_chain(result):
        return markdown_chain(result)
    return markdown_code(result) if "temperatures" in result else markdown_words(result)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """``acceptance.json``, ``acceptance.md`` and the plots, titled with the run's mode (``quick run``, ...)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(result, indent=1))
    (out / "acceptance.md").write_text(markdown(result))
    mode = f"{result['mode']} run" if result.get("mode") else ""
    if "temperatures" in result:
        for temperature, record in result["temperatures"].items():
            plot(record, out / f"acceptance-T{temperature}.png", title=f"{mode + ', ' if mode else ''}T = {temperature}: ")
    elif _is_chain(result):
        plot_chain(result, out / "acceptance-chain.png", title=f"{mode}: " if mode else "")
    else:
        plot(result, out / "acceptance.png", title=f"{mode}: " if mode else "")
