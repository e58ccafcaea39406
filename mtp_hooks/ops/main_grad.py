"""mcore's weight-gradient protocol for the output weight (gradient-accumulation fusion).

With ``gradient_accumulation_fusion=True`` mcore's ``ColumnParallelLinear`` adds its weight gradient
straight into ``weight.main_grad`` (the buffer mcore's DDP reduces) inside
``LinearWithGradAccumulationAndAsyncCommunication.backward``, returns a placeholder gradient and
sets ``weight.grad_added_to_main_grad``; DDP's hook then drops ``weight.grad`` unless the weight
carries ``zero_out_wgrad`` (mcore sets it on the shared embedding at PP=1 only, whose placeholder
is zeros). A weight gradient returned through plain autograd next to such a placeholder would be
dropped: for an untied head, and for a tied one on a pipeline's last stage. So every weight
gradient the library makes (the lean MTP loss, the log-probs) goes through ``HeadWeightGrad``: under
the protocol it adds into ``main_grad`` and returns what mcore returns, else a plain gradient.
``defer_embedding_wgrad_compute`` only delays mcore's own layer's addition to ``main_grad``
(drained at the end of the pipeline) and sets the same flag, so the same protocol covers it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from mtp_hooks.ops.workspace import Workspace


def add_product_(main_grad: Tensor, grad: Tensor, hidden: Tensor) -> None:
    """``main_grad += grad.T @ hidden``, accumulated in fp32 (as mcore's ``wgrad_gemm_accum_*`` kernels).

    ``grad``: fp32 (or fp64) logit gradient ``[T, rows]``; ``hidden``: ``[T, H]`` in any dtype.
    """
    if main_grad.dtype == grad.dtype:
        torch.addmm(main_grad, grad.t(), hidden.to(grad.dtype), out=main_grad)
    else:  # a half / bf16 main_grad (grad_reduce_in_fp32=False): fp32 product, rounded once on adding
        main_grad.add_(grad.t() @ hidden.to(grad.dtype))


def placeholder_grad(
    weight: Tensor, main_grad: Tensor, dtype: torch.dtype, spent: Optional[Tensor] = None
) -> Optional[Tensor]:
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


class HeadWeightGrad:
    """The output weight's gradient as one autograd function of the library makes it.

    Made in forward, where mcore's layer reads ``main_grad`` too. Backward hands it the parts:
    ``add_rows_`` (rows ``grad.T @ hidden`` of one vocabulary slice) or ``add_scaled_`` (a whole
    fp32 accumulator times the upstream factor), and returns ``result()`` as the weight's
    gradient. With ``main_grad_protocol`` (``head.follows_main_grad_protocol``) the parts go into
    ``weight.main_grad`` and the result is mcore's placeholder (``placeholder_grad``); without,
    they make a plain gradient in the weight's dtype. ``input_dtype``: the hidden states' dtype
    (mcore's placeholder has it).
    """

    def __init__(self, weight: Tensor, main_grad_protocol: bool, input_dtype: torch.dtype) -> None:
        # ``main_grad``: the attribute mcore's DDP sets on its parameters (not a Tensor attribute).
        self.main_grad: Optional[Tensor] = getattr(weight, "main_grad") if main_grad_protocol else None
        self._weight = weight if main_grad_protocol else None
        self._shape, self._dtype, self._device = weight.shape, weight.dtype, weight.device
        self._input_dtype = input_dtype
        self._plain: Optional[Tensor] = None
        self._spent: Optional[Tensor] = None

    def add_rows_(self, rows: slice, grad: Tensor, hidden: Tensor, space: Workspace) -> None:
        """Rows ``rows`` of the gradient: ``grad.T @ hidden``, ``grad`` the fp32 (fp64) logit gradient
        ``[T, len(rows)]``; a plain gradient rounds it to the weight's dtype in ``space`` first."""
        if self.main_grad is not None:
            add_product_(self.main_grad[rows], grad, hidden)
            return
        if self._plain is None:
            self._plain = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        torch.mm(space.rounded(grad, self._dtype).t(), hidden, out=self._plain[rows])

    def add_scaled_(self, acc: Tensor, factor: Tensor) -> None:
        """The whole gradient as ``acc * factor``; ``acc`` (fp32 ``[V/tp, H]``) is spent afterwards.
        A plain gradient is scaled in ``acc``'s precision and rounded once."""
        if self.main_grad is not None:
            self.main_grad.addcmul_(acc, factor)
            self._spent = acc
            return
        self._plain = torch.empty(acc.shape, dtype=self._dtype, device=acc.device)
        torch.mul(acc, factor, out=self._plain)

    def result(self) -> Optional[Tensor]:
        """What the autograd function returns as the weight's gradient."""
        if self.main_grad is None:
            return self._plain
        assert self._weight is not None
        return placeholder_grad(self._weight, self.main_grad, self._input_dtype, spent=self._spent)

