"""The hooked model against a stock twin over the product of the knobs (harness: ``tests/support/parity.py``).

Knobs (``parity.AXES``): output mode (logits; log-probs with and without entropy, temperature 0.7),
loss path (``lean`` auto, ``fused``, ``recompute``, ``dense``), tied / untied head, gradient-
accumulation fusion under mcore's DDP (``main_grad`` compared), fp32 / bf16 / fp16 (``Float16Module``,
fp16 with a loss scaler at 2^12), detach flags, ``calculate_per_token_loss``, ``torch.utils.checkpoint``
of the model call, 1 or 2 micro-batches in flight (all forwards first, backwards in forward or
reverse order), the draft chain (its step weights, MTP layer 1's input, and steps 2..k in the engine's
geometry on twins with rotary positions: ``stock_engine_geometry``), and the acceptance measured (``accept``: off, or the argmax,
sampled and match rules at T > 0 and greedy T = 0, against a dense reference from stock's logits;
never with the dense loss path, which measures none: ``parity.FORBIDDEN``). On two ranks (``tests.support.distributed``) also TP=2, TP=2 with SP, CP=2
(not with the engine geometry, whose stock reference cannot split its joined steps over CP: that is held out in
``tests/distributed/test_engine_geometry_parallel.py``).

Default set (``make test``): every combination of values of any 3 knobs (a greedy 3-wise covering
set), the full product of output x loss path x head x fusion x checkpoint x micro-batches at fp32,
and on two ranks every pair of values of the layout and the knobs. ``--parity-full`` (or
``MTP_PARITY=full``): the whole single-process product and a 3-wise covering set on two ranks.
``MTP_PARITY=pairwise``: a pairwise covering set on one process (the two-rank set as by default),
what ``scripts/matrix.py`` runs on the releases other than 0.16.1 (``make test``'s), for CI's time.

Every knob exists on megatron-core 0.14 - 0.19 (each release runs the whole default set), so no
case skips.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from tests.support import parity
from tests.support.distributed import SpawnedGroup
from tests.support.parity import AXES, FORBIDDEN, LAYOUTS, Case
from tests.support.stock_references import step_weights

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# The cheap sub-grid whose full product always runs: every knob that decides which gradient path
# the head takes and when the targets are read; the rest at their defaults (fp32, no detach, mean loss).
SUB_GRID = {name: AXES[name] for name in ("output", "loss_impl", "tied", "fusion", "checkpoint", "micro_batches")}
LAYOUT_GROUPS = {
    "tp": {"tensor_model_parallel_size": 2},
    "sp": {"tensor_model_parallel_size": 2},
    "cp": {"context_parallel_size": 2},
}


def _unique(rows: list[dict[str, Any]]) -> list[Case]:
    cases = {Case(**row): None for row in rows}
    return list(cases)


MODES = ("default", "pairwise", "full")


def parity_mode(config: pytest.Config) -> str:
    """``full`` with ``--parity-full``, else ``MTP_PARITY`` (``default``, ``pairwise`` or ``full``)."""
    mode = "full" if config.getoption("--parity-full") else os.environ.get("MTP_PARITY", "default")
    if mode not in MODES:
        raise pytest.UsageError(f"MTP_PARITY: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


def single_process_cases(mode: str) -> list[Case]:
    if mode == "full":
        return _unique([row for row in parity.product(AXES) if parity.allowed(row, FORBIDDEN)])
    if mode == "pairwise":
        return _unique(parity.covering(AXES, 2, FORBIDDEN))
    return _unique(parity.covering(AXES, 3, FORBIDDEN) + parity.product(SUB_GRID))


def two_rank_cases(mode: str) -> list[Case]:
    return _unique(parity.covering({"layout": LAYOUTS, **AXES}, 3 if mode == "full" else 2, FORBIDDEN))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        mode = parity_mode(metafunc.config)
        cases = single_process_cases(mode) + two_rank_cases(mode)
        metafunc.parametrize("case", [pytest.param(case, id=case.id) for case in cases])


def test_hooked_matches_stock(case: Case, request: pytest.FixtureRequest) -> None:
    if case.layout is None:
        parity.run_case(case)
    else:
        group: SpawnedGroup = request.getfixturevalue("group")
        differences = group.run(parity.scenario_case, LAYOUT_GROUPS[case.layout], case=case)
        assert differences == [None] * len(differences), "\n".join(f"rank {rank}: {d}" for rank, d in enumerate(differences) if d)


# --------------------------------------------------------------------------- the harness itself


@pytest.mark.parametrize("strength", [2, 3])
def test_covering_sets_hold_every_combination_and_are_deterministic(strength: int) -> None:
    rows = parity.covering(AXES, strength, FORBIDDEN)
    assert parity.is_covering(rows, AXES, strength, FORBIDDEN)
    assert not parity.is_covering(rows[:-1], AXES, strength, FORBIDDEN), "the last row added nothing"
    assert rows == parity.covering(AXES, strength, FORBIDDEN)
    assert len(rows) < len(parity.product(AXES)) // 50
    assert not any(row["loss_impl"] == "dense" and row["accept"] != "off" for row in rows), "a forbidden pair was run"
    assert not parity.is_covering([*rows, {**rows[0], "loss_impl": "dense", "accept": "match"}], AXES, strength, FORBIDDEN)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["output_layer.weight", "mtp.layers.0.eh_proj.weight"])
def test_the_comparison_catches_a_slightly_wrong_gradient(dtype: str, where: str) -> None:
    """The tolerances are not vacuous: a hooked gradient scaled by 1.001 (fp32) or 1.05 (bf16,
    a few times its unit roundoff) fails the comparison that the unchanged one passes."""
    case = Case(dtype=dtype)
    hooked, stock, reference = parity.run_twins(case)
    parity.compare(case, hooked, stock, reference)
    grad = hooked.grads[where]
    assert grad is not None
    hooked.grads[where] = grad * (1.001 if dtype == "fp32" else 1.05)
    with pytest.raises(AssertionError, match=where.replace(".", r"\.")):
        parity.compare(case, hooked, stock, reference)


def test_the_comparison_catches_wrong_mtp_losses() -> None:
    case = Case(output="logprobs_entropy")
    hooked, stock, reference = parity.run_twins(case)
    hooked.metrics[0] = [hooked.metrics[0][0] * 1.001, hooked.metrics[0][1]]
    with pytest.raises(AssertionError, match="MTP losses, hooks.metrics"):
        parity.compare(case, hooked, stock, reference)


def test_the_stock_detach_reference_differs_from_plain_stock() -> None:
    """The detach references change stock's gradients where the flags cut a path (a reference equal
    to plain stock would let a no-op flag pass)."""
    _, plain, _ = parity.run_twins(Case(), stock_only=True)
    for detach, cut in (("encoder", "decoder.layers.0.mlp.linear_fc1.weight"), ("head", "output_layer.weight"), ("between", "mtp.layers.0.eh_proj.weight")):
        _, stock, _ = parity.run_twins(Case(detach=detach), stock_only=True)
        assert not torch.allclose(stock.grads[cut], plain.grads[cut]), f"detach {detach}: {cut} unchanged"


def test_the_stock_chain_reference_differs_from_plain_stock() -> None:
    """Each chain reference changes what stock trains: more depths tracked, other MTP gradients."""
    _, plain, _ = parity.run_twins(Case(), stock_only=True)
    for chain in ("k2_argmax", "k3", "k4_argmax", "first_k2", "first_k3_argmax"):
        _, stock, _ = parity.run_twins(Case(chain=chain), stock_only=True)
        assert len(stock.mtp[0]) == Case(chain=chain).steps
        step_layer = "mtp.layers.0.eh_proj.weight" if chain.startswith("first") else "mtp.layers.1.eh_proj.weight"
        grad, plain_grad = stock.grads[step_layer], plain.grads[step_layer]
        assert grad is not None and plain_grad is not None and not torch.allclose(grad, plain_grad), f"chain {chain}: step layer's gradient unchanged"
        if chain.startswith("first"):  # layer 2 runs no step: its output is dropped
            dropped = stock.grads["mtp.layers.1.eh_proj.weight"]
            assert dropped is None or not dropped.any(), f"chain {chain}: layer 2 trained"


def test_the_stock_step_weight_reference_weighs_each_depth_of_plain_stock() -> None:
    """``draft_step_weights`` on stock: layer 2, which only depth 2's loss reaches, gets w_2 x plain stock's
    gradient; layer 1, reached by both depths, neither plain stock's nor w_1 x it."""
    _, plain, _ = parity.run_twins(Case(), stock_only=True)
    _, stock, _ = parity.run_twins(Case(chain="weighted"), stock_only=True)
    w1, w2 = step_weights("weighted")
    second, first = "mtp.layers.1.eh_proj.weight", "mtp.layers.0.eh_proj.weight"
    torch.testing.assert_close(stock.grads[second], w2 * plain.grads[second])
    assert not torch.allclose(stock.grads[first], plain.grads[first])
    assert not torch.allclose(stock.grads[first], w1 * plain.grads[first])


