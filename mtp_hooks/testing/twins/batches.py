"""One micro-batch for both twins, and the user's main-head loss computed from it.

A ``Batch`` holds what a training micro-batch gives a ``GPTModel``: token ids, positions,
next-token labels and a loss mask. Both twins are trained on the same batch with the same user
loss, the masked mean of the per-token cross-entropy (``masked_mean``): stock computes the
per-token CE itself from ``labels``, a hooked model returns logits and the user computes it
(``main_ce_from_logits``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Batch", "main_ce_from_logits", "make_batch", "masked_mean"]


@dataclasses.dataclass
class Batch:
    """One micro-batch: ``[b, s]`` token ids, positions, next-token labels and loss mask."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Optional[Tensor]

    @property
    def model_args(self) -> tuple[Tensor, Tensor, None]:
        """``(input_ids, position_ids, attention_mask=None)``: the positional arguments of ``GPTModel``."""
        return (self.input_ids, self.position_ids, None)


def make_batch(vocab_size: int, batch: int = 2, seq: int = 8, mask: str = "random", seed: int = 0) -> Batch:
    """A deterministic batch; ``mask`` is ``"random"``, ``"ones"``, ``"zeros"``, ``"last"`` or ``"none"``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    labels = torch.roll(ids, -1, 1)
    loss_mask: Optional[Tensor]
    if mask == "random":
        loss_mask = (torch.rand(batch, seq, generator=gen) > 0.3).float()
    elif mask == "ones":
        loss_mask = torch.ones(batch, seq)
    elif mask == "zeros":
        loss_mask = torch.zeros(batch, seq)
    elif mask == "last":
        loss_mask = torch.zeros(batch, seq)
        loss_mask[:, -1] = 1
    elif mask == "none":
        loss_mask = None
    else:
        raise ValueError(f"mask: expected 'random', 'ones', 'zeros', 'last' or 'none', received {mask!r}")
    return Batch(ids, positions, labels, loss_mask)


def masked_mean(per_token: Tensor, loss_mask: Optional[Tensor]) -> Tensor:
    """The user's main-head loss: masked mean of a ``[b, s]`` per-token loss."""
    if loss_mask is None:
        return per_token.mean()
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def main_ce_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token CE ``[b, s]`` of the main head from (gathered, TP=1) ``[b, s, V]`` logits."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)
