"""The lean MTP loss equals mcore's dense cross-entropy and a float64 reference (TP = 1).

``lean_mtp_loss`` (objective ``"ce"``) walks the tokens in chunks and never keeps logits for backward.
These tests pin it, chunk size by chunk size, against

* the dense path stock mcore takes: ``hidden @ weight.T`` then mcore's own
  ``tensor_parallel.vocab_parallel_cross_entropy`` (which writes into its fp32 input, hence the clone);
* a float64 log-sum-exp reference, and ``torch.autograd.gradcheck`` in float64;

and, at model level, ``loss_impl="lean"`` against ``loss_impl="dense"`` on twin real mcore models.
Multi-rank (vocab-parallel) runs of the same function are pinned elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

import mtp_hooks
from mtp_hooks.ops.draft_rule import DraftRule
from mtp_hooks.ops.lean_loss import KernelSpec, LeanMTPLoss, lean_mtp_loss
from mtp_hooks.ops.vocab_parallel import argmax_matches
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, hooked_train_step, make_batch
from tests.support.head_cases import HIDDEN, TOKENS, VOCAB
from tests.support.probes import LargestOutput

CHUNK_SIZES = [1, 3, TOKENS, TOKENS + 7]  # one token, not dividing T, exactly T, more than T


@dataclasses.dataclass
class Case:
    """Inputs of one loss call; ``hidden`` and ``weight`` are leaves the test may mark for grad."""

    hidden: Tensor
    weight: Tensor
    labels: Tensor
    token_weight: Tensor

    def leaves(self, hidden_grad: bool = True, weight_grad: bool = True, dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
        dtype = dtype or self.hidden.dtype
        return (
            self.hidden.detach().to(dtype).clone().requires_grad_(hidden_grad),
            self.weight.detach().to(dtype).clone().requires_grad_(weight_grad),
        )


def make_case(
    seed: int = 0,
    tokens: int = TOKENS,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    zero_weights: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Random inputs with logits of order one; some token weights zero (masked tokens)."""
    gen = torch.Generator().manual_seed(seed)
    token_weight = torch.rand(tokens, generator=gen, dtype=torch.float64) + 0.1
    if zero_weights:
        token_weight[::3] = 0.0
    return Case(
        hidden=torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype),
        weight=(torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.7).to(dtype),
        labels=torch.randint(0, vocab, (tokens,), generator=gen),
        token_weight=(token_weight / tokens).to(torch.float32),
    )


def mcore_dense(hidden: Tensor, weight: Tensor, labels: Tensor, token_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What stock mcore computes: full logits, then its vocab-parallel CE (objective, CE, correct);
    correct as stock 0.19's acceptance counts at TP = 1: ``torch.argmax`` equals the label."""
    logits = hidden @ weight.t()
    correct = logits.detach().argmax(dim=-1) == labels
    ce = vocab_parallel_cross_entropy(logits.float().clone(), labels)
    return (ce * token_weight).sum(), ce.detach(), correct


def float64_reference(hidden: Tensor, weight: Tensor, labels: Tensor, token_weight: Tensor) -> tuple[Tensor, Tensor]:
    """Objective and per-token CE from float64 log-sum-exp."""
    logits = hidden.double() @ weight.double().t()
    ce = logits.logsumexp(-1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (ce * token_weight.double()).sum(), ce.detach()


def run_lean(case: Case, chunk_size: int, hidden_grad: bool = True, weight_grad: bool = True, scale: float = 1.0):
    hidden, weight = case.leaves(hidden_grad, weight_grad)
    objective, ce, correct = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, chunk_size))[:3]
    if objective.requires_grad:
        (objective * scale).backward()
    return objective.detach(), ce, correct, hidden, weight


def run_dense(case: Case, hidden_grad: bool = True, weight_grad: bool = True, scale: float = 1.0):
    hidden, weight = case.leaves(hidden_grad, weight_grad)
    objective, ce, correct = mcore_dense(hidden, weight, case.labels, case.token_weight)
    if objective.requires_grad:
        (objective * scale).backward()
    return objective.detach(), ce, correct, hidden, weight


