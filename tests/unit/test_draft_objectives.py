"""Draft objectives (``"ce"``, ``"distill"``, ``"tv"``, ``"accept"``), at draft temperatures, and agreement
metrics (``mtp/accept_len`` included) against dense references, under the default acceptance rule
(``"argmax"``) unless a test names another; every rule and T = 0: ``test_accept_rule.py``.

Function level: ``lean_mtp_loss`` for every objective against a float64 reference built from the
full logits with plain torch ops (objective, per-token CE, correct flags, argmax agreement,
expected acceptance, gradients wrt hidden and weight with the teacher's weight detached), chunk
by chunk size, with zero token weights, a detached weight, and ``gradcheck`` in float64.

Model level (twin real mcore models): a stock twin runs the same micro-batch with its MTP loss
weighted 0 while plain forward hooks capture its MTP block output and its output-layer logits.
From those stock quantities the test computes, position by position, the agreement metrics
(argmax of depth ``k`` at ``t`` against the main head at ``t + k`` in the same sequence) and the
dense MTP objective of each kind (autograd through the captured block output, teacher detached);
the hooked twin's metrics and every parameter's gradient must equal them. Unpacked batches and
packed THD rows (padded and not) are covered, so targets and teachers crossing a sequence
boundary would show. Refused options name their argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mtp_hooks
from megatron.core.packed_seq_params import PackedSeqParams
from mtp_hooks.ops.draft_rule import OBJECTIVES, DraftRule
from mtp_hooks.ops.lean_loss import KernelSpec, lean_mtp_loss
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, grads_of, main_ce_from_logits, make_batch, masked_mean, output_layer_calls
from mtp_hooks.testing import stock_main_only_step
from tests.support.draft_references import acceptance, per_token_objective
from tests.support.head_cases import HIDDEN, TOKENS, VOCAB, Leaves
from tests.support.mcore_cpu import needs_packed_mtp, thd_params
from tests.unit.test_targets import Slot

CHUNK_SIZES = [1, 3, TOKENS, TOKENS + 5]  # one token, not dividing T, exactly T, more than T


# ============================================================================ function level


@dataclasses.dataclass
class Case(Leaves):
    """Inputs of one ``lean_mtp_loss`` call; ``teacher`` is the main head's input at the matching position."""

    hidden: Tensor
    weight: Tensor
    teacher: Tensor
    labels: Tensor
    token_weight: Tensor


def make_case(seed: int, tokens: int = TOKENS, hidden: int = HIDDEN, vocab: int = VOCAB, zero_weights: bool = True) -> Case:
    """Logits of order one; the teacher is a noisy copy of the hidden states, so some argmaxes agree."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    token_weight = torch.rand(tokens, generator=gen, dtype=torch.float64) + 0.1
    if zero_weights:
        token_weight[::3] = 0.0
    return Case(
        hidden=h,
        weight=torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.7,
        teacher=0.8 * h + 0.6 * torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
        labels=torch.randint(0, vocab, (tokens,), generator=gen),
        token_weight=token_weight / tokens,
    )


@dataclasses.dataclass
class Dense:
    """Per-token quantities of the dense reference (``objective`` carries the graph)."""

    objective: Tensor
    ce: Tensor
    correct: Tensor
    agree: Tensor
    accept: Tensor


def dense_reference(
    hidden: Tensor,
    weight: Tensor,
    teacher: Tensor,
    labels: Tensor,
    token_weight: Tensor,
    objective: str,
    detach_teacher_weight: bool = True,
    temperature: float = 1.0,
    logits_dtype: Optional[torch.dtype] = None,
    accept_rule: str = "argmax",
) -> Dense:
    """Full float64 logits, plain torch ops: q = softmax(hidden W^T / T), p = softmax(teacher W^T / T)
    (``per_token_objective``, ``acceptance``); the CE on the labels and its correct flags untempered.
    ``logits_dtype``: the logits take the values of a GEMM in that dtype (as the head computes them),
    their gradient stays float64's."""
    logits = hidden.double() @ weight.double().t()
    teacher_weight = weight.detach() if detach_teacher_weight else weight
    teacher_logits = teacher.double() @ teacher_weight.double().t()
    if logits_dtype is not None:
        logits = logits + ((hidden.to(logits_dtype) @ weight.to(logits_dtype).t()).double() - logits).detach()
        teacher_logits = (teacher.to(logits_dtype) @ teacher_weight.to(logits_dtype).t()).double()
    per_token = per_token_objective(objective, logits, teacher_logits, labels, temperature, accept_rule)
    return Dense(
        objective=(per_token * token_weight.double()).sum(),
        ce=(logits.logsumexp(-1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).detach(),
        correct=logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) >= logits.max(-1).values,
        agree=logits.argmax(-1) == teacher_logits.argmax(-1),
        accept=acceptance(logits, teacher_logits, temperature, accept_rule).detach(),
    )


