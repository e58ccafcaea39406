"""Stock and hooked model chunks through mcore's own pipeline schedule, on every rank of a group.

Test-only support for ``tests/distributed/test_parity_pipeline.py``: the schedule plumbing around the
pieces of the side-by-side harness ``mtp_hooks.testing.twins`` (batches, the output-layer recorder,
mcore's tracker, the hooks' per-depth losses). ``run_stock(knobs, ...)`` and
``run_hooked(case, ...)`` build this rank's model chunks (one per virtual stage, same seed), wrap
each in mcore's ``DistributedDataParallel`` (fp32 ``main_grad``), run two steps of four training
micro-batches through ``get_forward_backward_func()`` with Megatron's ``finalize_model_grads`` as
the schedule's finalize hook (no optimizer step: both steps' gradients are the same), and return a
``Run`` of the last step: every parameter's ``main_grad`` per chunk, the last stage's logits or
log-probs and per-depth MTP losses per micro-batch, and mcore's MTP tracker.

CPU accommodations, as in the other suites: ``cuda_calls_on_cpu`` and ``cuda_stream_on_cpu``
around the schedule, ``fused_wgrad_kernel_on_cpu`` for gradient-accumulation fusion. With
``defer_embedding_wgrad_compute`` only the output layer and the schedule's config carry the flag:
with the local layer spec every trunk ``ColumnParallelLinear`` would defer too (TE's layers do not).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from functools import partial
from typing import Any, Iterator, Optional

from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, context_parallel_positions, cuda_calls_on_cpu, fused_wgrad_kernel_on_cpu, make_batch
from mtp_hooks.testing import hooked_mtp_losses
from tests.support.megatron_loop import cuda_stream_on_cpu
from tests.support.pipeline_cases import Case, Knobs, draft_steps
from tests.support.pipeline_schedule import masked_sum_loss, run_schedule, stock_last_stage
from tests.support.stock_engine_geometry import stock_engine_steps
from tests.support.stock_references import ENGINE, stock_chain

SEED = 1234
MICRO_BATCHES = 4
STEPS = 2  # DDP's bucket bookkeeping asserts only from a step's zero_grad_buffer on; the last step is compared
SEQ = 8


@dataclasses.dataclass
class Run:
    """What one schedule run leaves on this rank."""

    grads: list[dict[str, Tensor]]  # per chunk: parameter name -> main_grad after finalize_model_grads
    outputs: list[Tensor]  # last stage, per micro-batch: logits [b, s, V/tp] or log-probs [b, s]
    mtp: list[list[float]]  # last stage, per micro-batch: per-depth MTP loss
    tracker: dict[str, Tensor]  # mcore's MTPLossLoggingHelper.tracker after the run
    last_stage: bool


def batches_for_this_rank() -> list[Batch]:
    """The micro-batches, cut to this rank's part of the sequence under CP (mcore's load-balanced split)."""
    from megatron.core import parallel_state as ps

    batches = [make_batch(64, batch=2, seq=SEQ, seed=20 + i) for i in range(MICRO_BATCHES)]
    cp_size = ps.get_context_parallel_world_size()
    if cp_size == 1:
        return batches
    index = context_parallel_positions(SEQ, ps.get_context_parallel_rank(), cp_size)
    return [Batch(b.input_ids[:, index], b.position_ids[:, index], b.labels[:, index], b.loss_mask[:, index]) for b in batches]


def _chunks(knobs: Knobs, vpp: Optional[int]) -> list[nn.Module]:
    overrides: dict[str, Any] = {"batch_p2p_comm": False, "gradient_accumulation_fusion": knobs.fusion}
    # Unbatched p2p: gloo matches batched isend/irecv pairs in posting order, which mcore's
    # batched ordering does not keep with two ranks and VPP (see tests/distributed/test_parallel.py).
    if vpp:
        overrides["virtual_pipeline_model_parallel_size"] = vpp
    if knobs.mtp_factor is not None:
        overrides["mtp_loss_scaling_factor"] = knobs.mtp_factor
    position = "rope" if knobs.draft in ENGINE else "learned_absolute"  # the engine geometry refuses learned absolute
    shape = TinyGPT(num_layers=2 * (vpp or 1), tied=knobs.tied, position_embedding_type=position, config_overrides=overrides)
    return pipeline_chunks(shape, SEED, vpp)


def pipeline_chunks(shape: TinyGPT, seed: int, vpp: Optional[int]) -> list[nn.Module]:
    """This rank's model chunks (one per virtual stage), each built with ``seed``."""
    from megatron.core import parallel_state as ps

    chunks = []
    for vp_stage in range(vpp or 1):
        stage = {"vp_stage": vp_stage} if vpp else {}
        chunks.append(
            shape.build(
                seed,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, **stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, **stage),
                **stage,
            )
        )
    return chunks


def _defer_head(gpt: nn.Module) -> None:
    """The output layer defers its weight gradient into GPTModel's buffers (as mcore sets up with the flag)."""
    layer = gpt.output_layer
    layer.config = copy.copy(layer.config)
    layer.config.defer_embedding_wgrad_compute = True
    gpt.embedding_activation_buffer, gpt.grad_output_buffer = [], []
    layer.embedding_activation_buffer, layer.grad_output_buffer = gpt.embedding_activation_buffer, gpt.grad_output_buffer