def assert_close(actual: Optional[Tensor], expected: Optional[Tensor], what: str, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert (actual is None) == (expected is None), f"{what}: one is None, the other is not"
    if actual is not None:
        torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------ against mcore's dense CE


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_lean_matches_mcore_vocab_parallel_cross_entropy(chunk_size: int) -> None:
    case = make_case(seed=chunk_size)
    lean = run_lean(case, chunk_size, scale=0.37)
    dense = run_dense(case, scale=0.37)
    for what, a, b in zip(("objective", "per-token CE"), lean[:2], dense[:2]):
        assert_close(a, b, what)
    assert torch.equal(lean[2], dense[2]), "correct flags differ"
    assert_close(lean[3].grad, dense[3].grad, "hidden grad")
    assert_close(lean[4].grad, dense[4].grad, "weight grad")


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_lean_matches_float64_reference(chunk_size: int) -> None:
    case = make_case(seed=10 + chunk_size)
    _, _, _, hidden, weight = run_lean(case, chunk_size)
    objective, ce, _, _, _ = run_lean(case, chunk_size, hidden_grad=False, weight_grad=False)
    ref_hidden, ref_weight = case.leaves(dtype=torch.float64)
    ref_objective, ref_ce = float64_reference(ref_hidden, ref_weight, case.labels, case.token_weight)
    ref_objective.backward()
    assert_close(objective, ref_objective, "objective", atol=1e-6, rtol=1e-5)
    assert_close(ce, ref_ce, "per-token CE", atol=1e-5, rtol=1e-5)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=1e-6, rtol=1e-4)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("labels", ["first", "last", "both edges"])
def test_labels_at_vocabulary_edges_match_mcore(labels: str) -> None:
    case = make_case(seed=3, zero_weights=False)
    if labels == "first":
        case.labels.fill_(0)
    elif labels == "last":
        case.labels.fill_(VOCAB - 1)
    else:
        case.labels[::2] = 0
        case.labels[1::2] = VOCAB - 1
    lean = run_lean(case, chunk_size=4)
    dense = run_dense(case)
    assert_close(lean[0], dense[0], "objective")
    assert_close(lean[1], dense[1], "per-token CE")
    assert torch.equal(lean[2], dense[2]), "correct flags differ"
    assert_close(lean[3].grad, dense[3].grad, "hidden grad")
    assert_close(lean[4].grad, dense[4].grad, "weight grad")


@pytest.mark.parametrize("label", ["first of the tie", "second of the tie"])
def test_correct_flags_give_a_tie_to_the_first_index_as_stock(label: str) -> None:
    """Stock 0.19 counts ``argmax == label``, and ``torch.argmax`` takes the first of equal maxima:
    of two tied tokens only the lower index counts as predicted, in the lean loss and in
    ``argmax_matches`` (the dense path's count)."""
    case = make_case(seed=4, zero_weights=False)
    logits = case.hidden @ case.weight.t()
    best = int(logits[0].argmax())
    twin = (best + 1) % VOCAB
    case.weight[twin] = case.weight[best]  # token 0's maximum is now a tie of best and twin
    first, second = min(best, twin), max(best, twin)
    case.labels[0] = first if label == "first of the tie" else second
    _, _, correct, _, _ = run_lean(case, chunk_size=3)
    tied_logits = case.hidden @ case.weight.t()
    assert tied_logits[0, first] == tied_logits[0, second] == tied_logits[0].max()
    assert bool(correct[0]) == (label == "first of the tie")
    expected = tied_logits.argmax(dim=-1) == case.labels
    assert torch.equal(correct, expected)
    assert torch.equal(argmax_matches(tied_logits, case.labels, None), expected)


@pytest.mark.parametrize("label", [-100, VOCAB], ids=["-100", "V"])
def test_labels_outside_the_vocabulary_have_mcores_ce(label: int) -> None:
    """Unvalidated labels outside the vocabulary (``validate="off"``): mcore's CE takes their
    target logit as the row's maximum (0 after its shift), so their CE is ``logsumexp - max``;
    the lean loss reports the same, and neither counts them as predicted."""
    case = make_case(seed=6, zero_weights=False)
    case.labels[::2] = label
    lean = run_lean(case, chunk_size=3)
    dense = run_dense(case)
    logits = case.hidden @ case.weight.t()
    torch.testing.assert_close(dense[1][::2], logits.logsumexp(-1)[::2] - logits.amax(-1)[::2])
    for what, a, b in zip(("objective", "per-token CE"), lean[:2], dense[:2]):
        assert_close(a, b, what)
    assert not bool(lean[2][::2].any()) and torch.equal(lean[2], dense[2])
    assert_close(lean[3].grad, dense[3].grad, "hidden grad")
    assert_close(lean[4].grad, dense[4].grad, "weight grad")


# ----------------------------------------------------------------------------- token weights


