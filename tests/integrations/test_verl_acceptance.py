"""Trainer-predicted against engine-measured draft acceptance, through verl 0.9.1's own metric code and configs.

A tiny model's MTP layers are trained towards its main head (objective ``accept``). An engine
(``tests/support/speculative_engine.py``: the MTP chain drafts, the main head verifies under a rule)
generates the rollouts with either the trained MTP weights (synced) or the ones from before training
(stale); its per-request counters go through verl's ``compute_spec_decode_metrics``, hooks on a copy
of the model measure ``mtp_k/accept`` / ``mtp/accept_len`` on the same rollouts under the options
``engine_draft_options`` reads from verl's own ``RolloutConfig`` (vLLM and SGLang: the argmax rule,
at the rollout's temperature, 0 included), and ``draft_acceptance_metrics`` gives the gap. Synced:
within a tolerance derived from the requests' spread; stale, or measured under the sampled rule
against the argmax engine: beyond it. Engines under the sampled and match rules are predicted by
hooks measuring those rules.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

import pytest
import torch

import mtp_hooks
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.integrations.verl import draft_acceptance_metrics, engine_draft_options
from mtp_hooks.testing import TinyGPT, cuda_current_device_is_cpu
from tests.support.speculative_engine import EngineStats, speculative_rollouts
from tests.support.verl_support import import_verl, verl_function

import_verl()
from omegaconf import OmegaConf  # noqa: E402  (verl's dependency, present once verl imports)
from verl.workers.config.model import MtpConfig  # noqa: E402
from verl.workers.config.rollout import RolloutConfig  # noqa: E402

# verl's aggregation of the engine's per-request counters into rollout/spec_accept_*.
compute_spec_decode_metrics = verl_function("verl.trainer.ppo.ray_trainer", "compute_spec_decode_metrics")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = TinyGPT(vocab_size=32, hidden_size=32, num_layers=1, mtp_num_layers=2, max_sequence_length=64)
TEMPERATURE = 0.7
PROMPT, NEW_TOKENS, REQUESTS = 3, 40, 48
Z = 4.0  # a synced draft fails the tolerance with probability ~6e-5 (normal approximation)


def rollout_config(name: str = "vllm", temperature: float = TEMPERATURE, draft_tokens: int = 2, **fields: Any) -> RolloutConfig:
    """verl's own rollout config (``config.actor_rollout_ref.rollout``) with MTP speculative rollout on."""
    mtp = MtpConfig(enable=True, enable_rollout=True, num_speculative_tokens=draft_tokens, speculative_num_steps=draft_tokens,
                    **fields.pop("mtp", {}))
    return RolloutConfig(name=name, temperature=temperature, mtp=mtp, **fields)


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
def trained() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A model whose sharpened main head the MTP layers do not match, then MTP trained towards it
    under the engine's rule (``engine_draft_options`` of the vLLM rollout); the MTP weights from
    before training are returned beside it."""
    model = SHAPE.build(seed=3)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
    before = {k: v.clone() for k, v in model.state_dict().items() if is_mtp(k) and isinstance(v, torch.Tensor)}
    options = engine_draft_options(rollout_config())
    hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=True, objective="accept", **options)
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
    hooks.remove()
    return model, before


def engine_copy(model: torch.nn.Module, mtp_state: Optional[dict[str, torch.Tensor]] = None) -> torch.nn.Module:
    """A stock model holding the trainer's weights (the synced engine), or them with other MTP weights."""
    engine = SHAPE.build(seed=99)
    engine.load_state_dict({**model.state_dict(), **(mtp_state or {})})
    return engine.eval()


