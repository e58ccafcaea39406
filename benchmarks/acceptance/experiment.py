"""Draft acceptance through an RL run: a frozen MTP draft against drafts trained inside RL.

``python -m benchmarks.acceptance [--task code|words] [--quick]`` (``make acceptance``). A real mcore
GPTModel with N = 2 MTP layers is first trained jointly (main + MTP losses, gradients into the
trunk, as stock mcore trains) on the task's text until it stops improving. Then one GRPO run is
replayed in variants that differ only in the draft:

* ``frozen``: the RL forward runs without labels (MTP block off); MTP parameters never change;
* ``ce`` / ``distill`` / ``tv`` / ``accept``: ``mtp_hooks.attach(objective=..., draft_temperature=T)``
  with ``detach_encoder=True, detach_head=True``, so MTP trains on the rollouts while the policy's
  gradients stay its own.

Tasks (``benchmarks.acceptance.task.Task``): ``code`` (the default; ``benchmarks/acceptance/code_task.py``):
the interpreter's own standard library, a byte-level BPE, function-definition prompts and a reward
verified on the generated code (it must parse, and double quotes score), run at rollout temperatures
T = 1.0 and 0.7 with the drafts trained at the same T; ``words``: the synthetic 12-word language
(``benchmarks/acceptance/task.py``, V = 32, T = 1.0, the four original variants).
``--task code --config chain``: an N = 1 model, variants that also train a chain of k = 3 draft
steps (``ce+tf`` teacher-forced, ``ce+chain`` / ``accept+chain`` on their own sampled drafts), and
every variant evaluated drafting k = 3 steps as an engine does (``benchmarks/acceptance/chain.py``).

Main and MTP parameters have separate Adam optimizers, rollouts come from one seeded generator,
and after every step the main parameters of all variants are checked to be bit-identical: the
policy trajectory is the same, only the draft differs. Every few steps, on fresh rollouts of the
current policy from held-out prompts (their own generator, never trained on), each variant reports
per depth the expected acceptance ``sum_v min(p, q)`` and top-1 agreement of a training-style
forward that is never backpropagated, the hooks' expected accepted length ``mtp/accept_len``, and
runs a real speculative sampling loop (``benchmarks/acceptance/drafts.py``). The policy's reward and
its KL to the pretrained policy are recorded per step.

The experiment is repeated for each of ``--seeds`` (default 0, 1, 2); tables give the mean and
min–max over seeds (``benchmarks/acceptance/report.py``). Pretrained models of the code task are
cached per seed under ``bench-out/acceptance-cache/`` (with the tokenizer and token streams), so
reruns skip pretraining. ``--seeds 0 --out A``, ``--seeds 1 --out B``, ... run as separate processes
(side by side on separate cores), then ``--merge A B ... --out C`` joins them into one record.
Output: ``bench-out/acceptance/`` (``acceptance.json``, ``acceptance.md``, plots).
"""

from __future__ import annotations

import argparse
import json
import contextlib
import dataclasses
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.acceptance import report as acceptance_report  # noqa: E402
from benchmarks.acceptance.chain import evaluate_chain, training_options  # noqa: E402
from benchmarks.acceptance.code_task import CodeTask  # noqa: E402
from benchmarks.acceptance.drafts import (  # noqa: E402
    DraftCapture,
    chain_tokens_per_step,
    device_of,
    draft_forward,
    expected_acceptance,
    positions,
    speculative_sampling,
)
from benchmarks.acceptance.pretrain import forward, pretrained  # noqa: E402
from benchmarks.acceptance.settings import CHAIN_VARIANTS, CODE_VARIANTS, SETTINGS, WORD_VARIANTS, Setting, config, overrides, shape_of  # noqa: E402
from benchmarks.acceptance.task import WordTask, group_advantages, next_token_targets, policy_gradient_loss, sample_rollouts  # noqa: E402

SEEDS = (0, 1, 2)
CACHE = Path("bench-out/acceptance-cache")
TASKS = {"words": WordTask, "code": CodeTask}
__all__ = ["CHAIN_VARIANTS", "CODE_VARIANTS", "SETTINGS", "WORD_VARIANTS", "Setting", "chain_tokens_per_step", "config", "main", "run", "run_seeds", "run_task", "shape_of"]


def _is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def main_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not _is_mtp(name)]


def mtp_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if _is_mtp(name)]


# ------------------------------------------------------------------------------------ RL


@dataclasses.dataclass
class Arm:
    """One variant of the RL phase: its model, hooks, capture and optimizers."""

    name: str
    model: nn.Module
    hooks: mtp_hooks.MTPHooks
    capture: Optional[DraftCapture]  # None: the chain's evaluation probes the model itself
    main_opt: torch.optim.Optimizer
    mtp_opt: Optional[torch.optim.Optimizer]