def assert_close(actual: Optional[Tensor], expected: Optional[Tensor], what: str, atol: float, rtol: float) -> None:
    assert (actual is None) == (expected is None), f"{what}: one is None, the other is not"
    if actual is not None and expected is not None:
        torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_same_head_loss(
    out: Any, ref: Dense, leaves: tuple[Tensor, Tensor], ref_leaves: tuple[Tensor, Tensor], tol: dict[str, float]
) -> None:
    """A lean ``HeadLoss`` ``out`` equals the dense reference ``ref``: objective, per-token CE,
    acceptance, correct and agreement flags, and the gradients of the ``(hidden, weight)`` leaves."""
    assert out.agree is not None and out.accept is not None
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", **tol)
    assert_close(out.ce, ref.ce, "per-token CE", **tol)
    assert_close(out.accept, ref.accept, "expected acceptance", **tol)
    assert torch.equal(out.correct, ref.correct), "correct flags"
    assert torch.equal(out.agree, ref.agree), "argmax agreement"
    for what, leaf, ref_leaf in zip(("hidden grad", "weight grad"), leaves, ref_leaves):
        assert_close(leaf.grad, ref_leaf.grad, what, **tol)


# float32 inputs are compared with the float64 reference at fp32 accuracy, float64 inputs tightly.
TOLERANCES = {torch.float32: dict(atol=1e-6, rtol=1e-4), torch.float64: dict(atol=1e-12, rtol=1e-10)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_lean_objective_matches_dense_float64_reference(objective: str, chunk_size: int, dtype: torch.dtype) -> None:
    case = make_case(seed=chunk_size + 100 * OBJECTIVES.index(objective))
    tol = TOLERANCES[dtype]
    hidden, weight = case.leaves(dtype)
    teacher = case.teacher.to(dtype)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.to(dtype), KernelSpec(None, chunk_size), DraftRule(objective), teacher)
    (out.objective * 0.37).backward()  # a non-unit upstream gradient: the hidden gradient is precomputed in forward
    ref_hidden, ref_weight = case.leaves(torch.float64)
    ref = dense_reference(ref_hidden, ref_weight, case.teacher, case.labels, case.token_weight, objective)
    (ref.objective * 0.37).backward()

    assert_same_head_loss(out, ref, (hidden, weight), (ref_hidden, ref_weight), tol)
    assert out.agree.any() and not out.agree.all(), "the case should mix agreeing and disagreeing tokens"
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype


def test_sampled_acceptance_is_one_minus_total_variation() -> None:
    case = make_case(seed=3)
    rule = DraftRule("tv", accept_rule="sampled")
    out = lean_mtp_loss(case.hidden, case.weight, case.labels, torch.ones(TOKENS, dtype=torch.float64), KernelSpec(None, 4), rule, case.teacher)
    assert out.accept is not None
    torch.testing.assert_close(out.objective, (1 - out.accept).sum(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("objective", ["distill", "tv"])
def test_teacher_logits_use_the_weight_detached(objective: str) -> None:
    """The weight gradient is the student's alone; a teacher path through the weight would change it."""
    case = make_case(seed=4)
    hidden, weight = case.leaves(torch.float64)
    teacher = case.teacher.clone().requires_grad_(True)
    lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, 3), DraftRule(objective), teacher).objective.backward()
    detached_h, detached_w = case.leaves(torch.float64)
    dense_reference(detached_h, detached_w, case.teacher, case.labels, case.token_weight, objective).objective.backward()
    attached_h, attached_w = case.leaves(torch.float64)
    attached = dense_reference(attached_h, attached_w, case.teacher, case.labels, case.token_weight, objective, detach_teacher_weight=False)
    attached.objective.backward()
    assert_close(weight.grad, detached_w.grad, "weight grad", atol=1e-12, rtol=1e-10)
    assert not torch.allclose(weight.grad, attached_w.grad, atol=1e-6), "the guard reference should differ"
    assert teacher.grad is None, "the teacher is the main head's detached input"


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_tokens_with_zero_weight_get_zero_hidden_gradient_but_keep_their_statistics(objective: str) -> None:
    case = make_case(seed=5)
    zero = case.token_weight == 0
    assert zero.any() and (~zero).any()
    hidden, weight = case.leaves(torch.float64)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, 3), DraftRule(objective), case.teacher)
    out.objective.backward()
    assert torch.equal(hidden.grad[zero], torch.zeros_like(hidden.grad[zero]))
    assert hidden.grad[~zero].abs().sum() > 0
    ref = dense_reference(*case.leaves(torch.float64), case.teacher, case.labels, case.token_weight, objective)
    assert_close(out.accept, ref.accept, "acceptance of every token", atol=1e-12, rtol=1e-10)
    assert_close(out.ce, ref.ce, "CE of every token", atol=1e-12, rtol=1e-10)
    assert torch.equal(out.agree, ref.agree)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_all_zero_token_weights_give_zero_objective_and_zero_gradients(objective: str) -> None:
    case = make_case(seed=6)
    hidden, weight = case.leaves(torch.float32)
    out = lean_mtp_loss(hidden, weight, case.labels, torch.zeros(TOKENS), KernelSpec(None, 4), DraftRule(objective), case.teacher.float())
    out.objective.backward()
    assert out.objective.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden.grad))
    assert torch.equal(weight.grad, torch.zeros_like(weight.grad))
    assert out.accept is not None and (out.accept > 0).all()