class Trainer:
    """Hooks measuring acceptance under given options, each on its own copy of the trained model (one copy
    per (rule, temperature)), and their metrics of a training-style forward that is never backpropagated."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.copies: dict[tuple[str, float], tuple[torch.nn.Module, mtp_hooks.MTPHooks]] = {}

    def hooks(self, accept_rule: str, draft_temperature: float) -> tuple[torch.nn.Module, mtp_hooks.MTPHooks]:
        key = (accept_rule, draft_temperature)
        if key not in self.copies:
            copy = engine_copy(self.model).train()
            self.copies[key] = copy, mtp_hooks.attach(copy, agreement_metrics=True, accept_rule=accept_rule, draft_temperature=draft_temperature)
        return self.copies[key]

    def metrics(self, tokens: torch.Tensor, accept_rule: str, draft_temperature: float, mask: Optional[torch.Tensor] = None) -> mtp_hooks.MTPHooks:
        """The hooks, holding (unread) the metrics of ``tokens`` alone (``mask``: another loss mask)."""
        copy, hooks = self.hooks(accept_rule, draft_temperature)
        hooks.metrics()
        labels, response = labels_and_mask(tokens)
        mask = response if mask is None else mask
        with cuda_current_device_is_cpu(), torch.enable_grad(), hooks.micro_batch(labels, mask):
            copy(tokens, torch.arange(tokens.shape[1]).expand_as(tokens).contiguous(), None)
        return hooks


@pytest.fixture(scope="module")
def trainer(trained: tuple[torch.nn.Module, dict[str, torch.Tensor]]) -> Trainer:
    return Trainer(trained[0])


def engine_run(model: torch.nn.Module, draft_tokens: int, temperature: float, rule: str, seed: int) -> tuple[torch.Tensor, EngineStats, dict[str, Any]]:
    """The engine's rollouts, its per-request counters and verl's metrics of them."""
    prompts = torch.randint(0, SHAPE.vocab_size, (REQUESTS, PROMPT), generator=torch.Generator().manual_seed(seed))
    tokens, stats = speculative_rollouts(model, prompts, NEW_TOKENS, draft_tokens, temperature, torch.Generator().manual_seed(seed + 1), rule)
    return tokens, stats, compute_spec_decode_metrics(stats.drafts, stats.accepted, stats.verify_steps)


def tolerance(trainer: Trainer, tokens: torch.Tensor, stats: EngineStats, draft_tokens: int, accept_rule: str, draft_temperature: float) -> float:
    """``Z`` standard errors of the mean over requests of the per-request length gap."""
    key = "mtp_1/accept" if draft_tokens == 1 else "mtp/accept_len"
    gaps = [
        a / v - trainer.metrics(tokens[i : i + 1], accept_rule, draft_temperature).metrics()[key]
        for i, (a, v) in enumerate(zip(stats.accepted, stats.verify_steps))
    ]
    return Z * statistics.stdev(gaps) / math.sqrt(len(gaps))


def compare(trainer: Trainer, rollout: Any, mtp_state: Optional[dict[str, torch.Tensor]], seed: int) -> tuple[dict[str, float], float]:
    """verl's figures of an engine run (its rule and temperature read from ``rollout``), the trainer's on
    its rollouts (hooks attached with ``engine_draft_options(rollout)``), their gap, and the tolerance."""
    options, draft_tokens = engine_draft_options(rollout), rollout.mtp.num_speculative_tokens
    tokens, stats, engine_metrics = engine_run(engine_copy(trainer.model, mtp_state), draft_tokens, rollout.temperature, options["accept_rule"], seed)
    out = draft_acceptance_metrics(trainer.metrics(tokens, **options), engine_metrics, rollout=rollout)
    return out, tolerance(trainer, tokens, stats, draft_tokens, **options)


SYNCED = [("vllm", TEMPERATURE, 1), ("vllm", TEMPERATURE, 2), ("sglang", TEMPERATURE, 2), ("vllm", 1.0, 2)]


@pytest.mark.parametrize(("engine", "temperature", "draft_tokens"), SYNCED, ids=[f"{e}-T{t}-{d}drafts" for e, t, d in SYNCED])
def test_synced_draft_shows_no_gap_beyond_sampling_noise(trainer: Trainer, engine: str, temperature: float, draft_tokens: int) -> None:
    rollout = rollout_config(engine, temperature, draft_tokens)
    out, tol = compare(trainer, rollout, None, seed=10)
    assert 0 < tol < 0.15, tol  # enough requests for the test to see a stale draft
    assert abs(out["mtp/accept_len_gap"]) < tol, (out, tol)
    assert abs(out["mtp/accept_rate_gap"]) < tol / draft_tokens, (out, tol)
    assert out["rollout/spec_accept_length"] == pytest.approx(out["mtp/predicted_spec_accept_length"] + out["mtp/accept_len_gap"])


def test_at_zero_temperature_the_hooks_count_exactly_what_the_greedy_engine_accepts(trainer: Trainer) -> None:
    """Greedy vLLM (the argmax rule at T = 0, one draft token): per request, the hooks' acceptance over the
    positions where the engine started a verification step (depth 1 at ``n - 2`` drafts token ``n``; its
    target's mask is position ``n - 1``'s) is the engine's accepted count, exactly: both are argmax
    agreement on the same tokens. Over all response positions it is another mean (greedy steps skip the
    positions their accepted drafts covered), which is why the sampled tests' tolerance does not apply."""
    rollout = rollout_config(temperature=0.0, draft_tokens=1)
    options = engine_draft_options(rollout)
    tokens, stats, engine_metrics = engine_run(engine_copy(trainer.model), 1, 0.0, options["accept_rule"], seed=50)
    assert 0 < sum(stats.accepted) < sum(stats.verify_steps), "the greedy draft should be accepted at some steps, not all"
    for row, (accepted, steps, starts) in enumerate(zip(stats.accepted, stats.verify_steps, stats.starts)):
        assert len(starts) == steps and max(starts) < tokens.shape[1]  # every step's first draft is a kept token
        mask = torch.zeros(1, tokens.shape[1])
        mask[0, [n - 1 for n in starts]] = 1.0
        measured = trainer.metrics(tokens[row : row + 1], **options, mask=mask).metrics()
        assert measured["mtp_1/tokens"] == steps, row
        assert measured["mtp_1/accept"] * steps == pytest.approx(accepted, abs=1e-9), (row, measured, accepted, steps)
    out = draft_acceptance_metrics(trainer.metrics(tokens, **options), engine_metrics, rollout=rollout)
    assert set(out) >= {"mtp/accept_len_gap", "mtp/accept_rate_gap"}


