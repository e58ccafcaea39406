"""Micro-batches as training loops mix them, the wrappers they call through, and the check after an error.

Test-only support on top of the side-by-side harness ``mtp_hooks.testing.twins``:

* ``assert_next_micro_batches_like_stock``: after a refused input or a fault, the next inference
  and training micro-batches behave like stock (``mtp_block_calls`` counts MTP block calls);
* the micro-batch kinds training loops mix, each run as ``kind(model, hooks, batch)``
  (``train_context``, ``train_kwargs``, ``infer_with_grad``, ...);
* the DDP-style (``ModuleHolder``) and multimodal-style (``LanguageModelHolder``) wrappers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, assert_same_mtp_losses, hooked_train_step, main_ce_from_logits
from mtp_hooks.testing import masked_mean, stock_train_step


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
    expected = stock_train_step(stock, batch)
    reference, reference_metrics = stock, None
    if hooks.options.detach_encoder or hooks.options.detach_head:
        reference = shape.build(seed)
        same_options = dict(
            detach_encoder=hooks.options.detach_encoder, detach_head=hooks.options.detach_head, loss_impl=hooks.options.loss_impl, chunk_size=hooks.options.chunk_size
        )
        with mtp_hooks.attached(reference, **same_options) as other:
            hooked_train_step(reference, other, batch)
            reference_metrics = other.metrics()

    with mtp_block_calls(model) as calls:
        with torch.no_grad():
            no_grad_logits = model(*batch.model_args)
        logits = model(*batch.model_args)  # grad enabled, no labels: still inference
        assert calls == [], "a stale target turned an inference call into a training one"
        assert torch.equal(no_grad_logits, expected.logits) and torch.equal(logits.detach(), expected.logits)
        assert hooks.metrics() == {}
        logits = hooked_train_step(model, hooks, batch)
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
    hooked_train_step(model, hooks, batch, "context")


def train_kwargs(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """A training micro-batch, labels through ``model(..., labels=, loss_mask=)``."""
    hooked_train_step(model, hooks, batch, "kwargs")


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
