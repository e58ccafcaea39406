"""Pipeline parallelism in the parity matrix: hooks against stock through mcore's own schedule.

Every case (``tests.support.pipeline_cases``) runs on each rank of a spawned gloo group: stock chunks and
hooked twins (same seed) in mcore DDP, wired as Megatron's ``training.py`` wires them (``no_sync_func``;
with ``overlap_grad_reduce`` also ``grad_sync_func``, as under its default ``align_grad_reduce``), two
steps of four micro-batches through ``get_forward_backward_func()`` with Megatron's
``finalize_model_grads``; then, rank by rank and chunk by chunk, every parameter's ``main_grad``, the
last stage's logits or log-probs and per-depth MTP losses per micro-batch (stock: its tracker; hooks:
``metrics()``), and mcore's MTP tracker (0.19+: acceptance counts too) after the last step.

Gradients are compared with the right reference: stock built as the case, except under a knob
where stock itself is wrong (``STOCK_DEFECTS``: stock without that knob), and under detach flags
stock with the MTP loss weighted 0 for the parameters the flags keep the MTP loss out of. The
``test_stock_*`` tests pin each of stock's own deviations (they fail once stock is fixed).

The draft factor adds k = 3 steps of MTP layer 1 in the engine's geometry (``draft_geometry="engine"`` on rotary
twins, MTP block on the last stage): stock runs the chain's definition there (``stock_engine_geometry``), and the
dropped layer 2 is the one MTP parameter allowed no gradient.

Default: a pairwise selection of the factors on PP=2 and PP=2 x VPP=2 (19 cases, 2 ranks) and three
cases on TP=2 x PP=2 and CP=2 x PP=2 (4 ranks). ``MTP_PARITY=full``: every allowed combination on
2 ranks (1,152) and a pairwise selection per 4-rank layout.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import pytest
import torch

import mtp_hooks

from tests.support.distributed import SpawnedGroup
from tests.support.pipeline_cases import STOCK_DEFECTS, Case, full_product, grad_reference, pairwise
from tests.support.pipeline_parity import Run, batches_for_this_rank, rel_l2, run_hooked, run_stock

FULL = os.environ.get("MTP_PARITY") == "full"
ATOL, RTOL = 1e-6, 1e-5
HEAD, WORDS = "output_layer.weight", "embedding.word_embeddings.weight"

TWO_RANK_CASES = full_product() if FULL else pairwise()
FOUR_RANK_CASES = (
    pairwise({"layout": "tp2_pp2"}) + pairwise({"layout": "cp2_pp2"})
    if FULL
    else [
        Case(layout="tp2_pp2", tied=False, output="logprobs", loss_impl="lean", sync="fusion"),
        Case(layout="cp2_pp2", tied=True, output="logits", loss_impl="fused", sync="overlap"),
        Case(layout="cp2_pp2", tied=False, output="logits", loss_impl="recompute", sync="fusion_overlap", detach="head"),
    ]
)


# ------------------------------------------------------------------ run on every rank


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.allclose(actual, expected, atol=ATOL, rtol=RTOL)


def _off_by(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    return f"rel L2 {rel_l2(actual, expected):.3g}"


def compare(case: Case, hooked: Run, stock: Run, full: Run, main: Run | None) -> list[str]:
    """Every mismatch of the hooked run against stock (outputs, losses, tracker) and against the
    reference gradients (``full``: stock with MTP, right knobs; ``main``: the same, MTP weighted 0)."""
    bad: list[str] = []
    for c, grads in enumerate(hooked.grads):
        for name, grad in grads.items():
            source = grad_reference(name, case)
            expected = (main if source == "main" else full).grads[c][name]  # type: ignore[union-attr]
            if not _close(grad, expected):
                bad.append(f"chunk {c} {name}: main_grad off the {source} reference by {_off_by(grad, expected)}")
            dropped = case.draft != "none" and name.startswith("mtp.layers.1.")  # layer 1 drafts every step
            if name.startswith("mtp.") and not grad.any() and not dropped:
                bad.append(f"chunk {c} {name}: no gradient from the MTP loss")
    if hooked.last_stage:
        expected_outputs = stock.outputs[0::2] if case.output == "logits" else stock.outputs[1::2]
        if len(hooked.outputs) != len(expected_outputs):
            bad.append(f"{len(hooked.outputs)} last-stage outputs, stock {len(expected_outputs)}")
        for m, (actual, expected) in enumerate(zip(hooked.outputs, expected_outputs)):
            if not _close(actual, expected):
                bad.append(f"micro-batch {m}: {case.output} off stock's by {_off_by(actual, expected)}")
        actual_mtp, expected_mtp = torch.tensor(hooked.mtp), torch.tensor(stock.mtp)
        if not _close(actual_mtp, expected_mtp):
            bad.append(f"per-micro-batch MTP losses {hooked.mtp} vs stock's tracker {stock.mtp}")
    if hooked.tracker.keys() != stock.tracker.keys():
        bad.append(f"MTP tracker keys {sorted(hooked.tracker)} vs stock's {sorted(stock.tracker)}")
    for key in hooked.tracker.keys() & stock.tracker.keys():
        if not _close(hooked.tracker[key].double(), stock.tracker[key].double()):
            bad.append(f"MTP tracker {key!r}: {hooked.tracker[key].tolist()} vs stock's {stock.tracker[key].tolist()}")
    return bad


def scenario_case(fields: dict[str, Any]) -> dict[str, Any]:
    case = Case(**fields)
    batches = batches_for_this_rank()
    stock = run_stock(case.knobs, case.vpp, batches)
    full = stock if case.reference == case.knobs else run_stock(case.reference, case.vpp, batches)
    main = None
    if case.detach != "none":
        main = run_stock(dataclasses.replace(case.reference, mtp_factor=0.0), case.vpp, batches)
    hooked = run_hooked(case, batches)
    return {"last_stage": hooked.last_stage, "failures": compare(case, hooked, stock, full, main), "chunks": len(hooked.grads)}


def scenario_stock_deviation(fields: dict[str, Any]) -> dict[str, Any]:
    """Stock with the case's knobs and stock without the broken ones (``case.reference``): the last
    stage's head and word-embedding ``main_grad``; the hooks' mismatches against that reference
    and their two ``main_grad``."""
    case = Case(**fields)
    assert case.reference != case.knobs, f"{case.id}: no stock defect applies"
    batches = batches_for_this_rank()
    stock = run_stock(case.knobs, case.vpp, batches)
    reference = run_stock(case.reference, case.vpp, batches)
    hooked = run_hooked(case, batches)
    runs = {"stock": stock, "reference": reference, "hooks": hooked}
    last_chunk = {kind: {n: run.grads[-1][n] for n in (HEAD, WORDS) if n in run.grads[-1]} for kind, run in runs.items()}
    return {"last_stage": hooked.last_stage, "failures": compare(case, hooked, stock, reference, None), **last_chunk}


def scenario_zero_out_wgrad_marks(tied: bool) -> dict[str, Any]:
    """This rank's word-embedding weight's ``zero_out_wgrad`` before ``attach``, attached, after ``remove()``."""
    from tests.support.pipeline_parity import _chunks, _on_cpu

    with _on_cpu(fusion=False):
        gpt = _chunks(Case(tied=tied).knobs, None)[0]
    weight = gpt.embedding.word_embeddings.weight
    marks = [getattr(weight, "zero_out_wgrad", None)]
    hooks = mtp_hooks.attach(gpt)
    marks.append(getattr(weight, "zero_out_wgrad", None))
    hooks.remove()
    marks.append(getattr(weight, "zero_out_wgrad", None))
    return {"last_stage": bool(gpt.post_process), "marks": marks}


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def pair() -> Iterator[SpawnedGroup]:
    with SpawnedGroup(world_size=2) as spawned:
        yield spawned


@pytest.fixture(scope="module")
def quad() -> Iterator[SpawnedGroup]:
    with SpawnedGroup(world_size=4) as spawned:
        yield spawned


def _run(group: SpawnedGroup, case: Case) -> None:
    results = group.run(scenario_case, case.parallel_layout, timeout_s=300.0, fields=dataclasses.asdict(case))
    assert any(r["last_stage"] for r in results) and not all(r["last_stage"] for r in results)
    failures = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["failures"]]
    assert not failures, f"{case.id} (reference: {case.reference}):\n" + "\n".join(failures)


@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda case: case.id)
def test_pipeline_case_matches_stock(pair: SpawnedGroup, case: Case) -> None:
    _run(pair, case)


@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=lambda case: case.id)
def test_pipeline_case_on_four_ranks_matches_stock(quad: SpawnedGroup, case: Case) -> None:
    _run(quad, case)


def test_the_pairwise_selection_covers_every_allowed_pair() -> None:
    from tests.support.pipeline_cases import FACTORS

    names = list(FACTORS)
    allowed = {(a, getattr(c, a), b, getattr(c, b)) for c in full_product() for i, a in enumerate(names) for b in names[i + 1 :]}
    covered = {(a, getattr(c, a), b, getattr(c, b)) for c in pairwise() for i, a in enumerate(names) for b in names[i + 1 :]}
    assert covered == allowed
    assert len(pairwise()) < len(full_product()) / 10


def _last_stage(pair: SpawnedGroup, case: Case) -> tuple[dict[str, Any], list[str]]:
    """``scenario_stock_deviation``'s last-stage result, and the hooks' mismatches on every rank."""
    results = pair.run(scenario_stock_deviation, case.parallel_layout, timeout_s=300.0, fields=dataclasses.asdict(case))
    failures = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["failures"]]
    return next(r for r in results if r["last_stage"]), failures



@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_mtp_stages_tied_embedding_copy_is_marked_zero_out_wgrad_while_attached(pair: SpawnedGroup, tied: bool) -> None:
    """PP=2: the last stage's tied word-embedding copy (the head's weight and the MTP lookups') is
    marked ``zero_out_wgrad`` while attached (``mtp_hooks.features.tied_copy.mark``; the tied
    fusion cases check the gradients) and unmarked by ``remove()``; nothing else is marked."""
    results = pair.run(scenario_zero_out_wgrad_marks, {"pipeline_model_parallel_size": 2}, timeout_s=120.0, tied=tied)
    marks = {r["last_stage"]: r["marks"] for r in results}
    assert marks[False] == [None, None, None]
    assert marks[True] == ([None, True, None] if tied else [None, None, None])


def test_stock_drops_the_mtp_embedding_lookup_gradient_with_tied_heads_and_fusion(pair: SpawnedGroup) -> None:
    """Tied heads, PP=2, gradient-accumulation fusion under mcore DDP: stock's shared word-embedding
    ``main_grad`` lacks the MTP layers' embedding lookups (their ``.grad`` is dropped by DDP's hook,
    see ``STOCK_DEFECTS``); the hooks must equal stock without fusion."""
    case = Case(layout="pp2", tied=True, output="logits", loss_impl="lean", sync="fusion")
    last, failures = _last_stage(pair, case)
    deviation = rel_l2(last["stock"][WORDS], last["reference"][WORDS])
    assert deviation > 0.05, f"stock now keeps the lookup gradient (rel L2 {deviation:.3g}): drop this STOCK_DEFECTS entry"
    assert not failures, "the hooks are off stock without fusion:\n" + "\n".join(failures)


def test_stock_pairs_deferred_activations_with_gradients_in_the_wrong_order(pair: SpawnedGroup) -> None:
    """``defer_embedding_wgrad_compute`` with MTP, PP=2, untied: what stock's drain adds (wherever
    it adds it: head plus word embeddings) is far from undeferred stock's (activations in forward
    order, gradients in backward order); the hooks defer the main head alone, so theirs adds up."""
    case = Case(layout="pp2", tied=False, output="logits", loss_impl="lean", sync="fusion", defer=True)
    last, _ = _last_stage(pair, case)
    total = {kind: last[kind][HEAD] + last[kind][WORDS] for kind in ("stock", "reference", "hooks")}
    deviation = rel_l2(total["stock"], total["reference"])
    assert deviation > 0.5, f"stock's deferred wgrad now pairs right (rel L2 {deviation:.3g}): drop this STOCK_DEFECTS entry"
    torch.testing.assert_close(total["hooks"], total["reference"], atol=ATOL, rtol=RTOL)


def test_stock_drains_the_deferred_head_gradient_into_the_embedding_weight(pair: SpawnedGroup) -> None:
    """``defer_embedding_wgrad_compute`` with MTP, PP=2, untied: stock's drain writes the head's
    gradient into the word embeddings, and the head's own ``main_grad`` stays 0. The hooks keep the
    main head's call undeferred there (``mtp_hooks.features.deferral``): both weights equal undeferred stock."""
    case = Case(layout="pp2", tied=False, output="logits", loss_impl="lean", sync="fusion", defer=True)
    last, _ = _last_stage(pair, case)
    assert last["reference"][HEAD].any()
    assert not last["stock"][HEAD].any(), "stock's deferred head gradient now reaches output_layer.weight: drop this STOCK_DEFECTS entry"
    assert rel_l2(last["stock"][WORDS], last["reference"][WORDS]) > 0.5
    for name in (HEAD, WORDS):
        torch.testing.assert_close(last["hooks"][name], last["reference"][name], atol=ATOL, rtol=RTOL)


def test_every_stock_defect_names_its_pin() -> None:
    names = {name for name in globals() if name.startswith("test_stock_")}
    assert {defect.test for defect in STOCK_DEFECTS} == names
