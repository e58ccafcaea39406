"""``start_embedding="zeroed"``: draft step 1 reads zeros as MTP layer 1's token embedding at each sequence's position 0,
as vLLM's drafters feed it. The reference is the definition by plain hooks on a model attached with the default
(``"kept"``): MTP layer 1's first call per forward gets its embedding's output with row 0 zeroed. Same weights, same
batch: MTP losses, logits and every gradient equal; and unlike ``"kept"``'s."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, hooked_train_step, make_batch
from mtp_hooks.testing.twins.batches import main_ce_from_logits, masked_mean
from tests.support.mcore_cpu import needs_packed_mtp

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ROPE = TinyGPT(vocab_size=64, mtp_num_layers=2, position_embedding_type="rope")
OPTIONS = {
    "depths": {},
    "first_k3_argmax": {"draft_steps": 3, "draft_inputs": "argmax", "draft_layers": "first"},
    "detach_encoder": {"detach_encoder": True},
    "engine_first_k3_argmax": {"draft_steps": 3, "draft_inputs": "argmax", "draft_layers": "first", "draft_geometry": "engine"},
    "pre_norm_k2": {"draft_steps": 2, "draft_inputs": "argmax", "draft_layers": "first", "mtp_input": "pre_final_norm"},
}


def _zero_row_0_on_first_call(model: nn.Module) -> list[Any]:
    """The definition: MTP layer 1's first call per forward embeds zeros at position 0 (row 0 of ``[s, b, h]``)."""
    seen: list[int] = []

    def wrap(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if seen:
            return None
        seen.append(1)
        embedding = kwargs["embedding"]

        def zeroed(**call: Any) -> torch.Tensor:
            out = embedding(**call)
            return torch.cat([torch.zeros_like(out[:1]), out[1:]])

        kwargs["embedding"] = zeroed
        return args, kwargs

    return [model.register_forward_pre_hook(lambda *_: seen.clear()),
            model.mtp.layers[0].register_forward_pre_hook(wrap, with_kwargs=True, prepend=True)]


def _step(model: nn.Module, **options: Any) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with mtp_hooks.attached(model, agreement_metrics=True, **options) as hooks:
        logits = hooked_train_step(model, hooks, make_batch(64, seq=12, seed=3))
        metrics = hooks.metrics()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits, metrics, grads


@pytest.mark.parametrize("name", list(OPTIONS))
def test_zeroed_start_trains_what_layer_1_computes_with_zeros_at_position_0(name: str) -> None:
    options = OPTIONS[name]
    model = ROPE.build(5)
    logits, metrics, grads = _step(model, start_embedding="zeroed", **options)
    handles = _zero_row_0_on_first_call(model)
    try:
        ref_logits, ref_metrics, ref_grads = _step(model, **options)
    finally:
        for handle in handles:
            handle.remove()
    kept_logits, kept_metrics, kept_grads = _step(model, **options)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-7), key
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-7, msg=key)
    # The option changes what trains: step 1's loss and MTP layer 1's gradients differ from kept's.
    assert metrics["mtp_1/loss"] != pytest.approx(kept_metrics["mtp_1/loss"], rel=1e-7)
    assert not torch.allclose(grads["mtp.layers.0.eh_proj.weight"], kept_grads["mtp.layers.0.eh_proj.weight"])
    torch.testing.assert_close(logits, kept_logits, rtol=0, atol=0)  # the main head's output is not touched


def test_the_vllm_profile_trains_the_zeroed_start() -> None:
    from mtp_hooks.profiles import vllm

    model = TinyGPT(vocab_size=64, mtp_num_layers=1, position_embedding_type="rope").build(5)
    with mtp_hooks.attached(model, engine=vllm("0.32", "mimo", 2)) as hooks:
        assert hooks.options.start_embedding == "zeroed"
    with pytest.raises(mtp_hooks.MTPHooksError, match="^start_embedding: "):
        mtp_hooks.attach(model, engine=vllm("0.32", "mimo", 2), start_embedding="kept_please")
    assert mtp_hooks.hooks_of(model) is None


def test_start_embedding_is_checked() -> None:
    model = ROPE.build(5)
    with pytest.raises(mtp_hooks.MTPHooksError, match="^start_embedding: bad value"):
        mtp_hooks.attach(model, start_embedding="zero")
    assert mtp_hooks.hooks_of(model) is None


@needs_packed_mtp
@pytest.mark.parametrize("options", [{}, {"draft_steps": 3, "draft_inputs": "argmax", "draft_layers": "first", "draft_geometry": "engine"}],
                         ids=["depths", "engine_first_k3_argmax"])
def test_packed_sequences_zero_each_sequences_start(options: dict[str, Any]) -> None:
    """THD with padding: every packed sequence's first row is zeroed, as each row of an unpacked batch. Two sequences of
    6 tokens, each padded to 8, packed, against the same two as rows (and unlike the packed run with kept starts)."""
    length, padded = 6, 8
    rows = make_batch(64, batch=2, seq=length, seed=5)
    assert rows.loss_mask is not None

    def padded_rows(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.cat([t, torch.full((2, padded - length), fill, dtype=t.dtype)], 1).reshape(1, -1)

    packed = Batch(padded_rows(rows.input_ids, 0), torch.arange(padded).repeat(2)[None], padded_rows(rows.labels, 0),
                   padded_rows(rows.loss_mask, 0))
    bounds, slots = torch.tensor([0, 6, 12], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=slots,
                             cu_seqlens_kv_padded=slots, max_seqlen_q=8, max_seqlen_kv=8)
    runs = []
    for batch, extra, start in ((rows, {}, "zeroed"), (packed, {"packed_seq_params": params}, "zeroed"),
                                (packed, {"packed_seq_params": params}, "kept")):
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        net = ROPE.build(11)
        with mtp_hooks.attached(net, start_embedding=start, **options) as hooks:
            with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                logits = net(*batch.model_args, **extra)
            masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
            runs.append((hooks.metrics(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
    (metrics, expected), (packed_metrics, got), (kept_metrics, _) = runs
    for key in (k for k in metrics if k.endswith("/loss")):
        assert packed_metrics[key] == pytest.approx(metrics[key], rel=1e-5), key
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert kept_metrics["mtp_1/loss"] != pytest.approx(packed_metrics["mtp_1/loss"], rel=1e-6)
