"""Whether a call of the output layer is one the lean paths reproduce without making it.

The lean MTP loss and the log-prob output compute ``hidden @ weight.T`` themselves, which is what
mcore's own ``tensor_parallel.ColumnParallelLinear`` computes: its ``forward`` (input copied into
the TP region or SP-gathered, no bias) and its ``_forward_impl`` (``linear_with_frozen_weight`` /
``linear_with_grad_accumulation_and_async_allreduce``). That is the class every ``GPTModel`` and
``HybridModel`` of megatron-core 0.14 - 0.19 builds as its output layer, also in a Transformer
Engine build; the one exception, 0.18+'s ``TELMHeadColumnParallelLinear`` under an MXFP8 output
projection (``fp8_output_proj``), is TE's own GEMM, which the lean paths do not reproduce.

Anything else a call may run (a subclass's own ``forward`` or ``_forward_impl``, such as logit
soft-capping; TE's layers; an instance attribute shadowing either; hooks on the layer or torch's
global module hooks) changes the logits, and only a real call of the layer reproduces it: such a
head takes the dense path (the MTP losses) or is refused (``output="logprobs"``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as _module

from megatron.core.tensor_parallel import ColumnParallelLinear

# What a call of the output layer resolves to, all of which must be mcore's own.
_REPRODUCED = ("__call__", "_call_impl", "forward", "_forward_impl")

# Hooks that never change a call: mtp_hooks' own, and torch's module trackers (FlopCounterMode,
# the memory and distributed trackers), which only record which module is running.
_TRANSPARENT_HOOK_MODULES = ("mtp_hooks.", "torch.utils.module_tracker", "torch.distributed._tools.")


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
