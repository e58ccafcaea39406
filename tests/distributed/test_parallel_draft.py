"""Draft objectives, agreement metrics and ``output="logprobs"`` across ranks (two CPU processes, gloo).

Reference: the same full weights at TP = 1. Twin builds with mcore's CPU initialisation draw the
full weight matrices from the seed and give each TP rank its slices, so a TP=2 model gathered
along each parameter's ``partition_dim`` is the TP=1 model (checked exactly first). Each case
(``"ce"`` + agreement metrics, ``"distill"``, ``"tv"``, ``"accept"`` under each acceptance rule and
at T = 0, and ``output="logprobs"`` with entropy, temperature and agreement) runs one training micro-batch at TP=1, then at TP=2 (with and without
sequence parallelism); MTP metrics (CE, accuracy, agreement, acceptance), returned log-probs and
entropies (and an inference micro-batch's), and every parameter's gradient gathered over the TP
group (summed over it for sequence-parallel norms) must equal the TP=1 result.

Function level, the vocabulary-parallel reductions of ``lean_mtp_loss`` (every objective, rule and
temperature, T = 0 included) and ``lean_logprobs`` (argmax ties across shards included) against
dense full-vocabulary references; and with CP=2,
agreement sums and (per-token loss, mcore <= 0.16.1) summed gradients of ``"distill"`` against the
whole sequence at CP=1, which needs teachers exchanged across CP ranks; and ``start_embedding="zeroed"``, whose
position 0 only CP rank 0 holds (and under sequence parallelism only TP rank 0: the case ``zeroed_start``).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks import _mcore
from mtp_hooks.testing import Batch, TinyGPT, context_parallel_positions, make_batch, masked_mean, output_layer_calls
from tests.support.distributed import SpawnedGroup

SEED = 1234
VOCAB = 96  # divisible by 2 for vocabulary shards
CASES: dict[str, dict[str, Any]] = {
    "ce_agreement": dict(agreement_metrics=True),
    "distill": dict(objective="distill"),
    "tv": dict(objective="tv", chunk_size=5),
    "accept_hot": dict(objective="accept", draft_temperature=1.7, chunk_size=5),
    "accept_greedy": dict(objective="accept", draft_temperature=0.0, chunk_size=5),
    "accept_match": dict(objective="accept", accept_rule="match", draft_temperature=1.3),
    "accept_sampled": dict(objective="accept", accept_rule="sampled", draft_temperature=0.7, chunk_size=5),
    "agreement_cold": dict(agreement_metrics=True, draft_temperature=0.6),
    "logprobs": dict(output="logprobs", entropy=True, temperature=0.8, agreement_metrics=True, chunk_size=6),
    # vLLM's zeroed token embedding at position 0: under sequence parallelism only the rank holding row 0 zeroes it
    "zeroed_start": dict(start_embedding="zeroed", agreement_metrics=True),
}


# ------------------------------------------------------------------ functions run on every rank


def _build(overrides: Optional[dict[str, Any]] = None) -> nn.Module:
    """The tiny model with heads that partly agree (as in ``test_draft_objectives.build``):
    output weight scaled to logits of order one, one shared bias on every final norm."""
    model = TinyGPT(vocab_size=VOCAB, config_overrides=overrides or {}).build(SEED)
    bias = 3.0 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.output_layer.weight.mul_(10.0)
        for norm in [model.decoder.final_layernorm, *(layer.final_layernorm for layer in model.mtp.layers)]:
            norm.bias.copy_(bias)
    return model


def _batch() -> tuple[Batch, Tensor]:
    batch = make_batch(VOCAB, batch=2, seq=8, seed=3)
    return batch, torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def _full(parameter: Tensor, value: Tensor, group: Any, sum_sequence_parallel: bool) -> Tensor:
    """``value`` (the parameter or its gradient) as at TP=1: vocabulary / head shards gathered along
    ``partition_dim``; gradients of sequence-parallel norms summed over the TP group."""
    value = value.detach().clone()
    if sum_sequence_parallel and getattr(parameter, "sequence_parallel", False):
        dist.all_reduce(value, group=group)
    if not getattr(parameter, "tensor_model_parallel", False):
        return value
    if getattr(parameter, "partition_stride", 1) != 1:
        raise AssertionError("strided partitions are not expected in the tiny model")
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=parameter.partition_dim)


def _train_and_infer(model: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """One training micro-batch (user loss on logits or log-probs) and, for log-probs, one inference one."""
    batch, advantages = _batch()
    hooks = mtp_hooks.attach(model, **options)
    out: dict[str, Any] = {}
    output = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    if options.get("output") == "logprobs":
        mask = batch.loss_mask
        loss = -(advantages * output.logprobs * mask).sum() / mask.sum() - 0.05 * (output.entropy * mask).sum() / mask.sum()
        out["logprobs"], out["entropy"] = output.logprobs.detach(), output.entropy.detach()
    else:
        logits = output.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        loss = masked_mean(model.compute_language_model_loss(batch.labels, logits), batch.loss_mask)
    loss.backward()
    out["metrics"] = hooks.metrics()
    if options.get("output") == "logprobs":
        with torch.no_grad():
            inference = model(*batch.model_args, labels=batch.labels)
        out["inference_logprobs"], out["inference_entropy"] = inference.logprobs, inference.entropy
    hooks.remove()
    return out


def scenario_full_vocabulary_reference() -> dict[str, Any]:
    """TP=1: every case's results and gradients, and the full weights."""
    model = _build()
    results: dict[str, Any] = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for name, options in CASES.items():
        model = _build()
        results[name] = _train_and_infer(model, options)
        results[name]["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return results


def scenario_tensor_parallel(case: str, sequence_parallel: bool, reference: dict[str, Any]) -> dict[str, float]:
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    model = _build({"sequence_parallel": sequence_parallel})
    assert model.output_layer.weight.shape[0] == VOCAB // 2
    for name, parameter in model.named_parameters():
        assert torch.equal(_full(parameter, parameter, tp_group, False), reference["weights"][name]), f"{name}: not the TP=1 weights"
    out = _train_and_infer(model, CASES[case])
    expected = reference[case]
    assert out["metrics"].keys() == expected["metrics"].keys()
    assert {"mtp_1/agree", "mtp_2/accept"} <= out["metrics"].keys()
    for key, value in expected["metrics"].items():
        assert out["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for key in ("logprobs", "entropy", "inference_logprobs", "inference_entropy"):
        if key in expected:
            torch.testing.assert_close(out[key], expected[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    for name, parameter in model.named_parameters():
        grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
        full = _full(parameter, grad, tp_group, sum_sequence_parallel=True)
        ref = expected["grads"].get(name, torch.zeros_like(full))
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    return out["metrics"]


def scenario_vocab_parallel_functions() -> None:
    """``lean_mtp_loss`` and ``lean_logprobs`` on this rank's vocabulary shard against full-vocabulary
    float64 references; the head has a row duplicated across the two shards, so argmax ties span
    ranks (lowest index wins, as ``torch.argmax``)."""
    from megatron.core import parallel_state

    from mtp_hooks.ops.logprobs import lean_logprobs
    from mtp_hooks.ops.draft_rule import ACCEPT_RULES, OBJECTIVES, DraftRule
    from mtp_hooks.ops.lean_loss import KernelSpec, lean_mtp_loss
    from mtp_hooks.ops.vocab_parallel import argmax_matches
    from tests.support.draft_references import acceptance, per_token_objective

    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    tokens, hidden_size, vocab = 12, 5, 16
    gen = torch.Generator().manual_seed(5)  # the same draws on both ranks
    hidden = torch.randn(tokens, hidden_size, generator=gen, dtype=torch.float64)
    teacher = 0.8 * hidden + 0.6 * torch.randn(tokens, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    token_weight = torch.rand(tokens, generator=gen, dtype=torch.float64)
    token_weight[::4] = 0
    best = int((hidden[0] @ weight.t()).argmax())
    twin_row = (best + vocab // 2) % vocab  # the same row in the other shard: token 0 ties across ranks
    weight[twin_row] = weight[best]
    labels[0] = max(best, twin_row)  # the later index of the tie: not the first argmax, so not correct
    rows = slice(rank * vocab // 2, (rank + 1) * vocab // 2)

    def shard_leaves() -> tuple[Tensor, Tensor]:
        return hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)

    def reduced_hidden_grad(grad: Tensor) -> Tensor:
        grad = grad.clone()  # each rank's hidden gradient is its shard's part; the TP region sums them
        dist.all_reduce(grad, group=group)
        return grad

    for objective, accept_rule, temperature in itertools.product(OBJECTIVES, ACCEPT_RULES, (0.0, 0.6, 1.0, 1.7)):
        if (objective in ("distill", "tv") or (objective == "accept" and accept_rule != "argmax")) and temperature == 0:
            continue  # undefined at T = 0 (refused: tests/unit/test_accept_rule.py)
        rule = DraftRule(objective, temperature, accept_rule)
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            # fp64 tightly; fp32 and bf16 leaves against the float64 reference on their rounded values
            # (bf16: logits as the bf16 GEMM gives them, gradients float64's), at their precision.
            tol = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-6, 1e-4), torch.bfloat16: (3e-3, 2e-2)}[dtype]
            h, w = (t.detach().to(dtype).requires_grad_(True) for t in shard_leaves())
            out = lean_mtp_loss(h, w, labels, token_weight.to(dtype), KernelSpec(group, 5), rule, teacher.to(dtype))
            out.objective.backward()
            full_weight = weight.to(dtype).double()
            ref_h, ref_w = hidden.to(dtype).double().clone().requires_grad_(True), full_weight.clone().requires_grad_(True)
            logits, teacher_logits = ref_h @ ref_w.t(), teacher.to(dtype).double() @ full_weight.t()
            if dtype == torch.bfloat16:
                low = (hidden.to(dtype) @ weight.to(dtype).t()).double()
                logits = logits + (low - logits).detach()
                teacher_logits = (teacher.to(dtype) @ weight.to(dtype).t()).double()
            ce = -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            alpha = acceptance(logits, teacher_logits, temperature, accept_rule)
            per_token = per_token_objective(objective, logits, teacher_logits, labels, temperature, accept_rule)
            (per_token * token_weight).sum().backward()
            where = f"{objective} {accept_rule} T={temperature} {dtype}"
            atol, rtol = tol
            close = lambda a, b, what: torch.testing.assert_close(  # noqa: E731
                a.double(), b.detach().double(), atol=atol, rtol=rtol, msg=lambda m: f"{where} {what}: {m}"
            )
            close(out.objective.detach(), (per_token * token_weight).sum(), "objective")
            close(out.ce, ce, "CE")
            close(out.accept, alpha, "acceptance")
            close(reduced_hidden_grad(h.grad), ref_h.grad, "hidden grad")
            close(w.grad, ref_w.grad[rows], "weight grad")
            if dtype == torch.float64:
                agree = logits.argmax(-1) == teacher_logits.argmax(-1)
                assert bool(agree[0]), "the tie case should agree on the lowest index"
                assert torch.equal(out.agree, agree), where
                assert torch.equal(out.correct, logits.argmax(-1) == labels)  # stock 0.19's count: the first argmax

    # No teacher ("ce" alone: the first-argmax candidates reduced once for all chunks), labels
    # outside the vocabulary included (validate="off"): stock's CE, logsumexp - max, and not correct.
    h, w = shard_leaves()
    outside = labels.clone()
    outside[1], outside[2] = -100, vocab
    out = lean_mtp_loss(h, w, outside, token_weight, KernelSpec(group, 5))
    logits = hidden @ weight.t()
    ce = logits.logsumexp(-1) - logits.gather(-1, outside.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    ce[1:3] = logits.logsumexp(-1)[1:3] - logits.amax(-1)[1:3]
    torch.testing.assert_close(out.ce, ce, atol=1e-12, rtol=1e-10)
    assert torch.equal(out.correct, logits.argmax(-1) == outside) and not bool(out.correct[:3].any())
    assert torch.equal(argmax_matches(logits[:, rows], outside, group), logits.argmax(-1) == outside)

    h, w = shard_leaves()
    out = lean_logprobs(h, w, labels, group, 5, 0.9, True)
    (token_weight * out.logprobs + 0.3 * out.entropy).sum().backward()
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_p = ((ref_h @ ref_w.t()) / 0.9).log_softmax(-1)
    ref_logprobs, ref_entropy = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    (token_weight * ref_logprobs + 0.3 * ref_entropy).sum().backward()
    torch.testing.assert_close(out.logprobs.detach(), ref_logprobs.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.entropy.detach(), ref_entropy.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(reduced_hidden_grad(h.grad), ref_h.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w.grad, ref_w.grad[rows], atol=1e-12, rtol=1e-10)


def _stock_accept_len(model: nn.Module, batch: Batch, temperature: float, positions: Tensor, accept_rule: str) -> float:
    """``mtp/accept_len`` of the sequence positions ``positions`` from stock's own logits (CP=1):
    ``alpha_k(t)`` the acceptance of depth k's draft at t by the main head at t+k under ``accept_rule``
    (``test_draft_objectives.acceptance``), ``sum_k mean_t prod_{j<=k} alpha_j(t)`` over the positions
    where ``loss_mask[t+j]`` counts for every ``j <= k`` (``t+j`` inside the row)."""
    from tests.support.draft_references import acceptance

    with output_layer_calls(model) as calls:
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    depth = model.config.mtp_num_layers
    main = calls[-1].double()  # [s, b, V]
    seq = main.shape[0]
    chain_alpha, chain_mask = torch.ones(seq, main.shape[1], dtype=torch.float64), torch.ones(seq, main.shape[1], dtype=torch.float64)
    length = 0.0
    for k in range(1, depth + 1):
        alpha, mask = torch.zeros_like(chain_alpha), torch.zeros_like(chain_mask)
        alpha[: seq - k] = acceptance(calls[k - 1].double()[: seq - k], main[k:], temperature, accept_rule)
        mask[: seq - k] = batch.loss_mask.t()[k:].double()
        chain_alpha, chain_mask = chain_alpha * alpha, chain_mask * mask
        picked = chain_mask[positions]
        length += float((chain_alpha[positions] * picked).sum() / picked.sum())
    return length


def _context_parallel_share(full: Batch) -> tuple[Any, Batch]:
    """From here on CP = 2: the context-parallel group and this rank's share of ``full`` (16 tokens, mcore's chunks)."""
    from megatron.core import parallel_state

    from mtp_hooks.testing import init_parallel

    init_parallel(context_parallel_size=2)
    index = context_parallel_positions(16, parallel_state.get_context_parallel_rank(), 2)
    local = Batch(full.input_ids[:, index], full.position_ids[:, index], full.labels[:, index], full.loss_mask[:, index])
    return parallel_state.get_context_parallel_group(), local


def _assert_gradients_add_up(model: nn.Module, reference_grads: dict[str, Tensor], cp_group: Any) -> None:
    """Every gradient summed over the CP ranks equals the whole sequence's at CP = 1."""
    for name, parameter in model.named_parameters():
        grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.detach().clone()
        dist.all_reduce(grad, group=cp_group)
        ref = reference_grads.get(name, torch.zeros_like(grad))
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def scenario_context_parallel_zeroed_start() -> None:
    """``start_embedding="zeroed"`` at CP=2 against the whole sequence at CP=1 (``calculate_per_token_loss``): only CP
    rank 0 holds position 0, so the ranks' token-weighted CE sums and gradients add up to the whole sequence's."""
    overrides = {"calculate_per_token_loss": True}
    full = make_batch(VOCAB, batch=2, seq=16, seed=6)

    def step(model: nn.Module, batch: Batch, start: str = "zeroed") -> dict[str, float]:
        hooks = mtp_hooks.attach(model, start_embedding=start)
        logits = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        per_token = model.compute_language_model_loss(batch.labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format))
        (per_token * batch.loss_mask).sum().backward()
        metrics = hooks.metrics()
        hooks.remove()
        return metrics

    reference = _build(overrides)
    reference_metrics = step(reference, full)
    reference_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    kept_metrics = step(_build(overrides), full, "kept")
    assert kept_metrics["mtp_1/loss"] != pytest.approx(reference_metrics["mtp_1/loss"], rel=1e-6)  # the option matters here
    cp_group, local = _context_parallel_share(full)
    model = _build(overrides)
    metrics = step(model, local)
    for k in (1, 2):
        tokens = metrics[f"mtp_{k}/tokens"]
        sums = torch.tensor([tokens, metrics[f"mtp_{k}/loss"] * tokens if tokens else 0.0], dtype=torch.float64)
        dist.all_reduce(sums, group=cp_group)
        ref_tokens = reference_metrics[f"mtp_{k}/tokens"]
        expected = torch.tensor([ref_tokens, reference_metrics[f"mtp_{k}/loss"] * ref_tokens], dtype=torch.float64)
        torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-6, msg=lambda m: f"depth {k} (tokens, loss): {m}")
    if not _mcore.PER_TOKEN_LOSS_RESCALED:
        _assert_gradients_add_up(model, reference_grads, cp_group)


def scenario_context_parallel_distill(
    gradients: bool, objective: str = "distill", temperature: float = 1.0, accept_rule: str = "argmax"
) -> dict[str, float]:
    """CP=2 against the whole sequence at CP=1, ``calculate_per_token_loss`` (nothing normalised per
    rank): token-weighted agreement, acceptance and CE sums per depth add up over the CP ranks and,
    with ``gradients``, so do the gradients. Each rank's ``mtp/accept_len`` is that of its own
    positions, from stock's logits of the whole sequence (the teachers cross CP ranks)."""
    from megatron.core import parallel_state

    overrides = {"calculate_per_token_loss": True}
    full = make_batch(VOCAB, batch=2, seq=16, seed=6)

    def step(model: nn.Module, batch: Batch) -> dict[str, float]:
        hooks = mtp_hooks.attach(model, objective=objective, draft_temperature=temperature, accept_rule=accept_rule)
        logits = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        per_token = model.compute_language_model_loss(batch.labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format))
        (per_token * batch.loss_mask).sum().backward()
        return hooks.metrics()

    reference = _build(overrides)
    reference_metrics = step(reference, full)
    reference_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}

    expected_len = {
        rank: _stock_accept_len(_build(overrides), full, temperature, context_parallel_positions(16, rank, 2), accept_rule) for rank in (0, 1)
    }
    cp_group, local = _context_parallel_share(full)
    model = _build(overrides)
    metrics = step(model, local)
    for k in (1, 2):
        names = ("loss", "acc", "agree", "accept")
        tokens = metrics[f"mtp_{k}/tokens"]
        sums = torch.tensor([tokens] + [metrics[f"mtp_{k}/{n}"] * tokens if tokens else 0.0 for n in names], dtype=torch.float64)
        dist.all_reduce(sums, group=cp_group)
        ref_tokens = reference_metrics[f"mtp_{k}/tokens"]
        expected = torch.tensor([ref_tokens] + [reference_metrics[f"mtp_{k}/{n}"] * ref_tokens for n in names], dtype=torch.float64)
        torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-6, msg=lambda m: f"depth {k} (tokens, {names}): {m}")
    assert metrics["mtp/accept_len"] == pytest.approx(expected_len[parallel_state.get_context_parallel_rank()], rel=1e-5, abs=1e-6)
    if gradients:
        _assert_gradients_add_up(model, reference_grads, cp_group)
    return metrics


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def reference(group: SpawnedGroup) -> dict[str, Any]:
    per_rank = group.run(scenario_full_vocabulary_reference, {})
    return per_rank[0]


TP2 = {"tensor_model_parallel_size": 2}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_equals_full_vocabulary_reference(
    group: SpawnedGroup, reference: dict[str, Any], case: str, sequence_parallel: bool
) -> None:
    metrics = reference[case]["metrics"]
    assert all(0 < metrics[f"mtp_{k}/agree"] < 1 for k in (1, 2)), "agreement should mix matches and misses"
    results = group.run(scenario_tensor_parallel, TP2, case=case, sequence_parallel=sequence_parallel, reference=reference)
    assert results[0] == results[1]  # metrics are reduced over the vocabulary shards: identical on both ranks


def test_vocab_parallel_losses_and_logprobs_equal_dense_references(group: SpawnedGroup) -> None:
    group.run(scenario_vocab_parallel_functions, TP2)


@pytest.mark.parametrize(
    "gradients",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                _mcore.PER_TOKEN_LOSS_RESCALED,
                reason="megatron-core >= 0.17.1 rescales the per-token MTP loss by this CP rank's token counts, "
                "so the CP ranks' gradients no longer add up to the whole sequence's",
            ),
        ),
    ],
    ids=["metrics", "gradients"],
)
@pytest.mark.parametrize(
    ("objective", "temperature", "accept_rule"),
    [("distill", 1.0, "argmax"), ("accept", 1.7, "argmax"), ("tv", 0.6, "sampled"), ("accept", 1.3, "match"), ("accept", 0.0, "argmax")],
    ids=["distill", "accept_hot", "tv_cold_sampled", "accept_match", "accept_greedy"],
)
def test_context_parallel_draft_objectives_add_up_to_the_whole_sequence(
    group: SpawnedGroup, gradients: bool, objective: str, temperature: float, accept_rule: str
) -> None:
    results = group.run(
        scenario_context_parallel_distill, {}, gradients=gradients, objective=objective, temperature=temperature, accept_rule=accept_rule
    )
    assert results[0]["mtp_1/tokens"] != results[1]["mtp_1/tokens"]  # each CP rank scores its own half
    assert results[0]["mtp/accept_len"] != pytest.approx(results[1]["mtp/accept_len"], rel=1e-4)


def test_context_parallel_zeroed_start_adds_up_to_the_whole_sequence(group: SpawnedGroup) -> None:
    group.run(scenario_context_parallel_zeroed_start, {})
