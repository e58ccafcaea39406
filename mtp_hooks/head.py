"""The output layer as one forward's heads use it: ``Head``, built on the call it serves.

The MTP heads, the log-prob output and the chain's drafts multiply by the output layer's weight
themselves; what they need to know about the layer (its TP group, sequence parallelism, mcore's
``main_grad`` protocol, whether the lean paths reproduce its call) is read on that call, in the
output layer's pre-hook, and passed down.

Whether the lean paths reproduce a call: they compute ``hidden @ weight.T``, which is what mcore's
own ``tensor_parallel.ColumnParallelLinear`` computes (input copied into the TP region or
SP-gathered, no bias), the output layer of every ``GPTModel`` and ``HybridModel`` of megatron-core
0.14 - 0.19, also in a Transformer Engine build; the one exception, 0.18+'s
``TELMHeadColumnParallelLinear`` under an MXFP8 output projection, is TE's own GEMM. Anything else
a call may run (a subclass's own ``forward`` or ``_forward_impl`` such as logit soft-capping, an
instance attribute shadowing either, hooks on the layer or torch's global module hooks) changes the
logits, and only a real call reproduces it: such a head takes the dense path (the MTP losses) or is
refused (``Head.require_reproducible``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.ops.chunking import auto_chunk_size
from mtp_hooks.ops.vocab_parallel import group_size

# Calls the output layer on (hidden, weight) without the hooks' own pre-hook acting on the call.
HeadCall = Callable[[Tensor, Tensor], Tensor]

# What a call of the output layer resolves to, all of which must be mcore's own.
_REPRODUCED = ("__call__", "_call_impl", "forward", "_forward_impl")

# Hooks that never change a call: mtp_hooks' own, and torch's module trackers (FlopCounterMode,
# the memory and distributed trackers), which only record which module is running.
_TRANSPARENT_HOOK_MODULES = ("mtp_hooks.", "torch.utils.module_tracker", "torch.distributed._tools.")


@dataclasses.dataclass(frozen=True)
class Head:
    """The output layer of one call, with the weight its heads multiply by.

    ``chunk_size``: the ``chunk_size`` option (``None``: ``ops.chunking.auto_chunk_size`` per call,
    ``chunk``); ``reproducible``: ``reproducible_head``; ``call``: the layer's own call, for the
    dense path.
    """

    layer: nn.Module
    weight: Tensor
    tp_group: Optional[torch.distributed.ProcessGroup]
    sequence_parallel: bool
    chunk_size: Optional[int]
    main_grad_protocol: bool  # ``follows_main_grad_protocol`` for ``weight``
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

    def require_reproducible(self, option: str, what: str, instead: str) -> None:
        """Refuse ``option`` (which computes ``what`` without calling the output layer) on a head
        whose call does more than the lean paths reproduce; ``instead`` says what to use."""
        if self.reproducible:
            return
        raise MTPHooksError(
            f"{option}: {what} without calling the output layer, which would bypass what its calls do "
            "(hooks registered on it or torch's global module hooks, a forward or _forward_impl of its own class)\n"
            "  expected: an output layer whose call mcore's own ColumnParallelLinear makes "
            "(no forward or _forward_impl of its own, no hooks other than mtp_hooks' own)\n"
            f"  received: a {type(self.layer).__name__} whose call does more; {instead}"
        )


def check_bias_free(model: nn.Module) -> None:
    """Refuse, at ``attach``, an output layer with a bias: the lean paths compute ``hidden @ weight.T``."""
    if model.post_process and getattr(model.output_layer, "bias", None) is not None:
        raise MTPHooksError(
            "model: the output layer has a bias; mtp_hooks supports bias-free output layers (GPTModel's default)"
        )


def reproducible_head(layer: nn.Module) -> bool:
    """Whether calling ``layer`` computes exactly what mcore's own ``ColumnParallelLinear`` does.

    True when ``layer`` is a ``ColumnParallelLinear`` whose class and instance resolve
    ``__call__``, ``forward`` and ``_forward_impl`` to mcore's own (a subclass that only adds
    attributes qualifies; one overriding either method does not) and no hooks other than
    mtp_hooks' own and torch's module trackers act on its calls (``foreign_hooks``).
    """
    if not isinstance(layer, ColumnParallelLinear):
        return False
    for name in _REPRODUCED:
        if name in vars(layer) or getattr(type(layer), name) is not getattr(ColumnParallelLinear, name):
            return False
    return not foreign_hooks(layer)


def foreign_hooks(layer: nn.Module) -> bool:
    """Whether a call of ``layer`` runs hooks that may change it: the layer's forward (pre-)hooks
    and backward (pre-)hooks and torch's global module hooks, other than mtp_hooks' own and
    torch's module trackers (``_TRANSPARENT_HOOK_MODULES``)."""
    registries = (
        layer._forward_pre_hooks,
        layer._forward_hooks,
        layer._backward_pre_hooks,
        layer._backward_hooks,
        _module._global_forward_pre_hooks,
        _module._global_forward_hooks,
        _module._global_backward_pre_hooks,
        _module._global_backward_hooks,
    )
    return any(not _is_own_hook(hook) for registry in registries for hook in registry.values())


def _is_own_hook(hook: Any) -> bool:
    function = getattr(hook, "__func__", hook)
    return str(getattr(function, "__module__", "")).startswith(_TRANSPARENT_HOOK_MODULES)


def follows_main_grad_protocol(layer: nn.Module, weight: Tensor) -> bool:
    """Whether mcore's output layer would accumulate ``weight``'s gradient into ``weight.main_grad``
    (``ops.main_grad``). mcore's own test: ``gradient_accumulation_fusion and hasattr(weight,
    "main_grad")``. A detached weight (a frozen head) is a new tensor without ``main_grad``."""
    fusion = bool(getattr(layer, "gradient_accumulation_fusion", False))
    return fusion and weight.requires_grad and hasattr(weight, "main_grad")
