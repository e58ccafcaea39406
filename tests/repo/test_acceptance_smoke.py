"""The acceptance benchmark's machinery end to end on very small settings of both tasks (seconds).

Pretraining, the RL phase in every variant (words: frozen, ce, distill, tv; code: also accept, at
two rollout temperatures), held-out evaluation and the speculative sampling loop run on a real
mcore GPTModel with two MTP layers; the controlled experiment's invariant (main parameters
bit-identical across variants) is checked inside ``run`` and shown here to be able to fail. The
code task's reward, its corpus split and its pretraining cache are pinned too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import mtp_hooks
from benchmarks import models
from benchmarks.acceptance import code_task, pretrain, report
from benchmarks.acceptance.arms import Arm, assert_same_policy, main_parameters
from benchmarks.acceptance.drafts import DraftCapture, chain_tokens_per_step, depth_speculative_sampling
from benchmarks.acceptance.experiment import run, run_seeds, run_task
from benchmarks.acceptance.run import main
from benchmarks.acceptance.settings import SETTINGS, config, shape_of
from benchmarks.acceptance.task import WORD_PROMPT, WordLanguage, WordTask

SMALL = dataclasses.replace(SETTINGS["words"]["smoke"], rl_steps=2, eval_every=1)
CODE = SETTINGS["code"]["smoke"]
needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="the code task's BPE needs the 'tokenizers' package, which is not installed (requirements/py311.txt pins it)",
)


@pytest.fixture(scope="module")
def result(one_intra_op_thread: None) -> dict:
    return run(SMALL, log=lambda line: None)


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
    assert chain_tokens_per_step([0.5, 0.5]) == pytest.approx(1.75)
    assert chain_tokens_per_step([1.0, 1.0]) == pytest.approx(3.0)
    assert chain_tokens_per_step([0.0, 1.0]) == pytest.approx(1.0)


def test_different_main_parameters_are_reported(one_intra_op_thread: None) -> None:
    shape = shape_of(SMALL)
    arms = [Arm(n, models.build(config(SMALL), shape, SMALL.mtp), None, None, None, None) for n in ("a", "b")]  # type: ignore[arg-type]
    assert_same_policy(arms, step=0)
    with torch.no_grad():
        main_parameters(arms[1].model)[0].view(-1)[0] += 1e-6
    with pytest.raises(AssertionError, match="main parameter .* of 'b' differs"):
        assert_same_policy(arms, step=3)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_realised_acceptance_of_speculative_sampling_matches_sum_of_min(one_intra_op_thread: None, temperature: float) -> None:
    """On an untrained model the loop's accepted share of drafts equals the mean of
    ``sum_v min(p, q)`` (both tempered) over the drafts it tried, within 5 standard errors."""
    model = models.build(config(SMALL), shape_of(SMALL), SMALL.mtp)
    language = WordLanguage.build(vocab=SMALL.vocab, seed=0)
    prompts = language.sample(48, WORD_PROMPT, torch.Generator().manual_seed(5))
    with mtp_hooks.attached(model, detach_encoder=True, detach_head=True, agreement_metrics=True, draft_temperature=temperature) as hooks:
        capture = DraftCapture(model)
        stats = depth_speculative_sampling(model, hooks, capture, prompts, SMALL.seq, torch.Generator().manual_seed(6), temperature)
        capture.remove()
    for tried, accepted, expected in zip(stats.tried, stats.accepted, stats.expected):
        assert tried > 100
        share, mean = accepted / tried, expected / tried
        assert abs(share - mean) < 5 * math.sqrt(max(mean * (1 - mean), 1e-4) / tried), (share, mean, tried)


def test_grammatical_share_is_one_on_the_language_and_drops_on_a_broken_sequence() -> None:
    language = WordLanguage.build(vocab=32, seed=0)
    samples = language.sample(16, 24, torch.Generator().manual_seed(2))
    assert language.grammatical_share(samples, WORD_PROMPT) == 1.0
    broken = samples.clone()
    broken[:, 10] = language.vocab - 1  # an interior letter: wrong wherever the spelling does not call for it
    assert language.grammatical_share(broken, WORD_PROMPT) < 1.0


def test_the_grammatical_reward_pays_a_preferred_word_only_inside_the_language() -> None:
    setting = dataclasses.replace(SMALL, word_reward="grammatical")
    task = WordTask.build(setting, seed=0)
    language = task.language
    samples = language.sample(16, 24, torch.Generator().manual_seed(2))
    assert torch.equal(task.reward(samples, WORD_PROMPT), language.reward(samples, WORD_PROMPT))  # grammatical: unchanged
    spelled = [w for w in sorted(language.preferred) if len(language.spellings[w]) > 1]  # its start token calls for a letter
    repeated = samples.clone()
    repeated[:, WORD_PROMPT:] = 1 + spelled[0]  # a preferred word's start token over and over: every word start preferred
    assert torch.all(language.reward(repeated, WORD_PROMPT) == 1.0)
    gated = task.reward(repeated, WORD_PROMPT)
    assert torch.allclose(gated, language.grammatical_rows(repeated, WORD_PROMPT)) and torch.all(gated < 1.0)
    with pytest.raises(ValueError, match="word_reward"):
        WordTask.build(dataclasses.replace(SMALL, word_reward="grammar"), seed=0)


def test_seeds_are_summarised_with_spread_and_every_run_is_kept(one_intra_op_thread: None) -> None:
    result = run_seeds(SMALL, (0, 1), log=lambda line: None)
    assert result["seeds"] == [0, 1] and [r["setting"]["seed"] for r in result["runs"]] == [0, 1]
    summary = result["summary"]
    for name in ("frozen", "ce", "distill", "tv"):
        for i, cell in enumerate(summary["variants"][name]["accept_1"]):
            values = [r["variants"][name]["accept_1"][i] for r in result["runs"]]
            assert cell["n"] == 2 and cell["min"] == min(values) and cell["max"] == max(values)
            assert cell["mean"] == pytest.approx(sum(values) / 2)
    assert set(summary["verdict"]) == {"ce", "distill", "tv"}
    assert all(0 <= v["seeds_above_frozen"] <= 2 for v in summary["verdict"].values())
    text = report.markdown(result)
    assert "2 seeds (0, 1)" in text and "seeds above frozen" in text


# ------------------------------------------------------------------------------------ code task


def test_function_lines_keep_the_body_and_stop_where_the_function_ends() -> None:
    text = "    def f(self, x):\n        y = x\n\n        return y\n    def g(self):\n        pass\n"
    assert code_task.function_lines(text) == "def f(self, x):\n    y = x\n\n    return y\n"
    # The last line is incomplete (no newline): dropped; a block opener gets a ``pass`` body.
    assert code_task.function_lines("def f(x):\n    if x:\n        ret") == "def f(x):\n    if x:\n        pass\n"
    assert code_task.function_lines("def f(x") is None


def test_reward_needs_code_that_parses_and_scores_double_quotes() -> None:
    assert code_task.score("def f():\n    return 'a' + \"b\"\n") == (True, 0.5)
    assert code_task.score('def f():\n    """Doc."""\n    return "a"\n') == (True, 1.0)  # docstrings do not count
    assert code_task.score("def f():\n    return 1\n") == (True, 0.0)
    assert code_task.score("def f():\n    return (1,\n") == (False, 0.0)
    assert code_task.score("def f():\n    return ('a', \"b\",\n") == (False, 0.5)  # literals before the error count
    assert code_task.score("def f(:\n    return 1\n")[0] is False


def test_stdlib_split_is_deterministic_and_disjoint() -> None:
    files = code_task.stdlib_files(40)
    assert files == sorted(files) and len(files) == 40
    assert files == code_task.stdlib_files(40)
    assert not any(part in code_task.SKIP for rel, _ in files for part in rel.split("/")[:-1])
    parts = code_task.split(files)
    names = [{rel for rel, _ in v} for v in parts.values()]
    assert sum(map(len, names)) == 40 and not (names[0] & names[1]) and not (names[0] & names[2]) and not (names[1] & names[2])


@pytest.fixture(scope="module")
def code_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("acceptance-cache")


@pytest.fixture(scope="module")
def code_result(one_intra_op_thread: None, code_cache: Path) -> dict:
    return run_task(CODE, (0,), log=lambda line: None, cache=code_cache)


@needs_tokenizers
def test_code_task_runs_every_variant_at_both_temperatures_with_reward_and_kl(code_result: dict) -> None:
    assert set(code_result["temperatures"]) == {"1.0", "0.7"}
    for temperature, record in code_result["temperatures"].items():
        run = record["runs"][0]
        assert run["temperature"] == float(temperature) and run["steps"] == [0, 1, 2]
        assert set(run["variants"]) == {"frozen", "ce", "distill", "tv", "accept"}
        for name, series in run["variants"].items():
            assert all(0.0 < v <= 1.0 for v in series["accept_1"] + series["accept_2"]), name
            assert all(0.0 < v <= 2.0 for v in series["accept_len"]), name
            assert series["accept_recomputed_max_diff"] < 1e-5, name
        assert len(run["reward"]["train_mean_per_step"]) == 2 and len(run["kl_to_pretrained"]["train_per_step"]) == 2
        assert run["kl_to_pretrained"]["held_out"][0] == pytest.approx(0.0, abs=1e-6)  # step 0: the pretrained policy itself
        assert all(k >= -1e-6 for k in run["kl_to_pretrained"]["train_per_step"])
        assert all(0.0 <= r <= 1.0 for r in run["reward"]["train_mean_per_step"])
        assert run["corpus"]["files"]["train"] > 0 and run["corpus"]["vocab"] <= CODE.vocab
    # The drafts are scored at the rollout's temperature: the same pretrained draft, other numbers.
    first = {t: r["runs"][0]["variants"]["frozen"]["accept_1"][0] for t, r in code_result["temperatures"].items()}
    assert first["1.0"] != first["0.7"]
    text = report.markdown(code_result)
    assert "T = 0.7" in text and "| accept |" in text and "accept_len" in text


@needs_tokenizers
def test_code_pretraining_is_cached_per_seed(one_intra_op_thread: None, code_result: dict, code_cache: Path) -> None:
    saved = sorted(code_cache.glob("pretrained-*.pt"))
    assert len(saved) == 1 and "seed0" in saved[0].name
    pretrain._PRETRAINED.clear()  # as a new process: read from disk, no training
    task = code_task.CodeTask.build(CODE, 0, code_cache)
    state, record = pretrain.pretrained(task, CODE, code_cache, log=lambda line: None)
    assert record["cached"] is True
    fresh = torch.load(saved[0], weights_only=False)["state"]
    assert all(torch.equal(state[k], fresh[k]) for k in state if isinstance(state[k], torch.Tensor))
    other = pretrain._pretrain_key(task, dataclasses.replace(CODE, seed=1))
    assert other != pretrain._pretrain_key(task, CODE)


@needs_tokenizers
def test_gpu_config_runs_one_step_on_cpu_at_tiny_sizes(one_intra_op_thread: None, code_cache: Path, tmp_path: Path) -> None:
    """``--config gpu`` through ``main``, its sizes overridden to tiny ones on the CPU."""
    sizes = ("device=cpu,vocab=1024,hidden=32,layers=1,heads=4,seq=12,prompt=8,sft_seq=16,sft_batch=2,sft_min_steps=0,"
             "sft_max_steps=1,sft_window=1,held_out_windows=2,files=40,rl_steps=1,prompts=1,group=2,eval_every=1,eval_rollouts=2")
    threads = torch.get_num_threads()
    try:
        assert main(["--task", "code", "--config", "gpu", "--set", sizes, "--seeds", "0", "--out", str(tmp_path), "--cache", str(code_cache)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "acceptance.json").read_text())
    run = result["temperatures"]["1.0"]["runs"][0]
    gpu = SETTINGS["code"]["gpu"]
    assert run["setting"]["rl_steps"] == 1 and run["setting"]["hidden"] == 32
    assert run["setting"]["variants"] == list(gpu.variants) and run["setting"]["sft_lr"] == gpu.sft_lr  # the gpu schedule's other fields
    assert gpu.device == "cuda" and gpu.vocab > CODE.vocab and gpu.hidden > 128
    assert (tmp_path / "acceptance-T0.7.png").exists()


def test_set_rejects_unknown_fields() -> None:
    with pytest.raises(SystemExit):
        main(["--task", "code", "--set", "hiden=3"])


@needs_tokenizers
def test_seeds_run_apart_merge_into_the_record_of_one_run(one_intra_op_thread: None, code_result: dict, code_cache: Path) -> None:
    """``--merge``: seeds run as separate processes join into the runs and summary of a run over both."""
    other = run_task(CODE, (1,), log=lambda line: None, cache=code_cache)
    both = run_task(CODE, (0, 1), log=lambda line: None, cache=code_cache)
    merged = report.merge_seeds([{**other, "wall_seconds": 2.0}, {**code_result, "wall_seconds": 1.0}])
    assert merged["wall_seconds"] == 2.0
    for temperature, record in both["temperatures"].items():
        joined = merged["temperatures"][temperature]
        assert joined["seeds"] == [0, 1]
        assert joined["summary"]["variants"] == record["summary"]["variants"]
        assert joined["summary"]["verdict"] == record["summary"]["verdict"]
