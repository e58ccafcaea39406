"""Module and autograd modes: ``eval()``, ``no_grad``, ``inference_mode`` and activation recompute.

Training is decided by two things only (see ``mtp_hooks/hooks.py``): labels were given and
gradients are enabled. ``model.eval()`` does not change that, exactly as stock mcore 0.16.1
attaches its MTP loss in eval mode too (only its loss logging is gated on ``training``). Under
``no_grad`` / ``inference_mode`` a forward with labels is an inference micro-batch: the MTP
block does not run and the logits are stock's.

Activation recompute (``recompute_granularity='full'``) re-runs decoder and MTP transformer
layers in backward through mcore's ``CheckpointFunction``, after the hooks' post-hook has
restored everything. ``CheckpointFunction`` snapshots the CUDA RNG state with
``torch.cuda.random.get_rng_state``, which raises on a CPU-only torch; the ``cuda_rng_on_cpu``
fixture below answers with the CPU generator's state instead (test-side, like
``cuda_current_device_is_cpu``; dropout is 0 in these models, so no RNG stream matters).
``distribute_saved_activations`` does not help here: the snapshot is taken on every path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, build_twins, hooked_train_step, main_ce_from_logits, make_batch
from mtp_hooks.testing import masked_mean, output_layer_calls, stock_mtp_losses, stock_train_step
from tests.support.mcore_cpu import MTP_RECOMPUTE_BROKEN, mtp_inner_layer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
needs_mtp_recompute = pytest.mark.skipif(MTP_RECOMPUTE_BROKEN is not None, reason=str(MTP_RECOMPUTE_BROKEN))

VOCAB = 32
DEPTH = 2


def shape(**overrides: Any) -> TinyGPT:
    return TinyGPT(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_attention_heads=2, mtp_num_layers=DEPTH, config_overrides=overrides
    )


def recompute(method: str) -> dict[str, Any]:
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": 1}


@pytest.fixture
def cuda_rng_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let mcore's ``CheckpointFunction`` snapshot an RNG state on a CPU-only torch.

    Its restore goes through ``torch.cuda._lazy_call``, which queues the call until CUDA is
    initialised (never, here); the queue is trimmed back afterwards.
    """
    monkeypatch.setattr(torch.cuda.random, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    queued = getattr(torch.cuda, "_queued_calls", None)
    length = None if queued is None else len(queued)
    yield
    if queued is not None:
        del queued[length:]


@contextlib.contextmanager
def calls_of(module: nn.Module) -> Iterator[list[int]]:
    calls: list[int] = []
    handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def user_loss(logits: Tensor, batch: Batch) -> Tensor:
    return masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask)


def stock_logits(model: nn.Module, batch: Batch) -> Tensor:
    """Stock main logits ``[b, s, V]``: a labelled stock forward, main head read by a plain forward hook."""
    with output_layer_calls(model) as calls:
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    return calls[-1].transpose(0, 1)


# ------------------------------------------------------------------------------ eval()


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_eval_with_labels_and_grad_is_a_training_micro_batch_like_stock(loss_impl: str) -> None:
    twins = build_twins(shape(), 5, loss_impl=loss_impl)
    hooked, hooks = twins.hooked, twins.hooks
    assert hooks is not None
    twins.stock.eval()
    hooked.eval()
    batch = make_batch(VOCAB)
    stock = twins.stock_step(batch)
    with calls_of(hooked.mtp) as mtp_calls:
        logits = twins.hooked_step(batch)
    assert mtp_calls == [1]
    assert torch.equal(logits, stock.logits)
    twins.assert_same_grads()
    assert hooks.metrics()["mtp_1/tokens"] == batch.loss_mask[:, 1:].sum().item()
    assert not hooked.training and not any(m.training for m in hooked.modules())


def test_eval_without_labels_is_inference_with_stock_logits() -> None:
    stock, hooked = shape().build(5), shape().build(5)
    stock.eval()
    hooked.eval()
    batch = make_batch(VOCAB)
    hooks = mtp_hooks.attach(hooked)
    with calls_of(hooked.mtp) as mtp_calls:
        logits = hooked(*batch.model_args)
    assert mtp_calls == []
    assert torch.equal(logits, stock_logits(stock, batch))
    assert hooks.metrics() == {}


# ------------------------------------------------------------------ no_grad / inference_mode

GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("train_mode", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("path", ["context", "kwargs", "no_labels"])
@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
def test_grad_disabled_forward_is_inference_with_stock_logits(grad_mode: str, path: str, train_mode: bool) -> None:
    stock, hooked = shape().build(5), shape().build(5)
    stock.train(train_mode)
    hooked.train(train_mode)
    batch = make_batch(VOCAB)
    hooks = mtp_hooks.attach(hooked)
    config = hooked.config
    with GRAD_MODES[grad_mode]():
        expected = stock_logits(stock, batch)
        with calls_of(hooked.mtp) as mtp_calls:
            if path == "context":
                with hooks.micro_batch(batch.labels, batch.loss_mask):
                    logits = hooked(*batch.model_args)
            elif path == "kwargs":
                logits = hooked(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            else:
                logits = hooked(*batch.model_args)
    stock_mtp_losses()
    assert mtp_calls == [], "the MTP block ran in a grad-disabled forward"
    assert logits.grad_fn is None and not logits.requires_grad
    assert torch.equal(logits, expected)
    assert hooks.metrics() == {}
    assert hooked.config is config and hooked.mtp_process is True
    assert all(p.grad is None for p in hooked.parameters())


# --------------------------------------------------------------------- activation recompute


@needs_mtp_recompute
@pytest.mark.usefixtures("cuda_rng_on_cpu")
@pytest.mark.parametrize("detach_head", [False, True])
def test_recompute_with_detached_encoder_equals_no_recompute(detach_head: bool) -> None:
    """Full recompute re-runs the MTP layers in backward; with ``detach_encoder`` their inputs are
    detached, yet the MTP parameters must get the same gradients as without recompute.

    (mcore 0.16.1 recomputes MTP layers only with ``recompute_method='uniform'``; ``'block'``
    skips MTP recompute with a warning.)"""
    options = {"detach_encoder": True, "detach_head": detach_head}
    recomputed, plain = shape(**recompute("uniform")).build(5), shape().build(5)
    hooks_r, hooks_p = mtp_hooks.attach(recomputed, **options), mtp_hooks.attach(plain, **options)
    batches = [make_batch(VOCAB, seed=seed) for seed in range(2)]
    for batch in batches:
        with calls_of(mtp_inner_layer(recomputed.mtp.layers[0])) as runs:
            logits_r = hooked_train_step(recomputed, hooks_r, batch)
        assert len(runs) == 2, f"expected forward + recompute of the MTP layer, got {len(runs)} runs"
        logits_p = hooked_train_step(plain, hooks_p, batch)
        torch.testing.assert_close(logits_r, logits_p, rtol=0, atol=0)
        assert hooks_r.metrics() == pytest.approx(hooks_p.metrics(), rel=1e-6)
    # a recomputed inference micro-batch with backward (no MTP) afterwards
    batch = make_batch(VOCAB, seed=9)
    user_loss(recomputed(*batch.model_args), batch).backward()
    user_loss(plain(*batch.model_args), batch).backward()
    assert_same_grads(recomputed, plain)
    mtp_grads = [p.grad for name, p in recomputed.named_parameters() if name.startswith("mtp.layers.")]
    assert all(g is not None and g.any() for g in mtp_grads), "an MTP parameter got no gradient under recompute"
    for name, param in recomputed.named_parameters():
        if name.startswith(("embedding.", "decoder.")) and param.grad is not None:
            # detach_encoder: the MTP loss sends nothing into the trunk, so main-only grads there
            assert torch.equal(param.grad, dict(plain.named_parameters())[name].grad), name


@needs_mtp_recompute
@pytest.mark.usefixtures("cuda_rng_on_cpu")
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_recompute_without_detach_equals_stock_recompute(loss_impl: str) -> None:
    twins = build_twins(shape(**recompute("uniform")), 5, loss_impl=loss_impl)
    plain_stock = shape().build(5)
    batch = make_batch(VOCAB)
    stock_losses = stock_train_step(plain_stock, batch).mtp_losses
    with calls_of(mtp_inner_layer(twins.hooked.mtp.layers[1])) as runs:
        step = twins.assert_step_matches(batch)
    assert len(runs) == 2
    assert step.stock.mtp_losses == pytest.approx(stock_losses)
    assert_same_grads(twins.stock, plain_stock)  # guard: recompute itself changes nothing in stock
