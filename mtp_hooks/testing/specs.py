"""mcore layer specs for CPU: the local (no Transformer Engine) spec with ``SDPAttention`` swapped in.

``local_layer_spec()`` is mcore's own ``get_gpt_layer_local_spec`` with its core attention
replaced (on CPU only); ``replace_module_class`` does the same replacement anywhere in a spec
tree (block specs, MTP block specs); ``SequenceParallelLayerNorm`` is the torch layer norm for
sequence-parallel CPU models, which mcore's ``WrappedTorchNorm`` refuses.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Union

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_hooks.testing.attention import SDPAttention

__all__ = ["SequenceParallelLayerNorm", "local_layer_spec", "replace_module_class"]


def local_layer_spec(device: Union[str, torch.device] = "cpu", **spec_kwargs: Any) -> ModuleSpec:
    """mcore's local GPT layer spec (``get_gpt_layer_local_spec(**spec_kwargs)``); on CPU with ``SDPAttention``.

    Keyword arguments this release's ``get_gpt_layer_local_spec`` does not take are dropped
    (``normalization`` is absent from some releases; the norm then follows the config). On a
    CUDA device the spec is mcore's, untouched.
    """
    accepted = inspect.signature(get_gpt_layer_local_spec).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    spec = get_gpt_layer_local_spec(**{k: v for k, v in spec_kwargs.items() if open_kwargs or k in accepted})
    if torch.device(device).type == "cpu":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def replace_module_class(spec: Any, old: type, new: type, seen: Optional[set[int]] = None) -> Any:
    """Replace ``old`` by ``new`` wherever it appears as a module class in an mcore spec tree (in place)."""
    seen = set() if seen is None else seen
    if id(spec) in seen:
        return spec
    seen.add(id(spec))
    if isinstance(spec, list):
        spec[:] = [new if item is old else replace_module_class(item, old, new, seen) for item in spec]
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            setattr(spec, field.name, new if value is old else replace_module_class(value, old, new, seen))
    return spec


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch ``LayerNorm`` for sequence-parallel CPU models (mcore's ``WrappedTorchNorm`` refuses SP).

    Marks its parameters ``sequence_parallel`` as Apex's and TE's norms do, so mcore knows their
    gradients are partial sums over the sequence shards of the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "LayerNorm":
            raise NotImplementedError(f"SequenceParallelLayerNorm: normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
