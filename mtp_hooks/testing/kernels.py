"""A CPU stand-in for Apex's fused weight-gradient kernel, installed only while a context manager is open.

mcore's gradient-accumulation fusion (``gradient_accumulation_fusion=True``) adds each linear
layer's weight gradient straight into its fp32 (or half) ``main_grad`` with
``fused_weight_gradient_mlp_cuda``. ``fused_wgrad_kernel_on_cpu()`` makes mcore find a CPU
implementation of the two entry points it calls, so models built with the fusion on construct
and train on CPU, with the ``main_grad`` protocol a production run has.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["fused_wgrad_kernel_on_cpu"]

_KERNEL_MODULE = "fused_weight_gradient_mlp_cuda"
_LAYER_NAMES = ("fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available")


class _FusedWeightGradientKernels:
    """CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (mcore's gradient-accumulation fusion).

    ``wgrad_gemm_accum_fp32(input, grad_output, main_grad)``: one GEMM ``grad_output.T @ input``
    of the 2-D operands, accumulated in fp32 and added to the fp32 ``main_grad`` (cuBLAS with
    ``beta = 1``). ``wgrad_gemm_accum_fp16``: the same into a half / bf16 ``main_grad``, the sum
    computed in fp32 and rounded once to its dtype.
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        assert main_grad.dtype == torch.float32 and input.dim() == grad_output.dim() == 2
        # out=: counted by FlopCounterMode
        torch.addmm(main_grad, grad_output.detach().t().float(), input.detach().float(), out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        assert main_grad.dtype in (torch.float16, torch.bfloat16) and input.dim() == grad_output.dim() == 2
        main_grad.copy_(torch.addmm(main_grad.float(), grad_output.t().float(), input.float()))


@contextlib.contextmanager
def fused_wgrad_kernel_on_cpu() -> Iterator[None]:
    """While open, mcore finds ``fused_weight_gradient_mlp_cuda`` (a CPU implementation), so layers
    built with ``gradient_accumulation_fusion=True`` construct and run on CPU.

    ``sys.modules`` and ``megatron.core.tensor_parallel.layers`` get back exactly what they had
    on exit, also when the body raises.
    """
    from megatron.core.tensor_parallel import layers

    kernels = _FusedWeightGradientKernels()
    saved_module = sys.modules.get(_KERNEL_MODULE)
    saved = {name: getattr(layers, name) for name in _LAYER_NAMES if hasattr(layers, name)}
    sys.modules[_KERNEL_MODULE] = kernels  # type: ignore[assignment]
    layers.fused_weight_gradient_mlp_cuda = kernels  # type: ignore[attr-defined]
    layers._grad_accum_fusion_available = True
    try:
        yield
    finally:
        if saved_module is None:
            sys.modules.pop(_KERNEL_MODULE, None)
        else:
            sys.modules[_KERNEL_MODULE] = saved_module
        for name in _LAYER_NAMES:
            if name in saved:
                setattr(layers, name, saved[name])
            elif hasattr(layers, name):
                delattr(layers, name)