def _make_arm(name: str, state: dict[str, Tensor], setting: Setting, temperature: float) -> Arm:
    model = models.build(config(setting), shape_of(setting), setting.mtp)
    model.load_state_dict(state)
    hooks = mtp_hooks.attach(model, **training_options(name, temperature, setting.chain))
    mtp_opt = None if name == "frozen" else torch.optim.Adam(mtp_parameters(model), lr=setting.mtp_lr)
    capture = None if setting.chain else DraftCapture(model)
    return Arm(name, model, hooks, capture, torch.optim.Adam(main_parameters(model), lr=setting.rl_lr), mtp_opt)


def _rl_step(arm: Arm, tokens: Tensor, advantages: Tensor, prompt: int) -> Tensor:
    """One GRPO update of ``arm``; returns the (detached) logits of its forward."""
    device = device_of(arm.model)
    labels, mask = next_token_targets(tokens, prompt)
    tokens, labels, mask = tokens.to(device), labels.to(device), mask.to(device)
    if arm.mtp_opt is None:  # frozen draft: a forward without labels, the MTP block does not run
        logits = arm.model(tokens, positions(tokens), None)
    else:
        with arm.hooks.micro_batch(labels=labels, loss_mask=mask):
            logits = arm.model(tokens, positions(tokens), None)
    policy_gradient_loss(logits, labels, mask, advantages.to(device)).backward()
    arm.main_opt.step()
    if arm.mtp_opt is not None:
        arm.mtp_opt.step()
    arm.model.zero_grad(set_to_none=True)
    arm.hooks.metrics()  # training-batch metrics are not the held-out ones reported
    return logits.detach()


def assert_same_policy(arms: list[Arm], step: int) -> None:
    """Every variant's main parameters bit-identical to the first's (the controlled experiment)."""
    reference = dict(arms[0].model.named_parameters())
    for arm in arms[1:]:
        for name, p in arm.model.named_parameters():
            if not _is_mtp(name) and not torch.equal(p, reference[name]):
                raise AssertionError(f"step {step}: main parameter {name} of {arm.name!r} differs from {arms[0].name!r}")


def kl_to_reference(logits: Tensor, reference: Tensor, mask: Tensor, temperature: float) -> float:
    """Masked mean over positions of ``KL(pi_T || pi0_T)``, both sampling distributions at ``temperature``."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(reference.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = mask.to(kl.device)
    return float((kl * mask).sum() / mask.sum())


def evaluate(arm: Arm, rollouts: Tensor, setting: Setting, seed: int, temperature: float = 1.0) -> dict[str, Any]:
    """Held-out draft quality of one variant on the current policy's rollouts."""
    _, mask = next_token_targets(rollouts, setting.prompt)
    main, drafts, metrics = draft_forward(arm.model, arm.hooks, arm.capture, rollouts, setting.prompt, temperature)
    accepts = [metrics[f"mtp_{k}/accept"] for k in range(1, setting.mtp + 1)]
    own = expected_acceptance(main, drafts, mask)
    del main, drafts
    spec = speculative_sampling(arm.model, arm.hooks, arm.capture, rollouts[:, : setting.prompt], setting.seq,
                                torch.Generator().manual_seed(seed), temperature)
    return {
        "accept": accepts,
        "agree": [metrics[f"mtp_{k}/agree"] for k in range(1, setting.mtp + 1)],
        "accept_len": metrics.get("mtp/accept_len", float("nan")),
        "accept_recomputed_max_diff": max(abs(a - b) for a, b in zip(accepts, own)),
        "tokens_per_step": chain_tokens_per_step(accepts),
        **spec.summary(),
    }


