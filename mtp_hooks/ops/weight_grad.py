"""How the lean loss makes the head weight's gradient: which path (``choose_weight_grad``) and, for
``"fused"``, its accumulation during forward (``add_weight_grad_``).

``"recompute"`` keeps nothing but the hidden states for backward and recomputes the logits there
one vocabulary slice at a time; ``"fused"`` adds each chunk's ``logit_grad.T @ hidden`` to one
``[V/tp, H]`` accumulator (fp32 for half, bf16 and fp32 inputs) during forward (``lean_loss``).
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import torch
from torch import Tensor

WeightGrad = Literal["fused", "recompute"]
WEIGHT_GRAD_MODES: tuple[str, ...] = get_args(WeightGrad)


def choose_weight_grad(hidden_size: int, tokens: int) -> str:
    """The weight-gradient path that keeps less memory from forward to backward.

    ``tokens``: all tokens of one ``lean_mtp_loss`` call on this rank (N depths x T when the
    depths share one call). ``"fused"`` keeps a ``[V/tp, hidden_size]`` fp32 accumulator,
    stock keeps ``[tokens, V/tp]`` fp32 logits: ``"fused"`` unless the accumulator is larger.
    """
    return "recompute" if hidden_size > tokens else "fused"


@functools.lru_cache(maxsize=None)
def _mm_accumulates_low_precision(device: torch.device, dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=acc_dtype, out=acc)`` runs for ``dtype`` operands here.

    Half / bf16 GEMMs with an fp32 output (CUDA, recent torch) keep the low-precision operands'
    speed and accumulate in fp32; elsewhere (CPU, older torch) the operands are upcast instead.
    """
    if dtype == acc_dtype or device.type == "cpu":
        return False
    acc = torch.zeros(1, 1, dtype=acc_dtype, device=device)
    operand = torch.zeros(1, 1, dtype=dtype, device=device)
    try:
        torch.addmm(acc, operand, operand, out_dtype=acc_dtype, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def add_weight_grad_(acc: Tensor, grad: Tensor, rounded: Tensor, hidden: Tensor) -> None:
    """``acc += grad.T @ hidden`` accumulated in ``acc.dtype`` (``grad``: the chunk's logit gradient
    in ``acc.dtype``; ``rounded``: the same in the head's dtype).

    Low-precision operands go through a GEMM with an ``acc.dtype`` output where torch has one for
    the device (``rounded``), else are upcast.
    """
    if hidden.dtype == acc.dtype:
        torch.addmm(acc, grad.t(), hidden, out=acc)
    elif _mm_accumulates_low_precision(hidden.device, hidden.dtype, acc.dtype):
        torch.addmm(acc, rounded.t(), hidden, out_dtype=acc.dtype, out=acc)
    else:
        torch.addmm(acc, grad.t(), hidden.to(acc.dtype), out=acc)

