"""``benchmarks.acceptance --engine vllm`` end to end at smoke sizes, decided by vLLM: the record carries the
fixed names for every variant and k, at the rollouts' temperature and at T = 0 (``greedy_``); the speculative output
is the plain engine's at T = 0; at k = 1 the trainer's prediction counts the engine's drafts and acceptances (the same
context at step 1) at both temperatures; at every draft position the prediction is within the goal
(``engine_report.GOAL``) of the engine on average; the replay's longer runs drew the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.acceptance import engine_report
from benchmarks.acceptance.engine_run import run_engine
from benchmarks.acceptance.settings import SETTINGS

SMOKE = SETTINGS["words"]["engine-smoke"]


def test_engine_smoke_run_records_engine_and_prediction(vllm_imported: None, tmp_path: Path) -> None:
    result = run_engine(SMOKE, (0,), cache=tmp_path / "cache")
    assert result["temperature_engine"] == result["temperature_rollouts"] == SMOKE.temperatures[0] > 0
    (run,) = result["runs"]
    assert list(run["variants"]) == list(SMOKE.variants) and run["steps"] == list(range(0, SMOKE.rl_steps + 1, SMOKE.eval_every))
    for name, per_k in run["variants"].items():
        assert sorted(per_k) == ["k1", "k2", "k3"], name
        for k in (1, 2, 3):
            fields = per_k[f"k{k}"]
            names = {f"engine_accept_{j}" for j in range(1, k + 1)} | {f"predicted_accept_{j}" for j in range(1, k + 1)}
            assert names | {"engine_accept_len", "accepted_per_target_forward", "wall_s_spec", "wall_s_plain"} <= set(fields), (name, k)
            assert {f"greedy_{field}" for field in names | {"engine_accept_len", "predicted_accept_len"}} <= set(fields), (name, k)
            assert all(fields["spec_equals_plain"]) and all(d > 0 for d in fields["drafts"]), (name, k)
            assert all(math.isfinite(v) for v in fields["engine_accept_len"] + fields["greedy_engine_accept_len"])
            assert all(share == 1.0 for share in fields["replay_prefix_equal"]), (name, k)
            # what bounds the sampled measurement: the target's own argmax as the draft, and one evaluation's spread
            ceiling = [fields[f"ceiling_accept_{j}"] for j in range(1, k + 1)] + [fields["ceiling_accept_len"]]
            assert all(math.isfinite(v) for values in ceiling for v in values) and all(se > 0 for se in fields["accept_len_se"]), (name, k)
        one = per_k["k1"]
        for prefix in ("", "greedy_"):
            for drafts, predicted, engine, guess in zip(*(one[f"{prefix}{f}"] for f in ("drafts", "predicted_drafts", "engine_accept_1", "predicted_accept_1"))):
                # a barely trained model: a near-tie may split the trainer and the engine once or twice
                assert abs(drafts - predicted) <= 2 and abs(engine - guess) <= 2.5 / drafts, (prefix, name, drafts, predicted, engine, guess)
    found = engine_report.verdict(result)
    assert found["lossless"] and set(found["prediction_gap"]) == set(found["greedy_prediction_gap"]) == {1, 2, 3}
    # Steps 2..3 replayed as the engine drafts them (one token at a time over step 1's cache): the issue's goal.
    assert all(gap <= engine_report.GOAL for gap in [*found["prediction_gap"].values(), *found["greedy_prediction_gap"].values()]), (
        found["prediction_gap"], found["greedy_prediction_gap"])
    engine_report.write_outputs(result, tmp_path / "out")
    assert (tmp_path / "out" / "acceptance-engine.png").stat().st_size > 0
