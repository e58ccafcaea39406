"""The MTP losses of a training forward, hung on the main head's call.

The output layer of a training forward receives the MTP block's concatenated output
``[(1+k)s, b, h]`` (the window keeps stock mcore from splitting it). ``attach`` splits it, computes
each draft step's loss on its chunk against the rolled targets (``mtp_targets``), lean or dense,
and hangs the losses on chunk 0 with mcore's ``MTPLossAutoScaler``, so they reach backward through
the main head exactly as stock mcore's do. ``Losses`` is what a training forward keeps of it: the
micro-batch's loss multiplier (``forward_scale``), the per-step metric sums and the loss path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from mtp_hooks import _mcore
from mtp_hooks.checks import check_loss_scale
from mtp_hooks.features import deferral
from mtp_hooks.features.packing import Packing
from mtp_hooks.head import Head
from mtp_hooks.metrics import DepthSums, MTPMetrics, chain_sums
from mtp_hooks.ops.lean_loss import KernelSpec, lean_mtp_loss
from mtp_hooks.ops.vocab_parallel import argmax_matches
from mtp_hooks.ops.weight_grad import choose_weight_grad
from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.micro_batch import MicroBatch
from mtp_hooks.targets import align_with_depths, roll_layout, rolled_targets


@dataclasses.dataclass
class Losses:
    """Per training forward: its MTP loss multiplier and, once attached, the per-step metric sums
    and the loss path taken."""

    scale: Any = None  # micro_batch(loss_scale=) x call_loss_scale; None = 1
    attached: bool = False
    metrics: list[DepthSums] = dataclasses.field(default_factory=list)
    path: Optional[str] = None
    in_own_head_call: bool = False  # the dense path is calling the output layer itself


def forward_scale(options: Options, targets: MicroBatch, arguments: Mapping[str, Any]) -> Any:
    """A training forward's MTP loss multiplier: its targets' times ``call_loss_scale``'s of the
    forward's ``arguments`` by name."""
    scale = targets.loss_scale
    if options.call_loss_scale is not None:
        from_call = check_loss_scale("call_loss_scale", options.call_loss_scale(arguments))
        if from_call is not None:
            scale = from_call if scale is None else scale * from_call
    return scale


def attach(
    options: Options, forward: Forward, losses: Losses, head: Head, hidden: Tensor, depth: int, packed: Packing
) -> Tensor:
    """The main head's call of a training forward: hang the ``depth`` steps' losses on it; returns the
    main chunk of ``hidden``, which carries them. ``head``: the output layer as the MTP heads use it
    (its weight detached where they must not train it, ``detach.mtp_head``); ``head.call`` is
    ``own_head_call`` (dense path); ``packed``: the forward's packing, which the targets roll by."""
    targets = forward.targets
    if targets is None:
        raise AssertionError("mtp_hooks: MTP losses asked for an inference forward")
    model = forward.model
    batch = MTPBatch(targets.labels, targets.loss_mask, depth, packed.params, packed.layout)
    scale = options.mtp_loss_scale(model.config)
    if losses.scale is not None:  # this micro-batch's multiplier
        scale = scale * losses.scale
    main, losses.metrics, losses.path = attach_mtp_losses(options, model, head, hidden, batch, scale)
    losses.attached = True
    return main


def check_finished(losses: Losses) -> None:
    """A training forward finished: its losses must hang on the main head's call."""
    if not losses.attached:
        raise AssertionError(
            "mtp_hooks: a training micro-batch finished without MTP losses; the output layer never "
            "received the MTP block's output (a path that bypasses module hooks?)"
        )


def count(losses: Losses, metrics: MTPMetrics, depth: int, track: bool, growth: Optional[_mcore.TrackerGrowth]) -> None:
    """Add a completed training forward's per-step sums to ``metrics`` and, with ``track`` (stock
    tracks in training mode only), to mcore's tracker as stock does; ``growth``: the chain's, when
    it has more steps than the model's depths (``_mcore.TrackerGrowth``)."""
    for entry in losses.metrics:
        metrics.add(*entry)
        if track:
            if growth is not None:
                growth.note()
            k, ce_sum, tokens, correct = entry[:4]
            _mcore.track_depth(k, depth, ce_sum, tokens, correct)