@pytest.mark.parametrize("chunk_size", [3, TOKENS + 5])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_detached_weight_gets_no_gradient_and_hidden_gradient_is_unchanged(objective: str, chunk_size: int) -> None:
    case = make_case(seed=7)
    hidden, weight = case.leaves(torch.float64, weight_grad=False)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, chunk_size), DraftRule(objective), case.teacher)
    out.objective.backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    ref = dense_reference(ref_hidden, ref_weight, case.teacher, case.labels, case.token_weight, objective)
    ref.objective.backward()
    assert weight.grad is None
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", atol=1e-12, rtol=1e-10)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_hidden_without_grad_still_gives_the_weight_gradient(objective: str) -> None:
    case = make_case(seed=8)
    hidden, weight = case.leaves(torch.float64, hidden_grad=False)
    lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, 3), DraftRule(objective), case.teacher).objective.backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    dense_reference(ref_hidden, ref_weight, case.teacher, case.labels, case.token_weight, objective).objective.backward()
    assert hidden.grad is None
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=1e-12, rtol=1e-10)


def test_ce_without_teacher_reports_no_agreement() -> None:
    case = make_case(seed=9)
    out = lean_mtp_loss(case.hidden, case.weight, case.labels, case.token_weight, KernelSpec(None, 3))
    assert out.agree is None and out.accept is None
    ref = dense_reference(case.hidden, case.weight, case.teacher, case.labels, case.token_weight, "ce")
    assert_close(out.objective, ref.objective, "objective", atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_gradcheck_wrt_hidden_in_float64(objective: str, chunk_size: int) -> None:
    """Finite differences in the hidden states (the teacher is a separate input, held fixed)."""
    case = make_case(seed=12, tokens=7, hidden=3, vocab=5)
    hidden, _ = case.leaves(torch.float64)
    weight = case.weight.clone()

    def loss(h: Tensor) -> Tensor:
        return lean_mtp_loss(h, weight, case.labels, case.token_weight, KernelSpec(None, chunk_size), DraftRule(objective), case.teacher).objective

    assert torch.autograd.gradcheck(loss, (hidden,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_gradcheck_wrt_weight_with_the_teacher_logits_held_fixed(objective: str) -> None:
    """Finite differences in the weight would also move the teacher's logits, which the objective
    treats as constants; so the teacher's hidden states are re-solved to keep its logits fixed
    (``teacher' = teacher W0^T pinv(W^T)`` with a square, invertible head) and the weight
    gradient checked is the student's alone."""
    case = make_case(seed=13, tokens=6, hidden=5, vocab=5)
    _, weight = case.leaves(torch.float64)
    w0 = case.weight.clone()
    teacher_logits = case.teacher @ w0.t()

    def loss(w: Tensor) -> Tensor:
        teacher = torch.linalg.solve(w.detach(), teacher_logits.t()).t()  # teacher @ w.T == teacher_logits
        return lean_mtp_loss(case.hidden, w, case.labels, case.token_weight, KernelSpec(None, 4), DraftRule(objective), teacher).objective

    assert torch.autograd.gradcheck(loss, (weight,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_bf16_inputs_match_the_float64_reference_within_bf16_rounding(objective: str) -> None:
    """bf16 hidden, weight and teacher: statistics reduced in fp32, gradients back in bf16."""
    case = make_case(seed=14, tokens=16, hidden=8, vocab=24)
    hidden, weight = case.leaves(torch.bfloat16)
    teacher = case.teacher.to(torch.bfloat16)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.float(), KernelSpec(None, 5), DraftRule(objective), teacher)
    out.objective.backward()
    # The reference sees the same bf16-rounded inputs, in float64.
    ref_hidden, ref_weight = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    ref = dense_reference(ref_hidden, ref_weight, teacher.double(), case.labels, case.token_weight, objective)
    ref.objective.backward()
    assert out.ce.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", atol=1e-3, rtol=1e-2)
    assert_close(out.ce, ref.ce, "per-token CE", atol=1e-2, rtol=1e-2)
    assert_close(out.accept, ref.accept, "expected acceptance", atol=1e-2, rtol=1e-2)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=2e-3, rtol=2e-2)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=2e-3, rtol=2e-2)


TEMPERATURES = [0.6, 1.0, 1.7]
DRAFT_OBJECTIVES = [o for o in OBJECTIVES if o != "ce"]


@pytest.mark.parametrize("weight_grad", ["recompute", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_at_temperature_matches_dense_reference_with_both_distributions_tempered(
    objective: str, temperature: float, dtype: torch.dtype, weight_grad: str
) -> None:
    """p = softmax(z_main / T) and q = softmax(z_mtp / T) (the CE on the labels untempered): objective,
    acceptance and both gradients; with ``"ce"`` only the acceptance is tempered."""
    case = make_case(seed=300 + OBJECTIVES.index(objective))
    tol = TOLERANCES[dtype]
    hidden, weight = case.leaves(dtype)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.to(dtype), KernelSpec(None, 4, weight_grad), DraftRule(objective, temperature), case.teacher.to(dtype))
    (out.objective * 0.37).backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    ref = dense_reference(ref_hidden, ref_weight, case.teacher, case.labels, case.token_weight, objective, temperature=temperature)
    (ref.objective * 0.37).backward()
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", **tol)
    assert_close(out.accept, ref.accept, "expected acceptance", **tol)
    assert_close(out.ce, ref.ce, "per-token CE (untempered)", **tol)
    assert torch.equal(out.agree, ref.agree), "argmax agreement"
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", **tol)
    assert_close(weight.grad, ref_weight.grad, "weight grad", **tol)
    if temperature != 1.0:  # guard: the untempered reference is another one
        untempered = dense_reference(case.hidden, case.weight, case.teacher, case.labels, case.token_weight, objective)
        assert not torch.allclose(out.accept.double(), untempered.accept, atol=1e-4)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_bf16_at_temperature_matches_the_float64_reference_within_bf16_rounding(objective: str, temperature: float) -> None:
    case = make_case(seed=400 + OBJECTIVES.index(objective), tokens=16, hidden=8, vocab=24)
    hidden, weight = case.leaves(torch.bfloat16)
    teacher = case.teacher.to(torch.bfloat16)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.float(), KernelSpec(None, 5), DraftRule(objective, temperature), teacher)
    out.objective.backward()
    ref_hidden, ref_weight = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    # The reference's logits are the bf16 GEMM's: tv's sign(q - p) would flip where a logit's bf16 rounding crosses p = q.
    ref = dense_reference(
        ref_hidden, ref_weight, teacher.double(), case.labels, case.token_weight, objective, temperature=temperature,
        logits_dtype=torch.bfloat16,
    )
    ref.objective.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", atol=1e-3, rtol=1e-2)
    assert_close(out.accept, ref.accept, "expected acceptance", atol=1e-2, rtol=1e-2)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=2e-3, rtol=2e-2)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("temperature", [0.6, 1.7])
@pytest.mark.parametrize("objective", DRAFT_OBJECTIVES)
def test_gradcheck_at_temperature_in_float64(objective: str, temperature: float) -> None:
    """Finite differences in the hidden states and (teacher logits held fixed, as above) in the weight."""
    case = make_case(seed=15, tokens=6, hidden=5, vocab=5)
    hidden, weight = case.leaves(torch.float64)
    teacher_logits = case.teacher @ case.weight.t()

    def loss(h: Tensor, w: Tensor) -> Tensor:
        teacher = torch.linalg.solve(w.detach(), teacher_logits.t()).t()
        return lean_mtp_loss(h, w, case.labels, case.token_weight, KernelSpec(None, 4), DraftRule(objective, temperature), teacher).objective

    assert torch.autograd.gradcheck(loss, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_sampled_accept_is_minus_log_acceptance_with_tvs_gradient_divided_by_acceptance() -> None:
    """Under ``"sampled"``, ``"accept"`` and ``"tv"`` share the optimum but not the weighting: per token,
    accept's hidden gradient is tv's divided by alpha, so the two objectives train differently wherever alpha < 1."""
    case = make_case(seed=16)
    grads, outs = {}, {}
    for objective in ("tv", "accept"):
        hidden, weight = case.leaves(torch.float64)
        outs[objective] = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, 3), DraftRule(objective, 1.3, "sampled"), case.teacher)
        outs[objective].objective.backward()
        grads[objective] = hidden.grad
    alpha = outs["accept"].accept
    assert (alpha < 0.9).any()
    torch.testing.assert_close(outs["accept"].objective, -(case.token_weight * alpha.log()).sum(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grads["accept"], grads["tv"] / alpha.unsqueeze(-1), atol=1e-12, rtol=1e-10)
    assert not torch.allclose(grads["accept"], grads["tv"], atol=1e-3)


@pytest.mark.parametrize("accept_rule", ["sampled", "match", "argmax"])
def test_accept_gradient_stays_accurate_in_fp32_when_acceptance_is_tiny(accept_rule: str) -> None:
    """Draft and target all but disjoint (alpha ~ 1e-6, every rule's; the argmax rule's surrogate sum
    alike): the fp32 gradient of -log alpha (or of the surrogate) matches fp64
    (no ``1 - 2 * sum`` cancellation divided by a tiny alpha), while tv's gradient has faded with alpha."""
    vocab, hidden_size = 8, 8
    weight = torch.eye(vocab, hidden_size, dtype=torch.float64) * 14.0
    hidden = torch.zeros(3, hidden_size, dtype=torch.float64)
    hidden[:, 1] = 1.0  # the draft bets on token 1 ...
    hidden[1, 2] = 0.3
    teacher = torch.zeros(3, hidden_size, dtype=torch.float64)
    teacher[:, 0] = 1.0  # ... the target on token 0
    labels, token_weight = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.float64)
    results = {}
    for dtype in (torch.float32, torch.float64):
        for objective in ("accept", "tv"):
            h, w = hidden.to(dtype).clone().requires_grad_(True), weight.to(dtype)
            rule = DraftRule(objective, accept_rule=accept_rule)
            out = lean_mtp_loss(h, w, labels, token_weight.to(dtype), KernelSpec(None, 2), rule, teacher.to(dtype))
            out.objective.backward()
            results[objective, dtype] = (h.grad.double(), out.accept.double())
    grad64, alpha = results["accept", torch.float64]
    assert (alpha < 1e-5).all() and (alpha >= 0).all()
    torch.testing.assert_close(results["accept", torch.float32][0], grad64, atol=1e-5, rtol=1e-4)
    assert grad64.abs().sum() > 1.0  # O(1): tv's gradient divided by alpha
    assert results["tv", torch.float64][0].abs().sum() < 1e-3


