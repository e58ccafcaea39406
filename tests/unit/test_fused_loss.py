"""The fused weight gradient of the lean MTP loss against recompute and a dense float64 reference.

``lean_mtp_loss(..., weight_grad="fused")`` accumulates the head weight's gradient during forward
into one ``[V/tp, H]`` buffer (fp32 for low-precision inputs) instead of recomputing the logits in
backward. Pinned here, for every objective:

* fused and recompute give the dense float64 autograd result (objective, per-token outputs, both
  gradients), at float64 and fp32 accuracy, and bf16 inputs accumulate in fp32;
* one call over several depths' concatenated tokens equals the per-depth calls;
* matmul count (``FlopCounterMode``): fused does stock's 3 head matmuls for ``"ce"``, recompute 4,
  a detached head 2 and allocates no accumulator; no host sync in forward or backward;
* vocabulary-parallel (TP=2, two gloo ranks): each rank's weight-gradient shard and the summed
  hidden gradient equal the dense reference.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from mtp_hooks import MTPHooksError
from mtp_hooks.ops.draft_rule import OBJECTIVES, DraftRule
from mtp_hooks.ops.lean_loss import HeadLoss, KernelSpec, lean_mtp_loss
from mtp_hooks.ops.weight_grad import WEIGHT_GRAD_MODES, choose_weight_grad
from tests.support.distributed import SpawnedGroup
from tests.unit.test_draft_objectives import TOLERANCES, Case, Dense, assert_close, assert_same_head_loss, dense_reference, make_case

TOKENS, HIDDEN, VOCAB = 10, 6, 13
SCALE = 0.37  # a non-unit upstream gradient: both paths prepare their gradients in forward


def run(
    case: Case,
    weight_grad: str,
    objective: str,
    chunk_size: int = 3,
    dtype: torch.dtype = torch.float64,
    hidden_grad: bool = True,
    weight_grad_needed: bool = True,
    with_teacher: bool = True,
) -> tuple[HeadLoss, Tensor, Tensor]:
    """One lean call and its backward (scaled by ``SCALE``); returns the outputs and both leaves."""
    hidden, weight = case.leaves(dtype, hidden_grad, weight_grad_needed)
    teacher = case.teacher.to(dtype) if with_teacher else None
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.to(dtype), KernelSpec(None, chunk_size, weight_grad), DraftRule(objective), teacher)
    if out.objective.requires_grad:
        (out.objective * SCALE).backward()
    return out, hidden, weight


def reference(case: Case, objective: str) -> tuple[Dense, Tensor, Tensor]:
    hidden, weight = case.leaves(torch.float64)
    ref = dense_reference(hidden, weight, case.teacher, case.labels, case.token_weight, objective)
    (ref.objective * SCALE).backward()
    return ref, hidden, weight


def assert_matches_reference(out: HeadLoss, hidden: Tensor, weight: Tensor, case: Case, objective: str, tol: dict[str, float]) -> None:
    ref, ref_hidden, ref_weight = reference(case, objective)
    assert_same_head_loss(out, ref, (hidden, weight), (ref_hidden, ref_weight), tol)


# ------------------------------------------------------------------ against the dense reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("chunk_size", [1, 3, TOKENS + 5])
@pytest.mark.parametrize("weight_grad", WEIGHT_GRAD_MODES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_both_weight_gradient_paths_match_dense_float64_reference(objective: str, weight_grad: str, chunk_size: int, dtype: torch.dtype) -> None:
    case = make_case(seed=200 + chunk_size + 10 * OBJECTIVES.index(objective))
    out, hidden, weight = run(case, weight_grad, objective, chunk_size, dtype)
    assert out.agree.any() and not out.agree.all(), "the case should mix agreeing and disagreeing tokens"
    assert weight.grad.dtype == dtype and hidden.grad.dtype == dtype
    assert_matches_reference(out, hidden, weight, case, objective, TOLERANCES[dtype])


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_fused_and_recompute_agree_in_float64(objective: str) -> None:
    case = make_case(seed=31 + OBJECTIVES.index(objective))
    fused, fused_hidden, fused_weight = run(case, "fused", objective, chunk_size=4)
    recompute, hidden, weight = run(case, "recompute", objective, chunk_size=4)
    for name in HeadLoss._fields:
        a, b = getattr(fused, name), getattr(recompute, name)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a.detach(), b.detach(), atol=1e-14, rtol=1e-12, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(fused_hidden.grad, hidden.grad, atol=0.0, rtol=0.0)  # the same forward computation
    torch.testing.assert_close(fused_weight.grad, weight.grad, atol=1e-14, rtol=1e-12)


def test_fused_gradcheck_in_float64() -> None:
    case = make_case(seed=40, tokens=7, hidden=3, vocab=5)
    hidden, weight = case.leaves(torch.float64)

    def objective(h: Tensor, w: Tensor) -> Tensor:
        return lean_mtp_loss(h, w, case.labels, case.token_weight, KernelSpec(None, 3, "fused"), DraftRule("ce"), None).objective

    assert torch.autograd.gradcheck(objective, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("objective", ["distill", "tv"])
def test_fused_gradcheck_wrt_weight_with_the_teacher_logits_held_fixed(objective: str) -> None:
    """The teacher's logits are constants of the objective: its hidden states are re-solved for each
    perturbed (square, invertible) head so that its logits stay fixed."""
    case = make_case(seed=41, tokens=6, hidden=5, vocab=5)
    _, weight = case.leaves(torch.float64)
    teacher_logits = case.teacher @ case.weight.t()

    def loss(w: Tensor) -> Tensor:
        teacher = torch.linalg.solve(w.detach(), teacher_logits.t()).t()
        return lean_mtp_loss(case.hidden, w, case.labels, case.token_weight, KernelSpec(None, 4, "fused"), DraftRule(objective), teacher).objective

    assert torch.autograd.gradcheck(loss, (weight,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fused_backward_twice_with_retained_graph_gives_twice_the_gradient() -> None:
    case = make_case(seed=41)
    hidden, weight = case.leaves(torch.float64)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, 3, "fused"), DraftRule("distill"), case.teacher)
    out.objective.backward(retain_graph=True)
    once = weight.grad.clone()
    out.objective.backward()
    torch.testing.assert_close(weight.grad, 2 * once, atol=0.0, rtol=0.0)


# ------------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_fused_bf16_matches_float64_reference_within_bf16_rounding(objective: str) -> None:
    case = make_case(seed=50 + OBJECTIVES.index(objective), tokens=8, hidden=4, vocab=6)
    for field in ("hidden", "weight", "teacher"):  # the reference sees the same bf16-rounded inputs
        setattr(case, field, getattr(case, field).to(torch.bfloat16).double())
    out, hidden, weight = run(case, "fused", objective, chunk_size=3, dtype=torch.bfloat16)
    ref, ref_hidden, ref_weight = reference(case, objective)
    assert out.ce.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    assert_close(out.objective.detach(), ref.objective.detach(), "objective", atol=1e-3, rtol=2e-2)
    assert_close(out.ce, ref.ce, "per-token CE", atol=1e-2, rtol=2e-2)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=2e-3, rtol=3e-2)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=2e-3, rtol=3e-2)


@pytest.mark.parametrize(
    ("dtype", "small", "tokens", "rtol"),
    [(torch.bfloat16, 2.0**-10, 65, 8e-3), (torch.float16, 2.0**-13, 257, 4e-3)],
    ids=["bf16", "fp16"],
)
def test_fused_low_precision_accumulates_in_fp32_and_keeps_small_contributions(
    dtype: torch.dtype, small: float, tokens: int, rtol: float
) -> None:
    """One-token chunks each add ``small`` times a leading token's contribution, below half an ulp
    of the running sum in ``dtype`` (2^-8 for bf16, 2^-11 for fp16 at 1): a running sum in
    ``dtype`` would lose them all (6 % and 3 % of the result), fp32 keeps them."""
    hidden_size, vocab = 4, 8
    gen = torch.Generator().manual_seed(60)
    row = torch.rand(1, hidden_size, generator=gen, dtype=torch.float64) + 0.5
    token_weight = torch.full((tokens,), small, dtype=torch.float64)
    token_weight[0] = 1.0
    case = Case(
        hidden=row.expand(tokens, hidden_size).to(dtype).double(),  # the same token every time
        weight=torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).to(dtype).double(),
        teacher=row.expand(tokens, hidden_size).to(dtype).double(),
        labels=torch.full((tokens,), 3),
        token_weight=token_weight,
    )
    hidden, weight = case.leaves(dtype, hidden_grad=False)
    out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.float(), KernelSpec(None, 1, "fused"), DraftRule("ce"), None)
    (accumulator,) = [t for t in out.objective.grad_fn.saved_tensors if t is not None and t.dim() == 2]
    assert accumulator.dtype == torch.float32 and accumulator.shape == (vocab, hidden_size)
    out.objective.backward()
    _, _, ref_weight = reference(case, "ce")
    assert_close(weight.grad, ref_weight.grad / SCALE, "weight grad", atol=1e-6, rtol=rtol)  # one rounding to dtype


# --------------------------------------------------------------------- depths in one call


@pytest.mark.parametrize("weight_grad", WEIGHT_GRAD_MODES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_one_call_over_concatenated_depths_equals_per_depth_calls(objective: str, weight_grad: str) -> None:
    depths = [make_case(seed=70 + k) for k in range(3)]
    coefficients = [0.5, 0.3, 0.2]
    weight_value = depths[0].weight

    per_depth: list[HeadLoss] = []
    weight = weight_value.clone().requires_grad_(True)
    hiddens = [case.hidden.clone().requires_grad_(True) for case in depths]
    for case, hidden, coefficient in zip(depths, hiddens, coefficients):
        token_weight = case.token_weight * coefficient
        out = lean_mtp_loss(hidden, weight, case.labels, token_weight, KernelSpec(None, 4, weight_grad), DraftRule(objective), case.teacher)
        (out.objective * SCALE).backward()
        per_depth.append(out)

    joint_weight = weight_value.clone().requires_grad_(True)
    joint_hidden = torch.cat([case.hidden for case in depths]).requires_grad_(True)
    joint = lean_mtp_loss(
        joint_hidden,
        joint_weight,
        torch.cat([case.labels for case in depths]),
        torch.cat([case.token_weight * c for case, c in zip(depths, coefficients)]),
        KernelSpec(None, 4, weight_grad),
        DraftRule(objective),
        torch.cat([case.teacher for case in depths]),
    )
    (joint.objective * SCALE).backward()

    tight = dict(atol=1e-14, rtol=1e-12)
    assert_close(joint.objective.detach(), sum(out.objective.detach() for out in per_depth), "objective", **tight)
    for name in ("ce", "correct", "agree", "accept"):
        assert_close(getattr(joint, name), torch.cat([getattr(out, name) for out in per_depth]), name, **tight)
    assert_close(joint_hidden.grad, torch.cat([hidden.grad for hidden in hiddens]), "hidden grad", **tight)
    assert_close(joint_weight.grad, weight.grad, "weight grad (summed over depths)", **tight)


# ------------------------------------------------------------------ work done, memory kept


def head_matmuls(objective: str, weight_grad: str, weight_needs_grad: bool = True) -> float:
    """FLOPs of forward + backward in units of one head matmul over all tokens (2 T H V); a teacher
    only where the objective needs one (with one, ``"ce"`` also computes its logits for agreement)."""
    case = make_case(seed=80, tokens=12, hidden=5, vocab=11)
    with FlopCounterMode(display=False) as counter:
        run(case, weight_grad, objective, 5, torch.float32, weight_grad_needed=weight_needs_grad, with_teacher=objective != "ce")
    return counter.get_total_flops() / (2 * 12 * 5 * 11)


@pytest.mark.parametrize(
    ("objective", "fused", "recompute"),
    [("ce", 3, 4), ("distill", 4, 6), ("tv", 4, 6)],  # a teacher adds its logits (recomputed too)
)
def test_fused_does_stocks_head_matmul_count_and_recompute_one_more(objective: str, fused: int, recompute: int) -> None:
    assert head_matmuls(objective, "fused") == fused
    assert head_matmuls(objective, "recompute") == recompute


@pytest.mark.parametrize("weight_grad", WEIGHT_GRAD_MODES)
def test_detached_head_does_no_weight_gradient_work(weight_grad: str) -> None:
    assert head_matmuls("ce", weight_grad, weight_needs_grad=False) == 2
    assert head_matmuls("distill", weight_grad, weight_needs_grad=False) == 3


class NewStorages(TorchDispatchMode):
    """Shapes and dtypes of op outputs that own fresh memory (views of their inputs left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.outputs.append((tuple(tensor.shape), tensor.dtype))
        return out


@pytest.mark.parametrize("weight_needs_grad", [True, False], ids=["trained head", "detached head"])
def test_fused_allocates_one_fp32_accumulator_only_for_a_trained_head(weight_needs_grad: bool) -> None:
    case = make_case(seed=90, tokens=12, hidden=5, vocab=11)
    hidden, weight = case.leaves(torch.float32, weight_grad=weight_needs_grad)
    probe = NewStorages()
    with probe:
        out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.float(), KernelSpec(None, 5, "fused"), DraftRule("distill"), case.teacher.float())
    saved = [(tuple(t.shape), t.dtype) for t in out.objective.grad_fn.saved_tensors if t is not None]
    accumulators = [entry for entry in probe.outputs if entry[0] == (11, 5)]
    if weight_needs_grad:
        assert accumulators == [((11, 5), torch.float32)]
        # hidden grad and accumulator (fp16 alone keeps the scale its token weights were accumulated at)
        assert sorted(saved) == sorted([((12, 5), torch.float32), ((11, 5), torch.float32)]), saved
    else:
        assert accumulators == []
        assert saved == [((12, 5), torch.float32)], saved  # the hidden gradient only


