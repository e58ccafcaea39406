"""A per-micro-batch MTP weight: ``micro_batch(..., loss_scale=)`` and the ``call_loss_scale`` option.

Reference: stock mcore whose ``mtp_loss_scaling_factor`` is the hooks' total weight times the
micro-batch's multiplier (the same weights, the same batch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mtp_hooks
from mtp_hooks.testing import TinyGPT, assert_same_grads, hooked_train_step, main_ce_from_logits, make_batch, masked_mean, stock_train_step

VOCAB = 48
SHAPE = TinyGPT(vocab_size=VOCAB)  # mtp_loss_scaling_factor 0.3


def stock_with_factor(factor: float) -> TinyGPT:
    return dataclasses.replace(SHAPE, config_overrides={"mtp_loss_scaling_factor": factor})


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("scale", [0.5, torch.tensor(2.5)], ids=["float", "tensor"])
def test_micro_batch_loss_scale_multiplies_the_mtp_weight(loss_impl: str, scale: object) -> None:
    batch = make_batch(VOCAB, seq=10, seed=3)
    stock, hooked = stock_with_factor(0.3 * float(scale)).build(4), SHAPE.build(4)  # type: ignore[arg-type]
    stock_train_step(stock, batch)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    with hooks.micro_batch(batch.labels, batch.loss_mask, loss_scale=scale):
        logits = hooked(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(hooked, stock)


def test_loss_scale_zero_gates_mtp_off_and_the_next_micro_batch_has_full_weight() -> None:
    batch = make_batch(VOCAB, seq=10, seed=5)
    hooked, stock = SHAPE.build(6), SHAPE.build(6)
    hooks = mtp_hooks.attach(hooked)
    with hooks.micro_batch(batch.labels, batch.loss_mask, loss_scale=0.0):
        logits = hooked(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert all(p.grad is None or not p.grad.any() for n, p in hooked.named_parameters() if n.startswith("mtp."))
    hooked.zero_grad(set_to_none=True)
    hooked_train_step(hooked, hooks, batch)  # no loss_scale: the configured weight again
    stock_train_step(stock, batch)
    assert_same_grads(hooked, stock)


def test_call_loss_scale_reads_the_forward_arguments_and_multiplies_micro_batch_loss_scale() -> None:
    batch = make_batch(VOCAB, seq=10, seed=7)
    stock, hooked = stock_with_factor(0.3 * 2.0 * 0.25).build(8), SHAPE.build(8)
    stock_train_step(stock, batch)
    seen = []

    def from_call(call: dict) -> float:
        seen.append(sorted(k for k, v in call.items() if v is not None))
        return 0.25

    hooks = mtp_hooks.attach(hooked, call_loss_scale=from_call)
    with hooks.micro_batch(batch.labels, batch.loss_mask, loss_scale=2.0):
        logits = hooked(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(hooked, stock)
    assert seen == [["input_ids", "position_ids"]]
    with torch.no_grad():
        hooked(*batch.model_args)  # inference: not called
    assert len(seen) == 1


@pytest.mark.parametrize("bad", [-1.0, True, "0.5", torch.tensor([1.0]), torch.tensor(1)])
def test_bad_loss_scale_is_refused_naming_it(bad: object) -> None:
    batch = make_batch(VOCAB, seq=6)
    hooks = mtp_hooks.attach(SHAPE.build(1))
    with pytest.raises(mtp_hooks.MTPHooksError, match="loss_scale"):
        hooks.micro_batch(batch.labels, batch.loss_mask, loss_scale=bad)
    with pytest.raises(mtp_hooks.MTPHooksError, match="call_loss_scale"):
        mtp_hooks.attach(SHAPE.build(2), call_loss_scale=0.5)
