"""What vLLM 0.32's GLM-4.5 drafter hands step 2, decided by the engine, and the trainer's prediction of it.

vLLM 0.32 / 0.33's ``glm4_moe_mtp`` returns ``residual + hidden``, the MTP layer's output before its final norm
(``shared_head.norm``), and the proposer recycles that into step 2; mcore's MTP layers hand each other the
normed state, as vLLM's DeepSeek-V3 drafter does. The two agree while the final norm's weight is uniform and
where the draft ignores the state it is handed (the counting draft's ``eh_proj`` is ``[A, 0]``), so the
counting target's copy draft here also reads it (``[I, I]``) and gets an MTP final norm far from 1 (each weight
in [0.25, 4], seeded): it then accepts neither 0 nor 1, and the engine's per-position acceptance at k = 2 and T = 0 is
predicted by the engine profile (``mtp_hooks.profiles.vllm("0.32", family, 2)``: vLLM's geometry, GLM-4.5's
``recycle="unnormed"``) within 0.03 at every position; with the other rule position 2 is predicted off by more
(the rule matters on these weights). DeepSeek-V3 (normed) and MiMo (normed, the target's pre-norm state in) with
the same final norm are predicted by their own profiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import mtp_hooks
from mtp_hooks.engine import generate_greedy
from mtp_hooks.predict import Replay, draft_hits, predict_engine_acceptance, replay
from mtp_hooks.profiles import vllm
from mtp_hooks.testing import engine_models as em
from mtp_hooks.testing import moe_mla_on_cpu

PROMPTS = em.counting_prompts(16)
TOKENS = 32
STEPS = 2
TOLERANCE = 0.03


def reads_what_it_is_handed(model: torch.nn.Module, seed: int = 7) -> None:
    """MTP layer 1 made to read the state it is handed (the hidden half of ``eh_proj``, zero in the counting draft,
    set to I) and its final norm weight far from 1 (each entry exp(U(-ln 4, ln 4)), in [0.25, 4], seeded)."""
    layer = model.mtp.layers[0]
    weight, eh_proj = layer.final_layernorm.weight, layer.eh_proj.weight
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        eh_proj[:, em.HIDDEN :] = torch.eye(em.HIDDEN)
        weight.copy_(torch.exp((torch.rand(weight.shape, generator=generator) * 2 - 1) * torch.log(torch.tensor(4.0))))


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3", "mimo"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str) -> torch.nn.Module:
    trainer = em.trainer(family, "copy")
    reads_what_it_is_handed(trainer)
    return trainer


@pytest.fixture(scope="module")
def folder(family: str, model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return em.engine_folder(tmp_path_factory.mktemp(f"recycle_{family}"), family, model)


def predicted(model: torch.nn.Module, family: str, truth: Any) -> tuple[Replay, Replay]:
    """The profile's prediction, and the same with the other recycle rule."""
    profile = vllm("0.32", family, STEPS)
    other = dict(profile.predict_options(), recycle="normed" if profile.recycle == "unnormed" else "unnormed")
    sequences = torch.tensor([list(p) + list(t) for p, t in zip(PROMPTS, truth)])
    with moe_mla_on_cpu(), mtp_hooks.attached(model, engine=profile) as hooks:
        right = predict_engine_acceptance(model, hooks, PROMPTS, truth, TOKENS, engine=profile)
        hits, agreement = draft_hits(model, hooks, sequences, len(PROMPTS[0]), **other)
    return right, replay(hits, len(PROMPTS[0]), TOKENS, agreement)


def test_the_profile_predicts_vllm_within_three_hundredths_and_the_other_recycle_rule_does_not(
    family: str, model: torch.nn.Module, folder: Path, engines: Callable[..., Any]
) -> None:
    truth = generate_greedy(engines(folder, 0), PROMPTS, TOKENS + STEPS).token_ids
    measured = generate_greedy(engines(folder, STEPS), PROMPTS, TOKENS)
    engine = measured.per_position
    assert 0.05 < engine[0] < 0.95, f"the final norm leaves the draft trivial here: {engine}"
    right, wrong = predicted(model, family, truth)
    print(f"{family}: vLLM {engine}, profile {right.per_position}, other recycle rule {wrong.per_position}")
    gaps = [abs(p - e) for p, e in zip(right.per_position, engine)]
    assert max(gaps) <= TOLERANCE, f"{family}: engine {engine}, predicted {right.per_position}"
    assert abs(wrong.per_position[1] - engine[1]) > TOLERANCE, (
        f"{family}: the other recycle rule predicts position 2 as well: {wrong.per_position} vs {engine}"
    )
