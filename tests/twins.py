"""The side-by-side harness: a stock mcore model and a hooked twin, one micro-batch, one comparison.

Stock mcore is the reference. Both twins are built from the same ``TinyGPT`` shape and seed, so
their weights are identical. On a training micro-batch:

* stock is called with ``labels``: it returns the per-token main loss and adds its MTP loss
  itself; its per-depth MTP losses land in mcore's tracker, and its main logits are read with a
  plain forward hook on the output layer (the last call of a training forward is the main head);
* the hooked twin returns logits; the user computes the same masked-mean CE from them.

``Twins.assert_step_matches`` runs both and checks main logits (bit-identical), per-depth MTP
losses and every parameter's gradient with one call. The step functions are usable on their own
for tests whose reference is something else (a never-hooked twin, a hooked twin without faults).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from tests.mcore_cpu import Batch, TinyGPT, assert_same_grads, main_ce_from_logits, masked_mean, output_layer_calls
from tests.mcore_cpu import stock_mtp_losses

PATHS = ("context", "kwargs")


@dataclasses.dataclass
class StockRun:
    """What a stock training micro-batch produced: main logits ``[b, s, V]`` and per-depth MTP losses."""

    logits: Tensor
    mtp_losses: list[float]


def stock_step(model: nn.Module, batch: Batch) -> StockRun:
    """Stock training step: backward of the masked mean of mcore's per-token loss."""
    with output_layer_calls(model) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    return StockRun(calls[-1].transpose(0, 1), stock_mtp_losses())


def hooked_forward(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, path: str = "context") -> Tensor:
    """One hooked training forward, labels through the ``micro_batch`` context or the ``labels=`` kwargs."""
    if path == "context":
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            return model(*batch.model_args)
    if path != "kwargs":
        raise AssertionError(f"path: expected one of {PATHS}, received {path!r}")
    return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def hooked_step(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, path: str = "context") -> Tensor:
    """Hooked training step: backward of the user's masked CE from the returned logits. Returns the logits."""
    logits = hooked_forward(model, hooks, batch, path)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return logits.detach()


def hooked_mtp_losses(metrics: dict[str, float], depth: int) -> list[float]:
    """The per-depth MTP losses in a ``hooks.metrics()`` dict, depth 1 first."""
    return [metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)]


def assert_same_mtp_losses(metrics: dict[str, float], stock: list[float], rel: float = 1e-5, abs: float = 1e-6) -> None:
    """The hooks' per-depth MTP losses equal the ones stock recorded (one per depth, none missing)."""
    assert stock, "stock recorded no MTP loss"
    assert sorted(k for k in metrics if k.endswith("/loss") and k.startswith("mtp_")) == sorted(
        f"mtp_{k}/loss" for k in range(1, len(stock) + 1)
    ), f"hooks report {sorted(metrics)}, stock recorded {len(stock)} depths"
    assert hooked_mtp_losses(metrics, len(stock)) == pytest.approx(stock, rel=rel, abs=abs)


class Twins:
    """A stock model and a hooked model with the same weights.

    Args:
        shape: the model shape both twins are built from.
        seed: the build seed (the same for both, so the weights are equal).
        stock_shape: a different shape for the stock twin (e.g. another ``mtp_loss_scaling_factor``).
        wrap: applied to the hooked model before ``attach`` (DDP-style or mcore wrappers); the
            unwrapped model stays ``self.hooked``, the wrapper is ``self.called``.
        attach: ``False`` builds the hooked twin without hooks (attach later with ``self.attach``).
        options: ``mtp_hooks.attach`` options.
    """

    def __init__(
        self,
        shape: TinyGPT,
        seed: int = 1234,
        *,
        stock_shape: Optional[TinyGPT] = None,
        wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
        attach: bool = True,
        **options: Any,
    ) -> None:
        self.stock = (stock_shape or shape).build(seed)
        self.hooked = shape.build(seed)
        self.called: nn.Module = self.hooked if wrap is None else wrap(self.hooked)
        self.hooks: Optional[mtp_hooks.MTPHooks] = None
        if attach:
            self.attach(**options)

    def attach(self, **options: Any) -> mtp_hooks.MTPHooks:
        self.hooks = mtp_hooks.attach(self.called, **options)
        return self.hooks

    def stock_step(self, batch: Batch) -> StockRun:
        return stock_step(self.stock, batch)

    def hooked_step(self, batch: Batch, path: str = "context") -> Tensor:
        if self.hooks is None:
            raise AssertionError("Twins.hooked_step: the hooked twin has no hooks; call attach() first")
        return hooked_step(self.called, self.hooks, batch, path)

    def assert_step_matches(
        self,
        batch: Batch,
        path: str = "context",
        *,
        atol: float = 1e-6,
        rtol: float = 1e-5,
        loss_rel: float = 1e-5,
    ) -> tuple[StockRun, Tensor]:
        """Run one training micro-batch on both twins; logits bit-identical, MTP losses and every gradient equal.

        Gradients accumulate over calls as in a training loop, so several calls compare the sums.
        Returns the stock run and the hooked logits for further checks.
        """
        stock = self.stock_step(batch)
        logits = self.hooked_step(batch, path)
        assert torch.equal(logits, stock.logits.to(logits.dtype)), "main logits differ from stock"
        assert self.hooks is not None
        assert_same_mtp_losses(self.hooks.metrics(), stock.mtp_losses, rel=loss_rel)
        self.assert_same_grads(atol=atol, rtol=rtol)
        return stock, logits

    def assert_same_grads(self, atol: float = 1e-6, rtol: float = 1e-5) -> None:
        """Every parameter's gradient of the hooked twin equals the stock twin's."""
        assert_same_grads(self.hooked, self.stock, atol=atol, rtol=rtol)

    def zero_grad(self) -> None:
        self.stock.zero_grad(set_to_none=True)
        self.hooked.zero_grad(set_to_none=True)
