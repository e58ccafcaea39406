"""The draft chain (``draft_steps``, ``draft_inputs``; ``mtp_hooks.features.chain``) beyond the parity matrix.

The matrix (``parity.AXES["chain"]``) runs k = 2 (own argmax drafts), 3 (teacher-forced) and 4
(own argmax drafts) on the N = 2 twins against stock's own k-depth loss with the chain applied by
hooks (``stock_references.stock_chain``), over every other knob and TP / SP / CP. Here: k = N teacher-forced
bit for bit against no option, sampled drafts against a dense Gumbel reference, the sampler's
distribution, packed sequences, mcore's repeated layer, per-step metrics and the refusals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks import MTPHooksError
from mtp_hooks.ops.drafts import draft_tokens, gumbel_noise
from mtp_hooks.testing import TinyGPT, assert_same_grads, grads_of, hooked_train_step, make_batch, masked_mean, stock_mtp_losses
from tests.support.mcore_cpu import needs_packed_mtp
from tests.support.parity import Case
from tests.support.stock_references import stock_chain

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)
HAS_REPEATED_LAYER = "mtp_use_repeated_layer" in {field.name for field in dataclasses.fields(TransformerConfig)}


def _train(options: dict[str, Any], seed: int = 0, **shape: Any) -> tuple[torch.nn.Module, dict[str, float], torch.Tensor]:
    model = TinyGPT(vocab_size=VOCAB, **shape).build()
    hooks = mtp_hooks.attach(model, **options)
    torch.manual_seed(seed)
    logits = hooked_train_step(model, hooks, make_batch(VOCAB, batch=2, seq=8))
    return model, hooks.metrics(), logits


@pytest.mark.parametrize("options", [{}, {"agreement_metrics": True, "objective": "tv"}, {"loss_impl": "dense"}, {"detach_encoder": True, "detach_between_depths": True}])
def test_n_teacher_forced_steps_are_todays_path_bit_for_bit(options: dict[str, Any]) -> None:
    base, base_metrics, base_logits = _train(options)
    chain, chain_metrics, chain_logits = _train({**options, "draft_steps": 2, "draft_inputs": "labels"})
    assert torch.equal(base_logits, chain_logits)
    assert base_metrics == chain_metrics
    for name, grad in grads_of(base).items():
        other = grads_of(chain)[name]
        assert (grad is None) == (other is None) and (grad is None or torch.equal(grad, other)), name


def _sampled_reference(temperature: float) -> tuple[torch.nn.Module, list[float]]:
    """Stock with the chain's definition (``stock_references.stock_chain``'s argmax reference, the draws
    replaced by a dense Gumbel-max sample: the same noise from the same generator state)."""
    model = SHAPE.build()
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, 0))

    def feed(layer: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            with torch.no_grad():
                hidden = kwargs["hidden_states"]
                logits = (hidden @ model.output_layer.weight.t()).float()
                s, b = logits.shape[:2]
                noise = gumbel_noise(s * b, VOCAB, logits.device).view(s, b, VOCAB)
                drafts = (logits / temperature + noise).argmax(-1).t().contiguous()
            embedding = kwargs["embedding"]
            kwargs["embedding"] = lambda **call: embedding(**{**call, "input_ids": drafts})
        return args, kwargs

    for layer in model.mtp.layers:
        layer.register_forward_pre_hook(feed, with_kwargs=True)
    batch = make_batch(VOCAB, batch=2, seq=8)
    stock_mtp_losses()
    torch.manual_seed(0)
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    return model, stock_mtp_losses()


def test_sampled_drafts_match_a_dense_gumbel_reference() -> None:
    stock, stock_losses = _sampled_reference(0.7)
    hooked, metrics, _ = _train({"draft_inputs": "sample", "draft_temperature": 0.7, "agreement_metrics": True, "chunk_size": 1 << 20})
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5)
    assert_same_grads(hooked, stock)
    argmax, argmax_metrics, _ = _train({"draft_inputs": "argmax"})
    assert argmax_metrics["mtp_2/loss"] != pytest.approx(metrics["mtp_2/loss"], rel=1e-4), "the sample fed the argmax"


def test_sampled_drafts_follow_the_tempered_distribution() -> None:
    torch.manual_seed(0)
    weight = torch.randn(5, 3)
    hidden = torch.randn(1, 3).expand(40_000, 3).contiguous()
    for temperature in (1.0, 0.5):
        tokens = draft_tokens(hidden, weight, None, 4096, temperature)
        expected = torch.softmax((hidden[0] @ weight.t()) / temperature, -1)
        share = torch.bincount(tokens, minlength=5).double() / len(tokens)
        stderr = (expected * (1 - expected) / len(tokens)).sqrt()
        assert ((share - expected).abs() <= 4 * stderr + 1e-12).all(), (temperature, share, expected)
    tied = torch.tensor([[0.0], [2.0], [2.0], [1.0]])  # logits 0, 2, 2, 1 for a hidden state of 1
    assert draft_tokens(torch.ones(1, 1), tied, None, 1, None).tolist() == [1]  # ties: the lowest id


@needs_packed_mtp
@pytest.mark.parametrize("chain", ["k3", "k4_argmax"])
def test_packed_sequences_keep_every_step_inside_its_sequence(chain: str) -> None:
    """THD: the chain against stock's own k-depth packed loss with the chain applied by hooks."""
    lengths = [6, 5, 4]
    batch = make_batch(VOCAB, batch=1, seq=sum(lengths))
    batch.position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 6, 11, 15], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    case = Case(chain=chain)
    stock, hooked = SHAPE.build(), SHAPE.build()
    with stock_chain(stock, case.chain):
        stock_mtp_losses()
        per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, packed_seq_params=params)
        masked_mean(per_token, batch.loss_mask).backward()
        stock_losses = stock_mtp_losses()
    hooks = mtp_hooks.attach(hooked, **case.options)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args, packed_seq_params=params)
    from mtp_hooks.testing import main_ce_from_logits

    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    metrics = hooks.metrics()
    steps = case.steps
    assert [metrics[f"mtp_{k}/loss"] for k in range(1, steps + 1)] == pytest.approx(stock_losses, rel=1e-5)
    mask = batch.loss_mask[0]
    bounds = ((0, 6), (6, 11), (11, 15))
    for k in range(1, steps + 1):  # step k never reaches across a sequence boundary
        assert metrics[f"mtp_{k}/tokens"] == float(sum(mask[start + k : end].sum() for start, end in bounds))
    assert_same_grads(hooked, stock)


