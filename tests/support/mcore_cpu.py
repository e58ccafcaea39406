"""Test-only helpers around real mcore models on CPU: what a megatron-core release lacks, packed sequences.

The models, CPU shims and the side-by-side harness are ``mtp_hooks.testing`` (public, documented
there); tests import them from there. What stays here is test-only: the skip reasons of releases
that lack a feature (``HYBRID_MTP_MISSING``, ``needs_packed_mtp``, ``MTP_RECOMPUTE_BROKEN``),
``mtp_inner_layer``, ``rolled`` and ``thd_params``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

from mtp_hooks import _mcore
from mtp_hooks.testing import hybrid_mtp_missing

# tests/support/bridge_models.py and megatron_bridge_models.py still import these two from here.
from mtp_hooks.testing import SDPAttention, replace_module_class as _replace_module_class  # noqa: F401

HYBRID_MTP_MISSING: Optional[str] = hybrid_mtp_missing()

# Packed (THD) micro-batches with MTP: mcore's roll_tensor takes packed_seq_params from 0.16.1.
needs_packed_mtp = pytest.mark.skipif(
    not _mcore.ROLLS_PACKED_SEQUENCES,
    reason="megatron-core < 0.16.1: roll_tensor has no packed_seq_params (mcore refuses MTP with packed sequences)",
)


def _mtp_recompute_broken() -> Optional[str]:
    """Why stock MTP layers cannot run under full activation recompute in this mcore, or ``None``."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    forward = inspect.signature(MultiTokenPredictionLayer.forward).parameters
    checkpointed = inspect.signature(MultiTokenPredictionLayer._checkpointed_forward).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in checkpointed.values())
    if "padding_mask" in forward and "padding_mask" not in checkpointed and not open_kwargs:
        return (
            "stock MTP full recompute is broken in this megatron-core: MultiTokenPredictionLayer.forward passes "
            "padding_mask to _checkpointed_forward, which does not take it (TypeError)"
        )
    return None


MTP_RECOMPUTE_BROKEN: Optional[str] = _mtp_recompute_broken()


def mtp_inner_layer(layer: torch.nn.Module) -> torch.nn.Module:
    """The transformer layer inside an MTP layer: ``transformer_layer`` up to 0.16, ``mtp_model_layer`` from 0.17."""
    inner = getattr(layer, "mtp_model_layer", None)
    return inner if inner is not None else layer.transformer_layer


def rolled(tensor: Tensor, k: int) -> Tensor:
    """Reference roll: ``out[..., t] = tensor[..., t + k]``, zero where ``t + k`` is past the end."""
    out = torch.zeros_like(tensor)
    if k < tensor.shape[-1]:
        out[..., : tensor.shape[-1] - k] = tensor[..., k:]
    return out


def thd_params(real: list[int], slot: list[int]) -> tuple[Any, Any]:
    """``PackedSeqParams`` for one THD row: sequence ``i`` has ``real[i]`` tokens at the start of a slot of ``slot[i]``.

    Returns what the model is given (real lengths in ``cu_seqlens_q``, slots in
    ``cu_seqlens_q_padded`` where they differ) and the slot layout (``cu_seqlens_q`` set to the
    slots, padded bounds where padded: how Megatron-LM, verl and NeMo-RL describe padded batches).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_real = torch.tensor([0, *real]).cumsum(0).to(torch.int32)
    cu_slot = torch.tensor([0, *slot]).cumsum(0).to(torch.int32)
    padded = real != slot

    def params(cu: Tensor, cu_padded: Optional[Tensor]) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(slot), max_seqlen_kv=max(slot),
        )

    given = params(cu_real, cu_slot) if padded else params(cu_slot, None)
    return given, params(cu_slot, cu_slot if padded else None)
