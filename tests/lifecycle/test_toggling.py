"""Toggling between training and inference micro-batches, nesting, and use from several threads.

A forward trains MTP only when it was given labels (``micro_batch`` or ``labels=``) and gradients
are enabled. Labels never outlive their ``micro_batch``, so a forward without labels after a
training one is an inference micro-batch: the MTP block does not run, MTP parameters get no
gradient, and no metrics are recorded. The reference for every sequence is a stock twin that
runs a training step for each training micro-batch and a main-loss-only step (MTP weight 0) for
each inference micro-batch that is backpropagated.

Threads: one hooks object is used by one thread at a time. While a ``micro_batch`` is open or a
forward is in flight, a ``micro_batch`` or forward of the same model from another thread raises
``MTPHooksError``; the owner's micro-batch is unaffected. Using the hooks from different
threads one after another is fine.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import Batch, TinyGPT, Twins, assert_same_grads, assert_same_mtp_losses, build_twins, grads_of, main_ce_from_logits
from mtp_hooks.testing import make_batch, masked_mean, stock_main_only_step, stock_mtp_losses, stock_train_step
from tests.support.micro_batches import assert_next_micro_batches_like_stock, infer_inference_mode, infer_no_grad_with_labels
from tests.support.micro_batches import infer_with_grad, mtp_block_calls, train_context, train_kwargs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 32
SHAPE = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_attention_heads=2, mtp_num_layers=2)


def twins() -> tuple[nn.Module, nn.Module]:
    return SHAPE.build(3), SHAPE.build(3)


def user_loss(logits: Tensor, batch: Batch) -> Tensor:
    return masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask)


def mtp_grads(model: nn.Module) -> dict[str, Optional[Tensor]]:
    return {name: grad for name, grad in grads_of(model).items() if name.startswith("mtp.")}


# --------------------------------------------------------------------- micro-batch kinds

# Each kind: (hooked step, stock step or None if nothing is backpropagated, trains MTP?)
Step = Callable[[nn.Module, mtp_hooks.MTPHooks, Batch], None]


def infer_eval_no_labels(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    model.eval()
    try:
        user_loss(model(*batch.model_args), batch).backward()
    finally:
        model.train()


KINDS: dict[str, tuple[Step, Optional[Callable[[nn.Module, Batch], Any]], bool]] = {
    "train_context": (train_context, stock_train_step, True),
    "train_kwargs": (train_kwargs, stock_train_step, True),
    "infer_with_grad": (infer_with_grad, stock_main_only_step, False),
    "infer_no_grad_with_labels": (infer_no_grad_with_labels, None, False),
    "infer_inference_mode": (infer_inference_mode, None, False),
    "infer_eval_no_labels": (infer_eval_no_labels, stock_main_only_step, False),
}

SEQUENCES = [
    ["train_context", "infer_with_grad"],
    ["train_kwargs", "infer_with_grad", "train_context"],
    ["train_context", "infer_no_grad_with_labels", "infer_with_grad", "train_kwargs", "infer_inference_mode", "infer_eval_no_labels"],
    ["infer_with_grad", "train_context", "train_context", "infer_eval_no_labels", "infer_with_grad"],
]


@pytest.mark.parametrize("sequence", SEQUENCES, ids=["-".join(s) for s in SEQUENCES])
def test_forward_without_labels_after_training_never_trains_mtp(sequence: list[str]) -> None:
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    for i, kind in enumerate(sequence):
        step, stock_step, trains = KINDS[kind]
        batch = make_batch(VOCAB, seed=i)
        before = {name: None if g is None else g.clone() for name, g in mtp_grads(hooked).items()}
        with mtp_block_calls(hooked) as calls:
            step(hooked, hooks, batch)
        metrics = hooks.metrics()
        if stock_step is not None:
            stock_step(stock, batch)
        stock_losses = stock_mtp_losses()
        if trains:
            assert calls == [1], kind
            assert metrics["mtp_1/tokens"] == batch.loss_mask[:, 1:].sum().item()
            assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5)
        else:
            assert calls == [], f"{kind}: the MTP block ran"
            assert metrics == {}, f"{kind}: recorded metrics"
            for name, grad in mtp_grads(hooked).items():
                old = before[name]
                assert (grad is None and old is None) or torch.equal(grad, old), f"{kind}: {name} got a gradient"
        assert_same_grads(hooked, stock)


def test_training_after_inference_mode_works() -> None:
    """Nothing created under ``inference_mode`` (metrics, cached tensors) leaks into a later training micro-batch."""
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    batch = make_batch(VOCAB)
    with torch.inference_mode():
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            hooked(*batch.model_args)
    train_context(hooked, hooks, batch)
    stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)
    metrics = hooks.metrics()
    assert [metrics[f"mtp_{k}/loss"] for k in (1, 2)] == pytest.approx(stock_mtp_losses(), rel=1e-5)


# --------------------------------------------------------------------------- nesting


def assert_refusal_left_stock_with_hooks(hooked: nn.Module, hooks: mtp_hooks.MTPHooks, config: TransformerConfig) -> None:
    """After a refused call: the real config and ``mtp_process`` are back, and the next micro-batches
    (inference, then training from zero gradients) behave like a fresh stock twin."""
    assert hooked.config is config and type(hooked.config) is TransformerConfig and hooked.mtp_process is True
    hooked.zero_grad(set_to_none=True)
    assert_next_micro_batches_like_stock(hooked, hooks, SHAPE, 3, make_batch(VOCAB, seed=5))


def assert_backward_like_stock(twins: Twins, logits: Tensor, batch: Batch) -> dict[str, float]:
    """Backward of the user's loss from the open micro-batch's ``logits``: logits, MTP losses and every
    gradient equal a stock training step on the same batch. Returns the hooks' metrics."""
    assert twins.hooks is not None
    user_loss(logits, batch).backward()
    stock = twins.stock_step(batch)
    assert torch.equal(logits.detach(), stock.logits)
    metrics = twins.hooks.metrics()
    assert_same_mtp_losses(metrics, stock.mtp_losses)
    twins.assert_same_grads()
    return metrics


