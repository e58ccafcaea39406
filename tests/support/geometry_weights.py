"""Weights on which the draft geometries differ: test-only support for the engine geometry's tests.

At a tiny model's default initialisation (std 0.02, norms at 1) the chain and the engine geometry draft alike at
every start and their losses are 2e-4 apart, so a test of the engine geometry scales the matrices up and moves the
norm weights off 1 (``spread``).
"""

from __future__ import annotations

import torch
from torch import nn


def spread(model: nn.Module, scale: float, seed: int = 12) -> nn.Module:
    """``model`` with every matrix times ``scale`` and every norm weight drawn from [0.3, 2.8); returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.mul_(scale)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(0.3 + 2.5 * torch.rand(param.shape, generator=generator))
    return model