@pytest.mark.parametrize(
    ("objective", "teacher", "match"),
    [
        ("kl", True, "^objective: bad value"),
        ("distill", False, "^teacher: bad value"),
        ("tv", False, "^teacher: bad value"),
        ("accept", False, "^teacher: bad value"),
    ],
)
def test_lean_mtp_loss_refuses_bad_objective_or_missing_teacher(objective: str, teacher: bool, match: str) -> None:
    case = make_case(seed=10)
    with pytest.raises(mtp_hooks.MTPHooksError, match=match):
        rule = DraftRule(objective)  # an unknown objective is refused here
        lean_mtp_loss(case.hidden, case.weight, case.labels, case.token_weight, KernelSpec(None, 3), rule, case.teacher if teacher else None)


# ============================================================================ model level

MODEL_VOCAB = 97  # no other dimension of the tiny model is 97
SHAPE = TinyGPT(vocab_size=MODEL_VOCAB)
LOSS_SCALE = 0.3


def build() -> nn.Module:
    """A twin (same seed every call) whose heads partly agree.

    A fresh tiny model's heads give near-uniform, unrelated distributions (agreement ~1/V). The
    output weight is scaled up to logits of order one and every final norm (main and MTP) gets the
    same bias, a shared preference, so agreement and acceptance fall strictly between 0 and 1.
    """
    model = SHAPE.build()
    bias = 3.0 * torch.randn(SHAPE.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.output_layer.weight.mul_(10.0)
        for norm in [model.decoder.final_layernorm, *(layer.final_layernorm for layer in model.mtp.layers)]:
            norm.bias.copy_(bias)
    return model


@dataclasses.dataclass
class Micro:
    """A micro-batch with the sequences it holds: ``(row, Slot)`` per sequence, and THD params if packed."""

    batch: Batch
    sequences: list[tuple[int, Slot]]
    given: Optional[PackedSeqParams] = None  # what the hooked model gets
    layout: Optional[PackedSeqParams] = None  # what stock gets: cu_seqlens_q = the slots (see test_parallel)

    def kwargs(self, stock: bool) -> dict[str, Any]:
        params = self.layout if stock else self.given
        return {} if params is None else {"packed_seq_params": params}


def unpacked_micro(seed: int, batch: int = 2, seq: int = 8) -> Micro:
    b = make_batch(MODEL_VOCAB, batch=batch, seq=seq, seed=seed)
    return Micro(b, [(row, Slot(0, seq, seq)) for row in range(batch)])


def packed_micro(seed: int, real: list[int], slot: list[int]) -> Micro:
    """One THD row: sequence ``i`` has ``real[i]`` tokens at the start of a slot of ``slot[i]``
    (positions restart per slot, padding and each sequence's last token masked out)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(slot)
    ids, positions, labels = (torch.zeros(1, total, dtype=torch.long) for _ in range(3))
    loss_mask = torch.zeros(1, total)
    sequences, start = [], 0
    for n, size in zip(real, slot):
        tokens = torch.randint(0, MODEL_VOCAB, (n,), generator=gen)
        ids[0, start : start + n] = tokens
        positions[0, start : start + size] = torch.arange(size)
        labels[0, start : start + n - 1] = tokens[1:]
        loss_mask[0, start : start + n - 1] = (torch.rand(n - 1, generator=gen) > 0.2).float()
        sequences.append((0, Slot(start, size, n)))
        start += size
    given, layout = thd_params(real, slot)
    return Micro(Batch(ids, positions, labels, loss_mask), sequences, given, layout)


def matching_positions(micro: Micro, k: int) -> list[tuple[int, int, int, float]]:
    """``(row, t, t + k, loss_mask[t + k])`` wherever ``t + k`` is a real token of the sequence of ``t``."""
    mask = micro.batch.loss_mask
    out = []
    for row, slot in micro.sequences:
        for offset in range(slot.real - k):
            t = slot.start + offset
            out.append((row, t, t + k, float(mask[row, t + k])))
    return out


def stock_reference_step(
    stock: nn.Module,
    micro: Micro,
    objective: str,
    temperature: float = 1.0,
    chains: Optional[list[tuple[float, float]]] = None,
    accept_rule: str = "argmax",
) -> dict[str, float]:
    """Stock mcore with its MTP loss weighted 0, plus the dense MTP ``objective`` built in the test.

    A forward hook captures the MTP block output ``[(1+N)s, b, h]`` (with its graph), the output
    layer's logits are recorded as stock computes them (depths 1..N, then the main head). Depth k's
    objective: ``(scale/N) * sum_t mask_k * loss(W h_k[t], teacher = W.detach() h_0[t+k].detach())
    / max(sum mask_k, 1)``; backward of stock's masked-mean main loss plus every depth's objective.
    Returns brute-force metrics from stock's own logits, keyed as ``hooks.metrics()``; ``p`` and
    ``q`` at ``temperature`` for the objective and the acceptance, the latter under ``accept_rule``. ``mtp/accept_len``: per position
    ``t``, ``prod_{j<=k} alpha_j(t)`` over the positions where depths 1..k all count, averaged per
    ``k`` and summed; ``chains`` gets each ``k``'s (sum, positions).
    """
    depth = stock.config.mtp_num_layers
    batch = micro.batch
    captured: list[Tensor] = []
    handle = stock.mtp.register_forward_hook(lambda module, args, out: captured.append(out))
    stock.config.mtp_loss_scaling_factor = 0.0
    try:
        with output_layer_calls(stock) as calls:
            per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, **micro.kwargs(stock=True))
    finally:
        stock.config.mtp_loss_scaling_factor = LOSS_SCALE
        handle.remove()
    assert len(captured) == 1 and len(calls) == depth + 1
    chunks = [c.transpose(0, 1) for c in captured[0].chunk(1 + depth, dim=0)]  # [b, s, h] each
    main_logits = calls[-1].transpose(0, 1).double()  # [b, s, V]
    weight = stock.output_layer.weight
    total = masked_mean(per_token, batch.loss_mask)
    metrics: dict[str, float] = {}
    alphas: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (row, t) -> [(alpha_j, mask_j), j = 1 ..]
    for k in range(1, depth + 1):
        positions = matching_positions(micro, k)
        rows = torch.tensor([p[0] for p in positions])
        t = torch.tensor([p[1] for p in positions])
        u = torch.tensor([p[2] for p in positions])
        w = torch.tensor([p[3] for p in positions], dtype=torch.float64)
        labels = batch.labels[rows, u]
        # Gradient reference: autograd through the captured block output.
        logits = chunks[k][rows, t].double() @ weight.double().t()
        teacher_logits = chunks[0][rows, u].detach().double() @ weight.detach().double().t()
        loss = (w * per_token_objective(objective, logits, teacher_logits, labels, temperature, accept_rule)).sum()
        total = total + (LOSS_SCALE / depth) * loss / w.sum().clamp(min=1)
        # Metrics: stock's own output-layer logits, position by position.
        mtp_logits = calls[k - 1].transpose(0, 1).double()[rows, t]
        main_at = main_logits[rows, u]
        tokens = w.sum()
        ce = F.cross_entropy(mtp_logits, labels, reduction="none")
        correct = mtp_logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) >= mtp_logits.max(-1).values
        agree = mtp_logits.argmax(-1) == main_at.argmax(-1)
        metrics[f"mtp_{k}/tokens"] = float(tokens)
        metrics[f"mtp_{k}/loss"] = float((w * ce).sum() / tokens)
        metrics[f"mtp_{k}/acc"] = float((w * correct).sum() / tokens)
        metrics[f"mtp_{k}/agree"] = float((w * agree).sum() / tokens)
        alpha = acceptance(mtp_logits, main_at, temperature, accept_rule)
        metrics[f"mtp_{k}/accept"] = float((w * alpha).sum() / tokens)
        for index, position in enumerate(positions):
            alphas.setdefault(position[:2], []).append((float(alpha[index]), position[3]))
    total.backward()
    length, complete = 0.0, True
    for k in range(1, depth + 1):
        chain_sum, chain_tokens = 0.0, 0.0
        for per_depth in alphas.values():
            if len(per_depth) >= k and all(mask == 1.0 for _alpha, mask in per_depth[:k]):
                chain_sum += math.prod(a for a, _mask in per_depth[:k])
                chain_tokens += 1
        if chains is not None:
            chains.append((chain_sum, chain_tokens))
        complete = complete and chain_tokens > 0
        length += chain_sum / max(chain_tokens, 1)
    if complete:
        metrics["mtp/accept_len"] = length
    return metrics


def hooked_step(model: nn.Module, micro: Micro, **options: Any) -> dict[str, float]:
    """Hooked training micro-batch: logits out, the test's masked-mean main CE, backward; metrics."""
    batch = micro.batch
    hooks = mtp_hooks.attach(model, loss_scale=LOSS_SCALE, **options)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args, **micro.kwargs(stock=False))
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return hooks.metrics()