def test_tokens_with_zero_weight_get_zero_hidden_gradient_but_keep_their_ce() -> None:
    case = make_case(seed=5)
    zero = case.token_weight == 0
    assert zero.any() and (~zero).any()
    _, ce, _, hidden, _ = run_lean(case, chunk_size=3)
    assert torch.equal(hidden.grad[zero], torch.zeros_like(hidden.grad[zero]))
    assert hidden.grad[~zero].abs().sum() > 0
    _, ref_ce = float64_reference(case.hidden, case.weight, case.labels, case.token_weight)
    assert_close(ce, ref_ce, "per-token CE of every token, weighted or not", atol=1e-5)


def test_all_zero_token_weights_give_zero_objective_and_zero_gradients() -> None:
    case = make_case(seed=6)
    case.token_weight.zero_()
    objective, ce, _, hidden, weight = run_lean(case, chunk_size=4)
    assert objective.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden.grad))
    assert torch.equal(weight.grad, torch.zeros_like(weight.grad))
    assert (ce > 0).all()


# ------------------------------------------------------------------------- which inputs need grad


@pytest.mark.parametrize("chunk_size", [3, TOKENS + 7])
@pytest.mark.parametrize("frozen", ["weight", "hidden"], ids=["detached_head_weight", "hidden_without_grad"])
def test_an_input_without_grad_gets_no_gradient_and_the_other_ones_gradient_is_unchanged(chunk_size: int, frozen: str) -> None:
    """A detached head weight (``detach_head``) leaves the hidden gradient as dense's, and a hidden
    state without grad still gives the weight gradient."""
    case = make_case(seed=7 if frozen == "weight" else 8)
    lean = run_lean(case, chunk_size, hidden_grad=frozen != "hidden", weight_grad=frozen != "weight")
    dense = run_dense(case)
    frozen_at, trained_at, trained = (4, 3, "hidden") if frozen == "weight" else (3, 4, "weight")
    assert lean[frozen_at].grad is None
    assert_close(lean[0], dense[0], "objective")
    assert_close(lean[trained_at].grad, dense[trained_at].grad, f"{trained} grad")


def test_lean_saves_no_logits_sized_tensor_for_backward() -> None:
    case = make_case(seed=9, tokens=12, hidden=4, vocab=29)
    hidden, weight = case.leaves()
    objective = LeanMTPLoss.apply(hidden, weight, case.labels, case.token_weight, None, KernelSpec(None, 5), DraftRule())[0]
    saved = [t for t in objective.grad_fn.saved_tensors if t is not None]
    assert saved, "the weight gradient needs hidden and weight"
    logits_numel = 12 * 29
    assert max(t.numel() for t in saved) < logits_numel, [tuple(t.shape) for t in saved]


def test_chunked_lean_never_materialises_a_full_logits_tensor() -> None:
    tokens, hidden_size, vocab, chunk = 32, 8, 64, 8
    case = make_case(seed=14, tokens=tokens, hidden=hidden_size, vocab=vocab)
    hidden, weight = case.leaves()
    probe = LargestOutput()
    with probe:
        objective = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, chunk)).objective
        objective.backward()
    assert weight.grad is not None and hidden.grad is not None
    # A forward chunk holds chunk * V logits; a backward vocabulary slice as many, over all tokens.
    assert probe.largest <= max(chunk * vocab, vocab * hidden_size), probe.largest
    assert probe.largest < tokens * vocab


