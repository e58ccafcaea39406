"""``torch.compile`` of a hooked model: the compiled forward trains like the eager one.

Dynamo traces the hooks and the proxies they hand mcore (the chain's ``DraftEmbedding``, detach's
``DetachedEmbedding``) and the unnormed recycle's swap. The engine geometry refuses a compiled forward: the core
attention's forward hook it needs does not run for the steps the chain adds there. Compiled with the ``eager`` and ``aot_eager`` backends, a training
micro-batch gives the logits, MTP metrics and every gradient of the same hooked model run eagerly.
The compiled runs happen in a spawned process: Dynamo's caches outlive ``torch._dynamo.reset()``
and are freed later, which other tests' live-tensor counts would see.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import pytest
import torch

import mtp_hooks
from mtp_hooks.testing import TinyGPT, assert_same_grads, make_batch, main_ce_from_logits, masked_mean
from tests.support.distributed import SpawnedGroup

VOCAB = 64
OWN_DRAFTS = {"draft_steps": 3, "draft_inputs": "argmax", "agreement_metrics": True}
TEACHER_FORCED = {"draft_steps": 3, "detach_encoder": True}
SAMPLED = {"draft_steps": 3, "draft_inputs": "sample", "draft_temperature": 0.7}
# vLLM's proposer for GLM-4.5: layer 1 for every step, own drafts, the unnormed recycle; in the engine geometry
# (rotary model) refused in a compiled forward.
UNNORMED = {"draft_steps": 3, "draft_layers": "first", "draft_inputs": "argmax", "draft_recycle": "unnormed"}
ENGINE = {**UNNORMED, "draft_geometry": "engine"}


def _step(options: dict[str, Any], backend: Optional[str]) -> tuple[torch.nn.Module, torch.Tensor, dict[str, float]]:
    position = "rope" if options.get("draft_geometry") == "engine" else "learned_absolute"
    model = TinyGPT(vocab_size=VOCAB, position_embedding_type=position).build()
    hooks = mtp_hooks.attach(model, **options)
    run = model if backend is None else torch.compile(model, backend=backend)
    batch = make_batch(VOCAB, batch=2, seq=8)
    torch.manual_seed(0)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = run(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return model, logits.detach(), hooks.metrics()


def scenario_compiled_against_eager(options: dict[str, Any], backend: str) -> None:
    """In the spawned process: the compiled step against the eager one (raises on a difference)."""
    torch._dynamo.reset()
    eager, eager_logits, eager_metrics = _step(options, None)
    compiled, logits, metrics = _step(options, backend)
    torch.testing.assert_close(logits, eager_logits, atol=1e-6, rtol=1e-5)
    assert metrics == pytest.approx(eager_metrics, rel=1e-5), (metrics, eager_metrics)
    assert_same_grads(compiled, eager)


def scenario_compiled_metrics(options: dict[str, Any], backend: str) -> dict[str, float]:
    torch._dynamo.reset()
    return _step(options, backend)[2]


@pytest.fixture(scope="module")
def process() -> Iterator[SpawnedGroup]:
    with SpawnedGroup(world_size=1) as spawned:
        yield spawned


@pytest.mark.parametrize(
    "options, backend",
    [(OWN_DRAFTS, "eager"), (OWN_DRAFTS, "aot_eager"), (TEACHER_FORCED, "aot_eager"), (UNNORMED, "aot_eager")],
    ids=["own_argmax_drafts-eager", "own_argmax_drafts-aot_eager", "teacher_forced_detached-aot_eager",
         "first_unnormed_argmax-aot_eager"],
)
def test_compiled_hooked_model_trains_like_the_eager_one(process: SpawnedGroup, options: dict[str, Any], backend: str) -> None:
    process.run(scenario_compiled_against_eager, {}, options=options, backend=backend, timeout_s=600.0)


def test_compiled_sampled_drafts_train(process: SpawnedGroup) -> None:
    """Sampled drafts draw from the default generator inside the compiled forward."""
    (metrics,) = process.run(scenario_compiled_metrics, {}, options=SAMPLED, backend="aot_eager", timeout_s=600.0)
    assert sorted(k for k in metrics if k.endswith("/loss")) == ["mtp_1/loss", "mtp_2/loss", "mtp_3/loss"]


def scenario_compiled_engine_geometry(backend: str) -> str:
    torch._dynamo.reset()
    with pytest.raises(mtp_hooks.MTPHooksError, match="torch.compile'd forward") as refused:
        _step(ENGINE, backend)
    return str(refused.value)


def test_the_engine_geometry_refuses_a_compiled_forward(process: SpawnedGroup) -> None:
    (message,) = process.run(scenario_compiled_engine_geometry, {}, backend="aot_eager", timeout_s=600.0)
    assert message.startswith("draft_geometry: bad value")