@pytest.mark.skipif(not HAS_REPEATED_LAYER, reason="megatron-core < 0.17: no mtp_use_repeated_layer")
@pytest.mark.parametrize("steps", [2, 3])
def test_one_layer_chain_teacher_forced_equals_stocks_repeated_layer(steps: int) -> None:
    """N = 1 with ``draft_steps=k`` is stock's ``mtp_use_repeated_layer`` with k depths (same weights)."""
    hooked = TinyGPT(vocab_size=VOCAB, mtp_num_layers=1).build()
    stock = TinyGPT(vocab_size=VOCAB, mtp_num_layers=steps, config_overrides={"mtp_use_repeated_layer": True}).build()
    assert len(stock.mtp.layers) == 1
    stock.load_state_dict(hooked.state_dict())
    batch = make_batch(VOCAB, batch=2, seq=8)
    stock_mtp_losses()
    masked_mean(stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch.loss_mask).backward()
    stock_losses = stock_mtp_losses()
    hooks = mtp_hooks.attach(hooked, draft_steps=steps)
    hooked_train_step(hooked, hooks, batch)
    metrics = hooks.metrics()
    assert [metrics[f"mtp_{k}/loss"] for k in range(1, steps + 1)] == pytest.approx(stock_losses, rel=1e-5)
    assert_same_grads(hooked, stock)