def own_head_call(layer: nn.Module, losses: Losses, hidden: Tensor, weight: Tensor) -> Tensor:
    """The output layer called for one draft step (dense path), past the hooks' own pre-hook and
    outside mcore's deferred weight-gradient buffers (``deferral.undeferred_call``)."""
    losses.in_own_head_call = True
    try:
        with deferral.undeferred_call(layer):
            logits, _bias = layer(hidden, weight=weight, runtime_gather_output=False)
    finally:
        losses.in_own_head_call = False
    return logits


class MTPBatch(NamedTuple):
    """One training micro-batch as the MTP heads take it: the user's targets, the ``depth`` draft
    steps trained (the model's N MTP layers, or ``draft_steps``) and the forward's packing
    (``packed_layout``: the MTP block's ``targets.packed_layout``, computed once per forward;
    ``None``: computed from ``packed_seq_params``)."""

    labels: Tensor
    loss_mask: Optional[Tensor]
    depth: int
    packed_seq_params: Any = None
    packed_layout: Any = None


def split_block_output(hidden: Tensor, depth: int) -> tuple[Tensor, ...]:
    """The MTP block's ``[(1+N)s, b, h]`` output as 1 + N equal chunks (main, depth 1, ..., N)."""
    chunks = torch.chunk(hidden, 1 + depth, dim=0)
    if len(chunks) != 1 + depth or chunks[-1].shape != chunks[0].shape:
        raise AssertionError(
            f"mtp_hooks: output layer input {tuple(hidden.shape)} does not split into 1 + {depth} equal chunks"
        )
    return chunks


def attach_mtp_losses(
    options: Options, model: nn.Module, head: Head, block_output: Tensor, batch: MTPBatch, loss_scale: Any
) -> tuple[Tensor, list[DepthSums], str]:
    """Hang every depth's MTP loss on the main chunk of ``block_output`` ``[(1+N)s, b, h]``, N = ``batch.depth``.

    Returns the main chunk (carrying the losses), the per-depth metric sums and the loss path
    taken (``loss_path``). ``head.weight`` is the output weight the MTP heads use (already
    detached when they must not train it). ``loss_scale`` (a float or 0-d tensor) is the total
    MTP weight, split evenly over the depths (``Options.mtp_loss_scale``), step j's share times its
    ``draft_step_weights`` weight where they are given; normalisation follows
    the installed mcore release (``_mcore.depth_coefficient``) unless ``options.per_token_rescale``
    picks a rule. Targets roll with the micro-batch's own CP group when ``packed_seq_params`` has
    one, by ``batch.packed_layout`` when given. An output layer whose call the lean path does not reproduce
    (``head.reproducible_head``: its own ``forward``, TE's layer, foreign hooks) takes the
    dense path: stock's MTP heads call the output layer, so what it does (soft-capping, adapters,
    monitors) acts on them, and only a real call reproduces that; the draft objectives and
    agreement metrics, lean only, are refused there.
    """
    labels, loss_mask, depth, packed_seq_params, packed_layout = batch
    chunks = split_block_output(block_output, depth)
    per_token = bool(getattr(model.config, "calculate_per_token_loss", False))
    cp_group = _mcore.cp_group_of(model, packed_seq_params)
    layout = roll_layout(packed_seq_params, cp_group, packed_layout)
    targets = rolled_targets(labels, loss_mask, depth, packed_seq_params, cp_group, options.validate, layout)
    # A count made on the device, not a tensor built from a host value (a blocking copy on a GPU).
    original_tokens = targets[0][1].new_full((), labels.numel()) if loss_mask is None else loss_mask.sum()
    tokens = [mask_k.sum() for _labels_k, mask_k in targets]
    weights = options.step_weights(depth)
    step_scales = [loss_scale / depth] * depth if weights is None else [loss_scale * w / depth for w in weights]
    if options.compares_with_main_head:
        head.require_reproducible(
            "objective",
            f"{options.objective!r} (and agreement_metrics) compute the MTP logits",
            "use objective='ce' without agreement_metrics (the dense path then calls it, as stock)",
        )
    if options.loss_impl == "dense" or not head.reproducible:
        main, sums = chunks[0], []
        for k, (chunk, (labels_k, mask_k)) in enumerate(zip(chunks[1:], targets)):
            scale = lambda ce, n=tokens[k], step_scale=step_scales[k]: _mcore.scale_depth_loss(  # noqa: E731
                ce, step_scale, per_token, original_tokens, n, options.per_token_rescale
            )
            objective, ce_sum, correct = _dense_depth_loss(model, head, chunk, labels_k, mask_k, scale)
            main = _mcore.MTPLossAutoScaler.apply(main, objective)
            sums.append((k, ce_sum, tokens[k], correct))
        return main, sums, "dense"
    coefs = [
        _mcore.depth_coefficient(step_scale, per_token, original_tokens, n, options.per_token_rescale)
        for step_scale, n in zip(step_scales, tokens)
    ]
    teachers = None
    if options.compares_with_main_head:
        teachers = _main_head_inputs(head, chunks[0], depth, layout, cp_group)
    depth_slab = block_output[chunks[0].shape[0] :]
    objective, sums, path = _lean_loss(options, head, depth_slab, chunks, targets, tokens, coefs, teachers)
    return _mcore.MTPLossAutoScaler.apply(chunks[0], objective), sums, path


