"""The acceptance benchmark's machinery end to end on a very small setting (seconds).

Pretraining, the RL phase in all four variants (frozen, ce, distill, tv), held-out evaluation and
the speculative sampling loop run on a real mcore GPTModel with two MTP layers; the controlled
experiment's invariant (main parameters bit-identical across variants) is checked inside ``run``
and shown here to be able to fail.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import mtp_hooks
from benchmarks import acceptance, models
from benchmarks.acceptance_task import WordLanguage

SMALL = dataclasses.replace(acceptance.SETTINGS["smoke"], rl_steps=2, eval_every=1)


@pytest.fixture(scope="module")
def result(one_intra_op_thread: None) -> dict:
    return acceptance.run(SMALL, log=lambda line: None)


def test_result_has_expected_acceptance_per_depth_for_every_variant_at_every_step(result: dict) -> None:
    assert result["steps"] == [0, 1, 2]
    assert set(result["variants"]) == {"frozen", "ce", "distill", "tv"}
    for name, series in result["variants"].items():
        for k in (1, 2):
            values = series[f"accept_{k}"]
            assert len(values) == 3, name
            assert all(0.0 < v <= 1.0 for v in values), (name, k, values)
        # The hooks' metric equals the same quantity recomputed from the captured MTP distributions.
        assert series["accept_recomputed_max_diff"] < 1e-5, name


def test_all_variants_start_from_the_same_draft_and_trained_drafts_move_away_from_frozen(result: dict) -> None:
    variants = result["variants"]
    first = {name: (v["accept_1"][0], v["accept_2"][0]) for name, v in variants.items()}
    assert len(set(first.values())) == 1, first
    for name in ("ce", "distill", "tv"):
        assert variants[name]["accept_1"][-1] != variants["frozen"]["accept_1"][-1], name


def test_speculative_sampling_counts_are_consistent(result: dict) -> None:
    for name, series in result["variants"].items():
        for tried_1, tried_2, tokens in zip(series["tried_1"], series["tried_2"], series["realised_tokens_per_step"]):
            assert tried_1 > 0 and 0 <= tried_2 <= tried_1, name
            assert 1.0 <= tokens <= 3.0, name


def test_chain_tokens_per_step_counts_the_targets_token_and_multiplies_depths() -> None:
    assert acceptance.chain_tokens_per_step([0.5, 0.5]) == pytest.approx(1.75)
    assert acceptance.chain_tokens_per_step([1.0, 1.0]) == pytest.approx(3.0)
    assert acceptance.chain_tokens_per_step([0.0, 1.0]) == pytest.approx(1.0)


def test_different_main_parameters_are_reported(one_intra_op_thread: None) -> None:
    shape = acceptance._shape(SMALL)
    arms = [acceptance.Arm(n, models.build(acceptance._config(), shape, SMALL.mtp), None, None, None, None) for n in ("a", "b")]  # type: ignore[arg-type]
    acceptance.assert_same_policy(arms, step=0)
    with torch.no_grad():
        acceptance.main_parameters(arms[1].model)[0].view(-1)[0] += 1e-6
    with pytest.raises(AssertionError, match="main parameter .* of 'b' differs"):
        acceptance.assert_same_policy(arms, step=3)


def test_realised_acceptance_of_speculative_sampling_matches_sum_of_min(one_intra_op_thread: None) -> None:
    """On an untrained model the loop's accepted share of drafts equals the mean of
    ``sum_v min(p, q)`` over the drafts it tried, within 5 standard errors."""
    model = models.build(acceptance._config(), acceptance._shape(SMALL), SMALL.mtp)
    language = WordLanguage.build(vocab=SMALL.vocab, seed=0)
    prompts = language.sample(48, acceptance.PROMPT, torch.Generator().manual_seed(5))
    with mtp_hooks.attached(model, detach_encoder=True, detach_head=True, agreement_metrics=True) as hooks:
        capture = acceptance.DraftCapture(model)
        stats = acceptance.speculative_sampling(model, hooks, capture, prompts, SMALL.seq, torch.Generator().manual_seed(6))
        capture.remove()
    for tried, accepted, expected in zip(stats.tried, stats.accepted, stats.expected):
        assert tried > 100
        share, mean = accepted / tried, expected / tried
        assert abs(share - mean) < 5 * math.sqrt(max(mean * (1 - mean), 1e-4) / tried), (share, mean, tried)


def test_grammatical_share_is_one_on_the_language_and_drops_on_a_broken_sequence() -> None:
    language = WordLanguage.build(vocab=32, seed=0)
    samples = language.sample(16, 24, torch.Generator().manual_seed(2))
    assert language.grammatical_share(samples, acceptance.PROMPT) == 1.0
    broken = samples.clone()
    broken[:, 10] = language.vocab - 1  # an interior letter: wrong wherever the spelling does not call for it
    assert language.grammatical_share(broken, acceptance.PROMPT) < 1.0


def test_seeds_are_summarised_with_spread_and_every_run_is_kept(one_intra_op_thread: None) -> None:
    result = acceptance.run_seeds(SMALL, (0, 1), log=lambda line: None)
    assert result["seeds"] == [0, 1] and [r["setting"]["seed"] for r in result["runs"]] == [0, 1]
    summary = result["summary"]
    for name in ("frozen", "ce", "distill", "tv"):
        for i, cell in enumerate(summary["variants"][name]["accept_1"]):
            values = [r["variants"][name]["accept_1"][i] for r in result["runs"]]
            assert cell["n"] == 2 and cell["min"] == min(values) and cell["max"] == max(values)
            assert cell["mean"] == pytest.approx(sum(values) / 2)
    assert set(summary["verdict"]) == {"ce", "distill", "tv"}
    assert all(0 <= v["seeds_above_frozen"] <= 2 for v in summary["verdict"].values())
    text = acceptance.markdown(result)
    assert "2 seeds (0, 1)" in text and "seeds above frozen" in text
