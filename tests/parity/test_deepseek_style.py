"""DeepSeek-style models (MLA + MoE + MTP, MTP layers MoE too) with hooks, side by side with stock.

Twin ``TinyDeepSeek`` models (same seed): multi-latent attention, one dense then one MoE decoder
layer (4 routed experts, top-2, a shared expert, auxiliary load-balancing loss, experts run one by
one: ``SequentialMLP`` with ``moe_grouped_gemm=False``), MTP depth N = 1 or 2 with MoE MTP layers.
Stock mcore is called with labels; the hooked twin returns logits. Compared: main logits
(bit-equal), per-depth MTP losses, every parameter's gradient (routers and experts included) and
mcore's MoE auxiliary-loss tracker (``get_moe_layer_wise_logging_tracker``). Inference
micro-batches run no MTP MoE layer, record nothing for the MTP layers in the tracker and do the
FLOPs of the same model without MTP layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyDeepSeek, assert_same_grads, main_ce_from_logits, make_batch, masked_mean, output_layer_calls
from mtp_hooks.testing import stock_mtp_losses
from tests.support.mcore_moe import DEEPSEEK_MISSING, forward_calls, moe_tracker_values, mtp_moe_layers, reduce_moe_tracker, reset_moe_process_state
from tests.support.mcore_moe import routers
from tests.support.mcore_moe import moe_on_cpu  # noqa: F401 (autouse: MoE and MLA on CPU, an empty MoE tracker)
from tests.support.probes import assert_training_forward_counts_more_flops, counted_flops, hooked_with_reference

pytestmark = [
    pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}"),
    pytest.mark.usefixtures("one_intra_op_thread"),
]

VOCAB = 64
SEQ = 16



def stock_step(model: nn.Module, batch: Batch) -> tuple[Tensor, list[float]]:
    """Stock training step; returns the main logits ``[b, s, V]`` and mcore's per-depth MTP losses."""
    with output_layer_calls(model) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    return calls[-1].transpose(0, 1), stock_mtp_losses()


