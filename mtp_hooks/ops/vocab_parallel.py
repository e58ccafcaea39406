"""Reductions over a vocabulary split across the tensor-parallel group (mcore's vocab-parallel logits).

Each rank holds ``V/tp`` columns of the logits; maxima, sums of exponentials, target logits and
argmaxes over the full vocabulary are all-reduced over ``tp_group`` (``None``: one rank). Shared by
the MTP losses (``lean_loss``) and the log-prob output (``logprobs``).
"""

from __future__ import annotations

import math
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


NO_INDEX = torch.iinfo(torch.long).max


def group_max(values: Tensor, group: ProcessGroup) -> Tensor:
    """Each row's maximum over the group (a new tensor), a NaN counting as the largest value, as
    ``torch.argmax`` takes it: collectives need not propagate NaN (gloo's MAX drops it)."""
    return all_reduce(values.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf), group, dist.ReduceOp.MAX)


def first_argmax_candidates(values: Tensor, index: Tensor, row_max: Tensor, group: ProcessGroup, shard: int) -> Tensor:
    """This shard's candidate for each row's first argmax over the full vocabulary.

    ``values``, ``index``: the shard's ``max(dim=-1)`` (torch takes the first of equal maxima);
    ``row_max``: the maximum over the group. A shard holding the row's maximum offers its first
    index of it as a full-vocabulary id, the others ``NO_INDEX``; MIN over the group gives the
    first full-vocabulary index of the maximum, which is ``torch.argmax`` of the gathered logits
    and stock mcore 0.19's vocab-parallel argmax (first rank holding the maximum, its first index).
    A NaN counts as the maximum, as in ``torch.argmax`` (``max`` returns the shard's first NaN):
    a row with one always gets a real id, never ``NO_INDEX`` (a draft token out of the vocabulary).
    """
    return torch.where((values == row_max) | values.isnan(), index + group_rank(group) * shard, NO_INDEX)


@torch.no_grad()
def argmax_matches(logits: Tensor, labels: Tensor, tp_group: ProcessGroup) -> Tensor:
    """Whether each label is the first argmax of its logits over the full (vocab-parallel) vocabulary.

    ``logits`` ``[..., V/tp]``, ``labels`` ``[...]``; returns a bool tensor shaped like ``labels``.
    Counts as stock mcore 0.19's MTP acceptance does: a tie goes to the first index, so a label
    tied with an earlier token does not match (nor does one outside the vocabulary).
    """
    values, index = logits.max(dim=-1)
    values = values.float()
    row_max = group_max(values, tp_group)
    candidates = first_argmax_candidates(values, index, row_max, tp_group, logits.shape[-1])
    return all_reduce(candidates, tp_group, dist.ReduceOp.MIN) == labels


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half, bf16 and fp32 inputs (as mcore's CE), fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)
