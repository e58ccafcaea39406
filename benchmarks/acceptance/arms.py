"""The variants of the RL phase as arms: one model each, with its hooks, draft capture and optimizers.

Main and MTP parameters have separate Adam optimizers, so that every arm takes the same main update
from the same rollouts (``assert_same_policy`` checks it after every step) and only the draft differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.chain import training_options
from benchmarks.acceptance.drafts import DraftCapture, device_of, positions
from benchmarks.acceptance.settings import Setting, build_model
from benchmarks.acceptance.task import Logits, Task, group_advantages, next_token_targets, policy_gradient_loss, sample_rollouts


def is_mtp(name: str) -> bool:
    """Whether the parameter ``name`` belongs to the MTP block."""
    return name.startswith("mtp.")


def main_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not is_mtp(name)]


def mtp_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_mtp(name)]


@dataclasses.dataclass
class Arm:
    """One variant of the RL phase: its model, hooks, capture and optimizers."""

    name: str
    model: nn.Module
    hooks: mtp_hooks.MTPHooks
    capture: Optional[DraftCapture]  # None: the chain's evaluation probes the model itself
    main_opt: torch.optim.Optimizer
    mtp_opt: Optional[torch.optim.Optimizer]  # None: the frozen draft


def make_arm(name: str, state: dict[str, Tensor], setting: Setting, temperature: float, options: Optional[dict[str, Any]] = None) -> Arm:
    """The variant ``name`` on a fresh model loaded with the pretrained ``state``, its hooks attached with
    ``options`` (default: ``training_options`` of the name)."""
    model = build_model(setting)
    model.load_state_dict(state)
    hooks = mtp_hooks.attach(model, **(training_options(name, temperature, setting.chain) if options is None else options))
    mtp_opt = None if name == "frozen" else torch.optim.Adam(mtp_parameters(model), lr=setting.mtp_lr)
    capture = None if setting.chain else DraftCapture(model)
    return Arm(name, model, hooks, capture, torch.optim.Adam(main_parameters(model), lr=setting.rl_lr), mtp_opt)


def rl_banner(setting: Setting, temperature: float) -> str:
    return (f"RL (GRPO, {setting.prompts} prompts x {setting.group} rollouts per step, {setting.rl_steps} steps, T = {temperature}), "
            f"variants {', '.join(setting.variants)}")


def grpo_batch(task: Task, setting: Setting, policy: Logits, gen: torch.Generator, temperature: float) -> tuple[Tensor, Tensor, float]:
    """One GRPO step's batch, the same for every variant: rollouts of ``setting.group`` per prompt from the
    policy, their group-standardised advantages and the mean reward."""
    prompts = task.prompts(setting.prompts, "rl", gen).repeat_interleave(setting.group, dim=0)
    rollouts = sample_rollouts(policy, prompts, setting.seq, gen, temperature)
    reward = task.reward(rollouts, setting.prompt)
    return rollouts, group_advantages(reward, setting.group), float(reward.mean())


def rl_step(arm: Arm, tokens: Tensor, advantages: Tensor, prompt: int) -> Tensor:
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
            if not is_mtp(name) and not torch.equal(p, reference[name]):
                raise AssertionError(f"step {step}: main parameter {name} of {arm.name!r} differs from {arms[0].name!r}")


def release(arms: list[Arm]) -> None:
    """Every arm's capture and hooks removed."""
    for arm in arms:
        if arm.capture is not None:
            arm.capture.remove()
        arm.hooks.remove()
