"""``torch.utils.checkpoint`` of hooked forwards: every recompute trains on its own forward's targets.

A checkpointed forward is run again in backward. The targets of that recompute are bound to the
checkpoint region of the forward they belong to (``mtp_hooks/runtime/recompute.py``), so several checkpointed
micro-batches may be in flight and backwarded in any order, one ``input_ids`` object may serve
micro-batches with different masks, and labels may be built inline and dropped before backward.
Stock mcore, called with the same labels under the same checkpoint, is the reference: every
parameter's gradient must match, and each micro-batch's MTP tokens count once.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, main_ce_from_logits, make_batch, masked_mean

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)
FLAVOURS = {"non_reentrant": False, "reentrant": True}
# How the hooked twin gives the targets: a ``micro_batch`` block around the checkpoint, ``labels=``
# through the checkpointed function, a block inside the checkpointed function with labels built
# there, a block around the checkpoint with labels built inline (nothing else keeps them alive).
PATHS = ("context", "kwargs", "inside", "inline")


def checkpointed(fn: Callable[..., Tensor], *args: object, reentrant: bool) -> Tensor:
    """``checkpoint(fn, *args)``; a grad-requiring dummy input lets the reentrant flavour's output
    require grad (its inputs are integer ids), for stock and hooked twins alike."""
    dummy = torch.ones((), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # reentrant: "None of the inputs have requires_grad"
        return torch.utils.checkpoint.checkpoint(lambda _d, *a: fn(*a), dummy, *args, use_reentrant=reentrant)


def stock_loss(model: nn.Module, batch: Batch, reentrant: bool) -> Tensor:
    def fn(ids: Tensor, positions: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
        return model(ids, positions, None, labels=labels, loss_mask=mask)

    per_token = checkpointed(fn, batch.input_ids, batch.position_ids, batch.labels, batch.loss_mask, reentrant=reentrant)
    return masked_mean(per_token, batch.loss_mask)


def hooked_loss(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, reentrant: bool, path: str) -> Tensor:
    def plain(ids: Tensor, positions: Tensor) -> Tensor:
        return model(ids, positions, None)

    def with_kwargs(ids: Tensor, positions: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
        return model(ids, positions, None, labels=labels, loss_mask=mask)

    def block_inside(ids: Tensor, positions: Tensor) -> Tensor:
        with hooks.micro_batch(batch.labels.clone(), batch.loss_mask.clone()):
            return model(ids, positions, None)

    ids, positions = batch.input_ids, batch.position_ids
    if path == "kwargs":
        logits = checkpointed(with_kwargs, ids, positions, batch.labels, batch.loss_mask, reentrant=reentrant)
    elif path == "inside":
        logits = checkpointed(block_inside, ids, positions, reentrant=reentrant)
    else:
        inline = path == "inline"
        labels = batch.labels.clone() if inline else batch.labels
        mask = batch.loss_mask.clone() if inline else batch.loss_mask
        with hooks.micro_batch(labels, mask):
            logits = checkpointed(plain, ids, positions, reentrant=reentrant)
    return masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask)


def micro_batches(count: int, shared_ids: bool) -> list[Batch]:
    """``count`` micro-batches; with ``shared_ids`` one ``input_ids`` object (and labels) for all,
    each with a mask of its own."""
    batches = [make_batch(VOCAB, seed=seed) for seed in range(count)]
    if shared_ids:
        first = batches[0]
        batches = [Batch(first.input_ids, first.position_ids, first.labels, b.loss_mask) for b in batches]
    return batches


@contextlib.contextmanager
def no_unused_targets_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*micro_batch block ended")
        yield


def run_side_by_side(batches: list[Batch], reentrant: bool, path: str, order: str) -> None:
    """All forwards first (every micro-batch in flight), then each backward, stock and hooked."""
    model, stock = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    stock_losses = [stock_loss(stock, batch, reentrant) for batch in batches]
    with no_unused_targets_warning():  # a reentrant checkpoint's grad-free forward takes the block's targets
        hooked_losses = [hooked_loss(model, hooks, batch, reentrant, path) for batch in batches]
    turn = range(len(batches)) if order == "forward" else reversed(range(len(batches)))
    for i in turn:
        stock_losses[i].backward()
        hooked_losses[i].backward()
    assert_same_grads(model, stock)
    tokens = sum(float(batch.loss_mask[:, 1:].sum()) for batch in batches)
    assert hooks.metrics()["mtp_1/tokens"] == tokens  # each micro-batch counted once


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("path", ["context", "inline"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_checkpointed_micro_batches_sharing_input_ids_train_like_stock(flavour: str, path: str, order: str) -> None:
    """One ``input_ids`` object, two masks, the block around the checkpoint: each recompute takes
    its own forward's mask (also when nothing but the forward kept the labels alive)."""
    run_side_by_side(micro_batches(2, shared_ids=True), FLAVOURS[flavour], path, order)


# Reentrant "kwargs" / "inside" give the recompute its labels by the call itself; the open-block test covers them.
IN_FLIGHT = [("non_reentrant", path) for path in PATHS] + [("reentrant", "context"), ("reentrant", "inline")]


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize(("flavour", "path"), IN_FLIGHT)
def test_three_checkpointed_micro_batches_in_flight_without_early_stop_train_like_stock(flavour: str, path: str, order: str) -> None:
    """Without early stop every recompute runs to its end, as a completed forward: each
    micro-batch's own targets, and counted once all the same."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        run_side_by_side(micro_batches(3, shared_ids=False), FLAVOURS[flavour], path, order)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_recompute_inside_another_open_micro_batch_keeps_its_own_targets(flavour: str, path: str) -> None:
    """A backward run while the next micro-batch's block is open: the recompute takes its own
    targets, never the open block's (nor does it clash with it), and the open block still trains
    its own forward."""
    reentrant = FLAVOURS[flavour]
    first, second = micro_batches(2, shared_ids=True)
    model, stock = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    stock_first = stock_loss(stock, first, reentrant)
    stock_second = stock_loss(stock, second, reentrant)
    stock_first.backward()
    stock_second.backward()
    hooked_first = hooked_loss(model, hooks, first, reentrant, path)
    with hooks.micro_batch(second.labels, second.loss_mask):
        hooked_first.backward()
        logits = checkpointed(lambda ids, pos: model(ids, pos, None), second.input_ids, second.position_ids, reentrant=reentrant)
    masked_mean(main_ce_from_logits(logits, second.labels), second.loss_mask).backward()
    assert_same_grads(model, stock)
    assert hooks.metrics()["mtp_1/tokens"] == float(first.loss_mask[:, 1:].sum() + second.loss_mask[:, 1:].sum())


def test_the_installed_torch_checkpoint_is_recognised() -> None:
    """The binding reads torch's own checkpoint frames (``mtp_hooks/runtime/recompute.py``): a torch whose
    checkpoint is laid out otherwise fails here, before any recompute could go without targets."""
    from mtp_hooks.runtime import recompute

    assert recompute.SUPPORTED