class HostSyncs(TorchDispatchMode):
    """Counts ops that copy a device value to the host (``.item()``, ``bool(tensor)``, ``nonzero``)."""

    SYNCING = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.item.default,
        torch.ops.aten.nonzero.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.SYNCING:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("weight_grad", WEIGHT_GRAD_MODES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_no_host_sync_in_forward_or_backward(objective: str, weight_grad: str) -> None:
    case = make_case(seed=95)
    probe = HostSyncs()
    with probe:
        out, hidden, weight = run(case, weight_grad, objective, chunk_size=4, dtype=torch.float32)
    assert hidden.grad is not None and weight.grad is not None
    assert probe.calls == []
    with probe:  # the probe sees a sync where there is one
        bool(out.objective.detach() > 0)
    assert probe.calls


# ------------------------------------------------------------------------- choice, errors


def test_choose_weight_grad_prefers_fused_until_the_accumulator_outweighs_the_logits() -> None:
    # accumulator V/tp * h * 4 bytes against N * T * V/tp * 4 bytes of fp32 MTP logits
    assert choose_weight_grad(hidden_size=4096, tokens=2 * 4096) == "fused"
    assert choose_weight_grad(hidden_size=4096, tokens=4096) == "fused"
    assert choose_weight_grad(hidden_size=4096, tokens=4095) == "recompute"


def test_unknown_weight_grad_mode_is_refused() -> None:
    case = make_case(seed=99)
    with pytest.raises(MTPHooksError, match="weight_grad: bad value\n  expected: one of \\('fused', 'recompute'\\)\n  received: 'dense'"):
        lean_mtp_loss(case.hidden, case.weight, case.labels, case.token_weight, KernelSpec(None, 3, "dense"), DraftRule("ce"), None)


# ---------------------------------------------------------------------------- vocabulary-parallel


def scenario_fused_vocab_parallel(objective: str) -> None:
    """This rank's vocabulary shard, fused and recompute, against the full-vocabulary float64 reference."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    case = make_case(seed=110, tokens=12, hidden=5, vocab=16)  # the same draws on every rank
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    ref, ref_hidden, ref_weight = reference(case, objective)
    grads: dict[str, tuple[Tensor, Tensor]] = {}
    for weight_grad in WEIGHT_GRAD_MODES:
        hidden = case.hidden.clone().requires_grad_(True)
        weight = case.weight[rows].clone().requires_grad_(True)
        out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(group, 5, weight_grad), DraftRule(objective), case.teacher)
        (out.objective * SCALE).backward()
        summed_hidden_grad = hidden.grad.clone()  # each rank holds its shard's part; the TP region sums them
        dist.all_reduce(summed_hidden_grad, group=group)
        tol = TOLERANCES[torch.float64]
        assert_close(out.objective.detach(), ref.objective.detach(), f"{weight_grad}: objective", **tol)
        assert_close(out.ce, ref.ce, f"{weight_grad}: per-token CE", **tol)
        assert_close(out.accept, ref.accept, f"{weight_grad}: expected acceptance", **tol)
        assert torch.equal(out.correct, ref.correct) and torch.equal(out.agree, ref.agree), weight_grad
        assert_close(summed_hidden_grad, ref_hidden.grad, f"{weight_grad}: hidden grad", **tol)
        assert_close(weight.grad, ref_weight.grad[rows], f"{weight_grad}: weight grad shard", **tol)
        grads[weight_grad] = (hidden.grad, weight.grad)
    torch.testing.assert_close(grads["fused"], grads["recompute"], atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_fused_vocab_parallel_matches_full_vocabulary_reference(group: SpawnedGroup, objective: str) -> None:
    group.run(scenario_fused_vocab_parallel, {"tensor_model_parallel_size": 2}, objective=objective)


@pytest.mark.parametrize("weight_grad", WEIGHT_GRAD_MODES)
def test_chunk_loops_write_every_chunk_into_one_buffer(weight_grad: str) -> None:
    """Forward makes one ``[chunk, V]`` logits buffer for all chunks (fresh pages per chunk cost as much
    as the chunk's matmul on CPU); recompute's backward one ``[T, slice]`` buffer for all slices."""
    case = make_case(seed=91, tokens=12, hidden=7, vocab=11)
    hidden, weight = case.leaves(torch.float32)
    probe = NewStorages()
    with probe:
        out = lean_mtp_loss(hidden, weight, case.labels, case.token_weight.float(), KernelSpec(None, 3, weight_grad), DraftRule("ce"), None)
    assert [entry for entry in probe.outputs if entry[0] == (3 * 11,)] == [((3 * 11,), torch.float32)], probe.outputs
    assert not [entry for entry in probe.outputs if entry[0] == (3, 11)], "a chunk's logits allocated outside the buffer"
    probe = NewStorages()
    with probe:
        out.objective.backward()
    slices = [entry for entry in probe.outputs if len(entry[0]) == 1 and entry[0][0] % 12 == 0 and entry[0][0] > 12]
    assert len(slices) == (1 if weight_grad == "recompute" else 0), probe.outputs
    assert not [entry for entry in probe.outputs if len(entry[0]) == 2 and entry[0][0] == 12 and entry[0][1] != 7], probe.outputs
