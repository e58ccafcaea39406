"""Trainer-predicted against engine-measured draft acceptance, through verl 0.9.1's own metric code.

A tiny model's MTP layers are trained towards its main head (objective ``accept``). An engine
(``tests/support/speculative_engine.py``: the MTP chain drafts, the main head verifies) generates the
rollouts with either the trained MTP weights (synced) or the ones from before training (stale);
its per-request counters go through verl's ``compute_spec_decode_metrics``, the hooks measure
``mtp_k/accept`` / ``mtp/accept_len`` on the same rollouts, and ``draft_acceptance_metrics``
gives the gap. Synced: within a tolerance derived from the requests' spread; stale: beyond it.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import mtp_hooks
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.integrations.verl import draft_acceptance_metrics
from mtp_hooks.testing import TinyGPT, cuda_current_device_is_cpu
from tests.support.speculative_engine import speculative_rollouts
from tests.support.verl_support import import_verl, verl_function

import_verl()
# verl's aggregation of the engine's per-request counters into rollout/spec_accept_*.
compute_spec_decode_metrics = verl_function("verl.trainer.ppo.ray_trainer", "compute_spec_decode_metrics")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = TinyGPT(vocab_size=32, hidden_size=32, num_layers=1, mtp_num_layers=2, max_sequence_length=64)
TEMPERATURE = 0.7
PROMPT, NEW_TOKENS, REQUESTS = 3, 40, 48
Z = 4.0  # a synced draft fails the tolerance with probability ~6e-5 (normal approximation)


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def labels_and_mask(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels; the mask keeps the response's tokens that the engine drafted (all but
    the first, which the target sampled alone), so depth 1's positions are the engine's step starts."""
    labels = torch.roll(tokens, -1, 1)
    mask = torch.zeros(tokens.shape, dtype=torch.float32)
    mask[:, PROMPT : tokens.shape[1] - 1] = 1.0
    return labels, mask


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, mtp_hooks.MTPHooks, dict[str, torch.Tensor]]:
    """A model whose sharpened main head the MTP layers do not match, then MTP trained towards it;
    the MTP weights from before training are returned beside the attached hooks."""
    model = SHAPE.build(seed=3)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
    before = {k: v.clone() for k, v in model.state_dict().items() if is_mtp(k) and isinstance(v, torch.Tensor)}
    hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=True, objective="accept", draft_temperature=TEMPERATURE)
    optimizer = torch.optim.Adam([p for n, p in model.named_parameters() if is_mtp(n)], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with cuda_current_device_is_cpu():
        for _ in range(40):
            tokens = torch.randint(0, SHAPE.vocab_size, (8, 32), generator=gen)
            labels, mask = labels_and_mask(tokens)
            with hooks.micro_batch(labels, mask):
                logits = model(tokens, torch.arange(32).expand(8, 32), None)
            (logits.sum() * 0).backward()  # the MTP losses ride on the main logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    hooks.metrics()
    return model, hooks, before


def engine_copy(model: torch.nn.Module, mtp_state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A stock model holding the trainer's weights (the synced engine), or them with other MTP weights."""
    engine = SHAPE.build(seed=99)
    engine.load_state_dict({**model.state_dict(), **(mtp_state or {})})
    return engine.eval()


def trainer_accept(model: torch.nn.Module, hooks: mtp_hooks.MTPHooks, tokens: torch.Tensor) -> dict[str, float]:
    """The hooks' metrics of a training-style forward on ``tokens`` that is never backpropagated."""
    hooks.metrics()
    labels, mask = labels_and_mask(tokens)
    with cuda_current_device_is_cpu(), torch.enable_grad(), hooks.micro_batch(labels, mask):
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens).contiguous(), None)
    return hooks.metrics()


def compare(trained: tuple, mtp_state: dict[str, torch.Tensor] | None, draft_tokens: int, seed: int) -> tuple[dict[str, float], float]:
    """verl's figures of an engine run, the trainer's on its rollouts, their gap, and the tolerance:
    ``Z`` standard errors of the mean over requests of the per-request length gap."""
    model, hooks, _ = trained
    engine = engine_copy(model, mtp_state)
    prompts = torch.randint(0, SHAPE.vocab_size, (REQUESTS, PROMPT), generator=torch.Generator().manual_seed(seed))
    tokens, stats = speculative_rollouts(engine, prompts, NEW_TOKENS, draft_tokens, TEMPERATURE, torch.Generator().manual_seed(seed + 1))
    engine_metrics = compute_spec_decode_metrics(stats.drafts, stats.accepted, stats.verify_steps)
    out = draft_acceptance_metrics(trainer_accept(model, hooks, tokens), engine_metrics, draft_tokens=draft_tokens)
    key = "mtp_1/accept" if draft_tokens == 1 else "mtp/accept_len"
    gaps = [a / v - trainer_accept(model, hooks, tokens[i : i + 1])[key] for i, (a, v) in enumerate(zip(stats.accepted, stats.verify_steps))]
    tolerance = Z * statistics.stdev(gaps) / math.sqrt(len(gaps))
    return out, tolerance


@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_synced_draft_shows_no_gap_beyond_sampling_noise(trained, draft_tokens: int) -> None:
    out, tolerance = compare(trained, None, draft_tokens, seed=10)
    assert 0 < tolerance < 0.15, tolerance  # enough requests for the test to see a stale draft
    assert abs(out["mtp/accept_len_gap"]) < tolerance, (out, tolerance)
    assert abs(out["mtp/accept_rate_gap"]) < tolerance / draft_tokens, (out, tolerance)
    assert out["rollout/spec_accept_length"] == pytest.approx(out["mtp/predicted_spec_accept_length"] + out["mtp/accept_len_gap"])


@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_stale_draft_in_the_engine_shows_a_gap_beyond_sampling_noise(trained, draft_tokens: int) -> None:
    _, _, before = trained
    out, tolerance = compare(trained, before, draft_tokens, seed=20)
    assert out["mtp/accept_len_gap"] < -tolerance, (out, tolerance)
    assert out["mtp/accept_rate_gap"] < -tolerance / draft_tokens, (out, tolerance)


TRAINER = {"mtp_1/tokens": 10.0, "mtp_2/tokens": 9.0, "mtp_1/accept": 0.8, "mtp_2/accept": 0.7, "mtp/accept_len": 1.3}


@pytest.mark.parametrize(
    "trainer, engine, draft_tokens, named",
    [
        (TRAINER, {}, 3, "draft_tokens"),
        (TRAINER, {}, True, "draft_tokens"),
        ({"mtp_1/tokens": 10.0, "mtp_1/loss": 2.0}, {}, 1, "trainer"),
        (TRAINER, {"rollout/spec_accept_rate": 0.5}, 2, "engine"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(trainer, engine, draft_tokens, named: str) -> None:
    with pytest.raises(MTPHooksError, match=f"^{named}"):
        draft_acceptance_metrics(trainer, engine, draft_tokens=draft_tokens)


def test_without_the_engines_figures_only_the_prediction_is_returned() -> None:
    out = draft_acceptance_metrics(TRAINER, {"actor/loss": 1.0}, draft_tokens=2)
    assert out == pytest.approx({"mtp_1/accept": 0.8, "mtp_2/accept": 0.7, "mtp/accept_len": 1.3, "mtp/predicted_spec_accept_length": 2.3, "mtp/predicted_spec_accept_rate": 0.65})