def test_nested_micro_batch_is_refused_and_outer_still_trains() -> None:
    twins = build_twins(SHAPE, 3)
    hooked, hooks, config = twins.hooked, twins.hooks, twins.hooked.config
    assert hooks is not None
    batch, other = make_batch(VOCAB, seed=0), make_batch(VOCAB, seed=1)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="^micro_batch: refused\n.*\n  received: a nested micro_batch"):
            with hooks.micro_batch(other.labels, other.loss_mask):
                pytest.fail("nested micro_batch was accepted")
        logits = hooked(*batch.model_args)  # the outer targets are still the ones in effect
    assert_backward_like_stock(twins, logits, batch)
    assert_refusal_left_stock_with_hooks(hooked, hooks, config)


def test_second_forward_in_one_micro_batch_is_refused() -> None:
    twins = build_twins(SHAPE, 3)
    hooked, hooks, config = twins.hooked, twins.hooks, twins.hooked.config
    assert hooks is not None
    batch = make_batch(VOCAB)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args)
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="^model: refused\n.*\n  received: a second training forward inside the same micro_batch"):
            hooked(*batch.model_args)
        assert hooked.config is config and hooked.mtp_process is True
    metrics = assert_backward_like_stock(twins, logits, batch)  # the first forward's graph is intact
    assert metrics["mtp_1/tokens"] == batch.loss_mask[:, 1:].sum().item()
    assert_refusal_left_stock_with_hooks(hooked, hooks, config)


def test_labels_in_both_micro_batch_and_call_are_refused() -> None:
    hooked, _ = twins()
    config = hooked.config
    hooks = mtp_hooks.attach(hooked)
    batch = make_batch(VOCAB)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with pytest.raises(mtp_hooks.MTPHooksError, match="^labels: bad value\n  expected: .*not both\n  received: "):
            hooked(*batch.model_args, labels=batch.labels)
    assert hooks.metrics() == {}
    assert_refusal_left_stock_with_hooks(hooked, hooks, config)


# --------------------------------------------------------------------------- threads


def in_thread(fn: Callable[[], Any]) -> Optional[BaseException]:
    """Run ``fn`` in a new thread, wait for it, and return what it raised (or ``None``)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            raised.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


THREAD_MESSAGE = "one thread at a time on these hooks"


def test_micro_batch_from_another_thread_is_refused_while_one_is_open() -> None:
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    batch, other = make_batch(VOCAB, seed=0), make_batch(VOCAB, seed=1)

    def open_other() -> None:
        with hooks.micro_batch(other.labels, other.loss_mask):
            pass

    with hooks.micro_batch(batch.labels, batch.loss_mask):
        error = in_thread(open_other)
        assert isinstance(error, mtp_hooks.MTPHooksStateError) and THREAD_MESSAGE in str(error), error
        logits = hooked(*batch.model_args)
    user_loss(logits, batch).backward()
    stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)


def test_forward_from_another_thread_never_takes_open_micro_batch_labels() -> None:
    """Without the refusal, the other thread's inference forward would train on these labels."""
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    batch, other = make_batch(VOCAB, seed=0), make_batch(VOCAB, seed=1)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with mtp_block_calls(hooked) as calls:
            error = in_thread(lambda: hooked(*other.model_args))
        assert error is None, error  # the other thread's forward is inference: it never sees these targets
        assert calls == []
        logits = hooked(*batch.model_args)
    user_loss(logits, batch).backward()
    stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)
    assert hooks.metrics()["mtp_1/tokens"] == batch.loss_mask[:, 1:].sum().item()


@pytest.mark.parametrize("other_has_labels", [False, True])
def test_forward_from_another_thread_is_refused_while_one_is_in_flight(other_has_labels: bool) -> None:
    """The other thread's forward starts while this thread's forward is inside the decoder."""
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    batch, other = make_batch(VOCAB, seed=0), make_batch(VOCAB, seed=1)
    errors: list[Optional[BaseException]] = []

    def other_forward() -> None:
        if other_has_labels:
            hooked(*other.model_args, labels=other.labels, loss_mask=other.loss_mask)
        else:
            hooked(*other.model_args)

    def during_decoder(*_: Any) -> None:
        if not errors:
            errors.append(in_thread(other_forward))

    handle = hooked.decoder.register_forward_hook(during_decoder)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args)
    handle.remove()
    assert len(errors) == 1
    assert isinstance(errors[0], mtp_hooks.MTPHooksStateError) and THREAD_MESSAGE in str(errors[0]), errors[0]
    user_loss(logits, batch).backward()
    stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)

    # once the first thread is done, the other thread may use the hooks
    error = in_thread(lambda: train_context(hooked, hooks, other))
    assert error is None, error
    stock_train_step(stock, other)
    assert_same_grads(hooked, stock)
    assert type(hooked.config) is TransformerConfig and hooked.mtp_process is True


def test_threads_taking_turns_are_allowed() -> None:
    hooked, stock = twins()
    hooks = mtp_hooks.attach(hooked)
    batches = [make_batch(VOCAB, seed=seed) for seed in range(4)]
    for i, batch in enumerate(batches):
        if i % 2:
            assert in_thread(lambda b=batch: train_context(hooked, hooks, b)) is None
        else:
            train_context(hooked, hooks, batch)
        stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)
    assert hooks.metrics()["mtp_1/tokens"] == sum(b.loss_mask[:, 1:].sum().item() for b in batches)