def hooked_step(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    """Hooked training step: logits out, the same masked-mean main CE computed from them."""
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return logits.detach()


def without_mtp_twin(model: nn.Module, shape: TinyDeepSeek) -> nn.Module:
    """The same model built without MTP layers, holding ``model``'s decoder, embedding and head weights."""
    twin = TinyDeepSeek(**{**shape.__dict__, "mtp_num_layers": None}).build()
    weights = {name: value for name, value in model.state_dict().items() if not name.startswith("mtp.")}
    result = twin.load_state_dict(weights, strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")], result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    for name, parameter in twin.named_parameters():
        assert torch.equal(parameter, model.get_parameter(name)), name
    return twin


# ------------------------------------------------------------------------------- training


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("depth", [1, 2])
def test_training_micro_batches_match_stock_with_moe_mtp_layers(depth: int, loss_impl: str) -> None:
    """Two micro-batches: logits bit-equal, MTP losses, every gradient and the MoE tracker equal stock."""
    shape = TinyDeepSeek(vocab_size=VOCAB, mtp_num_layers=depth)
    stock, hooked = shape.build(seed=3), shape.build(seed=3)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    batches = [make_batch(VOCAB, batch=2, seq=SEQ, mask=mask, seed=i) for i, mask in enumerate(("random", "ones"))]

    stock_out = [stock_step(stock, batch) for batch in batches]
    stock_tracker = moe_tracker_values()
    reset_moe_process_state()
    hooked_logits, hooked_losses = [], []
    for batch in batches:
        with forward_calls(routers(hooked)) as ran:
            hooked_logits.append(hooked_step(hooked, hooks, batch))
        assert sorted(ran) == sorted(routers(hooked)), "every decoder and MTP router runs in training"
        metrics = hooks.metrics()
        hooked_losses.append([metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)])
    hooked_tracker = moe_tracker_values()

    for (logits, losses), actual_logits, actual_losses in zip(stock_out, hooked_logits, hooked_losses):
        assert torch.equal(actual_logits, logits)
        assert len(losses) == depth
        assert actual_losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert_same_grads(hooked, stock)
    for name, p in hooked.named_parameters():
        if name.startswith("mtp.") or ".mlp.router." in name or ".experts." in name:
            assert p.grad is not None and p.grad.any(), f"{name}: no gradient"

    # One slot per decoder and MTP layer. (Which slot an MTP router adds to differs by release:
    # 0.14 adds it to slot 1, its inner layer's number; 0.16 to a slot of its own.)
    assert list(hooked_tracker) == list(stock_tracker) == ["load_balancing_loss"]
    values = stock_tracker["load_balancing_loss"]
    assert values.shape == (shape.num_layers + depth,) and values.any()
    torch.testing.assert_close(hooked_tracker["load_balancing_loss"], values, rtol=1e-5, atol=1e-6)


def stock_then_hooked(shape: Any, seed: int) -> tuple[nn.Module, nn.Module, list[float], dict[str, Tensor], dict[str, float]]:
    """Twins of ``shape`` built with ``seed``: one stock step, then one hooked step on the same batch
    (its logits equal stock's); ``(stock, hooked, stock MTP losses, stock MoE tracker, hooked metrics)``."""
    stock, hooked = shape.build(seed=seed), shape.build(seed=seed)
    batch = make_batch(VOCAB, batch=2, seq=SEQ, seed=seed)
    stock_logits, stock_losses = stock_step(stock, batch)
    stock_tracker = moe_tracker_values()
    reset_moe_process_state()
    hooks = mtp_hooks.attach(hooked)
    assert torch.equal(hooked_step(hooked, hooks, batch), stock_logits)
    return stock, hooked, stock_losses, stock_tracker, hooks.metrics()


def test_tied_embeddings_with_moe_mtp_layers_match_stock() -> None:
    stock, hooked, stock_losses, stock_tracker, metrics = stock_then_hooked(TinyDeepSeek(vocab_size=VOCAB, mtp_num_layers=2, tied=True), 5)
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5, abs=1e-6)
    assert_same_grads(hooked, stock)
    torch.testing.assert_close(moe_tracker_values(), stock_tracker, rtol=1e-5, atol=1e-6)


