"""A speculative-decoding rollout engine for tests: a stock model's MTP chain drafts, its main head verifies.

What vLLM's MTP speculative decoding does, without a KV cache (full recompute per forward, tiny
models): the first response token comes from the target alone (prefill); then every verification
step drafts ``draft_tokens`` tokens with MTP depths 1, 2, ... (depth k reads depth k - 1's draft),
accepts draft j with probability ``min(1, p/q)`` while all before it were accepted, replaces the
first rejected one by a draw from ``max(p - q, 0)`` or, all accepted, adds the target's own next
token. Per request it counts what vLLM's ``request_spec_decode_stats`` holds (drafted tokens,
accepted draft tokens, verification steps), the inputs of verl's ``compute_spec_decode_metrics``.
Draft and target are read with forward hooks on a stock model (no ``mtp_hooks``): an engine holds
its own copy of the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from mtp_hooks.testing import cuda_current_device_is_cpu


@dataclasses.dataclass
class EngineStats:
    """Per request: drafted tokens, accepted draft tokens, verification steps."""

    drafts: list[int]
    accepted: list[int]
    verify_steps: list[int]


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


def head_probs(model: nn.Module, tokens: Tensor, temperature: float) -> list[Tensor]:
    """``softmax(logits / T)`` ``[b, s, V]`` of the main head, then of MTP depths 1..N (depth k at
    position t predicts token t + k + 1), from one stock forward (labels given so the MTP block runs)."""
    heads = _Heads(model)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    try:
        with torch.no_grad(), cuda_current_device_is_cpu():
            model(tokens, positions, None, labels=torch.zeros_like(tokens))
            weight = model.output_layer.weight
            return [torch.softmax((h @ weight.t()).transpose(0, 1).double() / temperature, dim=-1) for h in heads.hidden]
    finally:
        heads.remove()


def _residual(p: Tensor, q: Tensor) -> Tensor:
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-300), p)


def speculative_rollouts(
    model: nn.Module, prompts: Tensor, new_tokens: int, draft_tokens: int, temperature: float, gen: torch.Generator
) -> tuple[Tensor, EngineStats]:
    """Generate at least ``new_tokens`` response tokens per prompt; the sequences ``[b, P + new_tokens]``
    (a step's tokens past that are dropped, its counts kept) and the engine's counters."""
    rows, prompt = prompts.shape
    end = prompt + new_tokens
    buffer = torch.zeros(rows, end + draft_tokens + 1, dtype=torch.long)
    buffer[:, :prompt] = prompts
    first = head_probs(model, buffer[:, :prompt], temperature)[0][:, -1]
    buffer[:, prompt] = torch.multinomial(first.float(), 1, generator=gen).squeeze(-1)
    n = torch.full((rows,), prompt + 1)  # tokens so far; the last one came from the target
    stats = EngineStats([0] * rows, [0] * rows, [0] * rows)
    idx = torch.arange(rows)
    while bool((n < end).any()):
        live = n < end
        pos = torch.where(live, n, prompt + 1)  # finished rows: any in-range position, results unused
        at = pos - 2  # depth k at position n - 2 drafts token n - 1 + k
        work = buffer.clone()
        drafts, q = [], []
        for k in range(1, draft_tokens + 1):
            q_k = head_probs(model, work, temperature)[k][idx, at]
            x = torch.multinomial(q_k.float(), 1, generator=gen).squeeze(-1)
            work[idx, pos - 1 + k] = x
            drafts.append(x)
            q.append(q_k)
        main = head_probs(model, work, temperature)[0]
        u = torch.rand(rows, draft_tokens, generator=gen, dtype=torch.float64)
        for r in idx[live].tolist():
            start, emitted = int(n[r]), []
            for j in range(draft_tokens):
                p_j, q_j, x = main[r, start - 1 + j], q[j][r], int(drafts[j][r])
                if u[r, j] < min(1.0, float(p_j[x] / q_j[x])):
                    emitted.append(x)
                    continue
                emitted.append(int(torch.multinomial(_residual(p_j, q_j).float(), 1, generator=gen)))
                break
            else:
                emitted.append(int(torch.multinomial(main[r, start - 1 + draft_tokens].float(), 1, generator=gen)))
            stats.drafts[r] += draft_tokens
            stats.accepted[r] += len(emitted) - 1
            stats.verify_steps[r] += 1
            buffer[r, start : start + len(emitted)] = torch.tensor(emitted)
            n[r] = start + len(emitted)
    return buffer[:, :end], stats
