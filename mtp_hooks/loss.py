"""Vocab-parallel cross-entropy for the MTP heads, dense and lean.

Knows nothing about hooks or models: hidden states, head weight, labels, token weights and the
tensor-parallel group go in; a scalar objective ``sum(token_weight * CE)`` plus detached per-token
CE and "argmax equals label" flags come out. Logits shards are ``[tokens, V/tp]``; the full
vocabulary is reduced over ``tp_group`` (max, sum of exponentials, target logit).

* ``argmax_matches`` scores logits that the caller computed (dense path; the CE itself is mcore's).
* ``LeanLinearCrossEntropy`` never keeps logits for backward: it walks the tokens in chunks,
  computes the hidden-state gradient during forward (the objective's upstream gradient is a
  scalar, so it is known up to that factor) and, when the head weight needs a gradient,
  recomputes each chunk's logits in backward to accumulate it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = Optional[dist.ProcessGroup]


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


def _chunk_statistics(
    logits: Tensor, local: Tensor, in_shard: Tensor, tp_group: ProcessGroup
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp, target logit, correct) of one chunk of vocab-parallel fp32 logits."""
    row_max = _all_reduce(logits.max(dim=-1).values, tp_group, dist.ReduceOp.MAX)
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
    sum_exp = (logits - row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    target, sum_exp = _all_reduce(torch.stack([picked, sum_exp]), tp_group).unbind(0)
    return row_max + sum_exp.log(), target, target >= row_max


def _logit_grad(logits: Tensor, lse: Tensor, local: Tensor, in_shard: Tensor, token_weight: Tensor) -> Tensor:
    """d(sum token_weight * CE)/d logits for one chunk, written over ``logits``."""
    grad = logits.sub_(lse.unsqueeze(-1)).exp_().mul_(token_weight.unsqueeze(-1))
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local] -= token_weight * in_shard
    return grad


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
        local, in_shard = _shard_targets(labels, weight.shape[0], tp_group)
        token_weight = token_weight.float()
        need_hidden_grad = ctx.needs_input_grad[0]
        need_weight_grad = ctx.needs_input_grad[1]
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        ce = torch.empty_like(lse)
        correct = torch.empty(tokens, dtype=torch.bool, device=hidden.device)
        hidden_grad = torch.empty_like(hidden) if need_hidden_grad else None
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, tokens))
            logits = (hidden[rows] @ weight.t()).float()
            lse[rows], target, correct[rows] = _chunk_statistics(logits, local[rows], in_shard[rows], tp_group)
            ce[rows] = lse[rows] - target
            if need_hidden_grad:
                grad = _logit_grad(logits, lse[rows], local[rows], in_shard[rows], token_weight[rows])
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
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        hidden_grad, hidden, weight, local, in_shard, token_weight, lse = ctx.saved_tensors
        d_hidden = None
        if hidden_grad is not None:
            d_hidden = hidden_grad * grad_objective.to(hidden_grad.dtype)
        d_weight = None
        if weight is not None:
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
                logits = (hidden[rows] @ weight.t()).float()
                grad = _logit_grad(logits, lse[rows], local[rows], in_shard[rows], token_weight[rows])
                acc.addmm_(grad.t(), hidden[rows].float())
            d_weight = acc.mul_(grad_objective.float()).to(weight.dtype)
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
