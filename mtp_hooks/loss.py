"""Vocab-parallel cross-entropy for the MTP heads, dense and lean.

Knows nothing about hooks or models: hidden states, head weight, labels, token weights and the
tensor-parallel group go in; a scalar objective ``sum(token_weight * CE)`` plus detached per-token
CE and "argmax equals label" flags come out. Logits shards are ``[tokens, V/tp]``; the full
vocabulary is reduced over ``tp_group`` (max, sum of exponentials, target logit).

* ``argmax_matches`` scores logits that the caller computed (dense path; the CE itself is mcore's).
* ``LeanLinearCrossEntropy`` never keeps logits for backward: it walks the tokens in chunks,
  computes the hidden-state gradient during forward (the objective's upstream gradient is a
  scalar, so it is known up to that factor) and, when the head weight needs a gradient,
  recomputes the logits in backward one vocabulary slice at a time; each slice yields its own
  rows of the weight gradient with one matmul over all tokens, so there is no accumulator and
  the result is rounded once, as in the dense path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

ProcessGroup = Optional[dist.ProcessGroup]

_MIN_WEIGHT_SLICES = 4  # the weight gradient's recompute never holds more than 1/4 of the logits


def _size(group: ProcessGroup) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: ProcessGroup) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(tensor: Tensor, group: ProcessGroup, op: Any = dist.ReduceOp.SUM) -> Tensor:
    if _size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _shard_targets(labels: Tensor, shard_size: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
    """Labels as indices into this rank's vocabulary shard, and whether they fall in it."""
    local = labels - _rank(group) * shard_size
    in_shard = (local >= 0) & (local < shard_size)
    return local.clamp(0, shard_size - 1), in_shard


