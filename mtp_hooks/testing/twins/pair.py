"""Twins: a stock model and a hooked model with the same weights, and the one-call check of a step.

``build_twins`` builds one shape twice with one seed, checks that the two builds hold the same
parameters, and attaches ``mtp_hooks`` to the second. ``Twins.assert_step_matches`` runs one
training micro-batch on both and checks main logits (bit-identical), per-depth MTP losses and
every parameter's gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing.twins.batches import Batch
from mtp_hooks.testing.twins.compare import assert_same_grads, assert_same_mtp_losses
from mtp_hooks.testing.twins.steps import StockRun, hooked_train_step, stock_train_step

__all__ = ["ModelShape", "TwinStep", "Twins", "build_twins"]


class ModelShape(Protocol):
    """What ``build_twins`` needs of a shape (``TinyGPT``, ``TinyQwen``, ``TinyDeepSeek``, ...)."""

    def build(self, seed: int = ...) -> nn.Module: ...


@dataclasses.dataclass
class TwinStep:
    """One side-by-side micro-batch: the stock run, the hooked logits and the hooks' metrics."""

    stock: StockRun
    logits: Tensor
    metrics: dict[str, float]


@dataclasses.dataclass(eq=False)
class Twins:
    """Two builds of one shape and seed: ``stock`` stays stock mcore, ``hooked`` carries ``hooks``.

    ``called`` is what a hooked step calls: ``hooked`` itself, or the wrapper around it
    (``build_twins(wrap=...)``). ``hooks`` is ``None`` until ``attach`` where the twins were built
    with ``attach=False``.
    """

    stock: nn.Module
    hooked: nn.Module
    called: nn.Module
    hooks: Optional[mtp_hooks.MTPHooks] = None

    def attach(self, **options: Any) -> mtp_hooks.MTPHooks:
        """Attach ``mtp_hooks`` with ``options`` to the hooked twin (through its wrapper, if any)."""
        self.hooks = mtp_hooks.attach(self.called, **options)
        return self.hooks

    def stock_step(self, batch: Batch) -> StockRun:
        """``stock_train_step`` of the stock twin."""
        return stock_train_step(self.stock, batch)

    def hooked_step(self, batch: Batch, path: str = "context") -> Tensor:
        """``hooked_train_step`` of the hooked twin (labels by ``path``). Returns the logits."""
        if self.hooks is None:
            raise AssertionError("Twins.hooked_step: the hooked twin has no hooks; call attach() first")
        return hooked_train_step(self.called, self.hooks, batch, path)

    def assert_step_matches(
        self, batch: Batch, path: str = "context", *, atol: float = 1e-6, rtol: float = 1e-5, loss_rel: float = 1e-5
    ) -> TwinStep:
        """Run one training micro-batch on both twins; logits bit-identical, MTP losses and every gradient equal.

        Gradients accumulate over calls as in a training loop, so several calls compare the sums.
        Returns what both sides produced (the hooks' metrics are read, so they start anew).
        """
        stock = self.stock_step(batch)
        logits = self.hooked_step(batch, path)
        assert torch.equal(logits, stock.logits.to(logits.dtype)), "main logits differ from stock"
        assert self.hooks is not None
        metrics = self.hooks.metrics()
        assert_same_mtp_losses(metrics, stock.mtp_losses, rel=loss_rel)
        self.assert_same_grads(atol=atol, rtol=rtol)
        return TwinStep(stock, logits, metrics)

    def assert_same_grads(self, atol: float = 1e-6, rtol: float = 1e-5) -> None:
        """Every parameter's gradient of the hooked twin equals the stock twin's."""
        assert_same_grads(self.hooked, self.stock, atol=atol, rtol=rtol)

    def zero_grad(self) -> None:
        """Drop both twins' gradients (``set_to_none``)."""
        self.stock.zero_grad(set_to_none=True)
        self.hooked.zero_grad(set_to_none=True)


def _assert_same_parameters(stock: nn.Module, hooked: nn.Module, what: str) -> None:
    theirs = dict(hooked.named_parameters())
    for name, parameter in stock.named_parameters():
        twin = theirs.pop(name, None)
        if twin is None or twin.shape != parameter.shape or not bool((twin == parameter).all()):
            raise AssertionError(f"build_twins: the two builds of {what} differ at parameter {name!r}")
    if theirs:
        raise AssertionError(f"build_twins: the second build of {what} has extra parameters {sorted(theirs)}")


def build_twins(
    shape: ModelShape,
    seed: int = 1234,
    *,
    stock_shape: Optional[ModelShape] = None,
    wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
    attach: bool = True,
    **options: Any,
) -> Twins:
    """Build ``shape`` twice with ``seed`` and attach ``mtp_hooks`` (``options``) to the second build.

    Args:
        shape: the model shape both twins are built from (``build(seed)``).
        seed: the build seed (the same for both, so the weights are equal).
        stock_shape: a different shape for the stock twin with the same parameters (e.g. another
            ``mtp_loss_scaling_factor``).
        wrap: applied to the hooked build before ``attach`` (DDP-style or mcore wrappers); the
            unwrapped model stays ``hooked``, the wrapper is ``called``.
        attach: ``False`` builds the hooked twin without hooks (attach later with ``Twins.attach``).
        options: ``mtp_hooks.attach`` options.

    Raises:
        AssertionError: the two builds differ in a parameter's name, shape or value (the
            shape's build is not deterministic, so no side-by-side check could be trusted).
    """
    stock, hooked = (stock_shape or shape).build(seed), shape.build(seed)
    _assert_same_parameters(stock, hooked, type(shape).__name__)
    twins = Twins(stock, hooked, hooked if wrap is None else wrap(hooked))
    if attach:
        twins.attach(**options)
    return twins
