"""Per-depth MTP metrics, accumulated on device over training micro-batches until read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class MTPMetrics:
    """Token-weighted sums per depth: masked CE, masked tokens, masked positions predicted right
    and, when the main head is compared, masked argmax agreements and expected acceptances.

    ``read`` turns them into ``{"mtp_k/loss": ..., "mtp_k/acc": ..., "mtp_k/tokens": ...}`` plus
    ``"mtp_k/agree"`` and ``"mtp_k/accept"`` when compared. A depth that saw no masked token
    reports ``mtp_k/tokens == 0`` and no ratios (never NaN, which a dashboard reads as divergence).
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._sums: Tensor | None = None  # [depth, 5]: ce, tokens, correct, agree, accept
        self._compared = False

    def add(
        self,
        k: int,
        ce_sum: Tensor,
        tokens: Tensor,
        correct: Tensor,
        agree: Optional[Tensor] = None,
        accept: Optional[Tensor] = None,
    ) -> None:
        """Add one micro-batch's sums for depth ``k`` (0-based)."""
        compared = agree is not None and accept is not None
        parts = [ce_sum, tokens, correct] + ([agree, accept] if compared else [torch.zeros_like(ce_sum)] * 2)
        row = torch.stack([part.detach().double() for part in parts])
        if self._sums is None:
            self._sums = torch.zeros(self.depth, 5, dtype=torch.float64, device=row.device)
        self._sums[k] += row
        self._compared = self._compared or compared

    def read(self, reset: bool = True) -> dict[str, float]:
        if self._sums is None:
            return {}
        sums, compared = self._sums.tolist(), self._compared
        if reset:
            self._sums, self._compared = None, False
        out: dict[str, float] = {}
        for k, (ce, tokens, correct, agree, accept) in enumerate(sums, start=1):
            if tokens:
                out[f"mtp_{k}/loss"] = ce / tokens
                out[f"mtp_{k}/acc"] = correct / tokens
            out[f"mtp_{k}/tokens"] = tokens
            if compared and tokens:
                out[f"mtp_{k}/agree"] = agree / tokens
                out[f"mtp_{k}/accept"] = accept / tokens
        return out
