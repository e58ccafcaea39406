"""Real Megatron-Core GPT models with MTP layers, runnable on CPU: the test suite's helpers.

The CPU shims, model builders and side-by-side steps are ``mtp_hooks.testing`` (public, documented
there) and are re-exported here under the names the tests import. What stays here is test-only:
``stock_main_only_step``, ``output_layer_calls`` (a profile-function recorder of the output
layer's calls), ``rolled``, ``thd_params``, ``mtp_inner_layer`` and ``MTP_RECOMPUTE_BROKEN``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import Tensor

from megatron.core.models.gpt import GPTModel

from mtp_hooks import _mcore

from mtp_hooks.testing import *  # noqa: F401,F403 (the public helpers, under the names the tests import)
from mtp_hooks.testing import Batch, hybrid_mtp_missing, masked_mean
from mtp_hooks.testing import CudaToCpu as _CudaToCpu, free_port as _free_port, replace_module_class as _replace_module_class  # noqa: F401

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


def stock_main_only_step(model: GPTModel, batch: Batch) -> Tensor:
    """Stock mcore with the MTP loss weighted 0 (and all-ones MTP mask, so no 0/0): main-head gradients only."""
    factor = model.config.mtp_loss_scaling_factor
    model.config.mtp_loss_scaling_factor = 0.0
    try:
        per_token = model(*batch.model_args, labels=batch.labels)
    finally:
        model.config.mtp_loss_scaling_factor = factor
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    return loss.detach()


@contextlib.contextmanager
def output_layer_calls(model: GPTModel) -> Iterator[list[Tensor]]:
    """Record every ``output_layer`` output (detached ``[s, b, V]`` logits) while the context is open.

    In a stock training forward the calls are depth 1 .. N of MTP, then the main head.
    Recorded by a profile function, not a module hook: a hook on the output layer would itself
    change what the hooks do (they send an output layer carrying foreign hooks down the dense path).
    """
    calls: list[Tensor] = []
    layer = model.output_layer
    forward_code = type(layer).forward.__code__
    previous = sys.getprofile()

    def profile(frame: Any, event: str, value: Any) -> None:
        if event == "return" and frame.f_code is forward_code and frame.f_locals.get("self") is layer and value is not None:
            calls.append(value[0].detach().clone())
        if previous is not None:  # an enclosing recorder (of another model) keeps recording
            previous(frame, event, value)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


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
