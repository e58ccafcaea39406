"""One acceptance experiment: pretrain (or load), then one GRPO run replayed in every variant, evaluated as it goes.

``run`` is one seed at one rollout temperature, ``run_seeds`` repeats it over seeds with the summary
over them, ``run_task`` over the setting's temperatures. After every RL step the main parameters of
all variants are checked to be bit-identical (the policy trajectory is the same, only the draft
differs); every ``eval_every`` steps each variant's draft is evaluated on fresh rollouts of the
current policy from held-out prompts (``benchmarks.acceptance.evaluate``), and the policy's reward,
measures and KL to the pretrained policy are recorded.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks.acceptance import report  # noqa: E402
from benchmarks.acceptance.arms import assert_same_policy, grpo_batch, make_arm, mtp_parameters, release, rl_banner, rl_step  # noqa: E402
from benchmarks.acceptance.code_task import CodeTask  # noqa: E402
from benchmarks.acceptance.evaluate import evaluator  # noqa: E402
from benchmarks.acceptance.pretrain import forward, pretrained  # noqa: E402
from benchmarks.acceptance.settings import Setting, build_model  # noqa: E402
from benchmarks.acceptance.task import WordTask, next_token_targets, sample_rollouts  # noqa: E402

CACHE = Path("bench-out/acceptance-cache")
TASKS = {"words": WordTask, "code": CodeTask}


def kl_to_reference(logits: Tensor, reference: Tensor, mask: Tensor, temperature: float) -> float:
    """Masked mean over positions of ``KL(pi_T || pi0_T)``, both sampling distributions at ``temperature``."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(reference.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = mask.to(kl.device)
    return float((kl * mask).sum() / mask.sum())