@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_stale_draft_in_the_engine_shows_a_gap_beyond_sampling_noise(trained, trainer: Trainer, draft_tokens: int) -> None:
    out, tol = compare(trainer, rollout_config(draft_tokens=draft_tokens), trained[1], seed=20)
    assert out["mtp/accept_len_gap"] < -tol, (out, tol)
    assert out["mtp/accept_rate_gap"] < -tol / draft_tokens, (out, tol)


@pytest.mark.parametrize("rule", ["sampled", "match"])
def test_each_rules_engine_is_predicted_by_hooks_measuring_that_rule(trainer: Trainer, rule: str) -> None:
    """Engines verifying under the sampled and match rules (no verl 0.9.1 engine does by default, so no
    rollout config names them): the hooks measuring that rule predict verl's figures of the engine's counters."""
    tokens, stats, engine_metrics = engine_run(engine_copy(trainer.model), 2, TEMPERATURE, rule, seed=30)
    length = engine_metrics["rollout/spec_accept_length"]
    tol = tolerance(trainer, tokens, stats, 2, rule, TEMPERATURE)
    predicted = 1 + trainer.metrics(tokens, rule, TEMPERATURE).metrics()["mtp/accept_len"]
    assert 0 < tol < 0.15, tol
    assert abs(length - predicted) < tol, (length, predicted, tol)


def test_hooks_measuring_the_sampled_rule_mispredict_the_argmax_engine(trainer: Trainer) -> None:
    """The reason for the rule: against vLLM's argmax verification, ``sum min(p, q)`` (the sampled rule)
    reads a gap beyond sampling noise for a draft that is in sync."""
    rollout = rollout_config()
    tokens, stats, engine_metrics = engine_run(engine_copy(trainer.model), 2, TEMPERATURE, "argmax", seed=40)
    tol = tolerance(trainer, tokens, stats, 2, "argmax", TEMPERATURE)
    hooks = trainer.metrics(tokens, "sampled", TEMPERATURE)
    out = draft_acceptance_metrics(hooks.metrics(reset=False), engine_metrics, rollout=rollout)  # a dict: the caller vouches
    assert abs(out["mtp/accept_len_gap"]) > tol, (out, tol)
    right = draft_acceptance_metrics(trainer.metrics(tokens, "argmax", TEMPERATURE), engine_metrics, rollout=rollout)
    assert abs(right["mtp/accept_len_gap"]) < tol, (right, tol)


