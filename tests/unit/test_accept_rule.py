"""The engine's verification rule (``accept_rule``) and greedy drafting (``draft_temperature=0``).

Function level: ``lean_mtp_loss`` under every defined (objective, rule, T in {0, 0.7, 1.0, 1.3})
against the float64 dense reference of ``test_draft_objectives`` (objective, per-token acceptance,
CE, agreement, gradients wrt hidden and weight), through both weight-gradient paths (the backward
recompute and the fused accumulator), chunk sizes, fp64, fp32 and bf16; ``gradcheck`` in float64
for the argmax rule's surrogate and the match rule; what T = 0 means (acceptance is agreement under
every rule, the surrogate is the CE against the target's argmax); the surrogate's optimum; ties;
refusals. Model level (twin real mcore models, BSHD and padded THD): the hooked metrics and
gradients under each rule against the dense reference built from stock's captured logits.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import Tensor

import mtp_hooks
from mtp_hooks.ops.draft_rule import ACCEPT_RULES, OBJECTIVES, DraftRule
from mtp_hooks.ops.drafts import draft_tokens
from mtp_hooks.ops.lean_loss import KernelSpec, lean_mtp_loss
from mtp_hooks.testing import assert_same_grads
from tests.support.head_cases import TOKENS
from tests.support.mcore_cpu import needs_packed_mtp
from tests.unit.test_draft_objectives import (
    MICROS,
    TOLERANCES,
    Case,
    assert_close,
    assert_metrics_equal,
    assert_same_head_loss,
    build,
    dense_reference,
    hooked_step,
    make_case,
    stock_reference_step,
)

TEMPERATURES = (0.0, 0.7, 1.0, 1.3)


def defined(objective: str, accept_rule: str, temperature: float) -> bool:
    """Whether T = 0 leaves the combination defined (the rest is refused: ``test_undefined_*``)."""
    return temperature > 0 or objective == "ce" or (objective == "accept" and accept_rule == "argmax")


RULES = [DraftRule(o, t, r) for o, r, t in itertools.product(OBJECTIVES, ACCEPT_RULES, TEMPERATURES) if defined(o, r, t)]
# (chunk size, dtype, weight-gradient path): one token, a chunk that does not divide T, more than T.
PATHS = [(1, torch.float64, "recompute"), (3, torch.float32, "fused"), (TOKENS + 5, torch.float32, "recompute"), (4, torch.float64, "fused")]


def rule_id(rule: DraftRule) -> str:
    return f"{rule.objective}-{rule.accept_rule}-T{rule.draft_temperature}"


def run(case: Case, rule: DraftRule, dtype: torch.dtype, chunk_size: int = 4, weight_grad: str = "recompute", scale: float = 0.37) -> tuple[Any, Tensor, Tensor]:
    hidden, weight = case.leaves(dtype)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.to(dtype), KernelSpec(None, chunk_size, weight_grad), rule, case.teacher.to(dtype))
    (out.objective * scale).backward()  # a non-unit upstream gradient: the hidden gradient is precomputed in forward
    return out, hidden, weight


def reference(case: Case, rule: DraftRule, scale: float = 0.37, **kwargs: Any) -> tuple[Any, Tensor, Tensor]:
    hidden, weight = case.leaves(torch.float64)
    ref = dense_reference(
        hidden, weight, case.teacher, case.labels, case.token_weight, rule.objective,
        temperature=rule.draft_temperature, accept_rule=rule.accept_rule, **kwargs,
    )
    (ref.objective * scale).backward()
    return ref, hidden, weight


# ============================================================================ function level


@pytest.mark.parametrize(("chunk_size", "dtype", "weight_grad"), PATHS, ids=[f"chunk{c}-{str(d)[6:]}-{w}" for c, d, w in PATHS])
@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_rule_matches_the_float64_dense_reference(rule: DraftRule, chunk_size: int, dtype: torch.dtype, weight_grad: str) -> None:
    case = make_case(seed=500 + RULES.index(rule))
    out, hidden, weight = run(case, rule, dtype, chunk_size, weight_grad)
    ref, ref_hidden, ref_weight = reference(case, rule)
    assert_same_head_loss(out, ref, (hidden, weight), (ref_hidden, ref_weight), TOLERANCES[dtype])
    assert out.agree.any() and not out.agree.all(), "the case should mix agreeing and disagreeing tokens"
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_rule_in_bf16_matches_the_float64_reference_within_bf16_rounding(rule: DraftRule) -> None:
    case = make_case(seed=600 + RULES.index(rule), tokens=16, hidden=8, vocab=24)
    out, hidden, weight = run(case, rule, torch.bfloat16, chunk_size=5, weight_grad="fused" if RULES.index(rule) % 2 else "recompute")
    # The reference sees the bf16-rounded inputs, its logits the bf16 GEMM's (argmaxes and tv's signs as the head's).
    case = Case(hidden.detach().double(), weight.detach().double(), case.teacher.to(torch.bfloat16).double(), case.labels, case.token_weight)
    ref, ref_hidden, ref_weight = reference(case, rule, logits_dtype=torch.bfloat16)
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", atol=1e-3, rtol=1e-2)
    assert_close(out.accept, ref.accept, "acceptance", atol=1e-2, rtol=1e-2)
    assert torch.equal(out.agree, ref.agree), "argmax agreement"
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=2e-3, rtol=2e-2)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=2e-3, rtol=2e-2)


SMOOTH = [DraftRule("accept", t, "argmax") for t in (0.0, 0.7, 1.3)] + [DraftRule("accept", t, "match") for t in (0.7, 1.3)]


@pytest.mark.parametrize("weight_grad", ["recompute", "fused"])
@pytest.mark.parametrize("rule", SMOOTH, ids=rule_id)
def test_gradcheck_of_the_argmax_surrogate_and_the_match_rule_in_float64(rule: DraftRule, weight_grad: str) -> None:
    """Finite differences in the hidden states and (the teacher's logits held fixed by re-solving its
    hidden states against a square, invertible head, as in ``test_draft_objectives``) in the weight."""
    case = make_case(seed=15, tokens=6, hidden=5, vocab=5)
    hidden, weight = case.leaves(torch.float64)
    teacher_logits = case.teacher @ case.weight.t()

    def loss(h: Tensor, w: Tensor) -> Tensor:
        teacher = torch.linalg.solve(w.detach(), teacher_logits.t()).t()
        return lean_mtp_loss(h, w, case.labels, case.token_weight, KernelSpec(None, 4, weight_grad), rule, teacher).objective

    assert torch.autograd.gradcheck(loss, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("objective", ["ce", "accept"])
def test_at_zero_temperature_every_rule_accepts_exactly_where_the_argmaxes_agree(objective: str) -> None:
    case = make_case(seed=21)
    accepts = []
    for accept_rule in ACCEPT_RULES if objective == "ce" else ("argmax",):
        out, _, _ = run(case, DraftRule(objective, 0.0, accept_rule), torch.float64)
        assert out.accept is not None and out.agree is not None
        assert torch.equal(out.accept, out.agree.double()), accept_rule
        accepts.append(out.accept)
    assert 0 < float(accepts[0].mean()) < 1
    assert all(torch.equal(a, accepts[0]) for a in accepts)


@pytest.mark.parametrize("weight_grad", ["recompute", "fused"])
def test_greedy_surrogate_is_the_cross_entropy_against_the_targets_argmax(weight_grad: str) -> None:
    """``"accept"`` at T = 0 under the argmax rule trains exactly what ``"ce"`` trains on labels that are
    the target's first argmax: objective and both gradients, bit for bit in float64 up to summation order."""
    case = make_case(seed=22)
    greedy, hidden, weight = run(case, DraftRule("accept", 0.0), torch.float64, weight_grad=weight_grad)
    target_argmax = (case.teacher @ case.weight.t()).argmax(-1)
    assert not torch.equal(target_argmax, case.labels)
    relabelled = Case(case.hidden, case.weight, case.teacher, target_argmax, case.token_weight)
    ce, ce_hidden, ce_weight = run(relabelled, DraftRule("ce"), torch.float64, weight_grad=weight_grad)
    tight = dict(atol=1e-13, rtol=1e-12)
    assert_close(greedy.objective.detach(), ce.objective.detach(), "objective", **tight)
    assert_close(hidden.grad, ce_hidden.grad, "hidden grad", **tight)
    assert_close(weight.grad, ce_weight.grad, "weight grad", **tight)
    assert_close(greedy.ce, run(case, DraftRule("ce"), torch.float64)[0].ce, "per-token CE stays the labels'", **tight)


