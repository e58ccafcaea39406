"""What the hooks verify about the targets a user hands them, before a forward uses them."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from mtp_hooks.errors import bad_argument, describe


def check_targets(labels: Any, loss_mask: Any) -> None:
    """Refuse labels that are not a ``[b, s]`` integer tensor, and masks not shaped like them or not 0/1."""
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise bad_argument("labels", "a [b, s] integer tensor", describe(labels))
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise bad_argument("labels", "an integer dtype (token ids)", describe(labels))
    if loss_mask is not None:
        if not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape:
            raise bad_argument("loss_mask", f"None or a tensor shaped like labels {tuple(labels.shape)}", describe(loss_mask))
        if loss_mask.dtype != torch.bool and not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
            raise bad_argument("loss_mask", "values in {0, 1}", f"{describe(loss_mask)} with other values")


def check_label_range(labels: Tensor, loss_mask: Optional[Tensor], vocab_size: int) -> None:
    """Refuse a label outside ``[0, vocab_size)`` where the mask counts it (one device sync):
    mcore's CE would silently treat it as a zero logit."""
    outside = (labels < 0) | (labels >= vocab_size)
    if loss_mask is not None:
        outside &= loss_mask != 0
    if bool(outside.any()):
        raise bad_argument("labels", f"token ids in [0, {vocab_size}) where loss_mask is 1", "ids outside the vocabulary")