def test_decoder_and_mtp_layers_run_mla_and_sequential_experts() -> None:
    """The pin above covers mcore's ``SequentialMLP`` (``moe_grouped_gemm=False``) and MLA, as intended."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    model = TinyDeepSeek(vocab_size=VOCAB).build()
    kinds = {type(m) for m in model.modules()}
    assert SequentialMLP in kinds and MLASelfAttention in kinds
    inner = "mtp_model_layer" if getattr(model.mtp.layers[0], "mtp_model_layer", None) is not None else "transformer_layer"
    expected = ["decoder.layers.1.mlp.router", *(f"mtp.layers.{k}.{inner}.mlp.router" for k in range(2))]
    assert sorted(routers(model)) == expected


# ------------------------------------------------------------------------------- inference


@pytest.mark.parametrize("kind", ["no_grad", "no_labels"])
def test_inference_micro_batch_runs_no_mtp_moe_layer_and_records_nothing_for_it(kind: str) -> None:
    """After a training micro-batch, an inference one (``no_grad``, or no labels with grad on).

    No MTP MoE layer runs; the MTP layers' tracker slots keep the training values. Under
    ``no_grad`` nothing changes; without labels the decoder's MoE layer adds exactly what the
    model without MTP layers records for the same batch. The logits equal stock's main logits.
    """
    shape = TinyDeepSeek(vocab_size=VOCAB, mtp_num_layers=2)
    stock, hooked = shape.build(seed=4), shape.build(seed=4)
    hooks = mtp_hooks.attach(hooked)
    train, infer = make_batch(VOCAB, seq=SEQ, seed=1), make_batch(VOCAB, seq=SEQ, seed=2)
    hooked_step(hooked, hooks, train)
    after_training = moe_tracker_values()["load_balancing_loss"]
    reset_moe_process_state()
    without_mtp = without_mtp_twin(hooked, shape)
    if kind == "no_labels":
        without_mtp(*infer.model_args)
    decoder_only = moe_tracker_values().get("load_balancing_loss", torch.zeros(shape.num_layers))
    reset_moe_process_state()  # the twin's tracker has no slots for MTP layers
    with output_layer_calls(stock) as calls:
        stock(*infer.model_args, labels=infer.labels, loss_mask=infer.loss_mask)
    stock_logits = calls[-1].transpose(0, 1)
    reset_moe_process_state()

    hooked_step(hooked, hooks, train)  # the tracker as after training, again
    hooks.metrics()
    with forward_calls(routers(hooked)) as ran, forward_calls(mtp_moe_layers(hooked)) as mtp_ran:
        if kind == "no_grad":
            with torch.no_grad(), hooks.micro_batch(infer.labels, infer.loss_mask):
                logits = hooked(*infer.model_args)
        else:
            logits = hooked(*infer.model_args)
    assert mtp_ran == [] and ran == ["decoder.layers.1.mlp.router"]
    assert hooks.metrics() == {}
    assert torch.equal(logits.detach(), stock_logits)
    tracker = moe_tracker_values()["load_balancing_loss"]
    assert tracker.shape == (shape.num_layers + 2,)
    torch.testing.assert_close(tracker[shape.num_layers :], after_training[shape.num_layers :], rtol=0, atol=0)
    expected_decoder = after_training[: shape.num_layers] + decoder_only
    torch.testing.assert_close(tracker[: shape.num_layers], expected_decoder, rtol=1e-6, atol=0)
    if kind == "no_labels":
        assert decoder_only[1] > 0, "the decoder's MoE layer recorded no loss without labels"
    reduce_moe_tracker()  # one rank: reduces in place without error
    torch.testing.assert_close(moe_tracker_values()["load_balancing_loss"], tracker)


@pytest.mark.parametrize("with_labels", [False, True], ids=["no_labels", "labels_under_no_grad"])
def test_inference_flops_equal_the_model_without_mtp_layers(with_labels: bool) -> None:
    """A hooked inference forward of the MoE + MTP model does the FLOPs of its decoder and head alone.

    The reference is a twin built without MTP layers holding the same weights, so it routes every
    token to the same experts; the counter is shown to see MTP work by a training forward.
    """
    model, hooks, reference, batch = hooked_with_reference(TinyDeepSeek(vocab_size=VOCAB, mtp_num_layers=2), without_mtp_twin, VOCAB, SEQ, seed=6)

    with torch.no_grad():
        expected_flops, expected_logits = counted_flops(lambda: reference(*batch.model_args))
        if with_labels:
            with hooks.micro_batch(batch.labels, batch.loss_mask):
                flops, logits = counted_flops(lambda: model(*batch.model_args))
        else:
            flops, logits = counted_flops(lambda: model(*batch.model_args))
    assert torch.equal(logits, expected_logits)
    assert flops == expected_flops > 0
    assert_training_forward_counts_more_flops(hooks, model, batch, flops)


# ------------------------------------------------------------------------------- hybrid


def test_hybrid_model_with_moe_layers_matches_stock() -> None:
    from mtp_hooks.testing import TinyHybridMoE
    from tests.support.mcore_moe import HYBRID_MOE_MISSING

    if HYBRID_MOE_MISSING is not None:
        pytest.skip(HYBRID_MOE_MISSING)
    shape = TinyHybridMoE(vocab_size=VOCAB)
    stock, hooked, stock_losses, stock_tracker, metrics = stock_then_hooked(shape, 8)
    assert len(stock_losses) == shape.mtp_num_layers
    assert [metrics[f"mtp_{k}/loss"] for k in range(1, len(stock_losses) + 1)] == pytest.approx(stock_losses, rel=1e-5, abs=1e-6)
    assert_same_grads(hooked, stock)
    assert any(name.startswith("mtp.") for name in routers(hooked)), "the hybrid MTP layers hold no MoE layer"
    assert stock_tracker, "the hybrid model's MoE layers recorded no auxiliary loss"
    torch.testing.assert_close(moe_tracker_values(), stock_tracker, rtol=1e-5, atol=1e-6)
