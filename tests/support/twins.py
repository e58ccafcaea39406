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

Also here: ``assert_next_micro_batches_like_stock`` (after a refused input or a fault, the next
inference and training micro-batches behave like stock), the micro-batch kinds training loops mix
(``train_context``, ``infer_with_grad``, ...) and the DDP-style and multimodal-style wrappers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.support.mcore_cpu import Batch, TinyGPT, assert_same_grads, main_ce_from_logits, masked_mean, output_layer_calls
from tests.support.mcore_cpu import stock_mtp_losses

PATHS = ("context", "kwargs")


class StockRun(NamedTuple):
    """What a stock training micro-batch produced: main logits ``[b, s, V]`` and per-depth MTP losses."""

    logits: Tensor
    mtp_losses: list[float]


@dataclasses.dataclass
class TwinStep:
    """One side-by-side micro-batch: the stock run, the hooked logits and the hooks' metrics."""

    stock: StockRun
    logits: Tensor
    metrics: dict[str, float]


def unwrapped(model: nn.Module) -> nn.Module:
    """The language model inside DDP-style (``.module``) or multimodal-style (``.language_model``) wrappers."""
    while not hasattr(model, "output_layer"):
        model = getattr(model, "module", None) or model.language_model
    return model


def stock_step(model: nn.Module, batch: Batch) -> StockRun:
    """Stock training step: backward of the masked mean of mcore's per-token loss.

    Empties mcore's MTP tracker first, so that the losses returned are this step's alone (hooked
    twins record into the same process-wide tracker).
    """
    stock_mtp_losses()
    with output_layer_calls(unwrapped(model)) as calls:
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
        self.stock.zero_grad(set_to_none=True)
        self.hooked.zero_grad(set_to_none=True)


@contextlib.contextmanager
def mtp_block_calls(model: nn.Module) -> Iterator[list[int]]:
    """Record a ``1`` for every call of the MTP block while the context is open."""
    calls: list[int] = []
    handle = model.mtp.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def assert_next_micro_batches_like_stock(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, shape: TinyGPT, seed: int, batch: Batch
) -> None:
    """After an error: forwards without labels are inference with stock's logits, then training equals stock.

    The reference is a fresh stock twin built from ``shape`` and ``seed`` (the weights ``model``
    had when it was built, so ``model`` must not have taken an optimizer step). With detach
    options the gradient reference is a twin hooked with the same options that never failed
    (stock has no detach); logits and MTP losses are still checked against stock. The
    caller clears ``model``'s gradients first if an earlier forward left some.
    """
    MTPLossLoggingHelper.tracker.clear()
    stock = shape.build(seed)
    expected = stock_step(stock, batch)
    reference, reference_metrics = stock, None
    if hooks.options.detach_encoder or hooks.options.detach_head:
        reference = shape.build(seed)
        same_options = dict(
            detach_encoder=hooks.options.detach_encoder, detach_head=hooks.options.detach_head, loss_impl=hooks.options.loss_impl, chunk_size=hooks.options.chunk_size
        )
        with mtp_hooks.attached(reference, **same_options) as other:
            hooked_step(reference, other, batch)
            reference_metrics = other.metrics()

    with mtp_block_calls(model) as calls:
        with torch.no_grad():
            no_grad_logits = model(*batch.model_args)
        logits = model(*batch.model_args)  # grad enabled, no labels: still inference
        assert calls == [], "a stale target turned an inference call into a training one"
        assert torch.equal(no_grad_logits, expected.logits) and torch.equal(logits.detach(), expected.logits)
        assert hooks.metrics() == {}
        logits = hooked_step(model, hooks, batch)
        assert calls == [1], "a training micro-batch did not run the MTP block once"
    assert torch.equal(logits, expected.logits)
    metrics = hooks.metrics()
    assert_same_mtp_losses(metrics, expected.mtp_losses)
    if reference_metrics is not None:
        assert metrics == pytest.approx(reference_metrics)
    assert_same_grads(model, reference)


class ModuleHolder(nn.Module):
    """A DDP-style wrapper (like DDP and mcore's ``Float16Module``) exposing the model as ``.module``."""

    def __init__(self, module: Optional[nn.Module]) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.module is not None
        return self.module(*args, **kwargs)


class LanguageModelHolder(nn.Module):
    """A multimodal-style model exposing its GPTModel as ``.language_model``."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.language_model(*args, **kwargs)


# --------------------------------------------------------------------------- micro-batch kinds
# Each runs one micro-batch of a kind that training loops mix, as ``kind(model, hooks, batch)``.


def train_context(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """A training micro-batch, labels through ``micro_batch``."""
    hooked_step(model, hooks, batch, "context")


def train_kwargs(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """A training micro-batch, labels through ``model(..., labels=, loss_mask=)``."""
    hooked_step(model, hooks, batch, "kwargs")


def infer_with_grad(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """No labels, grad enabled, main loss backpropagated (a reference-free main-head update)."""
    masked_mean(main_ce_from_logits(model(*batch.model_args), batch.labels), batch.loss_mask).backward()


def infer_no_grad_with_labels(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """Labels through ``micro_batch`` but gradients disabled: an inference micro-batch."""
    with torch.no_grad(), hooks.micro_batch(batch.labels, batch.loss_mask):
        model(*batch.model_args)


def infer_inference_mode(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """Labels through the call under ``torch.inference_mode()``: an inference micro-batch."""
    with torch.inference_mode():
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