def test_the_rules_measure_different_acceptances_at_positive_temperature() -> None:
    """Guard for the reference: on this case the three rules are three different numbers per token."""
    case = make_case(seed=23)
    accepts = {rule: run(case, DraftRule("ce", 0.7, rule), torch.float64)[0].accept for rule in ACCEPT_RULES}
    for a, b in itertools.combinations(ACCEPT_RULES, 2):
        assert not torch.allclose(accepts[a], accepts[b], atol=1e-3), f"{a} and {b}"
    # min(p, q) >= p q on [0, 1]: the sampled rule's acceptance is never below the match rule's.
    assert bool((accepts["sampled"] >= accepts["match"] - 1e-12).all())


def test_argmax_rule_scores_the_first_of_tied_draft_maxima() -> None:
    """Draft logits tied at tokens 0 and 1 (the target prefers 0): the engine drafts token 0, the first."""
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    hidden = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)  # z = (1, 1, -2)
    teacher = torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)  # y = (2, 0, -2), then (0, 2, -2)
    out = lean_mtp_loss(hidden, weight, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.float64), KernelSpec(None, 1), DraftRule("ce", 1.0), teacher)
    p = (teacher @ weight.t()).softmax(-1)
    assert out.accept is not None and out.agree is not None
    torch.testing.assert_close(out.accept, p[:, 0], atol=1e-15, rtol=0)
    assert out.agree.tolist() == [True, False]