# ------------------------------------------------------------------ verl's rollout configs


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        (dict(name="vllm", temperature=0.7), {"accept_rule": "argmax", "draft_temperature": 0.7}),
        (dict(name="vllm", temperature=0), {"accept_rule": "argmax", "draft_temperature": 0.0}),
        (dict(name="sglang", temperature=1.0), {"accept_rule": "argmax", "draft_temperature": 1.0}),
    ],
)
@pytest.mark.parametrize("form", ["dataclass", "omegaconf"])
def test_engine_draft_options_read_verls_rollout_config(rollout: dict[str, Any], expected: dict[str, Any], form: str) -> None:
    config: Any = rollout_config(**rollout)
    if form == "omegaconf":  # what a Hydra-composed trainer config holds at config.actor_rollout_ref.rollout
        config = OmegaConf.structured(config)
    assert engine_draft_options(config) == expected
    mtp_hooks.attach(SHAPE.build(seed=1), agreement_metrics=True, **engine_draft_options(config)).remove()


@pytest.mark.parametrize(
    "fields",
    [
        dict(name="hf"),
        dict(name="sglang", mtp=dict(speculative_eagle_topk=4)),
        dict(name="vllm", engine_kwargs={"vllm": {"speculative_config": {"rejection_sample_method": "synthetic"}}}),
        dict(name="vllm", engine_kwargs={"vllm": {"speculative_config": '{"draft_sample_method": "gumbel"}'}}),
        dict(name="vllm", temperature=-1.0),
    ],
    ids=["unknown-engine", "sglang-tree", "vllm-rejection-method", "vllm-draft-sampling-json", "negative-temperature"],
)
def test_rollouts_whose_rule_is_unknown_are_refused_naming_rollout(fields: dict[str, Any]) -> None:
    rollout = rollout_config(**fields) if fields.get("name") != "hf" else RolloutConfig(name="hf")
    with pytest.raises(MTPHooksError, match="^rollout: bad value"):
        draft_acceptance_metrics(TRAINER, {}, rollout=rollout)


@pytest.mark.parametrize(("options", "temperature"), [(dict(accept_rule="sampled", draft_temperature=0.7), 0.7), (dict(draft_temperature=1.0), 0.7)])
def test_hooks_measuring_another_rule_or_temperature_than_the_engine_are_refused(options: dict[str, Any], temperature: float) -> None:
    with mtp_hooks.attached(SHAPE.build(seed=1), agreement_metrics=True, **options) as hooks:
        with pytest.raises(MTPHooksError, match=r"^trainer: bad value\n  expected: hooks measuring the vllm rollout's acceptance"):
            draft_acceptance_metrics(hooks, {}, rollout=rollout_config(temperature=temperature))


TRAINER = {"mtp_1/tokens": 10.0, "mtp_2/tokens": 9.0, "mtp_1/accept": 0.8, "mtp_2/accept": 0.7, "mtp/accept_len": 1.3}


@pytest.mark.parametrize(
    "trainer, engine, draft_tokens, named",
    [
        (TRAINER, {}, 3, "rollout"),
        ({"mtp_1/tokens": 10.0, "mtp_1/loss": 2.0}, {}, 1, "trainer"),
        (TRAINER, {"rollout/spec_accept_rate": 0.5}, 2, "engine"),
        ([0.8], {}, 1, "trainer"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(trainer, engine, draft_tokens, named: str) -> None:
    with pytest.raises(MTPHooksError, match=f"^{named}"):
        draft_acceptance_metrics(trainer, engine, rollout=rollout_config(draft_tokens=draft_tokens))


def test_without_the_engines_figures_only_the_prediction_is_returned() -> None:
    out = draft_acceptance_metrics(TRAINER, {"actor/loss": 1.0}, rollout=rollout_config(draft_tokens=2))
    assert out == pytest.approx({"mtp_1/accept": 0.8, "mtp_2/accept": 0.7, "mtp/accept_len": 1.3, "mtp/predicted_spec_accept_length": 2.3, "mtp/predicted_spec_accept_rate": 0.65})
