"""Per-depth MTP metrics, accumulated on device over training micro-batches until read."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

# One depth of one micro-batch, as ``MTPMetrics.add`` takes it: (depth index, masked CE sum, masked
# tokens, masked correct[, masked agreements, masked acceptance, chained acceptance of depths 1..k
# and its positions (``chain_sums``)]).
DepthSums = tuple[Any, ...]

_COLUMNS = 7  # ce, tokens, correct, agree, accept, chain, chain_tokens


class MTPMetrics:
    """Token-weighted sums per depth: masked CE, masked tokens, masked positions predicted right
    and, when the main head is compared, masked argmax agreements, expected acceptances and the
    chained acceptances (``chain_sums``).

    ``read`` turns them into ``{"mtp_k/loss": ..., "mtp_k/acc": ..., "mtp_k/tokens": ...}`` plus
    ``"mtp_k/agree"``, ``"mtp_k/accept"`` and ``"mtp/accept_len"`` when compared. A depth that saw
    no masked token reports ``mtp_k/tokens == 0`` and no ratios (never NaN, which a dashboard reads
    as divergence); ``mtp/accept_len`` needs a position where every depth has a target.

    ``mtp/accept_len`` is the expected number of draft tokens a verifier accepts from a chain of
    the N depths, ``sum_k E_t[prod_{j<=k} alpha_j(t)]``: per position, not the product of the
    per-depth means. A position that is hard for depth 1 tends to be hard for depth 2, and the
    chain's k-th token counts only if all before it were accepted at that same position, so
    ``E[prod] != prod E`` and the product of the means would misstate the length (by how much
    depends on the correlation). The depths' tokens sit at the same positions in one loss call,
    so each term averages over the positions where depths 1..k all have a target, over the
    micro-batches since the last reset. ``alpha`` is the acceptance under the options'
    ``accept_rule`` (``ops.draft_rule``), as the lean kernel reports it. The acceptances are
    teacher-forced (each depth reads the data's tokens, not its own drafts), as are ``mtp_k/accept``.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._sums: Tensor | None = None  # [depth, _COLUMNS]
        self._compared = False

    def add(
        self,
        k: int,
        ce_sum: Tensor,
        tokens: Tensor,
        correct: Tensor,
        agree: Optional[Tensor] = None,
        accept: Optional[Tensor] = None,
        chain: Optional[Tensor] = None,
        chain_tokens: Optional[Tensor] = None,
    ) -> None:
        """Add one micro-batch's sums for depth ``k`` (0-based)."""
        compared = agree is not None and accept is not None and chain is not None and chain_tokens is not None
        parts = [ce_sum, tokens, correct] + (
            [agree, accept, chain, chain_tokens] if compared else [torch.zeros_like(ce_sum)] * 4
        )
        row = torch.stack([part.detach().double() for part in parts])
        if self._sums is None:
            self._sums = torch.zeros(self.depth, _COLUMNS, dtype=torch.float64, device=row.device)
        self._sums[k] += row
        self._compared = self._compared or compared

    def read(self, reset: bool = True) -> dict[str, float]:
        if self._sums is None:
            return {}
        sums, compared = self._sums.tolist(), self._compared
        if reset:
            self._sums, self._compared = None, False
        out: dict[str, float] = {}
        for k, (ce, tokens, correct, agree, accept, _chain, _chain_tokens) in enumerate(sums, start=1):
            if tokens:
                out[f"mtp_{k}/loss"] = ce / tokens
                out[f"mtp_{k}/acc"] = correct / tokens
            out[f"mtp_{k}/tokens"] = tokens
            if compared and tokens:
                out[f"mtp_{k}/agree"] = agree / tokens
                out[f"mtp_{k}/accept"] = accept / tokens
        if compared and sums[-1][6]:  # depth N's chain positions have every depth's target: no prefix is empty
            out["mtp/accept_len"] = sum(row[5] / row[6] for row in sums)
        return out


def chain_sums(accept: Tensor, masks: Tensor) -> tuple[Tensor, Tensor]:
    """Per step k, ``sum_t c_k(t) prod_{j<=k} alpha_j(t)`` and ``sum_t c_k(t)``, ``c_k(t) = prod_{j<=k} mask_j(t)``.

    ``accept``, ``masks``: ``[N, T]``, every step's tokens at the same positions (the lean call's
    order), so the product is the chance that a draft started at ``t`` has its first k tokens
    accepted, over the positions where steps 1..k all have a target.
    """
    chain = masks.cumprod(dim=0)
    return (accept.cumprod(dim=0) * chain).sum(dim=1), chain.sum(dim=1)