def run(setting: Setting, log: Any = print, temperature: Optional[float] = None, cache: Path = CACHE) -> dict[str, Any]:
    """Pretrain (or load), then the RL phase at ``temperature`` (default: the setting's first) in
    every variant; returns one seed's record."""
    temperature = setting.temperatures[0] if temperature is None else temperature
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    task = TASKS[setting.task].build(setting, setting.seed, cache)
    started = time.perf_counter()
    state, sft = pretrained(task, setting, cache, log)
    arms = [make_arm(name, state, setting, temperature) for name in setting.variants]
    reference = build_model(setting)
    reference.load_state_dict(state)
    ref_hooks = mtp_hooks.attach(reference)  # forwards without labels: MTP off
    frozen_mtp = [p.detach().clone() for p in mtp_parameters(arms[0].model)]
    rollout_gen = torch.Generator().manual_seed(setting.seed + 2)
    eval_gen = torch.Generator().manual_seed(setting.seed + 3)
    steps: list[int] = []
    results: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    train_seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
    evaluate_arm = evaluator(setting)
    rewards: list[float] = []
    kls: list[float] = []
    eval_rewards: list[float] = []
    eval_kls: list[float] = []
    measures: dict[str, list[float]] = {name: [] for name in task.policy_metrics}
    examples: dict[int, list[Any]] = {}
    policy = lambda tokens: forward(arms[0].model, tokens)  # noqa: E731  (same main params in all)

    def evaluate_all(step: int) -> None:
        prompts = task.prompts(setting.eval_rollouts, "eval", eval_gen)
        rollouts = sample_rollouts(policy, prompts, setting.seq, eval_gen, temperature)
        steps.append(step)
        eval_rewards.append(float(task.reward(rollouts, setting.prompt).mean()))
        for name, value in task.describe(rollouts, setting.prompt).items():
            measures[name].append(value)
        with torch.no_grad():
            eval_kls.append(kl_to_reference(policy(rollouts), forward(reference, rollouts), next_token_targets(rollouts, setting.prompt)[1], temperature))
        examples[step] = task.examples(rollouts[:3])
        line = []
        for arm in arms:
            out = evaluate_arm(arm, rollouts, setting, seed=setting.seed + 1000 + step, temperature=temperature)
            results[arm.name].append(out)
            line.append(f"{arm.name} " + "/".join(f"{a:.3f}" for a in out["accept"]))
        shown = ", ".join(f"{name} {values[-1]:.3f}" for name, values in measures.items())
        log(f"  step {step:>4}: held-out reward {eval_rewards[-1]:.3f}, {shown}, KL {eval_kls[-1]:.4f}; accept per depth: " + ", ".join(line))

    log(rl_banner(setting, temperature))
    evaluate_all(0)
    for step in range(1, setting.rl_steps + 1):
        rollouts, advantages, reward = grpo_batch(task, setting, policy, rollout_gen, temperature)
        rewards.append(reward)
        with torch.no_grad():
            ref_logits = forward(reference, rollouts)
        for i, arm in enumerate(arms):
            began = time.perf_counter()
            logits = rl_step(arm, rollouts, advantages, setting.prompt)
            train_seconds[arm.name].append(time.perf_counter() - began)
            if i == 0:  # the policy that sampled these rollouts, before its update
                kls.append(kl_to_reference(logits, ref_logits, next_token_targets(rollouts, setting.prompt)[1], temperature))
        assert_same_policy(arms, step)
        if step % setting.eval_every == 0 or step == setting.rl_steps:
            evaluate_all(step)
    for before, after in zip(frozen_mtp, mtp_parameters(arms[0].model)):
        if not torch.equal(before, after):
            raise AssertionError("the frozen variant's MTP parameters changed")
    release(arms)
    ref_hooks.remove()
    k_range = range(1, (setting.chain or setting.mtp) + 1)
    variants = {
        name: {
            **{f"accept_{k}": [r["accept"][k - 1] for r in rows] for k in k_range},
            **{f"agree_{k}": [r["agree"][k - 1] for r in rows] for k in k_range},
            "tokens_per_step": [r["tokens_per_step"] for r in rows],
            "accept_len": [r["accept_len"] for r in rows],
            **{f"realised_accept_{k}": [r["realised_accept"][k - 1] for r in rows] for k in k_range},
            **{f"expected_at_tried_{k}": [r["expected_at_tried"][k - 1] for r in rows] for k in k_range},
            **{f"tried_{k}": [r["tried"][k - 1] for r in rows] for k in k_range},
            "realised_tokens_per_step": [r["realised_tokens_per_step"] for r in rows],
            "accept_recomputed_max_diff": max(r["accept_recomputed_max_diff"] for r in rows),
            "train_seconds_per_step": sum(train_seconds[name]) / max(len(train_seconds[name]), 1),
        }
        for name, rows in results.items()
    }
    return {
        "task": task.name,
        "temperature": temperature,
        "steps": steps,
        "variants": variants,
        "reward": {"train_mean_per_step": rewards, "held_out_mean": eval_rewards},
        "kl_to_pretrained": {"train_per_step": kls, "held_out": eval_kls},
        "policy_metrics": list(task.policy_metrics),
        **measures,
        "example_rollouts": examples,
        "pretrain": sft,
        "main_parameters_identical_across_variants": True,  # assert_same_policy raised otherwise
        "setting": dataclasses.asdict(setting),
        ("language" if task.name == "words" else "corpus"): task.info(),
        "seconds": time.perf_counter() - started,
        "versions": report.versions(),
    }


def run_seeds(setting: Setting, seeds: tuple[int, ...], log: Any = print, temperature: Optional[float] = None, cache: Path = CACHE) -> dict[str, Any]:
    """``run`` once per seed; every run and the summary over them."""
    runs = []
    for seed in seeds:
        log(f"seed {seed}")
        runs.append(run(dataclasses.replace(setting, seed=seed), log, temperature, cache))
    return {"seeds": list(seeds), "runs": runs, "summary": report.summarize(runs)}


def run_task(setting: Setting, seeds: tuple[int, ...], log: Any = print, cache: Path = CACHE) -> dict[str, Any]:
    """Every temperature of the setting over the seeds: ``run_seeds``'s record for a single
    temperature (the words task), ``{"task", "temperatures": {T: record}}`` otherwise."""
    if len(setting.temperatures) == 1:
        return run_seeds(setting, seeds, log, cache=cache)
    out: dict[str, Any] = {"task": setting.task, "temperatures": {}}
    for temperature in setting.temperatures:
        log(f"rollout temperature {temperature}")
        out["temperatures"][str(temperature)] = run_seeds(setting, seeds, log, temperature, cache)
    return out
