"""Draft distributions of a hooked model, their expected acceptance, and a real speculative sampling loop.

Everything is at the sampler's temperature ``T``: target ``p = softmax(z_main / T)``, draft
``q_k = softmax(z_mtp_k / T)``, as an engine sampling at ``T`` verifies (and as the hooks'
``draft_temperature`` scores). Tokens and the random draws stay on the CPU (one seeded generator);
the model may sit on a GPU, and only the rows the loop needs are copied back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.task import next_token_targets


def positions(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class DraftCapture:
    """Forward hooks on the MTP layers keeping each depth's output hidden states ``[s, b, h]``.

    The layers return a tensor (mcore 0.14) or a tuple whose first item is the hidden state
    (0.15+); either way it is the layer's normalised output, the input of the shared head.
    """

    def __init__(self, model: nn.Module) -> None:
        self.hidden: list[Tensor] = []
        self.handles = [layer.register_forward_hook(self._keep) for layer in model.mtp.layers]

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.hidden.append((output if isinstance(output, Tensor) else output[0]).detach())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def draft_forward(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, capture: DraftCapture, tokens: Tensor, prompt: int, temperature: float = 1.0
) -> tuple[Tensor, list[Tensor], dict[str, float]]:
    """Main-head log-probs ``[b, s, V]``, per-depth MTP log-probs ``[b, s, V]`` (both at ``temperature``,
    fp32, on the model's device) and the hooks' metrics.

    A training-style micro-batch (grad enabled, so the MTP block runs) that is never
    backpropagated: nothing trains. Depth k at position t predicts token t + k + 1.
    """
    device = device_of(model)
    labels, mask = next_token_targets(tokens, prompt)
    tokens = tokens.to(device)
    capture.hidden.clear()
    with torch.enable_grad(), hooks.micro_batch(labels=labels.to(device), loss_mask=mask.to(device)):
        logits = model(tokens, positions(tokens), None)
    metrics = hooks.metrics()
    with torch.no_grad():
        weight = model.output_layer.weight
        drafts = [torch.log_softmax((h @ weight.t()).transpose(0, 1).float() / temperature, dim=-1) for h in capture.hidden]
        main = torch.log_softmax(logits.detach().float() / temperature, dim=-1)
    if len(drafts) != model.config.mtp_num_layers:
        raise AssertionError(f"captured {len(drafts)} MTP depths, expected {model.config.mtp_num_layers}")
    return main, drafts, metrics


def expected_acceptance(main: Tensor, drafts: list[Tensor], mask: Tensor) -> list[float]:
    """Per depth, masked mean of ``sum_v min(p_main[t + k], q_k[t])`` (the hooks' alignment)."""
    out = []
    p = main.exp()
    mask = mask.to(main.device)
    for k, q in enumerate(drafts, start=1):
        overlap = torch.minimum(p[:, k:], q.exp()[:, :-k]).sum(-1)
        m = mask[:, k:]
        out.append(float((overlap * m).sum() / m.sum()))
    return out


def chain_tokens_per_step(accepts: list[float]) -> float:
    """Expected tokens per verification step of a depth-N chain draft, counting the target's own
    token: ``1 + sum_j prod_{i<=j} a_i`` (depths treated as independent)."""
    total, running = 1.0, 1.0
    for a in accepts:
        running *= a
        total += running
    return total


def _residual_sample(p: Tensor, q: Tensor, gen: torch.Generator) -> Tensor:
    """Speculative sampling's correction: a draw from ``max(p - q, 0)`` normalised (``p`` if empty)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
    return torch.multinomial(residual, 1, generator=gen).squeeze(-1)


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of a speculative sampling run: per depth drafts tried and accepted, and the summed exact
    acceptance probability ``sum_v min(p, q)`` of the drafts tried; verification steps and tokens."""

    tried: list[int]
    accepted: list[int]
    expected: list[float]
    steps: int = 0
    tokens: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "realised_accept": [a / t if t else math.nan for a, t in zip(self.accepted, self.tried)],
            "expected_at_tried": [e / t if t else math.nan for e, t in zip(self.expected, self.tried)],
            "tried": list(self.tried),
            "realised_tokens_per_step": self.tokens / self.steps if self.steps else math.nan,
            "steps": self.steps,
        }


def _rows(x: Tensor, idx: Tensor, at: Tensor) -> Tensor:
    """``x[idx, at]`` as fp32 probabilities on the CPU (``x`` holds log-probs, on any device)."""
    return x[idx.to(x.device), at.to(x.device)].exp().float().cpu()


def speculative_sampling(
    model: nn.Module,
    hooks: mtp_hooks.MTPHooks,
    capture: DraftCapture,
    prompts: Tensor,
    length: int,
    gen: torch.Generator,
    temperature: float = 1.0,
) -> SpeculativeStats:
    """Generate from the main head at ``temperature`` with the MTP chain as the draft (standard
    speculative sampling, draft and target both tempered).

    Each verification step: the last token came from the target; depth 1 drafts the next token
    from it, depth 2 the one after from depth 1's draft; the target accepts draft j with
    probability ``min(1, p/q)`` while all before it were accepted, replaces the first rejected
    one by a draw from ``max(p - q, 0)``, or adds its own next token when all are accepted.
    Full recompute per forward (small models). Two-depth chains only.
    """
    if model.config.mtp_num_layers != 2:
        raise ValueError(f"speculative_sampling: expected a model with 2 MTP layers, got {model.config.mtp_num_layers}")
    rows, start_len = prompts.shape
    buffer = torch.zeros(rows, length + 2, dtype=torch.long)
    buffer[:, :start_len] = prompts
    n = torch.full((rows,), start_len)
    stats = SpeculativeStats([0, 0], [0, 0], [0.0, 0.0])
    idx = torch.arange(rows)
    device = device_of(model)
    while True:
        active = n <= length - 2  # room for d1, d2 and the target's token within the rollout length
        if not bool(active.any()):
            return stats
        at = torch.where(active, n, start_len)  # finished rows: any in-range position, results unused
        _, drafts, _ = draft_forward(model, hooks, capture, buffer, start_len, temperature)
        q1 = _rows(drafts[0], idx, at - 2)
        d1 = torch.multinomial(q1, 1, generator=gen).squeeze(-1)
        with_d1 = buffer.clone()
        with_d1[idx, at] = d1
        main, drafts, _ = draft_forward(model, hooks, capture, with_d1, start_len, temperature)
        q2 = _rows(drafts[1], idx, at - 2)
        p1, p2 = _rows(main, idx, at - 1), _rows(main, idx, at)
        d2 = torch.multinomial(q2, 1, generator=gen).squeeze(-1)
        with_d2 = with_d1.clone()
        with_d2[idx, at + 1] = d2
        with torch.no_grad():
            ids = with_d2.to(device)
            last = model(ids, positions(ids), None)[idx.to(device), (at + 1).to(device)].float().cpu()
        p3 = torch.softmax(last / temperature, dim=-1)
        u = torch.rand(rows, 2, generator=gen)
        ok1 = u[:, 0] < (p1[idx, d1] / q1[idx, d1]).clamp(max=1)
        ok2 = ok1 & (u[:, 1] < (p2[idx, d2] / q2[idx, d2]).clamp(max=1))
        fix1, fix2 = _residual_sample(p1, q1, gen), _residual_sample(p2, q2, gen)
        bonus = torch.multinomial(p3, 1, generator=gen).squeeze(-1)
        a1, a2 = torch.minimum(p1, q1).sum(-1), torch.minimum(p2, q2).sum(-1)
        tried2 = active & ok1
        stats.tried[0] += int(active.sum())
        stats.accepted[0] += int((active & ok1).sum())
        stats.expected[0] += float(a1[active].sum())
        stats.tried[1] += int(tried2.sum())
        stats.accepted[1] += int((tried2 & ok2).sum())
        stats.expected[1] += float(a2[tried2].sum())
        new_tokens = torch.where(ok1, torch.where(ok2, 3, 2), 1)
        stats.steps += int(active.sum())
        stats.tokens += int(new_tokens[active].sum())
        for r in idx[active].tolist():
            start = int(n[r])
            seq = [int(fix1[r])] if not ok1[r] else ([int(d1[r]), int(fix2[r])] if not ok2[r] else [int(d1[r]), int(d2[r]), int(bonus[r])])
            buffer[r, start : start + len(seq)] = torch.tensor(seq)
            buffer[r, start + len(seq) :] = 0
            n[r] = start + len(seq)
