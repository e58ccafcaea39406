"""mcore's MTP logging tracker (``MTPLossLoggingHelper``), filled by the hooks as stock fills it.

Megatron's ``training_log`` (through ``track_mtp_metrics``) and verl's Megatron actor read the
per-depth MTP losses from this process-wide tracker; with the hooks attached they must find what
stock mcore of the installed release would have written: same keys, same values, same groups.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, hooked_train_step, make_batch, stock_train_step

VOCAB = 64
TENSOR_KEYS = ("values", "loss_values", "correct_values", "total_values")


def tracker_snapshot() -> dict[str, Any]:
    """The tracker's entries (tensors cloned), then the tracker emptied."""
    snapshot = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in MTPLossLoggingHelper.tracker.items()}
    MTPLossLoggingHelper.tracker.clear()
    return snapshot


def assert_same_tracker(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    assert any(key in expected for key in TENSOR_KEYS), expected
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
        else:
            assert actual[key] is value, key  # the same process groups


@pytest.mark.parametrize("mask", ["random", "ones", "none"])
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"detach_encoder": True, "detach_head": True}], ids=["lean", "dense", "detached"])
def test_training_micro_batches_fill_the_tracker_like_stock(options: dict[str, Any], mask: str) -> None:
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)
    stock, hooked = spec.build(seed=2), spec.build(seed=2)
    hooks = mtp_hooks.attach(hooked, **options)
    batches = [make_batch(VOCAB, seq=10, mask=mask, seed=i) for i in range(2)]
    MTPLossLoggingHelper.tracker.clear()
    for batch in batches:  # two micro-batches accumulate, as in a Megatron iteration
        stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    expected = tracker_snapshot()
    for batch in batches:
        hooked_train_step(hooked, hooks, batch)
    assert_same_tracker(tracker_snapshot(), expected)


def tie_output_rows(model: torch.nn.Module, ties: str) -> None:
    """Make the output weight's rows tie the logits: every row equal to row 0 (``"all rows"``),
    row 2i+1 equal to row 2i (``"pairs"``), or every row nearly row 0 (``"near rows"``: logits that
    tie once rounded to a bf16 model's)."""
    with torch.no_grad():
        weight = model.output_layer.weight
        if ties == "all rows":
            weight.copy_(weight[:1].expand_as(weight))
        elif ties == "pairs":
            weight[1::2] = weight[0::2]
        else:
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
            weight.copy_(weight[:1] + 3e-5 * noise.to(weight.dtype))


@pytest.mark.parametrize("ties", ["all rows", "pairs", "near rows"])
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"detach_encoder": True, "detach_head": True}], ids=["lean", "dense", "detached"])
def test_acceptance_counts_give_ties_to_the_first_index_as_stock(options: dict[str, Any], ties: str) -> None:
    """Stock 0.19 counts a position as correct when ``argmax == label``, the first of tied maxima
    winning; the hooks' counts must be stock's, also where tied or bf16-rounded logits tie."""
    dtype = torch.bfloat16 if ties == "near rows" else torch.float32
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2, params_dtype=dtype)
    stock, hooked = spec.build(seed=2), spec.build(seed=2)
    for model in (stock, hooked):
        tie_output_rows(model, ties)
    if dtype == torch.bfloat16:
        stock, hooked = Float16Module(stock.config, stock), Float16Module(hooked.config, hooked)
    hooks = mtp_hooks.attach(hooked, **options)
    batch = make_batch(VOCAB, seq=12, mask="ones", seed=8)
    MTPLossLoggingHelper.tracker.clear()
    stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    expected = tracker_snapshot()
    if "correct_values" not in expected:
        pytest.skip("this megatron-core records no MTP acceptance counts (0.19+ does)")
    hooked_train_step(hooked, hooks, batch)
    actual = tracker_snapshot()
    assert expected["total_values"].tolist() == [22.0, 20.0]
    assert actual["correct_values"].tolist() == expected["correct_values"].tolist()
    assert actual["total_values"].tolist() == expected["total_values"].tolist()
    torch.testing.assert_close(actual["loss_values"], expected["loss_values"], rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}], ids=["lean", "dense"])
