"""Main-head log-probabilities of the labels (and entropy) without ``[tokens, V]`` logits.

For RL losses that only need ``log p(label)`` and the entropy per token. Tokens are walked in
chunks; forward keeps only the per-token log-sum-exp, backward recomputes each chunk's logits.
Vocab-parallel: every reduction over the vocabulary runs over ``tp_group``. Knows nothing about
hooks; ``mtp_hooks.attach(..., output="logprobs")`` wires it to the model's final hidden states.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtp_hooks.loss import ProcessGroup, _accumulation_dtype, _all_reduce, _shard_targets


class TokenLogProbs(NamedTuple):
    """What the model returns with ``output="logprobs"``: ``[b, s]`` tensors (entropy ``None`` unless asked)."""

    logprobs: Tensor
    entropy: Optional[Tensor]


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    logits = (hidden @ weight.t()).to(dtype)
    return logits if temperature == 1.0 else logits.div_(temperature)


class LeanLogProbs(torch.autograd.Function):
    """Per-token ``log softmax(hidden @ weight.T / temperature)[label]`` and entropy, chunked.

    Inputs: ``hidden`` ``[T, H]`` (gathered / copied into the TP region by the caller), ``weight``
    ``[V/tp, H]``, ``labels`` ``[T]``. Outputs: log-probs ``[T]`` and entropy ``[T]`` (zeros when
    ``with_entropy`` is false), in fp32 (fp64 for fp64 inputs).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        tp_group: ProcessGroup,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        tokens = hidden.shape[0]
        dtype = _accumulation_dtype(hidden.dtype)
        local, in_shard = _shard_targets(labels, weight.shape[0], tp_group)
        lse = torch.empty(tokens, dtype=dtype, device=hidden.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, tokens))
            logits = _chunk_logits(hidden[rows], weight, temperature, dtype)
            row_max = _all_reduce(logits.max(dim=-1).values, tp_group, dist.ReduceOp.MAX)
            target = logits.gather(-1, local[rows].unsqueeze(-1)).squeeze(-1) * in_shard[rows]
            shifted = logits.sub_(row_max.unsqueeze(-1))
            probs_unnormalised = shifted.exp()
            sums = [target, probs_unnormalised.sum(dim=-1)]
            if with_entropy:
                sums.append((probs_unnormalised * shifted).sum(dim=-1))
            reduced = _all_reduce(torch.stack(sums), tp_group)
            lse[rows] = row_max + reduced[1].log()
            logprobs[rows] = reduced[0] - lse[rows]
            if with_entropy:
                # H = log Z - E_q[z - max], with Z the partition function of the shifted logits.
                entropy[rows] = reduced[1].log() - reduced[2] / reduced[1]
        ctx.chunk_size, ctx.tp_group, ctx.temperature = chunk_size, tp_group, temperature
        ctx.save_for_backward(hidden, weight, local, in_shard, lse, entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor, grad_entropy: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, local, in_shard, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = lse.dtype
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_logprobs = grad_logprobs.to(dtype)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            log_q = _chunk_logits(hidden[rows], weight, ctx.temperature, dtype).sub_(lse[rows].unsqueeze(-1))
            q = log_q.exp()
            # d log q[label] / dz = onehot - q ;  d H / dz = -q * (log q + H)
            grad = q * (-grad_logprobs[rows]).unsqueeze(-1)
            if grad_entropy is not None:
                grad -= q * (log_q + entropy[rows].unsqueeze(-1)) * grad_entropy[rows].unsqueeze(-1)
            onehot_grad = (grad_logprobs[rows] * in_shard[rows]).unsqueeze(-1)
            grad.scatter_add_(-1, local[rows].unsqueeze(-1), onehot_grad)
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if need_hidden:
                d_hidden[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                d_weight.addmm_(grad.t(), hidden[rows].to(dtype))
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def lean_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    tp_group: ProcessGroup,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> TokenLogProbs:
    """Functional form of ``LeanLogProbs``; entropy is ``None`` unless ``with_entropy``."""
    logprobs, entropy = LeanLogProbs.apply(hidden, weight, labels, tp_group, chunk_size, temperature, with_entropy)
    return TokenLogProbs(logprobs, entropy if with_entropy else None)
