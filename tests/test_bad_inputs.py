"""Every bad input raises ``MTPHooksError`` naming the argument, with what was expected and received;
a forward that raises leaves no stale targets behind: the next call is a clean micro-batch.

"Clean" is checked against a stock twin: an inference call returns stock's main logits without
running the MTP block, and a training call gives stock's MTP losses and every gradient.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.mcore_cpu import (
    Batch,
    TinyGPT,
    assert_same_grads,
    main_ce_from_logits,
    make_batch,
    masked_mean,
    output_layer_calls,
    stock_mtp_losses,
)

VOCAB = 64
SEQ = 8


def names(argument: str) -> str:
    """Pattern for a message that names ``argument``, then what was expected and what was received."""
    return rf"(?s)^{re.escape(argument)}\b.*\n\s*expected: \S.*\n\s*received: \S"


def hook_state(model: nn.Module) -> list[Any]:
    return [(name, len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()] + [
        sorted(vars(model))
    ]


@pytest.fixture
def model() -> nn.Module:
    return TinyGPT(mtp_num_layers=2).build(seed=3)


@pytest.fixture
def batch() -> Batch:
    return make_batch(VOCAB, seq=SEQ, seed=3)


# --------------------------------------------------------------------------- attach


ATTACH_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "loss_scale_negative": ("loss_scale", {"loss_scale": -0.1}),
    "loss_scale_nan": ("loss_scale", {"loss_scale": float("nan")}),
    "loss_scale_string": ("loss_scale", {"loss_scale": "0.3"}),
    "loss_scale_bool": ("loss_scale", {"loss_scale": True}),
    "loss_impl_unknown": ("loss_impl", {"loss_impl": "flash"}),
    "chunk_size_zero": ("chunk_size", {"chunk_size": 0}),
    "chunk_size_float": ("chunk_size", {"chunk_size": 2.5}),
    "chunk_size_bool": ("chunk_size", {"chunk_size": True}),
    "detach_encoder_int": ("detach_encoder", {"detach_encoder": 1}),
    "detach_head_string": ("detach_head", {"detach_head": "yes"}),
}


@pytest.mark.parametrize("case", list(ATTACH_CASES))
def test_attach_rejects_bad_options_and_touches_nothing(model: nn.Module, case: str) -> None:
    argument, options = ATTACH_CASES[case]
    before = hook_state(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        mtp_hooks.attach(model, **options)
    assert hook_state(model) == before
    mtp_hooks.attach(model).remove()  # nothing half-attached is left in the way


def test_attach_rejects_a_model_without_mtp_layers() -> None:
    model = TinyGPT(mtp_num_layers=None).build(seed=1)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")) as error:
        mtp_hooks.attach(model)
    assert "mtp_num_layers" in str(error.value)
    assert mtp_hooks.hooks_of(model) is None


def test_attach_rejects_something_that_is_not_an_mcore_language_model() -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")):
        mtp_hooks.attach(nn.Linear(4, 4))


def test_attaching_twice_is_refused_naming_model_expected_and_received(model: nn.Module) -> None:
    hooks = mtp_hooks.attach(model)
    before = hook_state(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")):
        mtp_hooks.attach(model)
    assert hook_state(model) == before
    assert mtp_hooks.hooks_of(model) is hooks


def test_errors_are_value_errors() -> None:
    assert issubclass(mtp_hooks.MTPHooksError, ValueError)


# --------------------------------------------------------------------------- targets


TARGET_CASES: dict[str, tuple[str, Callable[[Batch], tuple[Any, Any]]]] = {
    "labels_1d": ("labels", lambda b: (b.labels[0], None)),
    "labels_float": ("labels", lambda b: (b.labels.float(), b.loss_mask)),
    "labels_bool": ("labels", lambda b: (b.labels > 3, b.loss_mask)),
    "labels_list": ("labels", lambda b: (b.labels.tolist(), None)),
    "loss_mask_twos": ("loss_mask", lambda b: (b.labels, b.loss_mask * 2)),
    "loss_mask_fraction": ("loss_mask", lambda b: (b.labels, b.loss_mask * 0.5)),
    "loss_mask_negative": ("loss_mask", lambda b: (b.labels, -b.loss_mask)),
    "loss_mask_shape": ("loss_mask", lambda b: (b.labels, b.loss_mask[:, :-1])),
    "loss_mask_transposed": ("loss_mask", lambda b: (b.labels, b.loss_mask.t())),
    "loss_mask_list": ("loss_mask", lambda b: (b.labels, b.loss_mask.tolist())),
}


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_micro_batch_rejects_bad_targets(model: nn.Module, batch: Batch, case: str) -> None:
    argument, make = TARGET_CASES[case]
    labels, loss_mask = make(batch)
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        with hooks.micro_batch(labels=labels, loss_mask=loss_mask):
            pytest.fail("the body must not run")
    assert_clean_next_calls(model, hooks, batch)


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_model_call_rejects_bad_targets_and_stays_clean(model: nn.Module, batch: Batch, case: str) -> None:
    argument, make = TARGET_CASES[case]
    labels, loss_mask = make(batch)
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        model(*batch.model_args, labels=labels, loss_mask=loss_mask)
    assert_clean_next_calls(model, hooks, batch)


@pytest.mark.parametrize("path", ["context", "kwargs"])
@pytest.mark.parametrize("shape", [(2, SEQ - 1), (1, SEQ), (2, SEQ + 3)])
def test_labels_not_shaped_like_input_ids_are_rejected(model: nn.Module, batch: Batch, path: str, shape: tuple[int, int]) -> None:
    labels = torch.zeros(shape, dtype=torch.long)
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("labels")) as error:
        if path == "context":
            with hooks.micro_batch(labels=labels):
                model(*batch.model_args)
        else:
            model(*batch.model_args, labels=labels)
    assert str(tuple(batch.input_ids.shape)) in str(error.value) and str(shape) in str(error.value)
    assert_clean_next_calls(model, hooks, batch)


def test_loss_mask_without_labels_is_rejected(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("labels")):
        model(*batch.model_args, loss_mask=batch.loss_mask)
    assert_clean_next_calls(model, hooks, batch)


def test_nested_micro_batch_is_rejected(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        with pytest.raises(mtp_hooks.MTPHooksError, match=names("micro_batch")):
            with hooks.micro_batch(labels=batch.labels):
                pytest.fail("the body must not run")
    assert_clean_next_calls(model, hooks, batch)


def test_labels_both_in_micro_batch_and_call_are_rejected(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        with pytest.raises(mtp_hooks.MTPHooksError, match=names("labels")):
            model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    assert_clean_next_calls(model, hooks, batch)


def test_second_forward_in_one_micro_batch_is_rejected(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        model(*batch.model_args)
        with pytest.raises(mtp_hooks.MTPHooksError, match=names("micro_batch")):
            model(*batch.model_args)
    hooks.metrics()  # the first forward trained; only what follows is checked
    assert_clean_next_calls(model, hooks, batch, zero_grads=True)


# --------------------------------------------------------------------------- forwards that raise


class Boom(RuntimeError):
    pass


def raise_from(module: nn.Module) -> Any:
    def hook(_m: nn.Module, _a: tuple[Any, ...]) -> None:
        raise Boom("raised inside the forward")

    return module.register_forward_pre_hook(hook)


FAILURE_POINTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "decoder": lambda m: m.decoder,
    "first_mtp_layer": lambda m: m.mtp.layers[0],
    "last_mtp_layer": lambda m: m.mtp.layers[-1],
    "mtp_embedding": lambda m: m.embedding.word_embeddings,
}


# Inference forwards never run the MTP layers, so they can only fail in the trunk or the embedding.
FAILURE_CASES = [
    pytest.param(where, path, id=f"{where}-{path}")
    for where in FAILURE_POINTS
    for path in ("context", "kwargs", "inference")
    if path != "inference" or "mtp_layer" not in where
]


@pytest.mark.parametrize("detach", [False, True], ids=["plain", "detach_both"])
@pytest.mark.parametrize("where,path", FAILURE_CASES)
def test_a_forward_that_raises_leaves_no_stale_state(model: nn.Module, batch: Batch, where: str, path: str, detach: bool) -> None:
    hooks = mtp_hooks.attach(model, detach_encoder=detach, detach_head=detach)
    config = model.config
    handle = raise_from(FAILURE_POINTS[where](model))
    with pytest.raises(Boom):
        if path == "context":
            with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                model(*batch.model_args)
        elif path == "kwargs":
            model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        else:
            model(*batch.model_args)
    handle.remove()
    assert model.config is config
    assert model.mtp_process is True
    assert assert_clean_next_calls(model, hooks, batch)


def test_a_forward_that_raises_after_the_mtp_losses_leaves_no_metrics(model: nn.Module, batch: Batch) -> None:
    """The output layer raises after the hooks computed the MTP losses: that micro-batch never
    happened for the user, so it must not show up in ``metrics()``."""
    hooks = mtp_hooks.attach(model)

    def explode(_m: nn.Module, _a: tuple[Any, ...], _out: Any) -> None:
        raise Boom("raised after the output layer")

    handle = model.output_layer.register_forward_hook(explode)
    with pytest.raises(Boom):
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    handle.remove()
    assert hooks.metrics() == {}
    assert_clean_next_calls(model, hooks, batch)


def test_input_that_makes_mcore_raise_leaves_no_stale_state(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    bad_ids = batch.input_ids.clone()
    bad_ids[0, 0] = VOCAB + 100  # out of the embedding table
    with pytest.raises((IndexError, RuntimeError)):
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            model(bad_ids, batch.position_ids, None)
    assert_clean_next_calls(model, hooks, batch)


# --------------------------------------------------------------------------- the clean-state check


def assert_clean_next_calls(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, zero_grads: bool = False) -> bool:
    """After an error: an inference call and then a training call behave exactly like stock.

    With detach options the training reference is a twin hooked with the same options that never
    failed (stock has no detach); its logits and MTP losses are still checked against stock.
    """
    stock = TinyGPT(mtp_num_layers=2).build(seed=3)
    if zero_grads:
        model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()
    with output_layer_calls(stock) as calls:
        per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    stock_losses = stock_mtp_losses()
    stock_logits = calls[-1].transpose(0, 1)
    reference = stock
    if hooks.detach_encoder or hooks.detach_head:
        reference = TinyGPT(mtp_num_layers=2).build(seed=3)
        with mtp_hooks.attached(reference, detach_encoder=hooks.detach_encoder, detach_head=hooks.detach_head):
            ref_logits = reference(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            masked_mean(main_ce_from_logits(ref_logits, batch.labels), batch.loss_mask).backward()

    mtp_runs: list[int] = []
    probe = model.mtp.register_forward_pre_hook(lambda m, a: mtp_runs.append(1))
    try:
        logits = model(*batch.model_args)  # no labels, grad enabled: inference
        assert mtp_runs == [], "a stale target turned an inference call into a training one"
        assert torch.equal(logits.detach(), stock_logits)
        assert hooks.metrics() == {}
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            logits = model(*batch.model_args)
        assert mtp_runs == [1]
    finally:
        probe.remove()
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert torch.equal(logits.detach(), stock_logits)
    metrics = hooks.metrics()
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5)
    assert_same_grads(model, reference)
    return True