def test_masked_in_labels_outside_the_vocabulary_log_stocks_loss_with_validation_off(options: dict[str, Any]) -> None:
    """``validate="off"`` checks no label values, as stock: a masked-in -100 gets mcore's CE
    (target logit = the row's maximum), so the logged loss is stock's, in ``metrics()`` and in
    mcore's tracker."""
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)
    stock, hooked = spec.build(seed=2), spec.build(seed=2)
    hooks = mtp_hooks.attach(hooked, validate="off", **options)
    batch = make_batch(VOCAB, seq=10, mask="ones", seed=9)
    labels = batch.labels.clone()
    labels[:, 3::4] = -100
    batch = Batch(batch.input_ids, batch.position_ids, labels, batch.loss_mask)
    stock_train_step(stock, batch)
    expected = tracker_snapshot()
    hooked_train_step(hooked, hooks, batch)
    assert_same_tracker(tracker_snapshot(), expected)
    metrics = hooks.metrics()
    stock_losses = expected.get("loss_values", expected.get("values"))
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses.tolist(), rel=1e-5)


def test_megatron_track_mtp_metrics_logs_the_same_losses() -> None:
    spec = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)
    stock, hooked = spec.build(seed=3), spec.build(seed=3)
    hooks = mtp_hooks.attach(hooked)
    batch = make_batch(VOCAB, seq=12, seed=5)
    logged: list[dict[str, Any]] = []
    for run in (lambda: stock_train_step(stock, batch), lambda: hooked_train_step(hooked, hooks, batch)):
        MTPLossLoggingHelper.tracker.clear()
        run()
        MTPLossLoggingHelper.tracker["avg_group"] = None  # gloo has no AVG reduction; one rank averages to itself
        total: dict[str, Any] = {}
        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0, iteration=1, writer=None, total_loss_dict=total)
        logged.append({name: float(value) for name, value in total.items()})
    stock_logged, hooked_logged = logged
    assert {"mtp_1 loss", "mtp_2 loss"} <= stock_logged.keys()
    assert hooked_logged.keys() == stock_logged.keys()
    assert hooked_logged == pytest.approx(stock_logged, rel=1e-5)


@pytest.mark.parametrize("mode", ["no_grad", "no_labels", "eval"])
def test_inference_and_eval_micro_batches_write_nothing_to_the_tracker(mode: str) -> None:
    """Inference does no MTP work; in eval mode stock trains MTP but does not log it, nor do the hooks."""
    model = TinyGPT(vocab_size=VOCAB).build(seed=4)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=6)
    MTPLossLoggingHelper.tracker.clear()
    if mode == "no_grad":
        with torch.no_grad(), hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    elif mode == "no_labels":
        model(*batch.model_args)
    else:
        model.eval()
        hooked_train_step(model, hooks, batch)
        assert hooks.metrics()["mtp_1/tokens"] > 0  # it trained
    assert MTPLossLoggingHelper.tracker == {}


def test_a_failed_forward_writes_nothing_to_the_tracker() -> None:
    model = TinyGPT(vocab_size=VOCAB).build(seed=4)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=7)

    def fail(*_: Any) -> None:
        raise RuntimeError("injected")

    handle = model.output_layer.register_forward_hook(fail)
    MTPLossLoggingHelper.tracker.clear()
    with pytest.raises(RuntimeError, match="injected"), hooks.micro_batch(batch.labels, batch.loss_mask):
        model(*batch.model_args)
    handle.remove()
    assert MTPLossLoggingHelper.tracker == {}


def test_remove_gives_back_the_depths_a_chain_grew_the_tracker_to() -> None:
    """A chain of k > N steps grows mcore's process-wide tracker to k depths; after ``remove()`` a model
    with N = 2 logs its two depths only (no phantom ``mtp_3`` / ``mtp_4`` at 0.0 every iteration)."""
    for before in (None, "stock"):
        MTPLossLoggingHelper.tracker.clear()
        if before == "stock":  # a tracker made by a stock forward first
            stock = TinyGPT(vocab_size=VOCAB).build()
            stock_train_step(stock, make_batch(VOCAB, batch=2, seq=8))
        chained = TinyGPT(vocab_size=VOCAB).build()
        hooks = mtp_hooks.attach(chained, draft_steps=4)
        hooked_train_step(chained, hooks, make_batch(VOCAB, batch=2, seq=8))
        assert all(v.shape[0] == 4 for v in MTPLossLoggingHelper.tracker.values() if isinstance(v, torch.Tensor))
        hooks.remove()
        other = TinyGPT(vocab_size=VOCAB).build()
        other_hooks = mtp_hooks.attach(other)
        hooked_train_step(other, other_hooks, make_batch(VOCAB, batch=2, seq=8))
        lengths = {v.shape[0] for v in MTPLossLoggingHelper.tracker.values() if isinstance(v, torch.Tensor) and v.dim() == 1}
        assert lengths == {2}, (before, lengths)
        other_hooks.remove()
    MTPLossLoggingHelper.tracker.clear()