def test_every_step_reports_its_acceptance_and_the_chain_its_length() -> None:
    _, metrics, _ = _train({"draft_steps": 4, "draft_inputs": "argmax", "agreement_metrics": True})
    for k in range(1, 5):
        assert 0.0 <= metrics[f"mtp_{k}/accept"] <= 1.0 and f"mtp_{k}/agree" in metrics
    assert "mtp_5/loss" not in metrics
    assert 0.0 <= metrics["mtp/accept_len"] <= 4.0
    _, two, _ = _train({"agreement_metrics": True})
    assert metrics["mtp/accept_len"] > two["mtp/accept_len"], "two more steps add to the expected length"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"draft_steps": 1}, "draft_steps: .*expected: None or an int >= the model's 2 MTP layers.*received: 1"),
        ({"draft_steps": 0}, "draft_steps: .*expected: None or an int >= 1.*received: 0"),
        ({"draft_steps": 2.0}, "draft_steps: .*expected: None or an int >= 1.*received: 2.0"),
        ({"draft_inputs": "greedy"}, "draft_inputs: .*expected: 'labels' or 'argmax' or 'sample'.*received: 'greedy'"),
        ({"draft_inputs": "argmax", "draft_temperature": 0.7}, "draft_temperature: .*expected: 1.0 unless.*draft_inputs='sample'"),
    ],
)
def test_bad_chain_options_are_refused_at_attach(options: dict[str, Any], match: str) -> None:
    with pytest.raises(MTPHooksError, match=f"(?s){match}"):
        mtp_hooks.attach(SHAPE.build(), **options)


def test_own_drafts_refuse_an_output_layer_whose_call_does_more() -> None:
    model = SHAPE.build()
    model.output_layer.register_forward_hook(lambda *_: None)  # a foreign hook: the lean heads cannot reproduce the call
    hooks = mtp_hooks.attach(model, draft_inputs="argmax")
    with pytest.raises(MTPHooksError, match="draft_inputs: own drafts"):
        hooked_train_step(model, hooks, make_batch(VOCAB, batch=2, seq=8))
    assert model.config.mtp_num_layers == 2 and model.mtp_process  # left stock


def test_a_checkpoint_recompute_draws_the_same_sampled_drafts() -> None:
    """torch.utils.checkpoint restores the RNG state for its recompute, so the recomputed chain is fed
    the drafts its forward drew: the gradients are those of the plain forward."""
    options = {"draft_steps": 3, "draft_inputs": "sample", "draft_temperature": 0.7}
    plain, _, _ = _train(options)
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, **options)
    batch = make_batch(VOCAB, batch=2, seq=8)
    torch.manual_seed(0)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = torch.utils.checkpoint.checkpoint(model, *batch.model_args, use_reentrant=False)
    from mtp_hooks.testing import main_ce_from_logits

    torch.manual_seed(1)  # the backward's recompute must not depend on the generator's state by then
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(model, plain)


# --------------------------------------------------------------------------- the layer schedule (draft_layers)


def _counting_model(random_layers: tuple[int, ...] = (), seed: int = 3) -> torch.nn.Module:
    """A TinyGPT whose greedy next token after x is x + 1 and whose MTP layers are perfect drafts of it,
    except the layers in ``random_layers`` (their eh_proj random): every residual branch zero, no
    positions, ``output_layer[y] = LayerNorm(E[y - 1])``, each MTP layer's ``eh_proj = [I, 0]`` (it
    passes the next token's embedding on, so its head predicts that token + 1)."""
    model = SHAPE.build(seed)
    hidden = SHAPE.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("linear_proj", "linear_fc2", "position_embeddings")):
                param.zero_()
        embedding = model.embedding.word_embeddings.weight
        embedding.copy_(torch.randn(VOCAB, hidden, generator=gen))
        normed = torch.nn.functional.layer_norm(embedding, (hidden,))
        model.output_layer.weight.copy_(torch.roll(normed, 1, 0))
        for index, layer in enumerate(model.mtp.layers):
            eye = torch.eye(hidden) if index not in random_layers else torch.randn(hidden, hidden, generator=gen)
            layer.eh_proj.weight.copy_(torch.cat([eye, torch.zeros(hidden, hidden)], dim=1))
    return model


def _agreement(model: torch.nn.Module, **options: Any) -> dict[str, float]:
    hooks = mtp_hooks.attach(model, agreement_metrics=True, **{"draft_inputs": "argmax", **options})
    ids = (torch.arange(16).unsqueeze(0) + torch.tensor([[3], [40]])) % VOCAB  # counting: the target's own greedy rollouts
    batch = make_batch(VOCAB, batch=2, seq=16, mask="ones")
    batch.input_ids, batch.labels = ids, torch.roll(ids, -1, 1)
    hooked_train_step(model, hooks, batch)
    return hooks.metrics()