def test_training_the_surrogate_reaches_the_argmax_rules_best_acceptance() -> None:
    """The surrogate's optimum is argmax agreement: free draft logits trained by it reach
    ``p_T(argmax q) = max p_T`` on every token (the most the argmax rule can accept), while the
    sampled rule's ``-log sum min(p, q)``, whose optimum is ``q = p``, may leave the argmax elsewhere."""
    vocab, tokens, temperature = 7, 9, 0.7
    gen = torch.Generator().manual_seed(24)
    target = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64) * 2.0
    draft = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64).requires_grad_(True)
    identity = torch.eye(vocab, dtype=torch.float64)  # hidden states are the logits
    labels, token_weight = torch.zeros(tokens, dtype=torch.long), torch.ones(tokens, dtype=torch.float64)
    rule = DraftRule("accept", temperature, "argmax")
    before = lean_mtp_loss(draft, identity, labels, token_weight, KernelSpec(None, 4), rule, target).accept
    optimizer = torch.optim.Adam([draft], lr=0.1)
    for _ in range(300):
        optimizer.zero_grad()
        lean_mtp_loss(draft, identity, labels, token_weight, KernelSpec(None, 4), rule, target).objective.backward()
        optimizer.step()
    after = lean_mtp_loss(draft, identity, labels, token_weight, KernelSpec(None, 4), rule, target)
    best = (target / temperature).softmax(-1).max(-1).values
    assert before is not None and after.accept is not None and after.agree is not None
    assert not bool(before.allclose(best)), "the untrained draft should not already be optimal"
    assert bool(after.agree.all())
    torch.testing.assert_close(after.accept, best, atol=1e-12, rtol=0)


def test_greedy_drafts_are_the_argmax() -> None:
    gen = torch.Generator().manual_seed(25)
    hidden, weight = torch.randn(10, 4, generator=gen), torch.randn(13, 4, generator=gen)
    assert torch.equal(draft_tokens(hidden, weight, None, 3, 0.0), (hidden @ weight.t()).argmax(-1))
    assert torch.equal(draft_tokens(hidden, weight, None, 3, 0.0), draft_tokens(hidden, weight, None, 3, None))


# ============================================================================ refusals


