"""``output="logprobs"`` and the output weight's ``main_grad``, side by side with stock mcore.

Stock's reference for the log-probs is its own main head: the logits of its main output-layer
call, ``log_softmax`` gathered at the labels (and the entropy), under the same policy loss; its
MTP loss rides along through ``MTPLossAutoScaler`` as always. Every case accumulates several
micro-batches into mcore DDP's ``main_grad`` with ``gradient_accumulation_fusion=True`` (the CPU
stand-in of the fused wgrad kernel, ``mtp_hooks.testing``) and compares every parameter's:

* untied head, every loss path, with and without entropy;
* tied head on one stage (mcore's ``zero_out_wgrad``: DDP adds ``.grad`` too);
* ``defer_embedding_wgrad_compute``: mcore's drain runs (it pairs every buffered head input with
  a gradient, in order) and the sums equal stock's undeferred, also for the dense MTP heads with
  ``output="logits"`` (stock's own deferred sums are wrong there);
* on two ranks, through mcore's schedule and ``finalize_model_grads``: PP=2 with tied embeddings
  (no ``zero_out_wgrad`` there; the embedding group's all-reduce carries the head's gradient to the
  first stage's input embeddings), and TP=2 with sequence parallelism, untied.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, fused_wgrad_kernel_on_cpu, make_batch
from tests.support.distributed import SpawnedGroup
from tests.unit.test_logprobs_output import rl_loss, token_logprobs_from_logits
from tests.parity.test_production_knobs import (
    PATHS,
    VOCAB,
    _defer_twin,
    _drain,
    assert_same_main_grads,
    ddp_twin,
    main_grads,
    step,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MICRO_BATCHES = 3


def _batches(seed: int) -> list[tuple[Batch, Tensor]]:
    """Micro-batches with per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    return [(make_batch(VOCAB, seed=seed + m), torch.randn(2, 1, generator=gen)) for m in range(MICRO_BATCHES)]


@contextlib.contextmanager
def stock_main_logits(model: nn.Module) -> Iterator[list[Tensor]]:
    """While open, collects the main-head logits ``[b, s, V]`` (in the graph) of every forward of ``model`` (a GPTModel).

    Stock calls the output layer for depth 1 .. N, then for the main head; that last call's logits
    are collected, and mcore's own per-token CE gets a detached copy (it writes into its input and
    its value is not used), so the policy loss on the collected logits alone trains the main head.
    """
    depth = model.config.mtp_num_layers
    calls, collected = [0], []

    def hook(layer: nn.Module, args: Any, output: Any) -> Any:
        calls[0] += 1
        if calls[0] % (depth + 1):
            return None
        logits, bias = output
        collected.append(logits.transpose(0, 1))
        return logits.detach().clone(), bias

    handle = model.output_layer.register_forward_hook(hook)
    try:
        yield collected
    finally:
        handle.remove()


def stock_policy_loss(model: nn.Module, logits: list[Tensor], batch: Batch, advantages: Tensor, entropy: bool) -> Tensor:
    MTPLossLoggingHelper.tracker.clear()
    model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    logprobs, entropies = token_logprobs_from_logits(logits[-1], batch.labels, 1.0)
    return rl_loss(logprobs, entropies if entropy else None, batch, advantages)


def hooked_policy_loss(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, advantages: Tensor) -> Tensor:
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        out = model(*batch.model_args)
    assert isinstance(out, mtp_hooks.TokenLogProbs)
    return rl_loss(out.logprobs, out.entropy, batch, advantages)


def _run_side_by_side(stock: nn.Module, hooked: nn.Module, hooks: mtp_hooks.MTPHooks, entropy: bool, seed: int) -> None:
    with stock_main_logits(stock.module) as logits:
        for batch, advantages in _batches(seed):
            step(lambda: stock_policy_loss(stock, logits, batch, advantages, entropy), 1 / MICRO_BATCHES)
            step(lambda: hooked_policy_loss(hooked, hooks, batch, advantages), 1 / MICRO_BATCHES)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "logprobs+entropy"])