@torch.no_grad()
def argmax_matches(logits: Tensor, labels: Tensor, tp_group: ProcessGroup) -> Tensor:
    """Whether each label's logit is the largest over the full (vocab-parallel) vocabulary.

    ``logits`` ``[..., V/tp]``, ``labels`` ``[...]``; returns a bool tensor shaped like ``labels``.
    A tie with another token counts as a match.
    """
    local, in_shard = _shard_targets(labels, logits.shape[-1], tp_group)
    row_max = _all_reduce(logits.max(dim=-1).values.float(), tp_group, dist.ReduceOp.MAX)
    target = _all_reduce(logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() * in_shard, tp_group)
    return target >= row_max


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half, bf16 and fp32 inputs (as mcore's CE), fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_statistics(
    logits: Tensor, local: Tensor, in_shard: Tensor, tp_group: ProcessGroup
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log-sum-exp, target logit, correct, sum of exponentials) of one chunk of vocab-parallel logits.

    Overwrites ``logits`` with ``exp(logits - row max)``, so the caller can form the softmax
    from it without a second exponential pass.
    """
    row_max = _all_reduce(logits.max(dim=-1).values, tp_group, dist.ReduceOp.MAX)
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
    sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    target, sum_exp = _all_reduce(torch.stack([picked, sum_exp]), tp_group).unbind(0)
    return row_max + sum_exp.log(), target, target >= row_max, sum_exp


def _subtract_targets(grad: Tensor, local: Tensor, in_shard: Tensor, token_weight: Tensor, first: int = 0) -> Tensor:
    """``grad[t, label_t - first] -= token_weight[t]`` where the label is one of ``grad``'s columns.

    ``grad`` holds the shard's vocabulary columns ``first .. first + grad.shape[-1]``.
    """
    columns = grad.shape[-1]
    index = local - first
    inside = in_shard & (index >= 0) & (index < columns)
    return grad.scatter_add_(-1, index.clamp(0, columns - 1).unsqueeze(-1), (-(token_weight * inside)).unsqueeze(-1))


def _logit_grad(logits: Tensor, lse: Tensor, local: Tensor, in_shard: Tensor, token_weight: Tensor, first: int) -> Tensor:
    """d(sum token_weight * CE)/d logits for a slice of vocabulary columns, written over ``logits``."""
    grad = logits.sub_(lse.unsqueeze(-1)).exp_().mul_(token_weight.unsqueeze(-1))
    return _subtract_targets(grad, local, in_shard, token_weight, first)


class LeanLinearCrossEntropy(torch.autograd.Function):
    """``sum(token_weight * CE(hidden @ weight.T, labels))`` without keeping logits for backward.

    Inputs: ``hidden`` ``[T, H]`` (already gathered / copied into the TP region by the caller),
    ``weight`` ``[V/tp, H]``, ``labels`` ``[T]``, ``token_weight`` ``[T]`` (0 where masked).
    Outputs: the scalar objective, detached per-token CE ``[T]`` and correct flags ``[T]``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        token_weight: Tensor,
        tp_group: ProcessGroup,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        tokens = hidden.shape[0]
        acc_dtype = _accumulation_dtype(hidden.dtype)
        local, in_shard = _shard_targets(labels, weight.shape[0], tp_group)
        token_weight = token_weight.to(acc_dtype)
        need_hidden_grad = ctx.needs_input_grad[0]
        need_weight_grad = ctx.needs_input_grad[1]
        lse = torch.empty(tokens, dtype=acc_dtype, device=hidden.device)
        ce = torch.empty_like(lse)
        correct = torch.empty(tokens, dtype=torch.bool, device=hidden.device)
        hidden_grad = torch.empty_like(hidden) if need_hidden_grad else None
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, tokens))
            logits = (hidden[rows] @ weight.t()).to(acc_dtype)
            lse[rows], target, correct[rows], sum_exp = _chunk_statistics(logits, local[rows], in_shard[rows], tp_group)
            ce[rows] = lse[rows] - target
            if need_hidden_grad:
                # logits now hold exp(logits - row max): one multiply turns them into weighted softmax.
                grad = logits.mul_((token_weight[rows] / sum_exp).unsqueeze(-1))
                grad = _subtract_targets(grad, local[rows], in_shard[rows], token_weight[rows])
                hidden_grad[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
        objective = (ce * token_weight).sum()
        ctx.chunk_size = chunk_size
        ctx.tp_group = tp_group
        ctx.save_for_backward(
            hidden_grad if need_hidden_grad else None,
            hidden if need_weight_grad else None,
            weight if need_weight_grad else None,
            local,
            in_shard,
            token_weight,
            lse,
        )
        ctx.mark_non_differentiable(ce, correct)
        return objective, ce, correct

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        hidden_grad, hidden, weight, local, in_shard, token_weight, lse = ctx.saved_tensors
        d_hidden = None
        if hidden_grad is not None:
            d_hidden = hidden_grad * grad_objective.to(hidden_grad.dtype)
        d_weight = None
        if weight is not None:
            # Vocabulary slices with as many logits as a forward chunk, and at most a quarter of the
            # shard (backward runs while the model's activation gradients are live); each slice
            # gives its own rows of dW.
            tokens, shard = hidden.shape[0], weight.shape[0]
            columns = min(-(-ctx.chunk_size * shard // max(tokens, 1)), -(-shard // _MIN_WEIGHT_SLICES))
            scaled = token_weight * grad_objective.to(lse.dtype)
            d_weight = torch.empty_like(weight)
            for first in range(0, shard, columns):
                cols = slice(first, min(first + columns, shard))
                logits = (hidden @ weight[cols].t()).to(lse.dtype)
                grad = _logit_grad(logits, lse, local, in_shard, scaled, first)
                torch.mm(grad.to(weight.dtype).t(), hidden, out=d_weight[cols])
        return d_hidden, d_weight, None, None, None, None


def lean_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_weight: Tensor,
    tp_group: ProcessGroup,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Functional form of ``LeanLinearCrossEntropy`` (see there)."""
    return LeanLinearCrossEntropy.apply(hidden, weight, labels, token_weight, tp_group, chunk_size)
