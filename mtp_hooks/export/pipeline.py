"""Pipeline parallelism: the stage that holds the MTP layers hands their tensors to the other stages.

Without a custom pipeline layout mcore builds the MTP layers on the last stage. ``holder_of``
finds the stage that has them (all-gathering one flag over the pipeline group, so a custom
layout that puts them elsewhere works too); ``broadcast_pairs`` then sends each unit's pairs
from that stage to every other one: first the unit's names, shapes and dtypes as one object,
then each tensor, as verl's ``per_tensor_generator`` broadcasts the whole model. Every rank of
the pipeline group must consume the pairs to the end.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from mtp_hooks.errors import MTPHooksError

__all__ = ["broadcast_pairs", "holder_of"]


def holder_of(group: Optional[dist.ProcessGroup], holds: bool) -> Optional[int]:
    """The global rank, in this rank's pipeline group, of the stage that holds the MTP layers.

    ``None`` when the group has one stage (nothing to hand over). Raises ``MTPHooksError`` when
    no stage or several stages hold MTP layers.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    flags: list[Optional[bool]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, holds, group=group)
    holders = [rank for rank, flag in zip(dist.get_process_group_ranks(group), flags) if flag]
    if len(holders) != 1:
        raise MTPHooksError(
            "model: the pipeline stages do not agree on where the MTP layers are\n"
            "  expected: exactly one stage of the pipeline group with MTP layers (the last, by default)\n"
            f"  received: {len(holders)} stages with MTP layers (global ranks {holders})"
        )
    return holders[0]


def broadcast_pairs(
    units: Optional[Iterable[list[tuple[str, Tensor]]]], group: dist.ProcessGroup, source: int, device: torch.device
) -> Iterator[tuple[str, Tensor]]:
    """The pairs of ``units`` on every rank of ``group``: ``source`` (global rank) sends, the others receive.

    ``units`` is read on ``source`` only; received tensors are new tensors on ``device``.
    """
    if dist.get_rank() == source:
        assert units is not None, "the holding stage has no units"
        for unit in units:
            dist.broadcast_object_list([[(name, tuple(t.shape), t.dtype) for name, t in unit]], src=source, group=group)
            for _, tensor in unit:
                dist.broadcast(tensor.contiguous(), src=source, group=group)
            yield from unit
        dist.broadcast_object_list([None], src=source, group=group)
        return
    while True:
        header: list[Optional[list[tuple[str, tuple[int, ...], torch.dtype]]]] = [None]
        dist.broadcast_object_list(header, src=source, group=group)
        if header[0] is None:
            return
        for name, shape, dtype in header[0]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=group)
            yield name, tensor