def test_weight_gradient_recompute_holds_at_most_a_quarter_of_the_logits_even_with_one_chunk() -> None:
    tokens, hidden_size, vocab = 32, 8, 64
    case = make_case(seed=15, tokens=tokens, hidden=hidden_size, vocab=vocab)
    hidden, weight = case.leaves()
    objective = lean_mtp_loss(hidden, weight, case.labels, case.token_weight, KernelSpec(None, tokens + 1)).objective
    probe = LargestOutput()
    with probe:
        objective.backward()
    assert weight.grad is not None
    assert probe.largest <= max(tokens * vocab // 4, vocab * hidden_size), probe.largest


def test_nothing_requires_grad_gives_values_without_graph() -> None:
    case = make_case(seed=11)
    objective, ce, correct, _, _ = run_lean(case, chunk_size=3, hidden_grad=False, weight_grad=False)
    dense = run_dense(case)
    assert not objective.requires_grad
    assert_close(objective, dense[0], "objective")
    assert_close(ce, dense[1], "per-token CE")
    assert torch.equal(correct, dense[2])


# ------------------------------------------------------------------------------ gradcheck, dtypes


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
@pytest.mark.parametrize("needs", ["both", "hidden only", "weight only"])
def test_gradcheck_in_float64(chunk_size: int, needs: str) -> None:
    case = make_case(seed=12, tokens=7, hidden=3, vocab=5, dtype=torch.float64)
    hidden, weight = case.leaves(hidden_grad=needs != "weight only", weight_grad=needs != "hidden only")
    token_weight = case.token_weight.double()

    def objective(h: Tensor, w: Tensor) -> Tensor:
        return lean_mtp_loss(h, w, case.labels, token_weight, KernelSpec(None, chunk_size)).objective

    assert objective(hidden, weight).dtype == torch.float64
    assert torch.autograd.gradcheck(objective, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_bf16_inputs_match_mcore_dense_within_bf16_rounding() -> None:
    case = make_case(seed=13, tokens=16, hidden=8, vocab=24, dtype=torch.bfloat16)
    lean_h, lean_w = case.leaves()
    objective, ce = lean_mtp_loss(lean_h, lean_w, case.labels, case.token_weight, KernelSpec(None, 5))[:2]
    objective.backward()
    dense_h, dense_w = case.leaves()
    ref_objective, ref_ce, _ = mcore_dense(dense_h, dense_w, case.labels, case.token_weight)
    ref_objective.backward()
    assert ce.dtype == torch.float32 and lean_h.grad.dtype == torch.bfloat16 and lean_w.grad.dtype == torch.bfloat16
    assert_close(objective, ref_objective, "objective", atol=1e-5, rtol=1e-5)
    assert_close(ce, ref_ce, "per-token CE", atol=1e-5, rtol=1e-5)
    assert_close(lean_h.grad, dense_h.grad, "hidden grad", atol=1e-3, rtol=2e-2)
    assert_close(lean_w.grad, dense_w.grad, "weight grad", atol=1e-3, rtol=2e-2)


# ------------------------------------------------------------------ model level: lean vs dense hooks

# A vocabulary no other layer width matches (2h is eh_proj's input, 3h the fused QKV, 4h the MLP), so
# "last dim == vocab" identifies logits.
SPEC = TinyGPT(vocab_size=80, hidden_size=32, mtp_num_layers=2)


def train_step_under(model: torch.nn.Module, batch: Batch, **options: Any) -> tuple[Tensor, dict[str, float]]:
    """One hooked training micro-batch under hooks attached for it; returns the logits and the metrics."""
    with mtp_hooks.attached(model, **options) as hooks:
        return hooked_train_step(model, hooks, batch), hooks.metrics()


@pytest.mark.parametrize("detach_head", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_lean_and_dense_hooks_give_equal_metrics_logits_and_grads(detach_head: bool, tied: bool) -> None:
    spec = dataclasses.replace(SPEC, tied=tied)
    batch = make_batch(spec.vocab_size, batch=2, seq=8, mask="random", seed=1)
    lean_model, dense_model = spec.build(seed=21), spec.build(seed=21)
    lean_logits, lean_metrics = train_step_under(lean_model, batch, loss_impl="lean", chunk_size=3, detach_head=detach_head)
    dense_logits, dense_metrics = train_step_under(dense_model, batch, loss_impl="dense", detach_head=detach_head)
    assert lean_metrics.keys() == dense_metrics.keys() and "mtp_2/loss" in lean_metrics
    for key, value in dense_metrics.items():
        assert lean_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(lean_logits, dense_logits, atol=1e-6, rtol=1e-5)
    assert_same_grads(lean_model, dense_model)
    head = lean_model.output_layer.weight if not tied else lean_model.embedding.word_embeddings.weight
    assert head.grad is not None and head.grad.abs().sum() > 0


def test_lean_hooks_keep_no_mtp_logits_for_backward_while_dense_keeps_one_per_depth() -> None:
    batch = make_batch(SPEC.vocab_size, batch=2, seq=8, mask="random", seed=2)
    logits_numel = 2 * 8 * SPEC.vocab_size

    def logits_sized_saves(loss_impl: str) -> int:
        model = SPEC.build(seed=22)
        sizes: list[tuple[int, ...]] = []

        def pack(tensor: Tensor) -> Tensor:
            sizes.append(tuple(tensor.shape))
            return tensor

        with mtp_hooks.attached(model, loss_impl=loss_impl) as hooks:
            with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    model(*batch.model_args)
        return sum(1 for shape in sizes if shape and shape[-1] == SPEC.vocab_size and torch.Size(shape).numel() >= logits_numel)

    assert logits_sized_saves("dense") >= SPEC.mtp_num_layers
    assert logits_sized_saves("lean") == 0
