"""``benchmarks.rollout_speed`` end to end at smoke sizes, decided by vLLM: every variant generates the same number of
tokens in every round, and with speculation in the same number of steps (the same seeds); the forward timers count what
vLLM's counters imply (one target forward per token without speculation; with it one per prompt's first token plus one
per verification, and k drafter forwards after each); the record's speedups are the ratios of its own medians and step
times."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.acceptance.settings import SETTINGS
from benchmarks.rollout_speed import report
from benchmarks.rollout_speed.run import run
from benchmarks.rollout_speed.timing import PLAIN
from tests.engine.conftest import ENGINE_CONFIG

SMOKE = SETTINGS["words"]["speed-smoke"]


def test_rollout_speed_smoke_times_every_variant_on_counted_forwards(vllm_imported: None, tmp_path: Path) -> None:
    result = run(SMOKE, (0,), tmp_path / "cache", rounds=2, batch=1, config=ENGINE_CONFIG)
    (seed,) = result["runs"]
    k, prompts, tokens = result["k"], seed["prompts"], seed["tokens_per_prompt"]
    assert list(seed["variants"]) == [PLAIN, *SMOKE.variants]
    assert len(seed["before_rl_per_position"]) == k and 0 <= seed["before_rl_per_position"][0] <= 1
    plain = seed["variants"][PLAIN]
    assert plain["drafts"] == plain["draft_forwards"] == 0 and plain["target_forwards"] == prompts * tokens
    for name in SMOKE.variants:
        v = seed["variants"][name]
        assert len(v["rounds"]) == 2 and all(s > 0 for s in v["rounds"]), name
        assert v["drafts_per_round"] == [v["drafts"]] * 2, name  # the same seeds draw the same tokens in every round
        assert v["target_forwards"] == prompts + v["drafts"], name  # the prompt's step, then one per verification
        assert v["draft_forwards"] == k * v["target_forwards"], name  # k drafter forwards after every target forward
        assert prompts + v["drafts"] + v["accepted"] >= prompts * tokens, name  # every token came from a target forward
        assert sum(v["accepted_per_position"]) == v["accepted"], name
        s = report.summaries(seed)[name]
        assert s["speedup_measured"] == pytest.approx(statistics.median(plain["rounds"]) / statistics.median(v["rounds"]))
        assert s["accept_len"] == pytest.approx(1 + v["accepted"] / v["drafts"])
    found = report.verdict(result)
    assert [row["seed"] for row in found["seeds"]] == [0] and set(found) >= {"confident", "speedup", "trained_not_slower"}
    result["meta"] = {"machine": "test", "date": "today", "load_before": "0", "load_after": "0", "params_main": 1,
                      "versions": {"torch": "t", "megatron-core": "m"}}
    report.write_outputs(result, tmp_path / "out")
    assert (tmp_path / "out" / "rollout_speed.png").stat().st_size > 0
    assert "| 0 | accept+profile |" in (tmp_path / "out" / "rollout_speed.md").read_text()
