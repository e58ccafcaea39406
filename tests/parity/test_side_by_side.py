"""Side by side with stock mcore, beyond the option grid of ``test_stock_twins``.

Twin models (same seed): one stock (labels in, per-token loss out, MTP loss attached by mcore), one
with ``mtp_hooks`` (logits out; the test computes the same masked-mean main loss from them). Every
parameter gradient must match, here for the model shapes, config fields, loss weights, call forms,
micro-batch schedules and packed sequences that the grid does not vary, and where stock and the
hooks knowingly differ (a depth without targets) the test pins the difference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.models.gpt import gpt_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, assert_same_mtp_losses, build_twins, grads_of, hooked_train_step
from mtp_hooks.testing import main_ce_from_logits, make_batch, masked_mean, stock_main_only_step, stock_mtp_losses, stock_train_step
from tests.support.mcore_cpu import needs_packed_mtp

VOCAB = 97  # no other dimension of the tiny model is 97
TWIN_SHAPE = TinyGPT(vocab_size=VOCAB)


def assert_metrics_match_stock(metrics: dict[str, float], stock_losses: list[float], tokens: list[float]) -> None:
    assert len(stock_losses) == len(tokens)
    for k, (loss, count) in enumerate(zip(stock_losses, tokens), start=1):
        assert metrics[f"mtp_{k}/tokens"] == count
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------------- the regime


@pytest.mark.skipif(
    hasattr(gpt_model, "process_mtp_loss"), reason="mcore >= 0.17 moved the MTP loss out of _postprocess"
)
def test_stock_mcore_0_16_cannot_return_logits_when_mtp_is_configured() -> None:
    """The premise on mcore 0.14 - 0.16: stock ``_postprocess`` clones ``labels`` once MTP is on."""
    model = TinyGPT(vocab_size=VOCAB).build()
    batch = make_batch(VOCAB)
    with pytest.raises(AttributeError, match="clone"):
        model(*batch.model_args)
    mtp_hooks.attach(model)
    assert model(*batch.model_args).shape == (2, 8, VOCAB)


# ------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 16, 64])
def test_lean_chunking_does_not_change_gradients(chunk_size: int) -> None:
    """16 tokens per depth: chunks of 1, uneven chunks, exactly one chunk and one oversized chunk."""
    twins = build_twins(TinyGPT(vocab_size=VOCAB), loss_impl="lean", chunk_size=chunk_size)
    twins.assert_step_matches(make_batch(VOCAB, batch=2, seq=8))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"calculate_per_token_loss": True}, id="per-token-loss"),
        pytest.param({"mtp_loss_scaling_factor": 1.7}, id="scaling-factor"),
        pytest.param({"num_query_groups": 2}, id="gqa"),
    ],
)
def test_gradients_match_stock_with_config(overrides: dict[str, Any]) -> None:
    build_twins(TinyGPT(vocab_size=VOCAB, config_overrides=overrides)).assert_step_matches(make_batch(VOCAB))


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_match_stock_with_rope(tied: bool) -> None:
    twins = build_twins(TinyGPT(vocab_size=VOCAB, tied=tied, position_embedding_type="rope"))
    twins.assert_step_matches(make_batch(VOCAB, batch=3, seq=10))


@pytest.mark.parametrize("batch_size, seq", [(1, 4), (1, 16), (4, 6)])
def test_gradients_match_stock_across_batch_shapes(batch_size: int, seq: int) -> None:
    twins = build_twins(TinyGPT(vocab_size=VOCAB, mtp_num_layers=3))
    twins.assert_step_matches(make_batch(VOCAB, batch=batch_size, seq=seq))


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_bf16_gradients_match_stock(loss_impl: str) -> None:
    """bf16 weights without a mixed-precision wrapper (``test_properties`` covers Float16Module).

    Dense reuses mcore's head and CE; lean reduces in fp32: both within bf16 rounding of stock.
    """
    twins = build_twins(TinyGPT(vocab_size=VOCAB, params_dtype=torch.bfloat16), attach=False)
    twins.stock.to(torch.bfloat16), twins.hooked.to(torch.bfloat16)
    twins.attach(loss_impl=loss_impl)
    step = twins.assert_step_matches(make_batch(VOCAB), atol=2e-3, rtol=2**-6, loss_rel=2**-7)
    assert step.logits.dtype == torch.bfloat16
    for grad in grads_of(twins.hooked).values():
        assert grad is None or grad.dtype == torch.bfloat16


def test_eval_mode_still_trains_mtp_like_stock() -> None:
    """Stock attaches the MTP loss in eval mode too (only its logging is gated on ``training``)."""
    twins = build_twins(TinyGPT(vocab_size=VOCAB))
    twins.stock.eval()
    twins.hooked.eval()
    batch = make_batch(VOCAB)
    stock = twins.stock_step(batch)
    assert stock.mtp_losses == []
    assert torch.equal(twins.hooked_step(batch), stock.logits)
    twins.assert_same_grads()
    hooks = twins.hooks
    assert set(hooks.metrics()) == {f"mtp_{k}/{m}" for k in (1, 2) for m in ("loss", "acc", "tokens")}


# -------------------------------------------------------------------- loss weight and scale


def test_config_scaling_factor_is_read_at_every_forward() -> None:
    twins = build_twins(TinyGPT(vocab_size=VOCAB))
    hooks = twins.hooks
    assert hooks.loss_scale == pytest.approx(0.3)
    twins.stock.config.mtp_loss_scaling_factor = 1.25
    twins.hooked.config.mtp_loss_scaling_factor = 1.25
    assert hooks.loss_scale == 1.25
    twins.assert_step_matches(make_batch(VOCAB))


def test_zero_loss_scale_is_main_loss_only() -> None:
    stock, hooked = TWIN_SHAPE.build(), TWIN_SHAPE.build()
    batch = make_batch(VOCAB)
    stock_main_only_step(stock, batch)
    hooks = mtp_hooks.attach(hooked, loss_scale=0.0)
    hooked_train_step(hooked, hooks, batch)
    assert_same_grads(hooked, stock)
    for name, grad in grads_of(hooked).items():
        if name.startswith("mtp."):
            assert grad is None or not grad.any(), name


def test_mtp_loss_auto_scaler_scale_applies_like_stock() -> None:
    """Megatron's schedules set the AutoScaler's scale to the main loss scale; the hooks obey it too."""
    twins = build_twins(TinyGPT(vocab_size=VOCAB))
    hooked, batch = twins.hooked, make_batch(VOCAB)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    twins.assert_step_matches(batch)

    # and the scale really matters: at scale 1 the MTP gradients differ
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    other = TinyGPT(vocab_size=VOCAB).build()
    other_hooks = mtp_hooks.attach(other)
    hooked_train_step(other, other_hooks, batch)
    mtp_weight = "mtp.layers.0.eh_proj.weight"
    torch.testing.assert_close(grads_of(other)[mtp_weight] * 0.25, grads_of(hooked)[mtp_weight])


# ----------------------------------------------------------------- how targets come in


def test_positional_labels_match_stock() -> None:
    stock, hooked = TWIN_SHAPE.build(), TWIN_SHAPE.build()
    batch = make_batch(VOCAB, mask="none")
    # GPTModel.forward(input_ids, position_ids, attention_mask, decoder_input, labels, ...)
    stock_loss = stock(batch.input_ids, batch.position_ids, None, None, batch.labels)
    stock_loss.mean().backward()
    mtp_hooks.attach(hooked)
    logits = hooked(batch.input_ids, batch.position_ids, None, None, batch.labels)
    main_ce_from_logits(logits, batch.labels).mean().backward()
    assert_same_grads(hooked, stock)


def test_bool_loss_mask_matches_float_mask() -> None:
    twins = build_twins(TinyGPT(vocab_size=VOCAB))
    batch = make_batch(VOCAB)
    stock = twins.stock_step(batch)
    assert twins.hooks is not None
    with twins.hooks.micro_batch(batch.labels, batch.loss_mask.bool()):
        logits = twins.hooked(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert torch.equal(logits.detach(), stock.logits)
    assert_same_mtp_losses(twins.hooks.metrics(), stock.mtp_losses)
    twins.assert_same_grads()


# ------------------------------------------------------------------ micro-batch schedules


def test_accumulating_trained_and_skipped_micro_batches_matches_stock() -> None:
    """Train MTP on micro-batches 1 and 3, skip it on 2; stock gets MTP weight 0 on micro-batch 2."""
    stock, hooked = TWIN_SHAPE.build(), TWIN_SHAPE.build()
    batches = [make_batch(VOCAB, seed=seed) for seed in range(3)]
    stock_train_step(stock, batches[0])
    stock_main_only_step(stock, batches[1])
    stock_train_step(stock, batches[2])

    hooks = mtp_hooks.attach(hooked)
    mtp_calls = []
    hooked.mtp.register_forward_pre_hook(lambda *_: mtp_calls.append(1))
    hooked_train_step(hooked, hooks, batches[0])
    skipped = hooked(*batches[1].model_args)  # no targets: an inference micro-batch, MTP does not run
    masked_mean(main_ce_from_logits(skipped, batches[1].labels), batches[1].loss_mask).backward()
    hooked_train_step(hooked, hooks, batches[2])

    assert len(mtp_calls) == 2
    assert_same_grads(hooked, stock)


# --------------------------------------------------------------------- packed sequences


def packed_batch() -> tuple[Batch, PackedSeqParams]:
    """Three sequences of 5, 4 and 3 tokens packed into one THD row."""
    lengths = [5, 4, 3]
    batch = make_batch(VOCAB, batch=1, seq=sum(lengths))
    batch.position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    return batch, params


@needs_packed_mtp
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_packed_sequences_match_stock(position_embedding_type: str, loss_impl: str) -> None:
    shape = TinyGPT(vocab_size=VOCAB, position_embedding_type=position_embedding_type)
    stock, hooked = shape.build(), shape.build()
    batch, params = packed_batch()
    per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, packed_seq_params=params)
    masked_mean(per_token, batch.loss_mask).backward()
    stock_losses = stock_mtp_losses()

    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args, packed_seq_params=params)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()

    assert_same_grads(hooked, stock)
    mask = batch.loss_mask[0]
    # depth k never reaches across a sequence boundary: the last k tokens of every sequence drop out
    tokens = [
        float(sum(mask[start + k : end].sum() for start, end in ((0, 5), (5, 9), (9, 12)))) for k in (1, 2)
    ]
    assert_metrics_match_stock(hooks.metrics(), stock_losses, tokens)


@needs_packed_mtp
def test_packed_sequences_differ_from_unpacked() -> None:
    """Guard for the test above: without ``packed_seq_params`` depth k would reach across boundaries."""
    packed, unpacked = TWIN_SHAPE.build(), TWIN_SHAPE.build()
    batch, params = packed_batch()
    tokens = {}
    for name, model, extra in (("packed", packed, {"packed_seq_params": params}), ("unpacked", unpacked, {})):
        hooks = mtp_hooks.attach(model)
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            logits = model(*batch.model_args, **extra)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
        tokens[name] = hooks.metrics()["mtp_1/tokens"]
    mask = batch.loss_mask[0]
    assert tokens["unpacked"] == mask[1:].sum()
    assert tokens["packed"] == mask[1:].sum() - mask[5] - mask[9]  # targets at the first tokens of sequences 2, 3
    weight = "mtp.layers.0.eh_proj.weight"
    assert not torch.allclose(grads_of(packed)[weight], grads_of(unpacked)[weight])


@needs_packed_mtp
@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
def test_a_packed_batchs_own_cp_group_rolls_the_mtp_layers_inputs(detach_encoder: bool) -> None:
    """Dynamic CP (``packed_seq_params.cp_group``): the MTP layers roll their input ids with the batch's own
    group while the block runs, with or without ``detach_encoder``, as the targets roll (``_mcore.cp_group_of``),
    and have their own group back after the forward. (One rank: the values are the same either way; what is
    pinned is the group.)"""
    dynamic = torch.distributed.new_group([0], backend="gloo")
    model = TWIN_SHAPE.build()
    batch, params = packed_batch()
    layers = list(model.mtp.layers)
    static = [layer.cp_group for layer in layers]
    seen: list[list[Any]] = []
    model.embedding.register_forward_pre_hook(lambda module, args: seen.append([layer.cp_group for layer in layers]))
    hooks = mtp_hooks.attach(model, detach_encoder=detach_encoder)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args, packed_seq_params=dataclasses.replace(params, cp_group=dynamic))
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    before_block, in_block = seen[0], seen[1:]  # the decoder's embedding call, then MTP layer k's (its k-th)
    assert all(group is own for group, own in zip(before_block, static))
    assert len(in_block) == len(layers) and all(groups[k] is dynamic for k, groups in enumerate(in_block))
    assert all(layer.cp_group is own for layer, own in zip(layers, static))


# --------------------------------------------------------------- masks with nothing to learn


@pytest.mark.skipif(
    hasattr(gpt_model, "process_mtp_loss"),
    reason="process_mtp_loss (megatron-core 0.17+) clamps the token count at 1: stock gives 0, not NaN "
    "(parity there: test_mcore_versions.py::test_depths_without_targets_match_stock_where_it_clamps)",
)
def test_depths_without_targets_contribute_nothing_where_stock_gives_nan() -> None:
    """Only position 0 unmasked: every MTP target is masked. Stock divides 0 by 0; the hooks add 0."""
    stock, hooked, reference = TWIN_SHAPE.build(), TWIN_SHAPE.build(), TWIN_SHAPE.build()
    batch = make_batch(VOCAB, mask="zeros")
    batch.loss_mask[:, 0] = 1

    stock_train_step(stock, batch)
    assert all(torch.isnan(torch.tensor(stock_mtp_losses())))
    assert not all(torch.isfinite(g).all() for g in grads_of(stock).values() if g is not None)

    stock_main_only_step(reference, batch)
    hooks = mtp_hooks.attach(hooked)
    hooked_train_step(hooked, hooks, batch)
    assert_same_grads(hooked, reference)
    metrics = hooks.metrics()
    for k in (1, 2):
        assert metrics[f"mtp_{k}/tokens"] == 0
        assert f"mtp_{k}/loss" not in metrics and f"mtp_{k}/acc" not in metrics  # no ratio of 0 tokens
