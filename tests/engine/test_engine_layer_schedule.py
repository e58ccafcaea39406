"""Which MTP layer vLLM 0.32 runs for each draft step, decided by the engine, and the trainer's prediction of it.

A MiMo counting target (``mtp_hooks.testing.engine_models``) with two MTP layers: layer 1 a perfect
draft ("copy"), layer 2 a random one. vLLM drafting k = 2 tokens at T = 0 accepts [1, 1] per
position: its proposer runs layer 1 for every step and never layer 2. The trainer predicts the
engine's per-position acceptance on the engine's own tokens (``mtp_hooks.predict``,
hooks with ``draft_steps=2, draft_inputs="argmax", accept_rule="argmax"``): with
``draft_layers="first"`` the prediction equals the engine's counts; with ``"per_step"`` (layer j
runs step j, SGLang's schedule) position 2 is the random layer's, far below the engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import mtp_hooks
from mtp_hooks.engine import generate_greedy
from mtp_hooks.testing import engine_models as em
from mtp_hooks.predict import Replay, predict_engine_acceptance

PROMPTS = em.counting_prompts(4)
TOKENS = 32
STEPS = 2


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    trainer = em.trainer("mimo", "copy", mtp_num_layers=2)
    with torch.no_grad():
        trainer.state_dict(keep_vars=True)["mtp.layers.1.eh_proj.weight"].copy_(em.draft_matrix("random"))
    return trainer


@pytest.fixture(scope="module")
def folder(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return em.engine_folder(tmp_path_factory.mktemp("schedule"), "mimo", model)


@pytest.fixture(scope="module")
def truth(folder: Path, engines: Callable[..., Any]) -> tuple[tuple[int, ...], ...]:
    """The target's greedy continuation, ``STEPS`` tokens past the speculative run's end (no speculation)."""
    return generate_greedy(engines(folder, 0), PROMPTS, TOKENS + STEPS).token_ids


def _predict(model: torch.nn.Module, truth: tuple[tuple[int, ...], ...], draft_layers: str) -> Replay:
    hooks = mtp_hooks.attach(model, draft_steps=STEPS, draft_inputs="argmax", accept_rule="argmax", draft_layers=draft_layers, agreement_metrics=True)
    try:
        return predict_engine_acceptance(model, hooks, PROMPTS, truth, TOKENS)
    finally:
        hooks.remove()


def test_vllm_runs_mtp_layer_1_for_every_draft_step_and_first_predicts_it(
    model: torch.nn.Module, folder: Path, truth: tuple[tuple[int, ...], ...], engines: Callable[..., Any]
) -> None:
    measured = generate_greedy(engines(folder, STEPS), PROMPTS, TOKENS)
    assert measured.counts.drafts > 0 and measured.per_position == (1.0, 1.0), measured.counts  # layer 2 never ran
    assert measured.token_ids == tuple(t[:TOKENS] for t in truth)  # lossless at T = 0

    first = _predict(model, truth, "first")
    assert (first.drafts, first.accepted_per_position) == (measured.counts.drafts, measured.counts.accepted_per_position)

    per_step = _predict(model, truth, "per_step")
    assert per_step.per_position[0] == 1.0 and per_step.per_position[1] < 0.1, per_step  # the random layer 2's step
    assert measured.per_position[1] - per_step.per_position[1] > 0.9