def _wrap(chunks: list[nn.Module], knobs: Knobs) -> list[nn.Module]:
    """mcore DDP around each chunk, and the schedule's hooks on the config it reads (chunk 0's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=knobs.overlap, use_distributed_optimizer=False)
    wrapped = []
    for index, gpt in enumerate(chunks):
        config = gpt.config
        if knobs.defer:
            config = copy.copy(config)
            config.defer_embedding_wgrad_compute = True
            if gpt.post_process:
                _defer_head(gpt)
        wrapped.append(DistributedDataParallel(config, ddp_config, gpt, disable_bucketing=index > 0))
    config = wrapped[0].config
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [ddp.no_sync for ddp in wrapped]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    if knobs.overlap:
        grad_sync = [ddp.start_grad_sync for ddp in wrapped]
        config.grad_sync_func = grad_sync if len(grad_sync) > 1 else grad_sync[0]
    return wrapped


@contextlib.contextmanager
def _on_cpu(fusion: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if fusion:
            stack.enter_context(fused_wgrad_kernel_on_cpu())
        stack.enter_context(cuda_calls_on_cpu())
        stack.enter_context(cuda_stream_on_cpu())
        yield


def _steps(model: list[nn.Module], batches: list[Batch], step: Any, records: tuple[list[Any], ...]) -> None:
    """``STEPS`` training steps without an optimizer step (each one's gradients are the same); what
    ``records`` and mcore's tracker hold is the last step's, as Megatron's ``training_log`` reads it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    for _ in range(STEPS):
        for record in records:
            record.clear()
        MTPLossLoggingHelper.tracker.clear()
        for chunk in model:
            chunk.zero_grad_buffer()
        run_schedule(model, batches, step, seq_length=SEQ)  # the whole sequence: the schedule divides it by CP


def _tracker() -> dict[str, Tensor]:
    """mcore's MTP tracker's tensors (then cleared): loss sums per depth, 0.19+ also acceptance counts."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    out = {key: value.detach().clone() for key, value in MTPLossLoggingHelper.tracker.items() if isinstance(value, Tensor)}
    MTPLossLoggingHelper.tracker.clear()
    return out


def _finish(model: list[nn.Module], outputs: list[Tensor], mtp: list[list[float]]) -> Run:
    grads = [
        {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters() if p.requires_grad} for ddp in model
    ]
    return Run(grads, outputs, mtp, _tracker(), model[-1].module.post_process)


def run_stock(knobs: Knobs, vpp: Optional[int], batches: list[Batch]) -> Run:
    """Stock mcore: labels in on every chunk; the last stage's per-token loss feeds the schedule's loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    outputs: list[Tensor] = []
    mtp: list[list[float]] = []
    with _on_cpu(knobs.fusion):
        chunks = _chunks(knobs, vpp)
        model = _wrap(chunks, knobs)

        def step(chunk: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            targets = {"labels": batch.labels, "loss_mask": batch.loss_mask}
            gpt = chunk.module
            if not gpt.post_process:
                return chunk(*batch.model_args, **targets), None
            steps = draft_steps(knobs.draft, gpt.config.mtp_num_layers)
            with stock_chain(gpt, knobs.draft), stock_engine_steps(gpt, knobs.draft), stock_last_stage(gpt, steps, outputs, mtp):
                per_token = chunk(*batch.model_args, **targets)
            outputs.append(-per_token.detach())  # the main head's log-probs of the labels
            return per_token, partial(masked_sum_loss, batch.loss_mask)

        _steps(model, batches, step, (outputs, mtp))
        return _finish(model, outputs, mtp)


def run_hooked(case: Case, batches: list[Batch]) -> Run:
    """The same chunks with ``mtp_hooks.attach(chunk, **case.hook_options)`` on each; labels passed
    as stock's; the loss from the returned logits (mcore's own CE) or log-probs."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    outputs: list[Tensor] = []
    mtp: list[list[float]] = []
    with _on_cpu(case.fusion):
        chunks = _chunks(case.knobs, case.vpp)
        model = _wrap(chunks, case.knobs)
        hooks = [mtp_hooks.attach(chunk, **case.hook_options) for chunk in model]

        def step(chunk: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            targets = {"labels": batch.labels, "loss_mask": batch.loss_mask}
            gpt = chunk.module
            output = chunk(*batch.model_args, **targets)
            if not gpt.post_process:
                return output, None
            if case.output == "logprobs":
                outputs.append(output.logprobs.detach().clone())
                per_token = -output.logprobs
            else:
                outputs.append(output.detach().clone())
                per_token = gpt.compute_language_model_loss(batch.labels, output.transpose(0, 1).contiguous())
            metrics = mtp_hooks.hooks_of(chunk).metrics()
            mtp.append(hooked_mtp_losses(metrics, draft_steps(case.draft, gpt.config.mtp_num_layers)))
            return per_token, partial(masked_sum_loss, batch.loss_mask)

        try:
            _steps(model, batches, step, (outputs, mtp))
            return _finish(model, outputs, mtp)
        finally:
            for h in hooks:
                h.remove()


def rel_l2(actual: Tensor, expected: Tensor) -> float:
    """``|actual - expected| / |expected|`` (L2; against 1 where ``expected`` is 0)."""
    diff = float((actual.double() - expected.double()).norm())
    return diff / max(float(expected.double().norm()), 1e-30) if expected.any() else diff
