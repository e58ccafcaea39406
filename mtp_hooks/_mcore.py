"""Everything that depends on which megatron-core release is installed.

Decisions are made by feature detection (signatures and attributes), never by version strings.
Regimes, per ``research/mcore-mtp-compat.md``:

* 0.14 - 0.16: ``GPTModel._postprocess`` computes the MTP loss inline whenever
  ``config.mtp_num_layers`` is set (and crashes on ``labels=None``). A config view that reads
  ``mtp_num_layers = None`` for the length of one forward turns that branch off.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction as _mtp

MTPLossAutoScaler = _mtp.MTPLossAutoScaler

_ROLL_PARAMETERS = frozenset(inspect.signature(_mtp.roll_tensor).parameters)


def roll_left(
    tensor: torch.Tensor,
    cp_group: Optional[torch.distributed.ProcessGroup],
    packed_seq_params: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll ``tensor`` one step left along its last dim with mcore's ``roll_tensor``.

    CP boundary exchange and packed-sequence boundaries follow mcore. Returns (rolled, sum).
    """
    kwargs: dict[str, Any] = {}
    if "cp_group" in _ROLL_PARAMETERS:
        kwargs["cp_group"] = cp_group
    if packed_seq_params is not None:
        if "packed_seq_params" not in _ROLL_PARAMETERS:
            raise AssertionError("packed sequences need megatron-core >= 0.16.1 for MTP")
        kwargs["packed_seq_params"] = packed_seq_params
    return _mtp.roll_tensor(tensor, shifts=-1, dims=-1, **kwargs)


def tp_group_of(layer: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The tensor-parallel group of an mcore parallel linear layer."""
    group = getattr(layer, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def cp_group_of(model: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The context-parallel group a language model rolls its MTP targets with."""
    group = getattr(model, "cp_group", None)
    if group is None:
        pg_collection = getattr(model, "pg_collection", None)
        group = getattr(pg_collection, "cp", None)
    return group


def group_size(group: Optional[torch.distributed.ProcessGroup]) -> int:
    return 1 if group is None else group.size()


def group_rank(group: Optional[torch.distributed.ProcessGroup]) -> int:
    return 0 if group is None else group.rank()