@pytest.mark.parametrize("path", PATHS)
def test_untied_head_main_grads_equal_stock(path: str, entropy: bool) -> None:
    """The policy's own share of ``output_layer.weight`` reaches ``main_grad`` next to the MTP share."""
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(7, tied=False)
        hooked_model, hooked = ddp_twin(7, tied=False)
        hooks = mtp_hooks.attach(hooked, loss_impl=path, output="logprobs", entropy=entropy)
        _run_side_by_side(stock, hooked, hooks, entropy, seed=40)
    expected = main_grads(stock_model)
    assert expected["output_layer.weight"].abs().sum() > 0
    assert_same_main_grads(main_grads(hooked_model), expected)
    assert all(p.grad is None for p in hooked_model.parameters()), "DDP's hook consumed every .grad"


@pytest.mark.parametrize("path", PATHS)
def test_tied_head_on_one_stage_main_grads_equal_stock(path: str) -> None:
    """mcore marks the shared embedding ``zero_out_wgrad`` at PP=1: DDP adds its ``.grad`` as well."""
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(8, tied=True)
        hooked_model, hooked = ddp_twin(8, tied=True)
        assert stock_model.embedding.word_embeddings.weight.zero_out_wgrad
        hooks = mtp_hooks.attach(hooked, loss_impl=path, output="logprobs", entropy=True)
        _run_side_by_side(stock, hooked, hooks, True, seed=50)
    expected = main_grads(stock_model)
    assert expected["embedding.word_embeddings.weight"].abs().sum() > 0
    assert_same_main_grads(main_grads(hooked_model), expected)


@pytest.mark.parametrize("path", PATHS)
def test_deferred_head_wgrad_drains_and_main_grads_equal_stock_without_deferral(path: str) -> None:
    """Every head input mcore buffers for the deferred wgrad gets its gradient (the drain asserts
    it), and the drained sums equal stock computing the same micro-batches undeferred."""
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(9, tied=False)
        hooked_model, hooked = _defer_twin(9)
        hooks = mtp_hooks.attach(hooked, loss_impl=path, output="logprobs", entropy=True)
        _run_side_by_side(stock, hooked, hooks, True, seed=60)
        activations, gradients = hooked_model.embedding_activation_buffer, hooked_model.grad_output_buffer
        assert len(activations) == len(gradients) == MICRO_BATCHES  # the main head's call, one per micro-batch
        _drain(hooked_model)
        assert not activations and not gradients
    assert_same_main_grads(main_grads(hooked_model), main_grads(stock_model))


def test_dense_mtp_heads_under_deferral_equal_stock_without_deferral() -> None:
    """``output="logits"``, dense: the MTP heads' own calls of the output layer stay out of the
    deferral buffers, so the drain pairs each main-head input with its own gradient. (Stock's
    deferred MTP heads are paired with the main head's gradient: a micro-batch's head calls reach
    backward in reverse order; its sums are off by far more than rounding.)"""
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(9, tied=False)
        hooked_model, hooked = _defer_twin(9)
        hooks = mtp_hooks.attach(hooked, loss_impl="dense")
        with stock_main_logits(stock.module) as logits:
            for batch, advantages in _batches(60):
                step(lambda: stock_policy_loss(stock, logits, batch, advantages, True), 1 / MICRO_BATCHES)

                def hooked_loss() -> Tensor:
                    with hooks.micro_batch(batch.labels, batch.loss_mask):
                        out = hooked(*batch.model_args)
                    return rl_loss(*token_logprobs_from_logits(out, batch.labels, 1.0), batch, advantages)

                step(hooked_loss, 1 / MICRO_BATCHES)
        assert len(hooked_model.embedding_activation_buffer) == len(hooked_model.grad_output_buffer) == MICRO_BATCHES
        _drain(hooked_model)
    assert hooks.loss_path == "dense"
    assert_same_main_grads(main_grads(hooked_model), main_grads(stock_model))


# ------------------------------------------------------------------ two ranks: PP=2 tied, TP=2 with SP


