"""The output layer as one forward's heads use it: ``Head``, asked once per forward.

The MTP heads and the log-prob output multiply by the output layer's weight themselves; what they
need to know about the layer (its TP group, sequence parallelism, mcore's ``main_grad`` protocol,
whether the lean paths reproduce its call) is read once, in the output layer's pre-hook
(``submodule_hooks``), and passed down with the micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from mtp_hooks import _mcore
from mtp_hooks.ops.chunking import auto_chunk_size
from mtp_hooks.ops.main_grad import follows_main_grad_protocol
from mtp_hooks.ops.vocab_parallel import group_size
from mtp_hooks.stock_head import reproducible_head

# Calls the output layer on (hidden, weight) without the hooks' own pre-hook acting on the call.
HeadCall = Callable[[Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Head:
    """The output layer of one forward, with the weight its heads multiply by.

    ``chunk_size``: the ``chunk_size`` option (``None``: ``ops.chunking.auto_chunk_size`` per call,
    ``chunk``); ``reproducible``: ``stock_head.reproducible_head``; ``call``: the layer's own call,
    for the dense path.
    """

    layer: nn.Module
    weight: Tensor
    tp_group: Optional[torch.distributed.ProcessGroup]
    sequence_parallel: bool
    chunk_size: Optional[int]
    main_grad_protocol: bool  # ``ops.main_grad.follows_main_grad_protocol`` for ``weight``
    reproducible: bool
    call: Optional[HeadCall] = None

    @classmethod
    def of(cls, layer: nn.Module, weight: Tensor, chunk_size: Optional[int], call: Optional[HeadCall] = None) -> Head:
        return cls(
            layer,
            weight,
            _mcore.tp_group_of(layer),
            bool(getattr(layer, "sequence_parallel", False)),
            chunk_size,
            follows_main_grad_protocol(layer, weight),
            reproducible_head(layer),
            call,
        )

    def detached(self) -> Head:
        """The same head with its weight detached (it trains nothing, so no ``main_grad`` protocol)."""
        return dataclasses.replace(self, weight=self.weight.detach(), main_grad_protocol=False)

    def chunk(self, tokens: int) -> int:
        """Tokens per chunk of a lean kernel over ``tokens`` tokens."""
        return self.chunk_size or auto_chunk_size(self.weight.shape[0], tokens)

    def input(self, hidden: Tensor) -> Tensor:
        """What ``ColumnParallelLinear`` multiplies: SP-gathered or copied into the TP region."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=self.tp_group)
        if group_size(self.tp_group) > 1:
            return copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return hidden
