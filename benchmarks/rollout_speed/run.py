"""One seed of the rollout-speed benchmark: pretrain (or load), a short GRPO run with the draft frozen and trained, then
vLLM's rollouts timed (``timing.time_rollouts``)."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from benchmarks.acceptance.arms import make_arm, release
from benchmarks.acceptance.engine_run import engine_options, state_of, run_grpo
from benchmarks.acceptance.experiment import TASKS
from benchmarks.acceptance.pretrain import pretrained
from benchmarks.acceptance.settings import Setting, build_model
from benchmarks.rollout_speed.timing import Plan, time_rollouts


def run_seed(setting: Setting, cache: Path, rounds: int, batch: int, config: str = "cpu",
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """The RL run (every variant replays one GRPO run: the same policy, only the MTP layer differs), then every
    variant's rollouts timed by vLLM at the rollouts' T: ``setting.eval_rollouts`` held-out prompts, the rest of
    ``setting.seq`` generated, ``setting.chain`` drafted tokens."""
    temperature = setting.temperatures[0]
    started = time.perf_counter()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    task = TASKS[setting.task].build(setting, setting.seed, cache)
    state, sft = pretrained(task, setting, cache, log)
    pretrain_seconds = time.perf_counter() - started
    arms = [make_arm(name, state, setting, temperature, engine_options(name, setting.chain)) for name in setting.variants]
    rewards = run_grpo(setting, task, arms, torch.Generator().manual_seed(setting.seed + 2), lambda step: None, log)
    drafts = {arm.name: state_of(arm.model) for arm in arms}
    final = arms[0].model
    release(arms)
    rl_seconds = time.perf_counter() - started - pretrain_seconds
    before = build_model(setting)
    before.load_state_dict(state)
    prompts = task.prompts(setting.eval_rollouts, "eval", torch.Generator().manual_seed(setting.seed + 3)).tolist()
    tokens = setting.seq - setting.prompt
    log(f"vLLM: {len(prompts)} prompts x {tokens} tokens at T = {temperature}, batch {batch}, k = {setting.chain}, {rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="rollout-speed-") as folder:
        plan = Plan(tokens, temperature, 1_000_000 * (setting.seed + 1), setting.chain, rounds, batch, setting.vocab, config)
        timed = time_rollouts(Path(folder), before, final, drafts, prompts, plan, log)
    return {
        "seed": setting.seed, **timed, "prompts": len(prompts), "tokens_per_prompt": tokens,
        "reward_train_mean_per_step": rewards, "pretrain": sft,
        "seconds": {"pretrain": pretrain_seconds, "rl": rl_seconds, "total": time.perf_counter() - started},
    }


def run(setting: Setting, seeds: tuple[int, ...], cache: Path, rounds: int, batch: int, config: str = "cpu",
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every seed; the record ``report`` reads."""
    runs = []
    for seed in seeds:
        log(f"seed {seed}")
        runs.append(run_seed(dataclasses.replace(setting, seed=seed), cache, rounds, batch, config, log))
    return {"runs": runs, "seeds": list(seeds), "k": setting.chain, "batch": batch, "rounds": rounds, "temperature": setting.temperatures[0],
            "config": config, "setting": dataclasses.asdict(setting)}
