"""A speculative-decoding rollout engine for tests: a stock model's MTP chain drafts, its main head verifies.

What an engine's MTP speculative decoding does, without a KV cache (full recompute per forward,
tiny models): the first response token comes from the target alone (prefill); then every
verification step drafts ``draft_tokens`` tokens with MTP depths 1, 2, ... (depth k reads depth
k - 1's draft: its argmax under the ``"argmax"`` rule, else a sample) and verifies them in
``mtp_hooks.testing.speculative``'s loop under the engine's rule (``"sampled"``, ``"argmax"``, vLLM's
and SGLang's default, or ``"match"``; ``mtp_hooks.ops.draft_rule``). Each rule emits exactly the
target's distribution; at T = 0 (``p``, ``q`` one-hot at the first argmax) all three are greedy
decoding. Per request it counts what vLLM's ``request_spec_decode_stats`` holds (drafted tokens,
accepted draft tokens, verification steps), the inputs of verl's ``compute_spec_decode_metrics``.
Draft and target are read with forward hooks on a stock model (nothing attached): an engine holds
its own copy of the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtp_hooks.testing import cuda_current_device_is_cpu
from mtp_hooks.testing.speculative import Proposal, Rule, speculative_sampling


@dataclasses.dataclass
class EngineStats:
    """Per request: drafted tokens, accepted draft tokens, verification steps, and each step's first
    drafted position (the index of its first draft token in the sequence)."""

    drafts: list[int]
    accepted: list[int]
    verify_steps: list[int]
    starts: list[list[int]] = dataclasses.field(default_factory=list)


class _Heads:
    """Forward hooks keeping the decoder's and every MTP layer's (normalised) output hidden states."""

    def __init__(self, model: nn.Module) -> None:
        self.hidden: list[Tensor] = []
        modules = [model.decoder, *model.mtp.layers]
        self.handles = [module.register_forward_hook(self._keep) for module in modules]

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.hidden.append((output if isinstance(output, Tensor) else output[0]).detach())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """``softmax(logits / T)``; at T = 0 one-hot at the first argmax (greedy)."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def head_probs(model: nn.Module, tokens: Tensor, temperature: float) -> list[Tensor]:
    """``softmax(logits / T)`` ``[b, s, V]`` (``tempered``) of the main head, then of MTP depths 1..N
    (depth k at position t predicts token t + k + 1), from one stock forward (labels given so the MTP
    block runs)."""
    heads = _Heads(model)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    try:
        with torch.no_grad(), cuda_current_device_is_cpu():
            model(tokens, positions, None, labels=torch.zeros_like(tokens))
            weight = model.output_layer.weight
            return [tempered((h @ weight.t()).transpose(0, 1).double(), temperature) for h in heads.hidden]
    finally:
        heads.remove()


def speculative_rollouts(
    model: nn.Module, prompts: Tensor, new_tokens: int, draft_tokens: int, temperature: float, gen: torch.Generator, rule: Rule = "sampled"
) -> tuple[Tensor, EngineStats]:
    """Generate at least ``new_tokens`` response tokens per prompt under the verification ``rule``; the
    sequences ``[b, P + new_tokens]`` (a step's tokens past that are dropped, its counts kept) and the
    engine's counters."""
    rows, prompt = prompts.shape
    end = prompt + new_tokens
    first = head_probs(model, prompts, temperature)[0][:, -1]
    started = torch.cat([prompts, torch.multinomial(first.float(), 1, generator=gen)], dim=1)  # prefill: the target alone
    idx = torch.arange(rows)
    starts: list[Tensor] = []  # per verification step, where each row's first draft goes

    def draft(tokens: Tensor, at: Tensor, step: int) -> Proposal:
        work, drafts, q = tokens.clone(), [], []
        for k in range(1, draft_tokens + 1):
            q_k = head_probs(model, work, temperature)[k][idx, at - 2]  # depth k at position at - 2 drafts token at - 1 + k
            x = q_k.argmax(-1) if rule == "argmax" else torch.multinomial(q_k.float(), 1, generator=gen).squeeze(-1)
            work[idx, at - 1 + k] = x
            drafts.append(x)
            q.append(q_k)
        main = head_probs(model, work, temperature)[0]
        p = torch.stack([main[idx, at - 1 + j] for j in range(draft_tokens + 1)], dim=1)
        starts.append(at)
        return Proposal(torch.stack(drafts, dim=1), torch.stack(q, dim=1), p)

    # A row steps while it holds fewer than ``end`` tokens: room for the drafts within end - 1 + draft_tokens.
    tokens, stats = speculative_sampling(draft, started, end - 1 + draft_tokens, draft_tokens, gen, rule)
    steps, accepted = stats.row_steps.tolist(), stats.row_accepted.tolist()
    # A row steps from the first step on until it is full: its starts are those of its first steps.
    row_starts = [[int(at[r]) for at in starts[:n]] for r, n in enumerate(steps)]
    return tokens[:, :end], EngineStats([draft_tokens * s for s in steps], accepted, steps, row_starts)
