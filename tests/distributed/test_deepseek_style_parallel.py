"""DeepSeek-style models (MLA + MoE + MoE MTP layers) with hooks against stock on two gloo ranks.

* Pipeline parallelism (PP=2, every decoder layer MoE, the MTP layers on the last stage) through
  mcore's pipeline schedule: training micro-batches give stock's logits, MTP losses, gradients and
  MoE aux-loss tracker; inference micro-batches (no labels, with and without gradients) run no MTP
  MoE layer, and ``reduce_aux_losses_tracker_across_ranks`` then reduces the tracker across the
  pipeline ranks without error or hang (mcore PR 3401: a hang from MoE tracker sizes that differ
  between PP ranks with MTP + MoE + PP).
* Expert parallelism (EP=2, two experts per rank, ``allgather`` token dispatcher): each rank its
  own micro-batch, hooked twin against stock rank by rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyDeepSeek, assert_same_grads, main_ce_from_logits, make_batch, masked_mean, moe_mla_on_cpu
from mtp_hooks.testing import output_layer_calls, stock_mtp_losses
from tests.support.distributed import SpawnedGroup
from tests.support.mcore_moe import DEEPSEEK_MISSING, forward_calls, moe_tracker_values, mtp_moe_layers, reduce_moe_tracker
from tests.support.mcore_moe import reset_moe_process_state, routers
from tests.support.pipeline_schedule import masked_sum_loss, run_schedule, stock_last_stage

pytestmark = pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")

SEED = 1234
VOCAB = 64
SEQ = 16


def _twins(shape: TinyDeepSeek, **model_kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A stock model and its identical twin (same seed), checked equal parameter by parameter."""
    stock, twin = shape.build(SEED, **model_kwargs), shape.build(SEED, **model_kwargs)
    expected = {k: v for k, v in stock.state_dict().items() if isinstance(v, Tensor)}
    for name, value in twin.state_dict().items():
        if isinstance(value, Tensor):
            assert torch.equal(value, expected[name]), f"twin builds differ at {name}"
    return stock, twin


