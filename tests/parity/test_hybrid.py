"""``HybridModel`` with MTP layers, side by side with stock mcore, as the ``GPTModel`` tests do.

mcore 0.18 added ``HybridModel`` (``models/hybrid``) with MTP depths given by its layer pattern;
0.19 makes it the successor of ``GPTModel``. ``TinyHybrid`` builds one with attention and MLP
layers only (``"*-*-/*-/*-"``), so no Mamba kernel is needed. Twin builds (same seed) are compared:
stock gets labels and returns its per-token loss, the hooked twin returns logits. MTP losses, main
logits and every parameter's gradient must match; inference micro-batches must leave MTP alone,
including on 0.19, where stock derives MTP labels from ``input_ids`` when it gets none.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks import _mcore
from mtp_hooks.testing import TinyHybrid, assert_same_grads, build_twins, grads_of, hooked_train_step, main_ce_from_logits
from mtp_hooks.testing import make_batch, masked_mean, output_layer_calls, stock_main_only_step, stock_train_step
from tests.support.mcore_cpu import HYBRID_MTP_MISSING

pytestmark = pytest.mark.skipif(HYBRID_MTP_MISSING is not None, reason=str(HYBRID_MTP_MISSING))

VOCAB = 61  # no other dimension of the tiny model is 61


def mtp_grads_are_empty(model: nn.Module) -> bool:
    return all(p.grad is None or not p.grad.any() for name, p in model.named_parameters() if name.startswith("mtp."))


def grid() -> list[Any]:
    cases = []
    for depth, tied, mask, per_token, impl in itertools.product((1, 2), (False, True), ("random", "none"), (False, True), ("lean", "dense")):
        path = "context" if (depth + tied + per_token) % 2 else "kwargs"
        name = f"N{depth}-{'tied' if tied else 'untied'}-mask_{mask}-{'per_token' if per_token else 'mean'}-{path}-{impl}"
        cases.append(pytest.param(depth, tied, mask, per_token, path, impl, id=name))
    return cases


@pytest.mark.parametrize("depth,tied,mask,per_token,path,impl", grid())
def test_losses_logits_and_every_gradient_match_stock(depth: int, tied: bool, mask: str, per_token: bool, path: str, impl: str) -> None:
    shape = TinyHybrid(vocab_size=VOCAB, mtp_num_layers=depth, tied=tied, config_overrides={"calculate_per_token_loss": per_token})
    twins = build_twins(shape, seed=11, loss_impl=impl, chunk_size=7 if impl == "lean" else None)
    batch = make_batch(VOCAB, seq=10, mask=mask, seed=depth)

    step = twins.assert_step_matches(batch, path)

    assert step.logits.shape == (2, 10, VOCAB)
    assert len(step.stock.mtp_losses) == depth
    assert all(p.grad is not None and p.grad.any() for n, p in twins.hooked.named_parameters() if n.startswith("mtp."))


def test_training_and_inference_micro_batches_accumulate_like_stock() -> None:
    """Train, infer with gradients on (main loss only), train again; stock weighs MTP 0 on the middle one."""
    shape = TinyHybrid(vocab_size=VOCAB)
    stock, hooked = shape.build(seed=4), shape.build(seed=4)
    hooks = mtp_hooks.attach(hooked)
    batches = [make_batch(VOCAB, seq=9, seed=20 + i) for i in range(3)]

    stock_train_step(stock, batches[0])
    stock_main_only_step(stock, batches[1])
    stock_train_step(stock, batches[2])

    hooked_train_step(hooked, hooks, batches[0], "context")
    logits = hooked(*batches[1].model_args)  # no targets: an inference micro-batch
    masked_mean(main_ce_from_logits(logits, batches[1].labels), batches[1].loss_mask).backward()
    hooked_train_step(hooked, hooks, batches[2], "kwargs")

    assert_same_grads(hooked, stock)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_inference_returns_stock_logits_and_the_mtp_block_never_runs(grad: bool) -> None:
    shape = TinyHybrid(vocab_size=VOCAB)
    stock, hooked = shape.build(seed=2), shape.build(seed=2)
    mtp_hooks.attach(hooked)
    batch = make_batch(VOCAB, seq=8)
    runs: list[int] = []
    probe = hooked.mtp.register_forward_hook(lambda *_: runs.append(1))
    try:
        with torch.set_grad_enabled(grad):
            with output_layer_calls(stock) as calls:
                stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            logits = hooked(*batch.model_args)
    finally:
        probe.remove()
    assert runs == []
    assert torch.equal(logits, calls[-1].transpose(0, 1))


def test_labels_free_forward_with_grad_trains_only_the_main_model() -> None:
    """The user's loss on logits of a labels-free forward reaches trunk and head, never the MTP layers."""
    shape = TinyHybrid(vocab_size=VOCAB)
    reference, hooked = shape.build(seed=6), shape.build(seed=6)
    mtp_hooks.attach(hooked)
    batch = make_batch(VOCAB, seq=8)
    stock_main_only_step(reference, batch)
    logits = hooked(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert mtp_grads_are_empty(hooked)
    assert_same_grads(hooked, reference)


@pytest.mark.skipif(
    not _mcore.DERIVES_LABELS_FROM_INPUT_IDS,
    reason="process_mtp_loss(input_ids=) is missing: this megatron-core does not derive MTP labels from input_ids",
)
def test_stock_trains_mtp_on_a_labels_free_forward_so_the_pin_above_can_fail() -> None:
    """Control: stock 0.19 derives MTP labels from ``input_ids`` and trains MTP without being asked."""
    stock = TinyHybrid(vocab_size=VOCAB).build(seed=6)
    batch = make_batch(VOCAB, seq=8)
    logits = stock(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert not mtp_grads_are_empty(stock)


@pytest.mark.parametrize("detach_encoder,detach_head", [(True, False), (False, True), (True, True)])
def test_detach_flags_cut_their_gradient_paths(detach_encoder: bool, detach_head: bool) -> None:
    """Detached paths get exactly the main-loss gradient; the MTP layers still learn."""
    shape = TinyHybrid(vocab_size=VOCAB)
    reference, hooked = shape.build(seed=8), shape.build(seed=8)
    batch = make_batch(VOCAB, seq=8)
    stock_main_only_step(reference, batch)
    hooks = mtp_hooks.attach(hooked, detach_encoder=detach_encoder, detach_head=detach_head)
    hooked_train_step(hooked, hooks, batch, "context")
    expected = grads_of(reference)
    for name, grad in grads_of(hooked).items():
        if name.startswith("mtp."):
            assert grad is not None and grad.any(), name
        elif (detach_head and name.startswith("output_layer.")) or (detach_encoder and not name.startswith("output_layer.")):
            torch.testing.assert_close(grad, expected[name], msg=lambda m: f"{name}: {m}")
    trunk = "decoder.layers.0.self_attention.linear_qkv.weight"
    if not detach_encoder:
        assert not torch.allclose(grads_of(hooked)[trunk], expected[trunk])


def test_eval_mode_still_trains_mtp_like_stock() -> None:
    shape = TinyHybrid(vocab_size=VOCAB)
    stock, hooked = shape.build(seed=3), shape.build(seed=3)
    stock.eval()
    hooked.eval()
    batch = make_batch(VOCAB, seq=8)
    stock_train_step(stock, batch)
    hooked_train_step(hooked, mtp_hooks.attach(hooked), batch, "kwargs")
    assert_same_grads(hooked, stock)


def test_remove_restores_stock_hybrid_model_exactly() -> None:
    shape = TinyHybrid(vocab_size=VOCAB)
    stock, hooked = shape.build(seed=5), shape.build(seed=5)
    before = {name: dict(vars(module)) for name, module in hooked.named_modules()}
    hooks = mtp_hooks.attach(hooked)
    hooked_train_step(hooked, hooks, make_batch(VOCAB, seq=8, seed=1), "context")
    hooks.remove()
    hooked.zero_grad(set_to_none=True)
    for name, module in hooked.named_modules():
        assert vars(module).keys() == before[name].keys(), name
        assert not module._forward_hooks and not module._forward_pre_hooks, name
    assert hooked.config is before[""]["config"] and hooked.mtp_process is True

    batch = make_batch(VOCAB, seq=8, seed=2)
    stock_loss = masked_mean(stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch.loss_mask)
    stock_loss.backward()
    hooked_loss = masked_mean(hooked(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch.loss_mask)
    hooked_loss.backward()
    assert torch.equal(hooked_loss, stock_loss)
    assert_same_grads(hooked, stock, atol=0, rtol=0)
