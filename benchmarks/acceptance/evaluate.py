"""The held-out evaluation of one variant's draft: what the hooks predict and what speculative sampling realises.

Each evaluator takes an arm, rollouts of the current policy, the setting, a seed and the rollout
temperature, and returns one record: per draft position the hooks' expected acceptance
``mtp_j/accept`` and agreement, ``mtp/accept_len``, the same acceptance recomputed from the draft
distributions (the largest difference), the expected tokens per verification step, and the counts
of a real speculative sampling loop on those rollouts' prompts (``SpeculativeStats.summary``).

* ``evaluate_depths``: the N MTP depths as the draft (``benchmarks.acceptance.drafts``);
* ``evaluate_chain``: k draft steps from an N = 1 model, as an engine drafts (``benchmarks.acceptance.chain``).

``evaluator(setting)`` picks one. Another evaluation (e.g. through a real inference engine) is one
more function of the same signature beside these, and one more branch there.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

import mtp_hooks
from benchmarks.acceptance.arms import Arm
from benchmarks.acceptance.chain import ChainProbe, chain_forward, chain_speculative_sampling, training_options
from benchmarks.acceptance.drafts import chain_tokens_per_step, depth_speculative_sampling, draft_forward, expected_acceptance
from benchmarks.acceptance.settings import Setting
from benchmarks.acceptance.task import next_token_targets
from mtp_hooks.testing.speculative import SpeculativeStats

Evaluator = Callable[[Arm, Tensor, Setting, int, float], dict[str, Any]]


def record(metrics: dict[str, float], recomputed: list[float], spec: SpeculativeStats) -> dict[str, Any]:
    """One evaluation's record from the hooks' metrics, the acceptance recomputed from the draft
    distributions (one per draft position) and the speculative loop's counts."""
    positions = range(1, len(recomputed) + 1)
    accepts = [metrics[f"mtp_{j}/accept"] for j in positions]
    return {
        "accept": accepts,
        "agree": [metrics[f"mtp_{j}/agree"] for j in positions],
        "accept_len": metrics.get("mtp/accept_len", math.nan),
        "accept_recomputed_max_diff": max(abs(a - b) for a, b in zip(accepts, recomputed)),
        "tokens_per_step": chain_tokens_per_step(accepts),
        **spec.summary(),
    }


def evaluate_depths(arm: Arm, rollouts: Tensor, setting: Setting, seed: int, temperature: float = 1.0) -> dict[str, Any]:
    """Held-out draft quality of one variant's N MTP depths on the current policy's rollouts."""
    _, mask = next_token_targets(rollouts, setting.prompt)
    main, drafts, metrics = draft_forward(arm.model, arm.hooks, arm.capture, rollouts, setting.prompt, temperature)
    recomputed = expected_acceptance(main, drafts, mask)
    del main, drafts
    spec = depth_speculative_sampling(arm.model, arm.hooks, arm.capture, rollouts[:, : setting.prompt], setting.seq,
                                      torch.Generator().manual_seed(seed), temperature)
    return record(metrics, recomputed, spec)


def evaluate_chain(arm: Arm, rollouts: Tensor, setting: Setting, seed: int, temperature: float = 1.0) -> dict[str, Any]:
    """Held-out draft quality of one variant drafting ``setting.chain`` steps: the hooks' own-draft
    chain metrics and the engine-style loop. The arm's training hooks are swapped for eval hooks
    for the evaluation and re-attached after (its optimizers hold the parameters: unaffected)."""
    steps, model = setting.chain, arm.model
    arm.hooks.remove()
    hooks = mtp_hooks.attach(
        model, draft_steps=steps, draft_inputs="sample", draft_temperature=temperature, agreement_metrics=True, accept_rule="sampled"
    )
    probe = ChainProbe(model)
    try:
        _, mask = next_token_targets(rollouts, setting.prompt)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            logits, metrics = chain_forward(model, hooks, probe, rollouts, setting.prompt, steps)
        weight = model.output_layer.weight.detach()
        with torch.no_grad():
            main = torch.log_softmax(logits.float() / temperature, dim=-1)
            drafts = [torch.log_softmax((h @ weight.t()).transpose(0, 1).float() / temperature, dim=-1) for h in probe.hidden]
        recomputed = expected_acceptance(main, drafts, mask)
        del main, drafts, logits
        spec = chain_speculative_sampling(model, hooks, probe, rollouts[:, : setting.prompt], setting.seq,
                                          torch.Generator().manual_seed(seed), temperature, steps, seed)
    finally:
        probe.remove()
        hooks.remove()
        arm.hooks = mtp_hooks.attach(model, **training_options(arm.name, temperature, steps))
    return record(metrics, recomputed, spec)


def evaluator(setting: Setting) -> Evaluator:
    """The evaluation of ``setting``'s variants: the chain's where it drafts k steps, else the depths'."""
    return evaluate_chain if setting.chain else evaluate_depths