def _assert_moe_params_trained(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ".mlp.router." in name or ".experts." in name:
            assert p.grad is not None and p.grad.any(), f"{name}: no gradient"


# ------------------------------------------------------------------ pipeline parallel


def _inference_pass(model: nn.Module, batches: list[Batch], grad: bool) -> list[str]:
    """Forward-only schedule without labels; returns the names of the MTP MoE layers that ran."""

    def step(chunk: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
        output = chunk(*batch.model_args)
        if not chunk.post_process:
            return output, None
        return output, lambda logits: (logits.sum() * 0, torch.tensor(1, dtype=torch.int), {})

    with forward_calls(mtp_moe_layers(model)) as ran, torch.set_grad_enabled(grad):
        run_schedule(model, batches, step, forward_only=True)
    return ran


def scenario_pipeline(loss_impl: str) -> dict[str, Any]:
    """PP=2 through mcore's schedule, hooks against stock; then inference passes and the reduction.

    Returns, per rank, the tracker before and after ``reduce_aux_losses_tracker_across_ranks`` and
    the tracker sizes after an inference pass on a fresh tracker.
    """
    from megatron.core import parallel_state

    from mtp_hooks.testing import cuda_calls_on_cpu

    shape = TinyDeepSeek(vocab_size=VOCAB, first_dense_layers=0, config_overrides={"batch_p2p_comm": False})
    batches = [make_batch(VOCAB, batch=2, seq=SEQ, seed=10 + i) for i in range(3)]
    stages = {
        "pre_process": parallel_state.is_pipeline_first_stage(),
        "post_process": parallel_state.is_pipeline_last_stage(),
    }
    with moe_mla_on_cpu(), cuda_calls_on_cpu():
        reset_moe_process_state()
        stock, hooked = _twins(shape, **stages)
        hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
        is_last = hooked.post_process
        depth = shape.mtp_num_layers

        # An inference pass on a fresh tracker (gradients on, no labels): same sizes on every rank.
        assert _inference_pass(hooked, batches[:1], grad=True) == []
        fresh_sizes = {name: tuple(v.shape) for name, v in moe_tracker_values().items()}
        reduce_moe_tracker()
        reset_moe_process_state()

        stock_logits: list[Tensor] = []
        stock_mtp: list[list[float]] = []

        def stock_step(chunk: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            if not chunk.post_process:
                return chunk(*batch.model_args), None
            with stock_last_stage(chunk, depth, stock_logits, stock_mtp):
                per_token = chunk(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            return per_token, partial(masked_sum_loss, batch.loss_mask)

        hooked_logits: list[Tensor] = []
        hooked_mtp: list[list[float]] = []

        def hooked_step(chunk: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            targets = {"labels": batch.labels, "loss_mask": batch.loss_mask} if chunk.post_process else {}
            output = chunk(*batch.model_args, **targets)
            if not chunk.post_process:
                return output, None
            hooked_logits.append(output.detach().clone())
            metrics = hooks.metrics()
            hooked_mtp.append([metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)])
            return output, lambda logits: masked_sum_loss(batch.loss_mask, main_ce_from_logits(logits, batch.labels))

        run_schedule(stock, batches, stock_step)
        stock_tracker = moe_tracker_values()
        stock_mtp_losses()  # empties mcore's MTP tracker
        reset_moe_process_state()
        run_schedule(hooked, batches, hooked_step)
        trained = moe_tracker_values()

        if is_last:
            assert len(hooked_logits) == len(stock_logits) == len(batches)
            for actual, expected in zip(hooked_logits, stock_logits):
                assert torch.equal(actual, expected)
            torch.testing.assert_close(hooked_mtp, stock_mtp, atol=1e-6, rtol=1e-5)
        assert_same_grads(hooked, stock)
        _assert_moe_params_trained(hooked)
        assert list(trained) == list(stock_tracker) == ["load_balancing_loss"]
        torch.testing.assert_close(trained, stock_tracker, atol=1e-6, rtol=1e-5)

        # Inference micro-batches: no MTP MoE layer runs; under no_grad the tracker keeps the
        # training sums exactly.
        assert _inference_pass(hooked, batches, grad=False) == []
        after_inference = moe_tracker_values()
        torch.testing.assert_close(after_inference, trained, atol=0, rtol=0)
        assert _inference_pass(hooked, batches, grad=True) == []
        before_reduce = moe_tracker_values()
        reduce_moe_tracker()
        reduced = moe_tracker_values()
        hooks.remove()
    return {
        "last_stage": is_last,
        "fresh_sizes": fresh_sizes,
        "before_reduce": before_reduce,
        "reduced": reduced,
    }


# ------------------------------------------------------------------ expert parallel


def _expert_parallel_missing() -> Optional[str]:
    import inspect

    from megatron.core import parallel_state

    if "expert_model_parallel_size" not in inspect.signature(parallel_state.initialize_model_parallel).parameters:
        return "parallel_state.initialize_model_parallel has no expert_model_parallel_size"
    return None


def scenario_expert_parallel(loss_impl: str) -> dict[str, Any]:
    """EP=2 (TP=PP=1, so the two ranks are also the data-parallel ranks), each rank its own batch.

    mcore's groups are set up for EP=2 here and back to the default layout on the way out.
    """
    from megatron.core import parallel_state

    from mtp_hooks.testing import init_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        with moe_mla_on_cpu():
            reset_moe_process_state()
            shape = TinyDeepSeek(vocab_size=VOCAB)
            stock, hooked = _twins(shape)
            assert len(stock.decoder.layers[1].mlp.experts.local_experts) == shape.num_experts // 2
            batch = make_batch(VOCAB, batch=2, seq=SEQ, seed=20 + ep_rank)

            with output_layer_calls(stock) as calls:
                per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            masked_mean(per_token, batch.loss_mask).backward()
            stock_logits, stock_losses = calls[-1].transpose(0, 1), stock_mtp_losses()
            stock_tracker = moe_tracker_values()
            reset_moe_process_state()

            hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
            with forward_calls(routers(hooked)) as ran, hooks.micro_batch(batch.labels, batch.loss_mask):
                logits = hooked(*batch.model_args)
            masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
            assert sorted(ran) == sorted(routers(hooked))
            metrics = hooks.metrics()

            assert torch.equal(logits.detach(), stock_logits)
            assert len(stock_losses) == shape.mtp_num_layers
            losses = [metrics[f"mtp_{k}/loss"] for k in range(1, shape.mtp_num_layers + 1)]
            assert losses == pytest.approx(stock_losses, rel=1e-5, abs=1e-6)
            assert_same_grads(hooked, stock)
            _assert_moe_params_trained(hooked)
            torch.testing.assert_close(moe_tracker_values(), stock_tracker, atol=1e-6, rtol=1e-5)
            hooks.remove()
            reset_moe_process_state()
        return {"ep_rank": ep_rank, "mtp": losses}
    finally:
        parallel_state.destroy_model_parallel()
        init_parallel()


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_pipeline_training_matches_stock_and_inference_keeps_the_moe_tracker_reducible(group: SpawnedGroup, loss_impl: str) -> None:
    results = group.run(scenario_pipeline, {"pipeline_model_parallel_size": 2}, loss_impl=loss_impl, timeout_s=180.0)
    assert [r["last_stage"] for r in results] == [False, True]
    # Both ranks hold the same tracker names and sizes, so the PP all-reduce pairs up ...
    assert results[0]["fresh_sizes"] == results[1]["fresh_sizes"] == {"load_balancing_loss": (2 + 2,)}
    first, last = (r["before_reduce"]["load_balancing_loss"] for r in results)
    assert first.shape == last.shape and first.any() and last.any()
    # ... and the reduction sums the stages' per-layer sums on every rank.
    for r in results:
        torch.testing.assert_close(r["reduced"]["load_balancing_loss"], first + last, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(_expert_parallel_missing() is not None, reason=str(_expert_parallel_missing()))
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_expert_parallel_matches_stock(group: SpawnedGroup, loss_impl: str) -> None:
    results = group.run(scenario_expert_parallel, {}, loss_impl=loss_impl, timeout_s=180.0)
    assert [r["ep_rank"] for r in results] == [0, 1]
    assert results[0]["mtp"] != results[1]["mtp"]  # each rank trained on its own batch
