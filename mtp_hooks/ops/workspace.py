"""One reusable buffer per chunk loop of the lean losses and log-probs.

Every chunk of a loop needs a temporary of the same size (``[chunk, V/tp]`` logits, or a
vocabulary slice of them in backward). Allocating it anew per chunk costs, on CPU, the kernel's
zeroing of fresh pages (for a 256 MiB chunk about as long as the chunk's matmul) and, on CUDA, an
allocator round trip; stock's dense loss pays that once, for all tokens at once. A ``Workspace``
hands out views of one buffer, written with ``out=``, so a loop holds one chunk's memory and pays
for it once. A view is valid until the next request: callers use one view per workspace at a time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class Workspace:
    """A flat buffer of ``dtype`` on ``device``, grown to the largest request, viewed as matrices."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._buffer: Optional[Tensor] = None
        self._low: Optional[Workspace] = None  # the head's dtype, for products made in half / bf16

    def matrix(self, rows: int, columns: int) -> Tensor:
        """A contiguous ``[rows, columns]`` view of the buffer (uninitialised)."""
        numel = rows * columns
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = None  # the old buffer is freed before the new one is made
            self._buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._buffer[:numel].view(rows, columns)

    def rounded(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """``tensor.to(dtype)``: ``tensor`` itself when it has that dtype, else a view of a second buffer
        (shared with ``product``'s rounding, whose view is spent by then)."""
        if tensor.dtype == dtype:
            return tensor
        return self._low_space(dtype).matrix(*tensor.shape).copy_(tensor)

    def _low_space(self, dtype: torch.dtype) -> "Workspace":
        if self._low is None or self._low.dtype != dtype:
            self._low = None
            self._low = Workspace(dtype, self.device)
        return self._low

    def product(self, a: Tensor, b: Tensor) -> Tensor:
        """``(a @ b.T).to(self.dtype)`` in the buffer: the GEMM runs in the operands' dtype and is
        rounded there first, exactly as ``(a @ b.T).to(dtype)`` (stock's ``logits.float()``)."""
        out = self.matrix(a.shape[0], b.shape[0])
        if a.dtype == self.dtype:
            return torch.mm(a, b.t(), out=out)
        return out.copy_(self._low_space(a.dtype).product(a, b))