def test_the_comparison_catches_step_weights_applied_in_reverse_order() -> None:
    case = Case(chain="weighted")
    _, stock, reference = parity.run_twins(case, stock_only=True)
    hooked, _, _ = parity.run_twins(case, hooked_options={"draft_step_weights": step_weights("weighted")[::-1]})
    assert hooked is not None
    with pytest.raises(AssertionError, match="differs|gradient|MTP"):
        parity.compare(case, hooked, stock, reference)


def test_the_stock_pre_norm_reference_moves_the_mtp_gradient_off_the_final_norm() -> None:
    """``mtp_input="pre_final_norm"`` on stock: the MTP loss reaches the decoder around its final norm, so the norm's
    weight and the MTP layers get other gradients than plain stock's."""
    _, plain, _ = parity.run_twins(Case(), stock_only=True)
    _, stock, _ = parity.run_twins(Case(chain="pre_norm"), stock_only=True)
    norm = "decoder.final_layernorm.weight"
    assert not torch.allclose(stock.grads[norm], plain.grads[norm])
    assert not torch.allclose(stock.grads["mtp.layers.0.eh_proj.weight"], plain.grads["mtp.layers.0.eh_proj.weight"])


def test_the_comparison_catches_mtp_layer_1_fed_the_normed_output() -> None:
    case = Case(chain="pre_norm")
    _, stock, reference = parity.run_twins(case, stock_only=True)
    hooked, _, _ = parity.run_twins(case, hooked_options={"mtp_input": "decoder_output"})
    assert hooked is not None
    with pytest.raises(AssertionError, match="differs|gradient|MTP"):
        parity.compare(case, hooked, stock, reference)


