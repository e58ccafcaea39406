"""Probes on what torch computes, for tests that pin what a loss path never materialises."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces while active (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out
