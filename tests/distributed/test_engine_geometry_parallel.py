"""``draft_geometry="engine"`` under context parallelism: CP = 2 adds up to the whole sequence at CP = 1.

Two CPU processes (gloo). Each rank holds mcore's load-balanced half of every sequence (chunks r and 3 - r of 4);
step 1's cache spans both ranks, so each rank's steps 2..k read the other rank's step-1 keys and values. With
``calculate_per_token_loss`` (nothing normalised per rank) the per-step CE sums and token counts over the ranks, and
every parameter's gradient summed over them, equal one process running the whole sequence. The model has rotary
positions, weights scaled up and norms off 1 (``tests/unit/test_engine_geometry.py``: there the geometries differ),
and its attention is ``SDPAttention``, which gathers keys over the CP group itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, context_parallel_positions, cuda_calls_on_cpu, make_batch
from tests.support.distributed import SpawnedGroup
from tests.support.geometry_weights import spread

VOCAB, SEQ = 64, 16


def _model() -> nn.Module:
    shape = TinyGPT(vocab_size=VOCAB, mtp_num_layers=1, position_embedding_type="rope",
                    config_overrides={"calculate_per_token_loss": True})
    return spread(shape.build(11), 4.0)


def _step(model: nn.Module, batch: Batch, options: dict[str, Any]) -> dict[str, float]:
    with mtp_hooks.attached(model, **options) as hooks:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            logits = model(*batch.model_args)
        per_token = model.compute_language_model_loss(batch.labels, logits.transpose(0, 1).contiguous())
        (per_token * batch.loss_mask).sum().backward()
        return hooks.metrics()


def scenario_context_parallel_engine(inputs: str, recycle: str) -> dict[str, float]:
    from megatron.core import parallel_state

    from mtp_hooks.testing import init_parallel

    # per_token_rescale=False: each step's sum as 0.14 - 0.16 weigh it (0.17+'s rescale by this rank's token counts
    # would not add up over the ranks).
    options = dict(draft_steps=3, draft_geometry="engine", draft_inputs=inputs, draft_recycle=recycle, per_token_rescale=False)
    full = make_batch(VOCAB, batch=2, seq=SEQ, seed=6)
    reference = _model()
    expected = _step(reference, full, options)
    expected_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    chain = _step(_model(), full, {**options, "draft_geometry": "chain"})
    init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    index = context_parallel_positions(SEQ, parallel_state.get_context_parallel_rank(), 2)
    local = Batch(full.input_ids[:, index], full.position_ids[:, index], full.labels[:, index], full.loss_mask[:, index])
    model = _model()
    with cuda_calls_on_cpu():  # mcore's RoPE pins its CP indices for the GPU
        metrics = _step(model, local, options)
    for j in (1, 2, 3):
        tokens = metrics[f"mtp_{j}/tokens"]
        sums = torch.tensor([tokens, metrics[f"mtp_{j}/loss"] * tokens if tokens else 0.0], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        wanted = torch.tensor([expected[f"mtp_{j}/tokens"], expected[f"mtp_{j}/loss"] * expected[f"mtp_{j}/tokens"]],
                              dtype=torch.float64)
        torch.testing.assert_close(sums, wanted, atol=1e-4, rtol=1e-5, msg=lambda m, j=j: f"step {j} (tokens, CE sum): {m}")
    for name, parameter in model.named_parameters():
        grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, expected_grads.get(name, torch.zeros_like(grad)), atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    return {"expected": expected["mtp_2/loss"], "chain": chain["mtp_2/loss"]}


@pytest.mark.parametrize(("inputs", "recycle"), [("labels", "normed"), ("argmax", "unnormed")])
def test_context_parallel_engine_geometry_adds_up_to_the_whole_sequence(group: SpawnedGroup, inputs: str, recycle: str) -> None:
    results = group.run(scenario_context_parallel_engine, {}, inputs=inputs, recycle=recycle)
    # On these weights the geometries differ, by far more than the 1e-4 the step's CE sum (over ~30 tokens) is held to.
    assert abs(results[0]["expected"] - results[0]["chain"]) > 1e-4
