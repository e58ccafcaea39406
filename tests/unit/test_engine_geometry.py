"""``draft_geometry="engine"`` against a one-start-at-a-time reference built from the model's own modules.

The reference drafts each start p alone, as an engine reusing one MTP layer does: step 1 is the block's own
teacher-forced call (a twin hooked with ``draft_steps=1``, weighted as one of k steps, whose step-1 path is stock's
per the parity matrix); step j >= 2 runs the MTP layer's transformer layer over step 1's body inputs at positions
0..p followed by steps 2..j's own inputs of that start (positions p + 1 .. p + j - 1, causal, rotary as at those
positions), and its loss is mcore's depth-j loss at p (labels and mask rolled j times), weighted
``loss_scale * w_j / k`` over the starts it counts (``draft_step_weights``). Losses (``mtp_j/loss``) and every
parameter's gradient must agree. On a tiny model's default initialisation the two geometries barely differ, so
the weights are scaled up and the norms moved off 1; the chain geometry is checked to differ from the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

import mtp_hooks
from mtp_hooks.models import mtp_layer_body
from mtp_hooks.testing import Batch, TinyGPT, TinyQwen, make_batch
from mtp_hooks.testing.twins.batches import main_ce_from_logits, masked_mean
from tests.support.geometry_weights import spread
from tests.support.mcore_cpu import needs_packed_mtp

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, SEQ, SCALE = 64, 10, 0.3
SHAPE = TinyGPT(vocab_size=VOCAB, mtp_num_layers=1, position_embedding_type="rope")
# name: (the model, what feeds steps 2..k, which layers draft, step weights); the reference drafts with layer 1
CASES: dict[str, tuple[Any, str, str, tuple[float, ...]]] = {
    "one_layer_labels": (SHAPE, "labels", "per_step", (1.0, 1.0, 1.0)),
    "gqa_argmax": (TinyQwen(vocab_size=VOCAB, mtp_num_layers=1), "argmax", "per_step", (1.0, 1.0, 1.0)),
    "two_layers_first": (TinyGPT(vocab_size=VOCAB, mtp_num_layers=2, position_embedding_type="rope"), "labels", "first",
                         (1.0, 1.0, 1.0)),
    "step_weights": (SHAPE, "labels", "per_step", (0.5, 1.75, 0.25)),
}


def model(shape: Any = SHAPE) -> nn.Module:
    return spread(shape.build(11), 6.0)  # far from the default init, where the two geometries draft alike


def grads(net: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


def hooked(batch: Batch, steps: int, geometry: str, case: str) -> tuple[dict[str, float], dict[str, Tensor]]:
    shape, inputs, layers, weights = CASES[case]
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    net = model(shape)
    options = dict(draft_steps=steps, loss_scale=SCALE, draft_geometry=geometry, draft_inputs=inputs, draft_layers=layers,
                   draft_step_weights=weights[:steps])
    with mtp_hooks.attached(net, **options) as hooks:
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            logits = net(*batch.model_args)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
        return hooks.metrics(), grads(net)


def _project(layer: nn.Module, embedded: Tensor, hidden: Tensor) -> Tensor:
    out = layer.eh_proj(torch.cat((layer.enorm(embedded), layer.hnorm(hidden)), -1))
    return out[0] if isinstance(out, tuple) else out


def reference(batch: Batch, steps: int, case: str) -> tuple[dict[str, float], dict[str, Tensor]]:
    shape, inputs, layers, weights = CASES[case]
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    net = model(shape)
    layer, body = net.mtp.layers[0], mtp_layer_body(net.mtp.layers[0])
    seen: dict[str, Tensor] = {}
    def body_input(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen.setdefault("x1", kwargs["hidden_states"])

    def layer_output(module: nn.Module, args: Any, out: Any) -> None:
        seen.setdefault("y1", out[0])

    handles = [body.register_forward_pre_hook(body_input, with_kwargs=True), layer.register_forward_hook(layer_output)]
    ids, labels = batch.input_ids, batch.labels
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(labels, dtype=torch.float32)
    b, s = ids.shape
    with mtp_hooks.attached(net, draft_steps=1, loss_scale=SCALE * weights[0] / steps, draft_layers="first") as hooks:
        with hooks.micro_batch(labels=labels, loss_mask=batch.loss_mask):
            logits = net(*batch.model_args)
        step_one = hooks.metrics(reset=False)
    for handle in handles:
        handle.remove()
    rotary = net.rotary_pos_emb(s + steps)
    total = masked_mean(main_ce_from_logits(logits, labels), batch.loss_mask)
    metrics = {"mtp_1/loss": step_one["mtp_1/loss"]}
    for j in range(2, steps + 1):
        ce_sum, counted = torch.zeros(()), torch.zeros(())
        for row in range(b):
            for p in range(s):
                at = p + j
                if at >= s or not mask[row, at]:
                    continue  # no target: the start does not count
                parts, hidden = [seen["x1"][: p + 1, row]], seen["y1"][p, row]  # step 1's cache up to p
                for i in range(2, j + 1):  # step i embeds the data's token at p + i (mcore's depth-i roll) or the
                    if inputs == "argmax":  # previous step's draft: the head's first argmax on its output
                        token = F.linear(hidden.detach(), net.output_layer.weight.detach()).argmax()
                    else:
                        token = ids[row, p + i] if p + i < s else torch.zeros((), dtype=torch.long)
                    embedded = net.embedding(input_ids=token.view(1, 1), position_ids=torch.zeros(1, 1, dtype=torch.long))
                    parts.append(_project(layer, embedded[0], hidden[None]))
                    seq = torch.cat(parts)[:, None]  # [p + i, 1, h]: positions 0 .. p + i - 1
                    out = body(hidden_states=seq, attention_mask=None, rotary_pos_emb=rotary[: seq.shape[0]])
                    hidden = layer.final_layernorm((out[0] if isinstance(out, tuple) else out)[-1, 0])
                head = F.linear(hidden, net.output_layer.weight).float()
                ce_sum = ce_sum + F.cross_entropy(head[None], labels[row, at].view(1)) * mask[row, at]
                counted = counted + mask[row, at]
        metrics[f"mtp_{j}/loss"] = float(ce_sum / counted)
        total = total + SCALE * weights[j - 1] / steps * ce_sum / counted.clamp(min=1)
    total.backward()
    return metrics, grads(net)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("steps", [2, 3])
def test_engine_geometry_equals_each_start_drafted_alone(steps: int, case: str) -> None:
    batch = make_batch(VOCAB, seq=SEQ, seed=3)
    expected_metrics, expected = reference(batch, steps, case)
    metrics, got = hooked(batch, steps, "engine", case)
    for j in range(1, steps + 1):
        assert metrics[f"mtp_{j}/loss"] == pytest.approx(expected_metrics[f"mtp_{j}/loss"], rel=1e-5, abs=1e-5), j
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    chain_metrics, chain = hooked(batch, steps, "chain", case)  # the geometry matters on these weights
    assert abs(chain_metrics["mtp_2/loss"] - expected_metrics["mtp_2/loss"]) > 1e-3
    assert any(not torch.allclose(chain[n], expected[n], rtol=1e-4, atol=1e-5) for n in expected if n.startswith("mtp."))


@pytest.mark.parametrize(
    ("shape", "options", "message"),
    [
        (TinyGPT(vocab_size=VOCAB, mtp_num_layers=1), {"draft_steps": 3}, "position_embedding_type='learned_absolute'"),
        (SHAPE, {"draft_steps": 1}, "draft_steps=1"),
        (TinyGPT(vocab_size=VOCAB, mtp_num_layers=2, position_embedding_type="rope"), {"draft_steps": 3},
         "over 2 block step"),
        (SHAPE, {"draft_steps": 3, "draft_geometry": "cache"}, "received: 'cache'"),
    ],
    ids=["learned_absolute", "one_step", "per_step_layers", "unknown"],
)
def test_what_the_engine_geometry_cannot_train_is_refused(shape: Any, options: dict[str, Any], message: str) -> None:
    net = shape.build(1)
    options = {"draft_geometry": "engine", **options}
    with pytest.raises(mtp_hooks.MTPHooksError, match=rf"(?s)^draft_geometry: bad value.*{message}"):
        mtp_hooks.attach(net, **options)
    assert mtp_hooks.hooks_of(net) is None
    two_layers = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2, position_embedding_type="rope").build(1)
    mtp_hooks.attach(two_layers, draft_steps=3, draft_layers="first", draft_geometry="engine").remove()  # layer 1 drafts all


@needs_packed_mtp
@pytest.mark.parametrize("inputs", ["labels", "argmax"])
def test_packed_sequences_draft_as_each_sequence_alone(inputs: str) -> None:
    """THD with padding: step 1's cache stops at each sequence's start, and the rotary positions restart there. Two
    sequences of 6 tokens, each padded to 8, packed, against the same two as rows of an unpacked batch."""
    length, padded, steps = 6, 8, 3
    rows = make_batch(VOCAB, batch=2, seq=length, seed=5)
    assert rows.loss_mask is not None

    def padded_rows(t: Tensor, fill: float) -> Tensor:
        return torch.cat([t, torch.full((2, padded - length), fill, dtype=t.dtype)], 1).reshape(1, -1)

    packed = Batch(padded_rows(rows.input_ids, 0), torch.arange(padded).repeat(2)[None], padded_rows(rows.labels, 0),
                   padded_rows(rows.loss_mask, 0))
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=torch.tensor([0, 6, 12], dtype=torch.int32),
        cu_seqlens_kv=torch.tensor([0, 6, 12], dtype=torch.int32),
        cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor([0, 8, 16], dtype=torch.int32), max_seqlen_q=8, max_seqlen_kv=8,
    )
    runs = []
    for batch, extra in ((rows, {}), (packed, {"packed_seq_params": params})):
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        net = model()
        with mtp_hooks.attached(net, draft_steps=steps, draft_geometry="engine", draft_inputs=inputs) as hooks:
            with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                logits = net(*batch.model_args, **extra)
            masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
            runs.append((hooks.metrics(), grads(net)))
    (metrics, expected), (packed_metrics, got) = runs
    for j in range(1, steps + 1):
        assert packed_metrics[f"mtp_{j}/tokens"] == metrics[f"mtp_{j}/tokens"]
        assert packed_metrics[f"mtp_{j}/loss"] == pytest.approx(metrics[f"mtp_{j}/loss"], rel=1e-5), j
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
