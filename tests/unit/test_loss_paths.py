"""The lean loss's two weight-gradient paths, the automatic choice between them, and their cost.

``"fused"`` accumulates the head's weight gradient during forward (stock's matmul count),
``"recompute"`` recomputes it in backward (one head matmul per depth more, no accumulator);
``"lean"`` picks fused unless its ``[V/tp, h]`` buffer outweighs the ``N * T`` MTP logits.
Costs are counted exactly (FLOPs), never timed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mtp_hooks
from mtp_hooks.testing import TinyGPT, assert_same_grads, hooked_train_step, make_batch, stock_mtp_losses, stock_train_step

VOCAB = 256
HIDDEN = 32


@pytest.mark.parametrize("loss_impl", ["fused", "recompute"])
@pytest.mark.parametrize("tied", [False, True])
def test_both_weight_gradient_paths_equal_stock(loss_impl: str, tied: bool) -> None:
    spec = TinyGPT(vocab_size=VOCAB, hidden_size=HIDDEN, mtp_num_layers=2, tied=tied)
    stock, hooked = spec.build(seed=21), spec.build(seed=21)
    batch = make_batch(VOCAB, seq=12, seed=3)
    stock_train_step(stock, batch)
    stock_losses = stock_mtp_losses()
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl, chunk_size=5)
    hooked_train_step(hooked, hooks, batch)
    metrics = hooks.metrics()
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5)
    assert_same_grads(hooked, stock)
    assert hooks.loss_path == loss_impl


@pytest.mark.parametrize(
    "seq, batch_size, expected",
    [(8, 2, "fused"), (4, 2, "fused"), (3, 2, "recompute"), (2, 1, "recompute")],
    ids=["N*T=32", "N*T=16", "N*T=12", "N*T=4"],
)
def test_lean_picks_fused_unless_its_buffer_outweighs_the_logits(seq: int, batch_size: int, expected: str) -> None:
    """Rule: recompute when h > N * T (the buffer [V, h] is larger than the logits [N*T, V]); h = 16, N = 2."""
    model = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, mtp_num_layers=2).build()
    hooks = mtp_hooks.attach(model)
    assert hooks.loss_path is None
    hooked_train_step(model, hooks, make_batch(VOCAB, batch=batch_size, seq=seq))
    assert hooks.loss_path == expected


@pytest.mark.parametrize("options, expected", [({"detach_head": True}, "detached"), ({"loss_impl": "dense"}, "dense")])
def test_loss_path_names_detached_and_dense(options: dict[str, Any], expected: str) -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model, **options)
    hooked_train_step(model, hooks, make_batch(VOCAB))
    assert hooks.loss_path == expected


def training_flops(model: torch.nn.Module, step: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def test_training_flops_fused_equal_stock_recompute_add_one_head_matmul_per_depth_detached_save_one() -> None:
    """Exact FLOPs of a training micro-batch (forward + backward), hooks against stock."""
    depth, seq, batch_size = 2, 16, 2
    spec = TinyGPT(vocab_size=VOCAB, hidden_size=HIDDEN, mtp_num_layers=depth)
    batch = make_batch(VOCAB, batch=batch_size, seq=seq, seed=5)
    stock = spec.build(seed=1)
    stock_flops = training_flops(stock, lambda: stock_train_step(stock, batch))
    head_matmul = 2 * seq * batch_size * HIDDEN * VOCAB  # one [T, h] x [h, V] product
    flops = {}
    for name, options in {
        "fused": {"loss_impl": "fused"},
        "recompute": {"loss_impl": "recompute"},
        "detached": {"loss_impl": "fused", "detach_head": True},
        "dense": {"loss_impl": "dense"},
    }.items():
        model = spec.build(seed=1)
        hooks = mtp_hooks.attach(model, **options)
        flops[name] = training_flops(model, lambda: hooked_train_step(model, hooks, batch))
    assert flops["fused"] == stock_flops
    assert flops["dense"] == stock_flops
    assert flops["recompute"] == stock_flops + depth * head_matmul
    assert flops["detached"] == stock_flops - depth * head_matmul
