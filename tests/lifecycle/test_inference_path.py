"""Inference micro-batches: no labels, or gradients disabled. Logits only, the MTP block never runs."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, build_twins, grads_of, make_batch, output_layer_calls
from mtp_hooks.testing import stock_main_only_step
from tests.support.micro_batches import infer_with_grad, train_kwargs

VOCAB = 64


def stock_main_logits(model: nn.Module, batch: Batch) -> Tensor:
    """Main-head logits ``[b, s, V]`` of stock mcore (last output-layer call), without backward."""
    with torch.no_grad(), output_layer_calls(model) as calls:
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    MTPLossLoggingHelper.tracker.clear()
    return calls[-1].transpose(0, 1)


@contextlib.contextmanager
def mtp_calls(model: nn.Module) -> Iterator[list[str]]:
    """Record, with forward pre-hooks, every call of the MTP block and of each MTP layer."""
    calls: list[str] = []
    modules = [("mtp", model.mtp)] + [(f"mtp.layers.{i}", layer) for i, layer in enumerate(model.mtp.layers)]
    handles = [m.register_forward_pre_hook(lambda _m, _a, name=name: calls.append(name)) for name, m in modules]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def no_labels(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    return model(*batch.model_args)


def no_grad_micro_batch(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    with torch.no_grad(), hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        return model(*batch.model_args)


def no_grad_kwargs(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    with torch.no_grad():
        return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def inference_mode_kwargs(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    with torch.inference_mode():
        return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def eval_no_labels(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(*batch.model_args)
    finally:
        model.train()


CALLS: dict[str, Callable[[nn.Module, mtp_hooks.MTPHooks, Batch], Tensor]] = {
    "no_labels": no_labels,
    "no_grad_micro_batch": no_grad_micro_batch,
    "no_grad_kwargs": no_grad_kwargs,
    "inference_mode_kwargs": inference_mode_kwargs,
    "eval_no_labels": eval_no_labels,
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("call", list(CALLS))
def test_inference_returns_stock_logits_and_mtp_block_never_runs(call: str, tied: bool) -> None:
    twins = build_twins(TinyGPT(mtp_num_layers=2, tied=tied), seed=11)
    hooked, hooks, config = twins.hooked, twins.hooks, twins.hooked.config
    assert hooks is not None
    batch = make_batch(VOCAB, seq=10, seed=3)
    expected = stock_main_logits(twins.stock, batch)

    with mtp_calls(hooked) as calls, output_layer_calls(hooked) as head_calls:
        logits = CALLS[call](hooked, hooks, batch)

    assert logits.shape == (2, 10, VOCAB)
    assert torch.equal(logits, expected)
    assert calls == [], f"MTP modules ran: {calls}"
    assert len(head_calls) == 1, "only the main head may run"
    assert hooks.metrics() == {}
    assert MTPLossLoggingHelper.tracker == {}
    assert hooked.config is config
    assert hooked.mtp_process is True


def test_labels_free_forward_with_grad_trains_only_the_main_model() -> None:
    """No labels but gradients on: the user's loss on the logits trains the trunk and head exactly
    as stock does when its MTP loss weighs 0; MTP parameters get no gradient at all."""
    twins = build_twins(TinyGPT(mtp_num_layers=2), seed=4)
    hooked, hooks = twins.hooked, twins.hooks
    assert hooks is not None
    batch = make_batch(VOCAB, seq=10, seed=4)
    stock_main_only_step(twins.stock, batch)
    with mtp_calls(hooked) as calls:
        infer_with_grad(hooked, hooks, batch)

    assert calls == []
    grads = grads_of(hooked)
    assert all(grads[name] is None for name in grads if name.startswith("mtp.")), "MTP parameters got gradients"
    assert all(grads[name] is not None for name in grads if not name.startswith("mtp."))
    twins.assert_same_grads()
    assert hooks.metrics() == {}


def test_inference_micro_batches_between_training_ones_leave_metrics_and_mtp_grads_alone() -> None:
    """Only training micro-batches count in the metrics and reach the MTP parameters."""
    spec = TinyGPT(mtp_num_layers=2)
    hooked, reference = spec.build(seed=9), spec.build(seed=9)
    train = make_batch(VOCAB, seq=10, seed=1)
    infer = make_batch(VOCAB, seq=10, seed=2)
    hooks = mtp_hooks.attach(hooked)
    ref_hooks = mtp_hooks.attach(reference)

    train_kwargs(hooked, hooks, train)
    with torch.no_grad():
        hooked(*infer.model_args, labels=infer.labels, loss_mask=infer.loss_mask)
    hooked(*infer.model_args)  # grad-enabled, labels-free: logits unused, nothing backpropagated
    train_kwargs(reference, ref_hooks, train)

    assert hooks.metrics() == ref_hooks.metrics()
    assert_same_grads(hooked, reference, atol=0, rtol=0)


def test_inference_forward_leaves_every_model_attribute_as_it_was() -> None:
    """The flag and config swapped for an inference forward are put back: same keys, same objects."""
    model = TinyGPT(mtp_num_layers=1).build(seed=2)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seq=8)
    before: dict[str, Any] = dict(model.__dict__)
    with torch.no_grad():
        model(*batch.model_args)
    assert model.__dict__.keys() == before.keys()
    assert all(model.__dict__[k] is v for k, v in before.items() if k not in ("_parameters", "_buffers", "_modules"))
    hooks.remove()