def test_the_first_layer_schedule_predicts_what_an_engine_running_layer_1_for_every_step_accepts() -> None:
    """vLLM 0.32 runs MTP layer 1 for every draft step. A model whose layer 1 is a perfect draft and
    layer 2 a random one: under ``draft_layers="first"`` both steps agree with the target everywhere
    (what that engine accepts, [1, 1]); under ``"per_step"`` step 2 is layer 2 and does not."""
    first = _agreement(_counting_model(random_layers=(1,)), draft_layers="first")
    per_step = _agreement(_counting_model(random_layers=(1,)))
    assert (first["mtp_1/agree"], first["mtp_2/agree"]) == (1.0, 1.0)
    assert per_step["mtp_1/agree"] == 1.0 and per_step["mtp_2/agree"] < 0.5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("accept_rule", ["argmax", "sampled", "match"])
def test_the_first_layer_schedules_acceptance_follows_its_steps_under_every_rule(accept_rule: str, temperature: float) -> None:
    """``accept_rule`` with ``draft_layers="first"``: ``mtp_j/accept`` and ``mtp/accept_len`` are draft
    step j's, whichever layer ran it, under the rule. The counting model's layer 1 drafts the target's
    own (sharp) distribution, so every rule accepts both of its steps ([1, 1], length 2; exactly at
    T = 0, where every rule is argmax agreement); under ``"per_step"`` step 2 is the random layer 2."""
    options = dict(accept_rule=accept_rule, draft_temperature=temperature, draft_inputs="sample")
    first = _agreement(_counting_model(random_layers=(1,)), draft_layers="first", **options)
    per_step = _agreement(_counting_model(random_layers=(1,)), **options)
    tol = 0.0 if temperature == 0.0 else 1e-3
    assert [first["mtp_1/accept"], first["mtp_2/accept"], first["mtp/accept_len"]] == pytest.approx([1.0, 1.0, 2.0], abs=2 * tol)
    assert per_step["mtp_1/accept"] == pytest.approx(1.0, abs=tol) and per_step["mtp_2/accept"] < 0.01


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"objective": "accept", "draft_temperature": 0.7},  # the argmax rule's surrogate
        {"objective": "accept", "draft_temperature": 0.0},  # greedy: the CE against the target's argmax
        {"objective": "accept", "accept_rule": "match", "draft_temperature": 0.7},
    ],
    ids=["ce", "accept-argmax", "accept-argmax-greedy", "accept-match"],
)
def test_the_first_layer_schedule_leaves_the_other_layers_untrained(options: dict[str, Any]) -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, draft_layers="first", draft_steps=3, **options)
    hooked_train_step(model, hooks, make_batch(VOCAB, batch=2, seq=8))
    grads = grads_of(model)
    assert all(grads[name] is None for name in grads if name.startswith("mtp.layers.1.")), "layer 2 runs no step"
    assert grads["mtp.layers.0.eh_proj.weight"] is not None and grads["mtp.layers.0.eh_proj.weight"].any()
    metrics = hooks.metrics()
    assert sorted(k for k in metrics if k.endswith("/loss")) == ["mtp_1/loss", "mtp_2/loss", "mtp_3/loss"]
    if options:  # a draft objective measures every step's acceptance under its rule
        assert sorted(k for k in metrics if k.endswith("/accept")) == ["mtp_1/accept", "mtp_2/accept", "mtp_3/accept"]


@pytest.mark.parametrize("steps", [None, 2])
def test_on_one_layer_both_schedules_are_the_same_bit_for_bit(steps: Any) -> None:
    base, base_metrics, base_logits = _train({"draft_steps": steps, "draft_inputs": "argmax"}, mtp_num_layers=1)
    first, first_metrics, first_logits = _train({"draft_steps": steps, "draft_inputs": "argmax", "draft_layers": "first"}, mtp_num_layers=1)
    assert torch.equal(base_logits, first_logits) and base_metrics == first_metrics
    assert_same_grads(first, base)


def test_the_first_layer_schedule_may_train_fewer_steps_than_layers() -> None:
    _, metrics, _ = _train({"draft_layers": "first", "draft_steps": 1})
    assert "mtp_1/loss" in metrics and "mtp_2/loss" not in metrics
    with pytest.raises(MTPHooksError, match="(?s)draft_layers: .*expected: 'per_step' or 'first'.*received: 'last'"):
        mtp_hooks.attach(SHAPE.build(), draft_layers="last")
