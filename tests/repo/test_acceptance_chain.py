"""The acceptance benchmark's draft chain (``--config chain``): variant names, the k-step verification,
the probe's reading of the chain, the engine-style speculative loop, and the setting end to end at
smoke sizes (seconds)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import mtp_hooks
from benchmarks import models
from benchmarks.acceptance import report
from benchmarks.acceptance.chain import ChainProbe, chain_forward, chain_speculative_sampling, parse_variant, training_options
from benchmarks.acceptance.experiment import run_task
from benchmarks.acceptance.settings import SETTINGS, config, shape_of
from benchmarks.acceptance.task import WORD_PROMPT, WordLanguage
from mtp_hooks.testing.speculative import verify

WORDS = dataclasses.replace(SETTINGS["words"]["smoke"], mtp=1, chain=3)
needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="the code task's BPE needs the 'tokenizers' package, which is not installed (requirements/py311.txt pins it)",
)


def _mcore_embeds_own_ids() -> bool:
    import inspect

    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return "input_ids" in inspect.signature(MultiTokenPredictionLayer.forward).parameters


needs_015 = pytest.mark.skipif(not _mcore_embeds_own_ids(), reason="the chain needs MTP layers that embed their own ids (megatron-core 0.15+); this release's do not")


def test_variant_names_parse_into_objective_and_chain_inputs() -> None:
    assert parse_variant("ce") == ("ce", None)
    assert parse_variant("ce+tf") == ("ce", "labels")
    assert parse_variant("accept+chain") == ("accept", "sample")
    for bad in ("frozen+chain", "ce+chains", "kl+tf", "ce+"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)
    assert training_options("ce+chain", 0.7, 3)["draft_steps"] == 3 and training_options("ce+chain", 0.7, 3)["draft_temperature"] == 0.7
    assert "draft_steps" not in training_options("accept", 1.0, 3)
    assert training_options("accept", 1.0, 3)["accept_rule"] == "sampled"  # what the speculative loops verify


def test_verify_accepts_every_draft_drawn_from_the_target_itself() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 3, 7, generator=gen), dim=-1)
    drafts = torch.multinomial(p.flatten(0, 1), 1, generator=gen).view(64, 3)
    bonus = torch.softmax(torch.randn(64, 7, generator=gen), dim=-1)
    ok, tokens, overlap = verify(p, p.clone(), drafts, bonus, gen)
    assert ok.all() and torch.equal(tokens[:, :3], drafts)
    assert torch.allclose(overlap, torch.ones_like(overlap))


@needs_015
def test_probe_reads_each_steps_input_ids_as_the_previous_steps_own_draft(one_intra_op_thread: None) -> None:
    """Embedding call j + 1 of a chain forward embeds step j's argmax draft from its probed hidden state:
    what the loop reads as the drafts steps 2 and 3 were fed."""
    model = models.build(config(WORDS), shape_of(WORDS), 1)
    tokens = WordLanguage.build(vocab=WORDS.vocab, seed=0).sample(3, WORDS.seq, torch.Generator().manual_seed(2))
    with mtp_hooks.attached(model, draft_steps=3, draft_inputs="argmax", agreement_metrics=True) as hooks:
        probe = ChainProbe(model)
        _, metrics = chain_forward(model, hooks, probe, tokens, WORD_PROMPT, 3)
        probe.remove()
    assert {f"mtp_{j}/accept" for j in (1, 2, 3)} <= set(metrics)
    assert torch.equal(probe.ids[1], torch.roll(tokens, -1, 1))  # step 1: the data's next token
    weight = model.output_layer.weight.detach()
    for j in (1, 2):
        argmax = (probe.hidden[j - 1] @ weight.t()).argmax(-1).t()
        assert torch.equal(probe.ids[j + 1], argmax), j


@needs_015
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_chain_loop_realised_acceptance_matches_sum_of_min_at_every_step(one_intra_op_thread: None, temperature: float) -> None:
    """On an untrained N = 1 model, drafting 3 steps: per step the loop's accepted share equals the
    mean ``sum_v min(p, q_j)`` of the drafts it tried, within 5 standard errors; reproducible."""
    model = models.build(config(WORDS), shape_of(WORDS), 1)
    with torch.no_grad():  # peaked p and q: a draft not drawn from q would be accepted at another rate
        model.output_layer.weight.mul_(6.0)
    prompts = WordLanguage.build(vocab=WORDS.vocab, seed=0).sample(96, WORD_PROMPT, torch.Generator().manual_seed(5))
    runs = []
    with mtp_hooks.attached(model, draft_steps=3, draft_inputs="sample", draft_temperature=temperature, agreement_metrics=True) as hooks:
        probe = ChainProbe(model)
        for _ in range(2):
            runs.append(chain_speculative_sampling(model, hooks, probe, prompts, WORDS.seq, torch.Generator().manual_seed(6), temperature, 3, seed=7))
        probe.remove()
    stats = runs[0]
    assert runs[1].summary() == stats.summary()
    for tried, accepted, expected in zip(stats.tried, stats.accepted, stats.expected):
        assert tried > 60
        share, mean = accepted / tried, expected / tried
        assert abs(share - mean) < 5 * math.sqrt(max(mean * (1 - mean), 1e-4) / tried), (share, mean, tried)
    assert stats.tried[0] >= stats.tried[1] >= stats.tried[2]
    assert 1.0 <= stats.tokens / stats.steps <= 4.0


@needs_015
@needs_tokenizers
def test_chain_setting_runs_every_variant_with_three_step_drafts(one_intra_op_thread: None, tmp_path: Path) -> None:
    setting = SETTINGS["code"]["chain-smoke"]
    result = run_task(setting, (0,), log=lambda line: None, cache=tmp_path)
    run = result["runs"][0]
    assert run["steps"] == [0, 1, 2] and run["setting"]["mtp"] == 1 and run["setting"]["chain"] == 3
    assert list(run["variants"]) == ["frozen", "ce", "ce+tf", "ce+chain", "accept", "accept+chain"]
    for name, series in run["variants"].items():
        for j in (1, 2, 3):
            assert all(0.0 < a <= 1.0 for a in series[f"accept_{j}"]), (name, j)
        assert all(t1 >= t2 >= t3 > 0 for t1, t2, t3 in zip(series["tried_1"], series["tried_2"], series["tried_3"])), name
        assert all(1.0 <= t <= 4.0 for t in series["realised_tokens_per_step"]), name
        assert all(0.0 < a <= 3.0 for a in series["accept_len"]), name
        assert series["accept_recomputed_max_diff"] < 1e-5, name
        assert series["train_seconds_per_step"] > 0, name
    first = {name: tuple(s[f"accept_{j}"][0] for j in (1, 2, 3)) for name, s in run["variants"].items()}
    assert len(set(first.values())) == 1, first  # step 0: one pretrained draft, one evaluation
    variants = run["variants"]
    assert any(variants["ce+tf"][f"accept_{j}"][-1] != variants["ce+chain"][f"accept_{j}"][-1] for j in (1, 2, 3))
    text = report.markdown(result)
    assert "ce+chain vs ce+tf" in text and "train s/step" in text