def assert_metrics_equal(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def assert_mtp_parameters_trained(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: the MTP objective sent no gradient"


MICROS = {
    "bshd": lambda: unpacked_micro(seed=3),
    # Sequences of 5 and 2 tokens (shorter than N + 1 = 3) packed without padding ...
    "thd": lambda: packed_micro(seed=7, real=[5, 2, 6, 4], slot=[5, 2, 6, 4]),
    # ... and in padded slots, where mcore given cu_seqlens_q alone would roll across sequences.
    "thd_padded": lambda: packed_micro(seed=8, real=[5, 2, 6, 4], slot=[8, 4, 8, 4]),
}
LAYOUTS = ["bshd", pytest.param("thd", marks=needs_packed_mtp), pytest.param("thd_padded", marks=needs_packed_mtp)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_hooked_objective_gradients_and_agreement_metrics_equal_dense_reference_from_stock(objective: str, layout: str) -> None:
    micro = MICROS[layout]()
    stock, hooked = build(), build()
    expected = stock_reference_step(stock, micro, objective)
    metrics = hooked_step(hooked, micro, objective=objective, agreement_metrics=True, chunk_size=5)
    assert_metrics_equal(metrics, expected)
    for k in (1, 2):
        assert 0 < expected[f"mtp_{k}/agree"] < 1, "agreement should mix matches and misses"
    assert_same_grads(hooked, stock)
    assert_mtp_parameters_trained(hooked)


@pytest.mark.parametrize("layout", ["bshd", pytest.param("thd_padded", marks=needs_packed_mtp)])
@pytest.mark.parametrize("temperature", [0.6, 1.7])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_hooked_objectives_and_metrics_at_draft_temperature_equal_dense_reference_from_stock(
    objective: str, temperature: float, layout: str
) -> None:
    micro = MICROS[layout]()
    stock, hooked = build(), build()
    expected = stock_reference_step(stock, micro, objective, temperature)
    metrics = hooked_step(hooked, micro, objective=objective, agreement_metrics=True, chunk_size=5, draft_temperature=temperature)
    assert_metrics_equal(metrics, expected)
    assert_same_grads(hooked, stock)
    untempered = stock_reference_step(build(), micro, objective)
    assert metrics["mtp_1/accept"] != pytest.approx(untempered["mtp_1/accept"], rel=1e-3), "guard: T should change acceptance"


def test_accept_len_is_the_per_position_chain_not_the_product_of_the_means() -> None:
    """Guard for the reference: on this micro-batch the product of the per-depth means is another number."""
    micro = unpacked_micro(seed=3)
    metrics = hooked_step(build(), micro, objective="accept")
    expected = stock_reference_step(build(), micro, "accept")
    assert metrics["mtp/accept_len"] == pytest.approx(expected["mtp/accept_len"], rel=1e-5, abs=1e-6)
    of_means = metrics["mtp_1/accept"] + metrics["mtp_1/accept"] * metrics["mtp_2/accept"]
    assert metrics["mtp/accept_len"] != pytest.approx(of_means, rel=1e-3)
    assert 0 < metrics["mtp/accept_len"] < 2


@needs_packed_mtp
def test_packed_reference_differs_from_one_that_crosses_sequences() -> None:
    """Guard for the THD cases: the same row read as one unpacked sequence gives other metrics."""
    micro = MICROS["thd"]()
    crossing = dataclasses.replace(micro, sequences=[(0, Slot(0, micro.batch.input_ids.shape[1], micro.batch.input_ids.shape[1]))])
    metrics = hooked_step(build(), micro, objective="distill")
    crossing_metrics = stock_reference_step(build(), crossing, "distill")
    assert metrics["mtp_1/tokens"] < crossing_metrics["mtp_1/tokens"]
    assert metrics["mtp_2/accept"] != pytest.approx(crossing_metrics["mtp_2/accept"], rel=1e-3)


def test_agreement_metrics_leave_the_ce_gradients_of_stock_unchanged() -> None:
    """``agreement_metrics=True`` with ``"ce"`` only adds metrics: gradients are stock's."""
    micro = unpacked_micro(seed=4)
    stock, hooked, plain = build(), build(), build()
    batch = micro.batch
    per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    with_metrics = hooked_step(hooked, micro, agreement_metrics=True)
    without = hooked_step(plain, micro)
    assert_same_grads(hooked, stock)
    assert_metrics_equal({k: v for k, v in with_metrics.items() if k in without}, without)
    assert set(with_metrics) - set(without) == {f"mtp_{k}/{m}" for k in (1, 2) for m in ("agree", "accept")} | {"mtp/accept_len"}


def test_each_objective_trains_the_mtp_layers_differently() -> None:
    """Guard for the gradient test: the objectives are not interchangeable on this micro-batch."""
    micro = unpacked_micro(seed=5)
    grads = {}
    for objective in OBJECTIVES:
        model = build()
        hooked_step(model, micro, objective=objective)
        grads[objective] = {n: g for n, g in grads_of(model).items() if n.startswith("mtp.")}
    for a, b in [("ce", "distill"), ("ce", "tv"), ("distill", "tv"), ("tv", "accept"), ("distill", "accept")]:
        weight = "mtp.layers.0.eh_proj.weight"
        assert not torch.allclose(grads[a][weight], grads[b][weight], atol=1e-6), f"{a} and {b} gave the same gradient"


def test_metrics_accumulate_agreement_over_micro_batches_token_weighted() -> None:
    micros = [unpacked_micro(seed=11), unpacked_micro(seed=12, batch=1, seq=6)]
    hooked = build()
    hooks = mtp_hooks.attach(hooked, objective="tv", loss_scale=LOSS_SCALE)
    expected: list[dict[str, float]] = []
    chains: list[list[tuple[float, float]]] = []
    for micro in micros:
        chains.append([])
        expected.append(stock_reference_step(build(), micro, "tv", chains=chains[-1]))
        with hooks.micro_batch(micro.batch.labels, micro.batch.loss_mask):
            logits = hooked(*micro.batch.model_args)
        masked_mean(main_ce_from_logits(logits, micro.batch.labels), micro.batch.loss_mask).backward()
    metrics = hooks.metrics()
    for k in (1, 2):
        tokens = [e[f"mtp_{k}/tokens"] for e in expected]
        assert metrics[f"mtp_{k}/tokens"] == sum(tokens)
        for name in ("agree", "accept", "loss"):
            mean = sum(e[f"mtp_{k}/{name}"] * n for e, n in zip(expected, tokens)) / sum(tokens)
            assert metrics[f"mtp_{k}/{name}"] == pytest.approx(mean, rel=1e-5, abs=1e-6), f"mtp_{k}/{name}"
    # Each term of the length pools its chained positions over both micro-batches (not a mean of the two lengths).
    pooled = sum(sum(c[k][0] for c in chains) / sum(c[k][1] for c in chains) for k in range(2))
    assert metrics["mtp/accept_len"] == pytest.approx(pooled, rel=1e-5, abs=1e-6)
    assert metrics["mtp/accept_len"] != pytest.approx(sum(e["mtp/accept_len"] for e in expected) / 2, rel=1e-4)
    assert hooks.metrics() == {}


@pytest.mark.parametrize("objective", ["distill", "tv"])
def test_depths_without_targets_report_no_ratios_and_no_gradient(objective: str) -> None:
    """Only position 0 counts: no depth has a target. The draft objective adds exactly nothing
    (gradients are stock's with MTP weighted 0) and the metrics have no loss / agreement / acceptance
    for those depths (neither 0 nor NaN), only their token count 0."""
    batch = make_batch(MODEL_VOCAB, mask="zeros", seed=6)
    batch.loss_mask[:, 0] = 1
    stock, hooked = build(), build()
    stock_main_only_step(stock, batch)
    metrics = hooked_step(hooked, Micro(batch, []), objective=objective)
    assert_same_grads(hooked, stock)
    for k in (1, 2):
        assert metrics[f"mtp_{k}/tokens"] == 0
        for name in ("loss", "acc", "agree", "accept"):
            assert f"mtp_{k}/{name}" not in metrics, f"mtp_{k}/{name}"
    assert "mtp/accept_len" not in metrics


# ============================================================================ refused options


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        pytest.param({"objective": "kl"}, "objective", id="unknown-objective"),
        pytest.param({"objective": None}, "objective", id="objective-none"),
        pytest.param({"loss_impl": "dense", "objective": "distill"}, "loss_impl", id="dense-distill"),
        pytest.param({"loss_impl": "dense", "objective": "tv"}, "loss_impl", id="dense-tv"),
        pytest.param({"loss_impl": "dense", "agreement_metrics": True}, "loss_impl", id="dense-agreement"),
        pytest.param({"agreement_metrics": 1}, "agreement_metrics", id="agreement-not-bool"),
        pytest.param({"output": "probs"}, "output", id="unknown-output"),
        pytest.param({"entropy": True}, "entropy", id="entropy-with-logits"),
        pytest.param({"output": "logprobs", "entropy": "yes"}, "entropy", id="entropy-not-bool"),
        pytest.param({"output": "logprobs", "temperature": 0.0}, "temperature", id="temperature-zero"),
        pytest.param({"output": "logprobs", "temperature": -1.0}, "temperature", id="temperature-negative"),
        pytest.param({"output": "logprobs", "temperature": float("nan")}, "temperature", id="temperature-nan"),
        pytest.param({"output": "logprobs", "temperature": True}, "temperature", id="temperature-bool"),
        pytest.param({"output": "logprobs", "temperature": "1.0"}, "temperature", id="temperature-str"),
        pytest.param({"temperature": 0.7}, "temperature", id="temperature-with-logits"),
        pytest.param({"loss_impl": "dense", "objective": "accept"}, "loss_impl", id="dense-accept"),
        pytest.param({"objective": "accept", "accept_rule": "sampled", "draft_temperature": 0.0}, "draft_temperature", id="draft-temperature-zero-sampled"),
        pytest.param({"objective": "accept", "accept_rule": "match", "draft_temperature": 0.0}, "draft_temperature", id="draft-temperature-zero-match"),
        pytest.param({"objective": "distill", "draft_temperature": 0.0}, "draft_temperature", id="draft-temperature-zero-distill"),
        pytest.param({"objective": "tv", "accept_rule": "argmax", "draft_temperature": 0.0}, "draft_temperature", id="draft-temperature-zero-tv"),
        pytest.param({"draft_temperature": 0.0}, "draft_temperature", id="draft-temperature-zero-with-ce-alone"),
        pytest.param({"objective": "accept", "accept_rule": "greedy"}, "accept_rule", id="unknown-accept-rule"),
        pytest.param({"objective": "accept", "accept_rule": None}, "accept_rule", id="accept-rule-none"),
        pytest.param({"accept_rule": "sampled"}, "accept_rule", id="accept-rule-without-acceptance"),
        pytest.param({"loss_impl": "dense", "accept_rule": "match"}, "accept_rule", id="accept-rule-dense"),
        pytest.param({"objective": "accept", "draft_temperature": -0.5}, "draft_temperature", id="draft-temperature-negative"),
        pytest.param({"objective": "tv", "draft_temperature": float("nan")}, "draft_temperature", id="draft-temperature-nan"),
        pytest.param({"objective": "tv", "draft_temperature": float("inf")}, "draft_temperature", id="draft-temperature-inf"),
        pytest.param({"objective": "distill", "draft_temperature": True}, "draft_temperature", id="draft-temperature-bool"),
        pytest.param({"objective": "distill", "draft_temperature": "0.7"}, "draft_temperature", id="draft-temperature-str"),
        pytest.param({"draft_temperature": 0.7}, "draft_temperature", id="draft-temperature-with-ce-alone"),
    ],
)
def test_bad_draft_options_are_refused_naming_the_argument(options: dict[str, Any], argument: str) -> None:
    model = build()
    pre_hooks = dict(model._forward_pre_hooks)
    with pytest.raises(mtp_hooks.MTPHooksError, match=f"^{argument}: "):
        mtp_hooks.attach(model, **options)
    assert mtp_hooks.hooks_of(model) is None
    assert dict(model._forward_pre_hooks) == pre_hooks
