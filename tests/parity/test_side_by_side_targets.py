"""The label / mask contract and the metrics, against what stock mcore computes.

* ``mtp_targets`` equals mcore's own ``roll_tensor`` applied k times (what ``GPTModel._postprocess``
  does for labels and loss mask), and the plain-language rule: depth k predicts ``labels[t + k]``
  under ``loss_mask[t + k]``, never past the end of a (packed) sequence.
* ``metrics()``: loss is stock's tracked per-depth MTP loss, acceptance is the share of masked
  positions where stock's own MTP logits put their maximum on the label, both token-weighted over
  micro-batches.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import mtp_hooks
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import roll_tensor
from mtp_hooks import MTPHooksError, mtp_targets
from mtp_hooks.metrics import MTPMetrics
from mtp_hooks.testing import Batch, TinyGPT, hooked_train_step, make_batch, output_layer_calls, stock_mtp_losses, stock_train_step
from tests.support.mcore_cpu import needs_packed_mtp, rolled

VOCAB = 97


def stock_rolls(labels: Tensor, mask: Tensor, depth: int, packed: Optional[PackedSeqParams] = None) -> list[tuple[Tensor, Tensor]]:
    """What stock ``_postprocess`` feeds its per-depth CE: labels and mask rolled once more per depth."""
    out = []
    extra = {} if packed is None else {"packed_seq_params": packed}  # roll_tensor takes it from 0.16.1
    for _ in range(depth):
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=None, **extra)
        mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=None, **extra)
        out.append((labels, mask))
    return out


def packed_params(lengths: list[int]) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


# --------------------------------------------------------------------------------- targets


@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 12),
    depth=st.integers(1, 5),
    mask_kind=st.sampled_from(["float", "bool", "none"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_targets_are_stock_rolls_and_the_plain_rule(batch: int, seq: int, depth: int, mask_kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask01 = (torch.rand(batch, seq, generator=gen) > 0.4).float()
    mask = {"float": mask01, "bool": mask01.bool(), "none": None}[mask_kind]
    labels_before = labels.clone()

    targets = mtp_targets(labels, mask, depth)

    assert torch.equal(labels, labels_before)
    reference_mask = torch.ones(batch, seq) if mask is None else mask01
    stock = stock_rolls(labels, reference_mask, depth)
    assert len(targets) == depth
    for k, ((labels_k, mask_k), (stock_labels, stock_mask)) in enumerate(zip(targets, stock), start=1):
        assert labels_k.dtype == labels.dtype and mask_k.dtype == torch.float32
        assert torch.equal(mask_k, stock_mask.float())
        assert torch.equal(mask_k, rolled(reference_mask, k))
        scored = mask_k.bool()  # labels are specified where the mask is 1
        assert torch.equal(labels_k[scored], stock_labels[scored])
        assert torch.equal(labels_k[scored], rolled(labels, k)[scored])


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    depth=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
@needs_packed_mtp
def test_packed_targets_are_stock_rolls_within_each_sequence(lengths: list[int], depth: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    labels = torch.randint(0, VOCAB, (1, total), generator=gen)
    mask = (torch.rand(1, total, generator=gen) > 0.3).float()
    params = packed_params(lengths)

    targets = mtp_targets(labels, mask, depth, packed_seq_params=params)

    for k, ((labels_k, mask_k), (stock_labels, stock_mask)) in enumerate(
        zip(targets, stock_rolls(labels, mask, depth, params)), start=1
    ):
        scored = mask_k.bool()
        assert torch.equal(mask_k, stock_mask)
        assert torch.equal(labels_k[scored], stock_labels[scored])
        start = 0
        for n in lengths:  # per sequence: the plain rule, as if it were alone
            piece = slice(start, start + n)
            assert torch.equal(mask_k[:, piece], rolled(mask[:, piece], k))
            assert torch.equal(labels_k[:, piece][scored[:, piece]], rolled(labels[:, piece], k)[scored[:, piece]])
            start += n


@pytest.mark.parametrize("depth", [0, -1, 1.0, "2", None])
def test_targets_reject_bad_depth(depth: object) -> None:
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(MTPHooksError, match="^depth: bad value"):
        mtp_targets(labels, None, depth)  # type: ignore[arg-type]


def test_targets_are_what_the_hooks_count() -> None:
    """``mtp_k/tokens`` of a training micro-batch is the mask of ``mtp_targets`` at depth k."""
    model = TinyGPT(vocab_size=VOCAB, mtp_num_layers=3).build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, batch=3, seq=9, seed=4)
    hooked_train_step(model, hooks, batch)
    metrics = hooks.metrics()
    for k, (_, mask_k) in enumerate(mtp_targets(batch.labels, batch.loss_mask, 3), start=1):
        assert metrics[f"mtp_{k}/tokens"] == mask_k.sum().item()


# --------------------------------------------------------------------------------- metrics


def stock_step_with_logits(model: torch.nn.Module, batch: Batch) -> tuple[list[float], list[Tensor]]:
    """Stock training step; returns its tracked MTP losses and its per-depth MTP logits ``[s, b, V]``."""
    with output_layer_calls(model) as calls:
        stock_train_step(model, batch)
    return stock_mtp_losses(), calls[:-1]


def stock_acceptance(logits: list[Tensor], batch: Batch) -> list[tuple[float, float]]:
    """Per depth (masked correct count, masked tokens) from stock's MTP logits: argmax equals the label."""
    out = []
    for (labels_k, mask_k), logits_k in zip(mtp_targets(batch.labels, batch.loss_mask, len(logits)), logits):
        hit = (logits_k.argmax(-1).t() == labels_k).float()
        out.append(((hit * mask_k).sum().item(), mask_k.sum().item()))
    return out


