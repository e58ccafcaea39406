"""Per-depth MTP metrics, accumulated on device over training micro-batches until read."""

from __future__ import annotations

import math

import torch
from torch import Tensor


class MTPMetrics:
    """Token-weighted sums per depth: masked CE, masked tokens, masked positions predicted right.

    ``read`` turns them into ``{"mtp_k/loss": ..., "mtp_k/acc": ..., "mtp_k/tokens": ...}``;
    loss and acceptance are ``nan`` for a depth that saw no masked token.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._sums: Tensor | None = None  # [depth, 3]: ce, tokens, correct

    def add(self, k: int, ce_sum: Tensor, tokens: Tensor, correct: Tensor) -> None:
        """Add one micro-batch's sums for depth ``k`` (0-based)."""
        row = torch.stack([ce_sum.detach().double(), tokens.detach().double(), correct.detach().double()])
        if self._sums is None:
            self._sums = torch.zeros(self.depth, 3, dtype=torch.float64, device=row.device)
        self._sums[k] += row

    def read(self, reset: bool = True) -> dict[str, float]:
        if self._sums is None:
            return {}
        sums = self._sums.tolist()
        if reset:
            self._sums = None
        out: dict[str, float] = {}
        for k, (ce, tokens, correct) in enumerate(sums, start=1):
            out[f"mtp_{k}/loss"] = ce / tokens if tokens else math.nan
            out[f"mtp_{k}/acc"] = correct / tokens if tokens else math.nan
            out[f"mtp_{k}/tokens"] = tokens
        return out
