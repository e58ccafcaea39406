"""Stock mcore's CUDA assumptions, answered on CPU for as long as a context manager is open.

mcore asks ``torch.cuda.current_device()`` for the device of a few buffers (its MTP loss tracker,
tensor-parallel gathers, RoPE frequencies), pins RoPE's context-parallel indices, makes its pipeline
schedule's token counter with ``device="cuda"`` and calls ``.cuda()`` on embeddings of later pipeline
stages. Each context manager here turns one of these to CPU while it is open and undoes it on exit; nothing is
changed at import. ``mtp_hooks`` itself relies on none of them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "cuda_calls_on_cpu", "cuda_current_device_is_cpu"]


@contextlib.contextmanager
def cuda_current_device_is_cpu() -> Iterator[None]:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` while the context is open.

    The original function is put back on exit, also when the body raises.
    """
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class CudaToCpu(TorchFunctionMode):
    """A torch function mode: ``device="cuda"`` of tensor factories becomes CPU, ``pin_memory=True`` is dropped (no
    pinned allocator without an accelerator; mcore pins RoPE's CP indices), ``Tensor.cuda()`` a no-op."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """While open, tensors that mcore creates with ``device="cuda"`` or moves with ``.cuda()`` stay on CPU.

    Needed by mcore's pipeline schedules (a token counter made on ``"cuda"``) and by tied or MTP
    embeddings on a later pipeline stage (``setup_embeddings_and_output_layer`` calls ``.cuda()``).
    Every torch call goes through the mode, so open it only where those paths run.
    """
    with CudaToCpu():
        yield