def run(setting: Setting, log: Any = print, temperature: Optional[float] = None, cache: Path = CACHE) -> dict[str, Any]:
    """Pretrain (or load), then the RL phase at ``temperature`` (default: the setting's first) in
    every variant; returns one seed's record."""
    temperature = setting.temperatures[0] if temperature is None else temperature
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    task = TASKS[setting.task].build(setting, setting.seed, cache)
    started = time.perf_counter()
    state, sft = pretrained(task, setting, cache, log)
    arms = [_make_arm(name, state, setting, temperature) for name in setting.variants]
    reference = models.build(config(setting), shape_of(setting), setting.mtp)
    reference.load_state_dict(state)
    ref_hooks = mtp_hooks.attach(reference)  # forwards without labels: MTP off
    frozen_mtp = [p.detach().clone() for p in mtp_parameters(arms[0].model)]
    rollout_gen = torch.Generator().manual_seed(setting.seed + 2)
    eval_gen = torch.Generator().manual_seed(setting.seed + 3)
    steps: list[int] = []
    results: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    train_seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
    evaluate_arm = evaluate_chain if setting.chain else evaluate
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

    log(f"RL (GRPO, {setting.prompts} prompts x {setting.group} rollouts per step, {setting.rl_steps} steps, T = {temperature}), "
        f"variants {', '.join(setting.variants)}")
    evaluate_all(0)
    for step in range(1, setting.rl_steps + 1):
        prompts = task.prompts(setting.prompts, "rl", rollout_gen).repeat_interleave(setting.group, dim=0)
        rollouts = sample_rollouts(policy, prompts, setting.seq, rollout_gen, temperature)
        reward = task.reward(rollouts, setting.prompt)
        rewards.append(float(reward.mean()))
        advantages = group_advantages(reward, setting.group)
        with torch.no_grad():
            ref_logits = forward(reference, rollouts)
        for i, arm in enumerate(arms):
            began = time.perf_counter()
            logits = _rl_step(arm, rollouts, advantages, setting.prompt)
            train_seconds[arm.name].append(time.perf_counter() - began)
            if i == 0:  # the policy that sampled these rollouts, before its update
                kls.append(kl_to_reference(logits, ref_logits, next_token_targets(rollouts, setting.prompt)[1], temperature))
        assert_same_policy(arms, step)
        if step % setting.eval_every == 0 or step == setting.rl_steps:
            evaluate_all(step)
    for before, after in zip(frozen_mtp, mtp_parameters(arms[0].model)):
        if not torch.equal(before, after):
            raise AssertionError("the frozen variant's MTP parameters changed")
    for arm in arms:
        if arm.capture is not None:
            arm.capture.remove()
        arm.hooks.remove()
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
        "versions": acceptance_report.versions(),
    }


def run_seeds(setting: Setting, seeds: tuple[int, ...], log: Any = print, temperature: Optional[float] = None, cache: Path = CACHE) -> dict[str, Any]:
    """``run`` once per seed; every run and the summary over them."""
    runs = []
    for seed in seeds:
        log(f"seed {seed}")
        runs.append(run(dataclasses.replace(setting, seed=seed), log, temperature, cache))
    return {"seeds": list(seeds), "runs": runs, "summary": acceptance_report.summarize(runs)}


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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="code", help="code (default): the standard library's source; words: the synthetic language")
    parser.add_argument("--quick", action="store_true", help="the short schedule (3 seeds in minutes on 2 cores)")
    parser.add_argument("--config", "--setting", dest="setting", help="named schedule: quick, full (default), smoke; code also gpu (one CUDA device), chain (k = 3 drafts from N = 1), chain-smoke")
    parser.add_argument("--set", default="", metavar="FIELD=VALUE,...", help="override sizes or schedule, e.g. hidden=32,layers=1,device=cpu")
    parser.add_argument("--out", type=Path, default=Path("bench-out/acceptance"))
    parser.add_argument("--cache", type=Path, default=CACHE, help="tokenizer, token streams and pretrained models (code task)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (small matmuls: 1 is fastest on a shared CPU)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default: 0,1,2; at least 1)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="join the acceptance.json of runs over separate seeds into --out, run nothing")
    args = parser.parse_args(argv)
    if args.merge:
        result = acceptance_report.merge_seeds([json.loads((directory / "acceptance.json").read_text()) for directory in args.merge])
        acceptance_report.write_outputs(result, args.out)
        print(acceptance_report.markdown(result))
        return 0
    name = args.setting or ("quick" if args.quick else "full")
    if name not in SETTINGS[args.task]:
        parser.error(f"--config {name!r}: the {args.task} task has {', '.join(sorted(SETTINGS[args.task]))}")
    try:
        setting = dataclasses.replace(SETTINGS[args.task][name], **overrides(args.set))
    except ValueError as error:
        parser.error(str(error))
    seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
    if not seeds:
        parser.error("--seeds needs at least one seed")
    torch.set_num_threads(args.threads)
    if setting.device != "cpu":  # the controlled experiment needs bit-identical main updates in every variant
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        models.setup(config(setting), stack)
        result = run_task(setting, seeds, cache=args.cache)
    result["wall_seconds"] = time.perf_counter() - started
    acceptance_report.write_outputs(result, args.out)
    print(acceptance_report.markdown(result))
    print(f"written: {args.out}/acceptance.json, acceptance.md and the plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
