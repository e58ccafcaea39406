"""mcore's weight-gradient protocol for the output weight (gradient-accumulation fusion).

With ``gradient_accumulation_fusion=True`` mcore's ``ColumnParallelLinear`` adds its weight gradient
straight into ``weight.main_grad`` (the buffer mcore's DDP reduces) inside
``LinearWithGradAccumulationAndAsyncCommunication.backward``, returns a placeholder gradient and
sets ``weight.grad_added_to_main_grad``; DDP's hook then drops ``weight.grad`` unless the weight
carries ``zero_out_wgrad`` (mcore sets it on the shared embedding, whose placeholder is zeros). A
weight gradient returned through plain autograd would be dropped for an untied head, so the lean
MTP loss follows the same protocol: it adds its share to ``main_grad`` itself and returns what
mcore returns. ``defer_embedding_wgrad_compute`` only delays the main head's own addition to
``main_grad`` (mcore drains it at the end of the pipeline) and sets the same flag, so the same
protocol covers it: the MTP share is added in the loss's backward, stock's sum is the same.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn


def follows_main_grad_protocol(layer: nn.Module, weight: Tensor) -> bool:
    """Whether mcore's output layer would accumulate ``weight``'s gradient into ``weight.main_grad``.

    mcore's own test (``LinearWithGradAccumulationAndAsyncCommunication.forward``):
    ``gradient_accumulation_fusion and hasattr(weight, "main_grad")``. A detached weight (a
    frozen head) is a new tensor without ``main_grad``.
    """
    return bool(getattr(layer, "gradient_accumulation_fusion", False)) and weight.requires_grad and hasattr(weight, "main_grad")


def add_product_(main_grad: Tensor, grad: Tensor, hidden: Tensor) -> None:
    """``main_grad += grad.T @ hidden``, accumulated in fp32 (as mcore's ``wgrad_gemm_accum_*`` kernels).

    ``grad``: fp32 (or fp64) logit gradient ``[T, rows]``; ``hidden``: ``[T, H]`` in any dtype.
    """
    if main_grad.dtype == grad.dtype:
        torch.addmm(main_grad, grad.t(), hidden.to(grad.dtype), out=main_grad)
    else:  # a half / bf16 main_grad (grad_reduce_in_fp32=False): fp32 product, rounded once on adding
        main_grad.add_(grad.t() @ hidden.to(grad.dtype))


def placeholder_grad(weight: Tensor, main_grad: Tensor, dtype: torch.dtype, spent: Optional[Tensor] = None) -> Optional[Tensor]:
    """What mcore's output layer returns as the weight's gradient once it used ``main_grad``.

    Sets ``weight.grad_added_to_main_grad`` where the weight has it (mcore DDP) and returns zeros
    for a weight with ``zero_out_wgrad`` (DDP then adds ``.grad``: the embedding's share) or an
    uninitialised tensor (DDP drops it); ``None`` without mcore DDP's attribute. ``spent``: a
    buffer of the same shape whose content is no longer needed (the fused accumulator, already
    added to ``main_grad``); it serves as the placeholder where its dtype matches, so nothing new
    is allocated.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    zero = getattr(weight, "zero_out_wgrad", False)
    if spent is not None and spent.dtype == dtype and spent.shape == main_grad.shape:
        return spent.zero_() if zero else spent
    make: Any = torch.zeros if zero else torch.empty
    return make(main_grad.shape, dtype=dtype, device=main_grad.device)