def test_the_comparison_catches_layer_1_embedding_the_start_as_trained() -> None:
    """The zeroed-start reference changes MTP layer 1's loss and gradients; a hooked twin keeping the start fails it."""
    _, plain, _ = parity.run_twins(Case(), stock_only=True)
    case = Case(chain="zeroed_start")
    _, stock, reference = parity.run_twins(case, stock_only=True)
    first = "mtp.layers.0.eh_proj.weight"
    assert not torch.allclose(stock.grads[first], plain.grads[first])
    hooked, _, _ = parity.run_twins(case, hooked_options={"start_embedding": "kept"})
    assert hooked is not None
    with pytest.raises(AssertionError, match="differs|gradient|MTP"):
        parity.compare(case, hooked, stock, reference)


def test_the_comparison_catches_a_chain_fed_the_labels_instead_of_its_drafts() -> None:
    """A hooked chain fed the data's tokens (teacher forcing) fails against the own-draft reference."""
    case = Case(chain="k4_argmax")
    _, stock, reference = parity.run_twins(case, stock_only=True)
    hooked, _, _ = parity.run_twins(dataclasses.replace(case, chain="none"), hooked_options={"draft_steps": 4})
    assert hooked is not None
    with pytest.raises(AssertionError, match="MTP losses|differs"):
        parity.compare(case, hooked, stock, reference)


@pytest.mark.parametrize(("dtype", "measured"), [("fp32", {"accept_rule": "sampled", "draft_temperature": 0.7}), ("bf16", {"draft_temperature": 0.0})])
def test_the_comparison_catches_acceptance_measured_under_another_rule_or_temperature(dtype: str, measured: dict[str, Any]) -> None:
    """A hooked twin measuring the sampled rule (or T = 0) fails against the argmax rule's reference at T = 0.7."""
    case = Case(accept="argmax", dtype=dtype)
    hooked, stock, reference = parity.run_twins(case, hooked_options=measured)
    assert hooked is not None
    with pytest.raises(AssertionError, match="acceptance metrics"):
        parity.compare(case, hooked, stock, reference)


def test_the_comparison_catches_engine_steps_trained_in_the_chain_geometry() -> None:
    """The engine reference (steps 2..k over step 1's cache) is not the chain's: a hooked twin training the same steps
    in the chain geometry fails against it, in the losses of steps 2..k and the MTP layer's gradients."""
    case = Case(chain="engine_first_k3")
    _, stock, reference = parity.run_twins(case, stock_only=True)
    hooked, _, _ = parity.run_twins(case, hooked_options={"draft_geometry": "chain"})
    assert hooked is not None
    with pytest.raises(AssertionError, match="MTP losses"):
        parity.compare(case, hooked, stock, reference)
    assert hooked.metrics[0][0] == pytest.approx(stock.mtp[0][0], rel=1e-6)  # step 1 is the same in both


@pytest.mark.parametrize(
    ("chain", "other"),
    [
        ("cyclic_k3_argmax", {"draft_layers": "per_step"}),  # step 3 by layer 2 again, not layer 1
        ("k3_unnormed", {"draft_recycle": "normed"}),
        ("engine_first_k3_argmax_unnormed", {"draft_recycle": "normed"}),
    ],
    ids=["cyclic_as_per_step", "unnormed_as_normed", "engine_unnormed_as_normed"],
)
def test_the_comparison_catches_a_step_run_by_another_layer_or_fed_another_state(chain: str, other: dict[str, Any]) -> None:
    """The cyclic and unnormed-recycle references are not the per-step or normed chains: a hooked twin with the other
    value fails against them."""
    case = Case(chain=chain)
    _, stock, reference = parity.run_twins(case, stock_only=True)
    hooked, _, _ = parity.run_twins(case, hooked_options=other)
    assert hooked is not None
    with pytest.raises(AssertionError, match="MTP losses|differs"):
        parity.compare(case, hooked, stock, reference)
