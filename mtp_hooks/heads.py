"""From the MTP block's output to the MTP losses on backward, and the main head's log-prob output.

The output layer of a training forward receives the MTP block's concatenated output
``[(1+N)s, b, h]`` (the hooks keep stock mcore from splitting it). ``attach_mtp_losses`` splits it,
computes each depth's loss on its chunk against the rolled targets (``mtp_targets``), lean or
dense, and hangs the losses on chunk 0 with mcore's ``MTPLossAutoScaler``, so they reach backward
through the main head exactly as stock mcore's do. ``head_logprobs`` scores labels with the main
head in chunks for ``output="logprobs"``. Nothing here registers or removes hooks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from mtp_hooks import _mcore
from mtp_hooks.logprobs import TokenLogProbs, lean_logprobs
from mtp_hooks.loss import argmax_matches, lean_mtp_loss
from mtp_hooks.options import Options
from mtp_hooks.targets import align_with_depths, mtp_targets

# (depth index, masked CE sum, masked tokens, masked correct[, masked agreements, masked acceptance])
DepthSums = tuple[Any, ...]
# Calls the output layer on (hidden, weight) without the hooks' own pre-hook acting on the call.
HeadCall = Callable[[Tensor, Tensor], Tensor]

_LOGITS_CHUNK_BYTES = 256 * 2**20


def auto_chunk_size(vocab_shard: int, tokens: int) -> int:
    """Tokens per lean chunk: a power of two keeping one chunk's fp32 logits near 256 MiB and at
    most about an eighth of all the logits (at least 16 tokens)."""
    budget = _LOGITS_CHUNK_BYTES // (4 * max(vocab_shard, 1))
    cap = 2 ** math.ceil(math.log2(max(-(-tokens // 8), 1)))
    return max(16, min(2 ** int(math.log2(max(budget, 1))), cap))


def split_block_output(hidden: Tensor, depth: int) -> tuple[Tensor, ...]:
    """The MTP block's ``[(1+N)s, b, h]`` output as 1 + N equal chunks (main, depth 1, ..., N)."""
    chunks = torch.chunk(hidden, 1 + depth, dim=0)
    if len(chunks) != 1 + depth or chunks[-1].shape != chunks[0].shape:
        raise AssertionError(f"mtp_hooks: output layer input {tuple(hidden.shape)} does not split into 1 + {depth} equal chunks")
    return chunks


def head_input(layer: nn.Module, hidden: Tensor, tp_group: Any) -> Tensor:
    """What ``ColumnParallelLinear`` multiplies: SP-gathered or copied into the TP region."""
    if getattr(layer, "sequence_parallel", False):
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    if _mcore.group_size(tp_group) > 1:
        return copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    return hidden


def attach_mtp_losses(
    options: Options,
    model: nn.Module,
    layer: nn.Module,
    chunks: tuple[Tensor, ...],
    weight: Tensor,
    labels: Tensor,
    loss_mask: Optional[Tensor],
    packed_seq_params: Any,
    call_head: HeadCall,
) -> tuple[Tensor, list[DepthSums]]:
    """Hang every depth's MTP loss on the main chunk; returns it and the per-depth metric sums.

    ``weight`` is the output weight the MTP heads use (already detached when they must not train
    it). Normalisation follows the installed mcore release (``_mcore.depth_coefficient``).
    """
    depth = len(chunks) - 1
    loss_scale = model.config.mtp_loss_scaling_factor if options.loss_scale is None else options.loss_scale
    depth_scale = loss_scale / depth
    per_token = bool(getattr(model.config, "calculate_per_token_loss", False))
    cp_group = _mcore.cp_group_of(model)
    targets = mtp_targets(labels, loss_mask, depth, packed_seq_params=packed_seq_params, cp_group=cp_group)
    original_tokens = labels.new_tensor(labels.numel()) if loss_mask is None else loss_mask.sum()
    teachers: list[Optional[Tensor]] = [None] * depth
    if options.compares_with_main_head:
        teachers = list(_main_head_inputs(layer, chunks[0], depth, packed_seq_params, cp_group))
    main = chunks[0]
    sums: list[DepthSums] = []
    for k, (chunk, (labels_k, mask_k), teacher) in enumerate(zip(chunks[1:], targets, teachers)):
        tokens = mask_k.sum()
        coef = _mcore.depth_coefficient(depth_scale, per_token, original_tokens, tokens)
        objective, *depth_sums = _depth_loss(options, model, layer, chunk, weight, labels_k, mask_k, coef, teacher, call_head)
        main = _mcore.MTPLossAutoScaler.apply(main, objective)
        sums.append((k, depth_sums[0], tokens, *depth_sums[1:]))
    return main, sums


