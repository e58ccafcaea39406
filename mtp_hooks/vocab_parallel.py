"""Reductions over a vocabulary split across the tensor-parallel group (mcore's vocab-parallel logits).

Each rank holds ``V/tp`` columns of the logits; maxima, sums of exponentials, target logits and
argmaxes over the full vocabulary are all-reduced over ``tp_group`` (``None``: one rank). Shared by
the MTP losses (``loss``) and the log-prob output (``logprobs``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: Tensor, group: ProcessGroup, op: Any = dist.ReduceOp.SUM) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def shard_targets(labels: Tensor, shard_size: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
    """Labels as indices into this rank's vocabulary shard, and whether they fall in it."""
    local = labels - group_rank(group) * shard_size
    in_shard = (local >= 0) & (local < shard_size)
    return local.clamp(0, shard_size - 1), in_shard


@torch.no_grad()
def argmax_matches(logits: Tensor, labels: Tensor, tp_group: ProcessGroup) -> Tensor:
    """Whether each label's logit is the largest over the full (vocab-parallel) vocabulary.

    ``logits`` ``[..., V/tp]``, ``labels`` ``[...]``; returns a bool tensor shaped like ``labels``.
    A tie with another token counts as a match.
    """
    local, in_shard = shard_targets(labels, logits.shape[-1], tp_group)
    row_max = all_reduce(logits.amax(dim=-1).float(), tp_group, dist.ReduceOp.MAX)
    target = all_reduce(logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() * in_shard, tp_group)
    return target >= row_max


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half, bf16 and fp32 inputs (as mcore's CE), fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)