def scenario_logprobs_main_grads(tied: bool, sequence_parallel: bool) -> dict[str, Any]:
    """Fusion, mcore DDP and ``finalize_model_grads`` through mcore's schedule, at this rank's layout.

    PP=2 with tied embeddings: the last stage holds its copy of the word embeddings as the output
    weight (for the MTP layers too), without ``zero_out_wgrad``, and ``finalize_model_grads``
    all-reduces that copy's ``main_grad`` with the first stage's; stock drops the MTP layers'
    embedding lookups' share of that copy under fusion (``tests.support.pipeline_cases.STOCK_DEFECTS``), so
    the tied stock twin runs without fusion. TP=2: stock's vocabulary shards are gathered
    (differentiably) before its ``log_softmax``. Every ``main_grad`` on this rank equal; returns
    whether this rank holds the output layer.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from mtp_hooks.testing import cuda_calls_on_cpu
    from tests.support.megatron_loop import cuda_stream_on_cpu
    from tests.distributed.test_parallel import _pipeline_chunks
    from tests.support.pipeline_schedule import run_schedule

    overrides = {"gradient_accumulation_fusion": True, "batch_p2p_comm": False, "sequence_parallel": sequence_parallel}
    shape = TinyGPT(vocab_size=VOCAB, num_layers=2, tied=tied, config_overrides=overrides)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rollout = _batches(70)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    with fused_wgrad_kernel_on_cpu(), cuda_calls_on_cpu(), cuda_stream_on_cpu():
        wrapped = {}
        stock_shape = TinyGPT(vocab_size=VOCAB, num_layers=2, tied=tied, config_overrides={**overrides, "gradient_accumulation_fusion": not tied})
        for name in ("stock", "hooked"):
            (chunk,) = _pipeline_chunks(stock_shape if name == "stock" else shape, None)
            chunk.config.finalize_model_grads_func = finalize_model_grads
            wrapped[name] = (chunk, DistributedDataParallel(chunk.config, ddp_config, chunk))
        stock_chunk, stock = wrapped["stock"]
        hooked_chunk, hooked = wrapped["hooked"]
        hooks = mtp_hooks.attach(hooked, output="logprobs")
        batches = [batch for batch, _ in rollout]
        advantages = {id(batch): adv for batch, adv in rollout}

        def loss_of(batch: Batch, logprobs: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            loss = rl_loss(logprobs, None, batch, advantages[id(batch)])
            return loss, torch.tensor(1, dtype=torch.int), {"pg loss": loss.detach()}

        last = stock_chunk.post_process
        with stock_main_logits(stock_chunk) if last else contextlib.nullcontext([]) as logits:

            def stock_step(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
                if not last:
                    return model(*batch.model_args), None
                MTPLossLoggingHelper.tracker.clear()
                per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
                full = logits[-1] if tp == 1 else gather_from_tensor_model_parallel_region(logits[-1])
                logprobs, _ = token_logprobs_from_logits(full, batch.labels, 1.0)
                return per_token, lambda _unused: loss_of(batch, logprobs)

            run_schedule([stock], batches, stock_step)

        def hooked_step(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            if not last:
                return model(*batch.model_args), None
            with hooks.micro_batch(batch.labels, batch.loss_mask):
                out = model(*batch.model_args)
            return out.logprobs, partial(loss_of, batch)

        run_schedule([hooked], batches, hooked_step)
        expected = main_grads(stock_chunk)
        head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
        if head in expected:
            assert expected[head].abs().sum() > 0
        assert_same_main_grads(main_grads(hooked_chunk), expected, atol=1e-5, rtol=1e-4)
        hooks.remove()
    return {"last_stage": bool(last)}


def test_pipeline_tied_head_main_grads_equal_stock(group: SpawnedGroup) -> None:
    """Both stages: the last stage's copy of the embeddings and, after the embedding group's
    all-reduce, the first stage's input embeddings."""
    results = group.run(scenario_logprobs_main_grads, {"pipeline_model_parallel_size": 2}, tied=True, sequence_parallel=False)
    assert [r["last_stage"] for r in results] == [False, True]


def test_tensor_parallel_sequence_parallel_untied_head_main_grads_equal_stock(group: SpawnedGroup) -> None:
    """TP=2 with SP: each rank's vocabulary shard of the head weight; mcore's own main-head call on
    ``hidden[:1]`` gathers and reduce-scatters like any head call."""
    results = group.run(scenario_logprobs_main_grads, {"tensor_model_parallel_size": 2}, tied=False, sequence_parallel=True)
    assert [r["last_stage"] for r in results] == [True, True]
