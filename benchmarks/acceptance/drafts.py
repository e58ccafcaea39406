"""Draft distributions of a hooked model's MTP depths, their expected acceptance, and those depths drafting.

Everything is at the sampler's temperature ``T``: target ``p = softmax(z_main / T)``, draft
``q_k = softmax(z_mtp_k / T)``, as an engine sampling at ``T`` verifies (and as the hooks'
``draft_temperature`` scores). Tokens and the random draws stay on the CPU (one seeded generator);
the model may sit on a GPU, and only the rows the loop needs are copied back. The speculative loop
itself is ``mtp_hooks.testing.speculative``'s; here are the depths as its drafter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.task import next_token_targets
from mtp_hooks.testing.speculative import Drafter, Proposal, SpeculativeStats, speculative_sampling


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


def _rows(x: Tensor, idx: Tensor, at: Tensor) -> Tensor:
    """``x[idx, at]`` as fp32 probabilities on the CPU (``x`` holds log-probs, on any device)."""
    return x[idx.to(x.device), at.to(x.device)].exp().float().cpu()


def depth_drafter(model: nn.Module, hooks: mtp_hooks.MTPHooks, capture: DraftCapture, prompt: int, gen: torch.Generator,
                  temperature: float = 1.0) -> Drafter:
    """The two MTP depths of an N = 2 model as the draft of ``speculative_sampling``, both tempered.

    The last token came from the target; depth 1 drafts the next token from it, depth 2 the one after
    from depth 1's draft (a second forward with that draft in place, whose main head also gives the
    target at the first two drafted positions); a third forward gives the target after both drafts.
    """
    device = device_of(model)

    def draft(buffer: Tensor, at: Tensor, step: int) -> Proposal:
        idx = torch.arange(buffer.shape[0])
        _, drafts, _ = draft_forward(model, hooks, capture, buffer, prompt, temperature)
        q1 = _rows(drafts[0], idx, at - 2)
        d1 = torch.multinomial(q1, 1, generator=gen).squeeze(-1)
        with_d1 = buffer.clone()
        with_d1[idx, at] = d1
        main, drafts, _ = draft_forward(model, hooks, capture, with_d1, prompt, temperature)
        q2 = _rows(drafts[1], idx, at - 2)
        p1, p2 = _rows(main, idx, at - 1), _rows(main, idx, at)
        d2 = torch.multinomial(q2, 1, generator=gen).squeeze(-1)
        with_d2 = with_d1.clone()
        with_d2[idx, at + 1] = d2
        with torch.no_grad():
            ids = with_d2.to(device)
            last = model(ids, positions(ids), None)[idx.to(device), (at + 1).to(device)].float().cpu()
        p3 = torch.softmax(last / temperature, dim=-1)
        return Proposal(torch.stack([d1, d2], dim=1), torch.stack([q1, q2], dim=1), torch.stack([p1, p2, p3], dim=1))

    return draft


def depth_speculative_sampling(
    model: nn.Module,
    hooks: mtp_hooks.MTPHooks,
    capture: DraftCapture,
    prompts: Tensor,
    length: int,
    gen: torch.Generator,
    temperature: float = 1.0,
) -> SpeculativeStats:
    """Generate from the main head at ``temperature`` with the MTP depths as the draft (standard
    speculative sampling, draft and target both tempered; ``depth_drafter``) until no row has room for
    two drafts and the target's token within ``length`` tokens. Two-depth models only."""
    if model.config.mtp_num_layers != 2:
        raise ValueError(f"depth_speculative_sampling: expected a model with 2 MTP layers, got {model.config.mtp_num_layers}")
    drafter = depth_drafter(model, hooks, capture, prompts.shape[1], gen, temperature)
    return speculative_sampling(drafter, prompts, length, 2, gen)[1]
