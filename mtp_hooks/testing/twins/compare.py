"""The comparisons of a side-by-side step: every parameter's gradient and the per-depth MTP losses.

Gradients are compared by parameter name, within ``torch.testing.assert_close`` tolerances (a
``None`` gradient matches ``None`` or zeros). The hooks' per-depth MTP losses (``hooks.metrics()``)
are compared with the ones stock mcore recorded in its tracker (``StockRun.mtp_losses``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["assert_same_grads", "assert_same_mtp_losses", "grads_of", "hooked_mtp_losses"]


def grads_of(model: nn.Module) -> dict[str, Optional[Tensor]]:
    """A copy of every parameter's ``.grad`` (``None`` where it has none), by parameter name."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_same_grads(actual: nn.Module, expected: nn.Module, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Every parameter's gradient of ``actual`` equals ``expected``'s (None matches None or zeros)."""
    expected_grads = grads_of(expected)
    for name, grad in grads_of(actual).items():
        ref = expected_grads[name]
        if ref is None or grad is None:
            other = grad if ref is None else ref
            assert other is None or not other.any(), f"{name}: one gradient is None, the other is not zero"
            continue
        torch.testing.assert_close(grad, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def hooked_mtp_losses(metrics: dict[str, float], depth: int) -> list[float]:
    """The per-depth MTP losses in a ``hooks.metrics()`` dict, depth 1 first (NaN for a depth it lacks)."""
    return [metrics.get(f"mtp_{k}/loss", float("nan")) for k in range(1, depth + 1)]


def assert_same_mtp_losses(metrics: dict[str, float], stock: list[float], rel: float = 1e-5, abs: float = 1e-6) -> None:
    """The hooks' per-depth MTP losses equal the ones stock recorded (one per depth, none missing).

    Equal means ``|hooked - stock| <= max(rel * |stock|, abs)`` for every depth.
    """
    assert stock, "stock recorded no MTP loss"
    reported = sorted(k for k in metrics if k.endswith("/loss") and k.startswith("mtp_"))
    expected_keys = sorted(f"mtp_{k}/loss" for k in range(1, len(stock) + 1))
    assert reported == expected_keys, f"hooks report {sorted(metrics)}, stock recorded {len(stock)} depths"
    hooked = hooked_mtp_losses(metrics, len(stock))
    for depth, (ours, theirs) in enumerate(zip(hooked, stock), start=1):
        close = ours == theirs or math.fabs(ours - theirs) <= max(rel * math.fabs(theirs), abs)
        assert close, (
            f"MTP loss of depth {depth}: hooks {ours}, stock {theirs} (rel={rel}, abs={abs}); all: {hooked} vs {stock}"
        )