def batch_the_model_gets_partly_right(model: torch.nn.Module, seed: int) -> Batch:
    """A batch whose labels are the MTP heads' own predictions at about half the positions.

    Logits depend on ``input_ids`` only, so labels can be chosen after looking at them: depth k at
    position t predicts ``labels[t + k]``; setting that label to the depth-k argmax makes it a hit.
    """
    batch = make_batch(VOCAB, batch=2, seq=10, seed=seed)
    with torch.no_grad(), output_layer_calls(model) as calls:
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    stock_mtp_losses()
    gen = torch.Generator().manual_seed(seed)
    labels = batch.labels.clone()
    seq = labels.shape[1]
    for k, logits_k in enumerate(calls[:-1], start=1):
        guesses = logits_k.argmax(-1).t()[:, : seq - k]  # depth k at positions 0 .. s-k-1
        take = torch.rand(guesses.shape, generator=gen) < 0.5
        labels[:, k:][take] = guesses[take]
    return Batch(batch.input_ids, batch.position_ids, labels, batch.loss_mask)


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_metrics_are_stock_losses_and_stock_argmax_acceptance(loss_impl: str) -> None:
    shape = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)
    stock, hooked = shape.build(), shape.build()
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl, chunk_size=7)
    totals = {k: [0.0, 0.0, 0.0] for k in (1, 2)}  # CE sum, hits, tokens
    for seed in (0, 1, 2):
        batch = batch_the_model_gets_partly_right(stock, seed)
        losses, logits = stock_step_with_logits(stock, batch)
        hooked_train_step(hooked, hooks, batch)
        for k, (loss, (hits, tokens)) in enumerate(zip(losses, stock_acceptance(logits, batch)), start=1):
            totals[k][0] += loss * tokens
            totals[k][1] += hits
            totals[k][2] += tokens

    metrics = hooks.metrics()
    for k, (ce, hits, tokens) in totals.items():
        assert 0 < hits < tokens, "the batch must make the acceptance non-trivial"
        assert metrics[f"mtp_{k}/tokens"] == tokens
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(ce / tokens, rel=1e-5)
        assert metrics[f"mtp_{k}/acc"] == pytest.approx(hits / tokens)


def test_metrics_reset_and_peek() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    assert hooks.metrics() == {}
    hooked_train_step(model, hooks, make_batch(VOCAB, seed=0))
    peek = hooks.metrics(reset=False)
    assert hooks.metrics(reset=False) == peek
    model(*make_batch(VOCAB, seed=1).model_args)  # inference micro-batches add nothing
    assert hooks.metrics() == peek
    assert hooks.metrics() == {}
    hooked_train_step(model, hooks, make_batch(VOCAB, seed=0))
    assert hooks.metrics() == pytest.approx(peek)


def test_metrics_unit_token_weighting_and_empty_depths() -> None:
    """Two micro-batches of depth 1 (CE sum, tokens, hits); depth 2 never saw a token."""
    metrics = MTPMetrics(depth=2)
    assert metrics.read() == {}
    sums = [(6.0, 3.0, 1.0), (3.0, 1.0, 1.0)]
    for ce, tokens, hits in sums:
        metrics.add(0, torch.tensor(ce), torch.tensor(tokens), torch.tensor(hits))
    ce, tokens, hits = (sum(column) for column in zip(*sums))
    out = metrics.read(reset=False)
    assert out["mtp_1/loss"] == ce / tokens and out["mtp_1/acc"] == hits / tokens and out["mtp_1/tokens"] == tokens
    assert out["mtp_1/loss"] != sum(c / t for c, t, _ in sums) / len(sums)  # token-weighted, not a mean of means
    assert "mtp_2/loss" not in out and "mtp_2/acc" not in out and out["mtp_2/tokens"] == 0.0  # never NaN
    assert metrics.read()["mtp_1/tokens"] == tokens
    assert metrics.read() == {}
