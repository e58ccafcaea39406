"""Hooked model vs stock mcore over the full option grid: twin models, same batch, same user loss.

Stock mcore 0.16 is called with ``labels`` and returns the per-token main loss; its MTP losses
land in mcore's tracker and its main logits are read with a plain forward hook on the output
layer (the last call of a training forward is the main head). The hooked twin returns logits;
the user computes the same masked CE from them. MTP losses, logits and every parameter's
gradient must match, for N = 1, 2, 3, tied and untied heads, random / all-ones / no loss mask,
mean and per-token normalisation, the ``micro_batch`` and the ``labels=`` paths, lean (chunked)
and dense losses.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import TinyGPT, build_twins, hooked_train_step, make_batch, output_layer_calls, stock_mtp_losses

VOCAB = 64


def grid() -> list[Any]:
    """Every combination of depth, head, mask, normalisation, call path and loss implementation."""
    cases = []
    for depth, tied, mask, per_token, path, impl in itertools.product(
        (1, 2, 3), (False, True), ("random", "ones", "none"), (False, True), ("context", "kwargs"), ("lean", "dense")
    ):
        name = f"N{depth}-{'tied' if tied else 'untied'}-mask_{mask}-{'per_token' if per_token else 'mean'}-{path}-{impl}"
        cases.append(pytest.param(depth, tied, mask, per_token, path, impl, id=name))
    return cases


@pytest.mark.parametrize("depth,tied,mask,per_token,path,impl", grid())
def test_losses_logits_and_every_gradient_match_stock(
    depth: int, tied: bool, mask: str, per_token: bool, path: str, impl: str
) -> None:
    spec = TinyGPT(mtp_num_layers=depth, tied=tied, config_overrides={"calculate_per_token_loss": per_token})
    twins = build_twins(spec, seed=7, loss_impl=impl, chunk_size=5 if impl == "lean" else None)
    batch = make_batch(VOCAB, batch=2, seq=12, mask=mask, seed=depth)

    step = twins.assert_step_matches(batch, path)

    assert step.logits.shape == (2, 12, VOCAB)
    assert len(step.stock.mtp_losses) == depth
    assert all(p.grad is not None and p.grad.any() for n, p in twins.hooked.named_parameters() if n.startswith("mtp."))


@pytest.mark.parametrize("impl", ["lean", "dense"])
def test_gradients_accumulate_like_stock_over_micro_batches(impl: str) -> None:
    """Three micro-batches with different masks, gradients accumulated, metrics token-weighted."""
    twins = build_twins(TinyGPT(mtp_num_layers=2), seed=3, loss_impl=impl, chunk_size=7)
    batches = [make_batch(VOCAB, seq=10, mask=m, seed=i) for i, m in enumerate(("random", "ones", "none"))]
    expected_ce = torch.zeros(2, dtype=torch.float64)
    expected_tokens = torch.zeros(2, dtype=torch.float64)
    for i, batch in enumerate(batches):
        stock = twins.stock_step(batch)
        logits = twins.hooked_step(batch, "context" if i % 2 else "kwargs")
        assert torch.equal(logits, stock.logits)
        mask = torch.ones_like(batch.labels, dtype=torch.float64) if batch.loss_mask is None else batch.loss_mask.double()
        for k in range(2):
            tokens = mask[:, k + 1 :].sum()  # depth k+1 predicts the label k+1 steps ahead
            expected_tokens[k] += tokens
            expected_ce[k] += stock.mtp_losses[k] * tokens
    twins.assert_same_grads()
    assert twins.hooks is not None
    metrics = twins.hooks.metrics()
    for k in range(2):
        assert metrics[f"mtp_{k + 1}/tokens"] == expected_tokens[k].item()
        assert metrics[f"mtp_{k + 1}/loss"] == pytest.approx((expected_ce[k] / expected_tokens[k]).item(), rel=1e-5)
    assert twins.hooks.metrics() == {}, "metrics(reset=True) must start a new accumulation"


def test_loss_scale_argument_overrides_config_factor() -> None:
    """``loss_scale`` replaces ``config.mtp_loss_scaling_factor``: same gradients as stock with that factor."""
    stock_shape = TinyGPT(mtp_num_layers=2, config_overrides={"mtp_loss_scaling_factor": 0.7})
    twins = build_twins(TinyGPT(mtp_num_layers=2), seed=5, stock_shape=stock_shape, loss_scale=0.7)
    assert twins.hooked.config.mtp_loss_scaling_factor != 0.7  # factor 0.3 in its config
    twins.assert_step_matches(make_batch(VOCAB, seq=10, seed=5))


@pytest.mark.parametrize("impl,extra_head_calls_per_depth", [("lean", 0), ("dense", 1)])
@pytest.mark.parametrize("depth", [1, 3])
def test_stock_computes_neither_its_mtp_loss_nor_the_main_loss(impl: str, extra_head_calls_per_depth: int, depth: int) -> None:
    """In a hooked training forward mcore runs no MTP loss and no main-head CE of its own.

    Pinned three ways: mcore's MTP tracker holds one record per depth, the hooks' (stock would add
    its own whenever it computes its MTP loss in training), the GPTModel's forward receives no labels (so ``_postprocess``
    returns logits, not its CE), and the output layer runs once for the main head plus, for the
    dense loss only, once per depth from ``mtp_hooks`` -- stock would add N calls of its own.
    """
    model = TinyGPT(mtp_num_layers=depth).build(seed=1)
    hooks = mtp_hooks.attach(model, loss_impl=impl)
    seen: list[Any] = []
    probe = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("labels", "absent")), with_kwargs=True)
    batch = make_batch(VOCAB, seq=8)
    try:
        for path in ("context", "kwargs"):
            seen.clear()
            with output_layer_calls(model) as calls:
                hooked_train_step(model, hooks, batch, path)
            assert len(calls) == 1 + extra_head_calls_per_depth * depth, f"{path}: output layer ran {len(calls)} times"
            assert seen == ([None] if path == "kwargs" else ["absent"])
            metrics = hooks.metrics()
            assert metrics["mtp_1/tokens"] > 0
            # The tracker holds the hooks' record alone: stock would have added its own as well.
            tracked = [metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)]
            assert stock_mtp_losses() == pytest.approx(tracked, rel=1e-6), f"{path}: stock mcore recorded its own MTP loss"
    finally:
        probe.remove()


def test_stock_twin_records_its_losses_so_the_pin_can_fail() -> None:
    """Control for the pin above: the same probes on an unhooked twin see mcore's own MTP loss."""
    model = TinyGPT(mtp_num_layers=2).build(seed=1)
    batch = make_batch(VOCAB, seq=8)
    with output_layer_calls(model) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    assert len(calls) == 3 and per_token.shape == (2, 8)
    assert len(stock_mtp_losses()) == 2