def _main_head_inputs(layer: nn.Module, main: Tensor, depth: int, packed_seq_params: Any, cp_group: Any) -> list[Tensor]:
    """Per depth k, the main head's (detached, SP-gathered) input at position t + k, for the
    draft objectives and agreement metrics (``targets.align_with_depths``)."""
    with torch.no_grad():
        if getattr(layer, "sequence_parallel", False):
            main = gather_from_sequence_parallel_region(main, group=_mcore.tp_group_of(layer))
        return align_with_depths(main, depth, packed_seq_params=packed_seq_params, cp_group=cp_group)


def _depth_loss(
    options: Options,
    model: nn.Module,
    layer: nn.Module,
    chunk: Tensor,
    weight: Tensor,
    labels: Tensor,
    mask: Tensor,
    coef: Any,
    teacher: Optional[Tensor],
    call_head: HeadCall,
) -> tuple[Tensor, ...]:
    """(objective carrying grad, detached masked CE sum, masked correct count[, masked argmax
    agreements, masked expected acceptance with a ``teacher``]) of one depth."""
    tp_group = _mcore.tp_group_of(layer)
    labels_sb, mask_sb = labels.t(), mask.t()  # [s, b], like the hidden states
    if options.loss_impl == "dense":
        logits = call_head(chunk, weight)
        correct = argmax_matches(logits, labels_sb, tp_group)  # before mcore's CE, which may write into logits
        ce = model.compute_language_model_loss(labels, logits).t()
        objective = (ce * mask_sb).sum() * coef
        return objective, (ce.detach() * mask_sb).sum(), (correct * mask_sb).sum()
    hidden = head_input(layer, chunk, tp_group)
    chunk_size = options.chunk_size or auto_chunk_size(weight.shape[0], hidden.shape[0] * hidden.shape[1])
    mask_flat = mask_sb.reshape(-1)
    out = lean_mtp_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels_sb.reshape(-1),
        mask_flat * coef,
        tp_group,
        chunk_size,
        options.objective,
        None if teacher is None else teacher.reshape(-1, teacher.shape[-1]),
    )
    sums = [out.objective, (out.ce * mask_flat).sum(), (out.correct * mask_flat).sum()]
    if out.agree is not None and out.accept is not None:
        sums += [(out.agree * mask_flat).sum(), (out.accept * mask_flat).sum()]
    return tuple(sums)


def head_logprobs(options: Options, layer: nn.Module, hidden: Tensor, weight: Tensor, labels: Tensor) -> TokenLogProbs:
    """``output="logprobs"``: the main head's log-probs of ``labels`` (and entropy), ``[b, s]``."""
    tp_group = _mcore.tp_group_of(layer)
    full = head_input(layer, hidden, tp_group)
    s, b = full.shape[0], full.shape[1]
    out = lean_logprobs(
        full.reshape(s * b, -1),
        weight,
        labels.t().reshape(-1),
        tp_group,
        options.chunk_size or auto_chunk_size(weight.shape[0], s * b),
        options.temperature,
        options.entropy,
    )

    def as_bs(tensor: Tensor) -> Tensor:
        return tensor.view(s, b).t()

    return TokenLogProbs(as_bs(out.logprobs), None if out.entropy is None else as_bs(out.entropy))
