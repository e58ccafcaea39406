"""What the function-level tests of the lean head ops share: the case sizes and fresh leaves."""

from __future__ import annotations

import torch
from torch import Tensor

TOKENS, HIDDEN, VOCAB = 10, 6, 13  # tokens, hidden size, vocabulary of one loss call


class Leaves:
    """For a dataclass case with ``hidden`` and ``weight``: copies of both as new leaves."""

    hidden: Tensor
    weight: Tensor

    def leaves(self, dtype: torch.dtype, hidden_grad: bool = True, weight_grad: bool = True) -> tuple[Tensor, Tensor]:
        return (
            self.hidden.detach().to(dtype).clone().requires_grad_(hidden_grad),
            self.weight.detach().to(dtype).clone().requires_grad_(weight_grad),
        )