@pytest.mark.parametrize(("objective", "accept_rule"), [("distill", "argmax"), ("tv", "sampled"), ("accept", "sampled"), ("accept", "match")])
def test_undefined_at_zero_temperature_is_refused_naming_draft_temperature(objective: str, accept_rule: str) -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"^draft_temperature: bad value\n  expected: a float > 0 with objective="):
        DraftRule(objective, 0.0, accept_rule)


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        (("accept", 0.7, "exact"), "accept_rule"),
        (("accept", -0.1, "argmax"), "draft_temperature"),
        (("accept", float("nan"), "argmax"), "draft_temperature"),
        (("accept", True, "argmax"), "draft_temperature"),
        (("kl", 1.0, "argmax"), "objective"),
    ],
)
def test_bad_draft_rules_are_refused_naming_the_field(arguments: tuple[Any, ...], name: str) -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=f"^{name}: bad value"):
        DraftRule(*arguments)


@pytest.mark.parametrize(
    ("spec", "rule", "name"),
    [
        (dict(chunk_size=0), None, "chunk_size"),
        (dict(chunk_size=True), None, "chunk_size"),
        (dict(chunk_size=3, weight_grad="dense"), None, "weight_grad"),
        (None, None, "spec"),
        (dict(chunk_size=3), "accept", "rule"),
    ],
)
def test_bad_kernel_arguments_are_refused_naming_them(spec: Any, rule: Any, name: str) -> None:
    case = make_case(seed=26)
    with pytest.raises(mtp_hooks.MTPHooksError, match=f"^{name}: bad value"):
        kernel: Any = spec if spec is None else KernelSpec(None, **spec)
        draft_rule: Any = DraftRule() if rule is None else rule
        lean_mtp_loss(case.hidden, case.weight, case.labels, case.token_weight, kernel, draft_rule, case.teacher)


# ============================================================================ model level

# (objective, rule, T): "accept" where T = 0 defines it, else "ce" with agreement metrics; and tv under match.
MODEL_RULES = [
    ("accept", "argmax", 0.0),
    ("accept", "argmax", 0.7),
    ("ce", "sampled", 0.0),
    ("accept", "sampled", 0.7),
    ("ce", "match", 0.0),
    ("accept", "match", 0.7),
    ("tv", "match", 1.3),
]


@pytest.mark.parametrize("layout", ["bshd", pytest.param("thd_padded", marks=needs_packed_mtp)])
@pytest.mark.parametrize(("objective", "accept_rule", "temperature"), MODEL_RULES, ids=[f"{o}-{r}-T{t}" for o, r, t in MODEL_RULES])
def test_hooked_rule_metrics_and_gradients_equal_dense_reference_from_stock(objective: str, accept_rule: str, temperature: float, layout: str) -> None:
    micro = MICROS[layout]()
    stock, hooked = build(), build()
    expected = stock_reference_step(stock, micro, objective, temperature, accept_rule=accept_rule)
    options = dict(objective=objective, agreement_metrics=True, chunk_size=5, draft_temperature=temperature, accept_rule=accept_rule)
    metrics = hooked_step(hooked, micro, **options)
    assert_metrics_equal(metrics, expected)
    assert_same_grads(hooked, stock)
    if temperature == 0:
        for k in (1, 2):
            assert metrics[f"mtp_{k}/accept"] == pytest.approx(metrics[f"mtp_{k}/agree"], abs=1e-12)
    else:  # guard: the same step under another rule reports another acceptance
        other = "sampled" if accept_rule != "sampled" else "argmax"
        assert metrics["mtp_1/accept"] != pytest.approx(stock_reference_step(build(), micro, objective, temperature, accept_rule=other)["mtp_1/accept"], rel=1e-3)


def test_hooks_options_and_repr_name_a_changed_rule() -> None:
    with mtp_hooks.attached(build(), agreement_metrics=True, accept_rule="match", draft_temperature=0.0) as hooks:
        assert hooks.options.accept_rule == "match" and hooks.options.draft_temperature == 0.0
        assert hooks.options.draft_rule == DraftRule("ce", 0.0, "match")
        assert "accept_rule='match'" in repr(hooks) and "draft_temperature=0.0" in repr(hooks)
    with mtp_hooks.attached(build(), agreement_metrics=True) as hooks:
        assert hooks.options.accept_rule == "argmax" and "accept_rule" not in repr(hooks)
