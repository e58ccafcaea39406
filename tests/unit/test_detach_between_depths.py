"""``detach_between_depths``: every MTP depth's loss trains its own layer only, as verl's patch did before 0.9.

The reference is stock mcore with the same detaches applied by pre-hooks written here: each MTP
layer gets detached input hidden states (the trunk's at depth 1, the previous depth's after) and
an embedding whose output is detached.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, assert_same_grads, hooked_train_step, make_batch, stock_mtp_losses, stock_train_step

VOCAB = 64


@contextlib.contextmanager
def per_depth_detach(model: nn.Module) -> Iterator[None]:
    """Stock mcore with every MTP layer's inputs detached (reference hooks of this test)."""

    def detach_inputs(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        embedding = kwargs["embedding"]
        kwargs["embedding"] = lambda **call: embedding(**call).detach()
        kwargs["hidden_states"] = kwargs["hidden_states"].detach()
        return args, kwargs

    handles = [layer.register_forward_pre_hook(detach_inputs, with_kwargs=True) for layer in model.mtp.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_each_depth_trains_only_its_own_layer_like_stock_with_per_depth_detaches(depth: int, tied: bool, loss_impl: str) -> None:
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=depth, tied=tied)
    stock, hooked = spec.build(seed=11), spec.build(seed=11)
    batch = make_batch(VOCAB, seq=10, seed=depth)
    with per_depth_detach(stock):
        stock_train_step(stock, batch)
    stock_losses = stock_mtp_losses()
    hooks = mtp_hooks.attach(hooked, detach_encoder=True, detach_between_depths=True, loss_impl=loss_impl)
    hooked_train_step(hooked, hooks, batch)
    metrics = hooks.metrics()
    assert [metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)] == pytest.approx(stock_losses, rel=1e-5)
    assert_same_grads(hooked, stock)


def test_without_it_deeper_depths_reach_earlier_layers() -> None:
    """The option changes something: with detach_encoder alone, depth 2's loss reaches layer 1."""
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)
    batch = make_batch(VOCAB, seq=10, seed=1)
    grads = []
    for between in (False, True):
        model = spec.build(seed=12)
        hooks = mtp_hooks.attach(model, detach_encoder=True, detach_between_depths=between)
        hooked_train_step(model, hooks, batch)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.layers.0.") and p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert any(not torch.allclose(grads[0][n], grads[1][n]) for n in grads[0])


def test_detach_between_depths_needs_detach_encoder() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    with pytest.raises(mtp_hooks.MTPHooksError, match="detach_between_depths: bad value"):
        mtp_hooks.attach(model, detach_between_depths=True)
    assert mtp_hooks.hooks_of(model) is None