def _dense_depth_loss(
    model: nn.Module, head: Head, chunk: Tensor, labels: Tensor, mask: Tensor, scale: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """One depth as stock computes it: logits from the output layer, mcore's own CE, stock's
    scaling of the masked per-token CE (``scale``), so every gradient is stock's to the bit."""
    labels_sb, mask_sb = labels.t(), mask.t()  # [s, b], like the hidden states
    if head.call is None:
        raise AssertionError("mtp_hooks: the dense MTP path needs the output layer's own call (Head.call)")
    logits = head.call(chunk, head.weight)
    correct = argmax_matches(logits, labels_sb, head.tp_group)  # before mcore's CE, which may write into logits
    ce = model.compute_language_model_loss(labels, logits)
    return scale(mask * ce).sum(), (ce.detach().t() * mask_sb).sum(), (correct * mask_sb).sum()


def _lean_loss(
    options: Options,
    head: Head,
    depth_slab: Tensor,
    chunks: tuple[Tensor, ...],
    targets: list[tuple[Tensor, Tensor]],
    tokens: list[Tensor],
    coefs: list[Any],
    teachers: Optional[list[Tensor]],
) -> tuple[Tensor, list[DepthSums], str]:
    """All depths in one ``lean_mtp_loss`` call, so the fused weight gradient has one accumulator.

    ``depth_slab`` is chunks 1..N of the block output as one view; tokens are ordered depth by
    depth, each in ``[s, b]`` order, and every depth's tokens carry its own coefficient.
    """
    weight = head.weight
    if head.sequence_parallel:  # gather each depth's sequence shards apart
        hidden = torch.cat([head.input(chunk) for chunk in chunks[1:]])
    else:
        hidden = head.input(depth_slab)
    depth = len(targets)
    per_depth = hidden.shape[0] * hidden.shape[1] // depth
    masks = torch.stack([mask_k.t().reshape(-1) for _labels_k, mask_k in targets])  # [N, T]
    # Each depth's tokens weighted by its own coefficient (a tensor, or a plain number: no host-to-device copy).
    token_weight = torch.stack([mask * coef for mask, coef in zip(masks, coefs)])
    path: str = options.loss_impl
    if path == "lean":
        path = choose_weight_grad(hidden.shape[-1], depth * per_depth)
    spec = KernelSpec(head.tp_group, head.chunk(per_depth), path, head.main_grad_protocol)
    out = lean_mtp_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        torch.cat([labels_k.t().reshape(-1) for labels_k, _mask_k in targets]),
        token_weight.reshape(-1),
        spec,
        options.draft_rule,
        None if teachers is None else torch.cat([t.reshape(-1, t.shape[-1]) for t in teachers]),
    )

    def masked_sums(per_token: Tensor) -> Tensor:
        return (per_token.view(depth, per_depth) * masks).sum(dim=1)

    columns = [masked_sums(out.ce), masked_sums(out.correct)]
    if out.agree is not None and out.accept is not None:
        columns += [
            masked_sums(out.agree), masked_sums(out.accept), *chain_sums(out.accept.view(depth, per_depth), masks)
        ]
    sums: list[DepthSums] = [(k, columns[0][k], tokens[k], *(c[k] for c in columns[1:])) for k in range(depth)]
    return out.objective, sums, path if weight.requires_grad else "detached"


def _main_head_inputs(head: Head, main: Tensor, depth: int, layout: Any, cp_group: Any) -> list[Tensor]:
    """Per depth k, the main head's (detached, SP-gathered) input at position t + k, for the
    draft objectives and agreement metrics (``targets.align_with_depths``)."""
    with torch.no_grad():
        if head.sequence_parallel:
            main = gather_from_sequence_parallel_region(main, group=head.tp_group)
        return align_with_depths(main, depth, layout=layout, cp_group=cp_group)

