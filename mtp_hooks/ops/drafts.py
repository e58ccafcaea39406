"""The draft token a head proposes at each position: its argmax, or a sample at a temperature.

What a speculative decoder feeds its next draft step. Lean like the losses: the logits of one
chunk of positions at a time, never ``[s, V]``; with a vocabulary split over the tensor-parallel
group the choice is reduced over the group, so every rank gets the same tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from mtp_hooks.ops.vocab_parallel import (
    ProcessGroup,
    all_reduce,
    first_argmax_candidates,
    group_max,
    group_rank,
    group_size,
)


def gumbel_noise(rows: int, vocab: int, device: torch.device) -> Tensor:
    """``-log(E)``, ``E ~ Exp(1)``: Gumbel(0, 1) noise ``[rows, vocab]`` from the default generator."""
    return torch.empty(rows, vocab, dtype=torch.float32, device=device).exponential_().log_().neg_()


@torch.no_grad()
def draft_tokens(
    hidden: Tensor, weight: Tensor, tp_group: ProcessGroup, chunk: int, temperature: Optional[float]
) -> Tensor:
    """Each row's draft token under the head ``weight`` ``[V/tp, h]``: ``hidden`` ``[n, h]`` -> ``[n]`` ids.

    ``temperature=None`` or 0 (greedy): the first argmax of the logits over the full vocabulary
    (ties to the lowest id, as ``torch.argmax`` of the gathered logits). A float ``T > 0``: a sample from
    ``softmax(logits / T)`` by the Gumbel-max trick, ``argmax(logits / T + g)``. Under tensor
    parallelism every rank draws the noise of the whole vocabulary from the default generator,
    which Megatron keeps equal across the group, and adds its own shard's columns, so the sample
    is exact and the same on every rank.
    """
    rows, shard = hidden.shape[0], weight.shape[0]
    rank, size = group_rank(tp_group), group_size(tp_group)
    out = torch.empty(rows, dtype=torch.long, device=hidden.device)
    for start in range(0, rows, chunk):
        logits = (hidden[start : start + chunk] @ weight.t()).float()
        if temperature:  # None or 0: the argmax
            noise = gumbel_noise(logits.shape[0], shard * size, logits.device)
            logits = logits / temperature + noise[:, rank * shard : (rank + 1) * shard]
        values, index = logits.max(dim=-1)
        row_max = group_max(values, tp_group)
        candidates = first_argmax_candidates(values, index, row_max, tp_group, shard)
        out[start : start + chunk] = all_reduce(candidates, tp_group, dist.ReduceOp.MIN)
    return out
