"""The label / loss-mask contract of MTP: what ``mtp_targets`` returns and the hooks train on.

* ``labels[b, t]`` is the token that follows position ``t`` (next-token labels, as for the main
  head); ``loss_mask[b, t]`` (0 or 1) says whether that label counts.
* Depth ``k`` (1 .. N) at position ``t`` targets ``labels[b, t + k]`` with weight
  ``loss_mask[b, t + k]`` when ``t + k`` is a real token of the same sequence as ``t``; otherwise
  its mask is 0. Labels where the mask is 0 are unspecified.
* A sequence is a row of a ``[b, s]`` batch. In a packed (THD) batch, ``b == 1`` and sequence
  ``i`` occupies the slot ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1])`` of the row
  (``cu_seqlens_q`` when there is no padded variant); its first
  ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` tokens are real, the rest of the slot is padding.
  Tokens after the last slot belong to no sequence.
* With context parallelism the tensors are this rank's part of mcore's load-balanced split:
  chunks ``r`` and ``2cp - 1 - r`` of ``2cp`` equal chunks of every sequence (of every slot, for
  THD, whose ``cu_seqlens`` stay global as mcore expects). ``t + k`` counts in the full sequence;
  boundary tokens come from the neighbouring CP ranks.

The rolls are mcore's own ``roll_tensor`` (zero fill at the end of each sequence, CP boundary
exchange), so the result is stock mcore's wherever stock is well defined: unpacked batches, and
packed ones whose ``cu_seqlens_q`` is the layout (no padding, or ``cu_seqlens_q`` equal to
``cu_seqlens_q_padded``, which is how Megatron-LM, verl and NeMo-RL fill it). Stock mcore 0.16
rolls by ``cu_seqlens_q`` even when a padded layout differs from it, i.e. by unpadded lengths
over the padded row, so its targets run across sequences there; here the rolls use the padded
layout and padding is masked.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from mtp_hooks import _mcore
from mtp_hooks.checks import Validate, require
from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.ops.vocab_parallel import group_rank, group_size


def mtp_targets(
    labels: Tensor,
    loss_mask: Optional[Tensor],
    depth: int,
    *,
    packed_seq_params: Any = None,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    validate: Validate = "device",
) -> list[tuple[Tensor, Tensor]]:
    """Per-depth MTP targets ``[(labels_1, mask_1), ..., (labels_N, mask_N)]`` of one micro-batch.

    ``mask_k[b, t]`` is ``loss_mask[b, t + k]`` where position ``t + k`` is a real token of the
    same sequence as ``t`` and 0 elsewhere; ``labels_k[b, t]`` is ``labels[b, t + k]`` where
    ``mask_k`` is 1 (unspecified elsewhere). Sequences, padding and the CP split are as in the
    module docstring; ``sum(mask_k)`` is the token count stock mcore normalises depth ``k`` by.

    Args:
        labels: ``[b, s]`` integer next-token labels (this CP rank's part with context parallelism).
        loss_mask: ``[b, s]`` 0/1 mask aligned with ``labels``; ``None`` means all ones.
        depth: number of MTP layers ``N``.
        packed_seq_params: mcore ``PackedSeqParams`` of a packed THD batch (``b == 1``; global
            ``cu_seqlens_q``, optional ``cu_seqlens_q_padded``), or ``None``.
        cp_group: context-parallel group, or ``None``.
        validate: how a packed layout's values are checked (``checks``): ``"device"`` (no host
            sync; on a GPU a device-side assert), ``"host"`` or ``"off"``.

    Returns:
        ``depth`` pairs of tensors shaped like ``labels``: labels in its dtype, float32 masks.

    Raises:
        MTPHooksError: for a bad ``depth``, shapes, or a packed layout that does not fit the row
            (slots shorter than their sequences, slots not divisible into ``2cp`` chunks).

    Example::

        (labels_1, mask_1), (labels_2, mask_2) = mtp_targets(labels, loss_mask, 2)
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise bad_argument("depth", "an int >= 1", describe(depth))
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise bad_argument("labels", "a [b, s] integer tensor", describe(labels))
    if loss_mask is not None and (not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape):
        raise bad_argument(
            "loss_mask", f"None or a tensor shaped like labels {tuple(labels.shape)}", describe(loss_mask)
        )
    return rolled_targets(
        labels, loss_mask, depth, packed_seq_params, cp_group, validate, roll_layout(packed_seq_params, cp_group)
    )


def rolled_targets(
    labels: Tensor,
    loss_mask: Optional[Tensor],
    depth: int,
    packed_seq_params: Any,
    cp_group: Optional[torch.distributed.ProcessGroup],
    validate: Validate,
    layout: Any,
) -> list[tuple[Tensor, Tensor]]:
    """``mtp_targets`` of checked arguments, rolled by ``layout`` (``roll_layout`` of the same
    ``packed_seq_params`` and ``cp_group``), which the hooks compute once per forward."""
    if packed_seq_params is not None and labels.shape[0] != 1:
        raise bad_argument("labels", "[1, t] for packed sequences (THD: batch 1, tokens along dim 1)", describe(labels))
    mask = (
        torch.ones(labels.shape, dtype=torch.float32, device=labels.device) if loss_mask is None else loss_mask.float()
    )
    if packed_seq_params is not None:
        mask = mask * _real_tokens(packed_seq_params, labels.shape[1], cp_group, labels.device, validate)
    out = []
    for _ in range(depth):
        labels, _sum = _mcore.roll_left(labels, cp_group, layout)
        mask, _sum = _mcore.roll_left(mask, cp_group, layout)
        out.append((labels, mask))
    return out


def align_with_depths(
    hidden: Tensor,
    depth: int,
    *,
    layout: Any = None,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> list[Tensor]:
    """The main head's input seen from each MTP depth: ``hidden`` ``[s, b, h]`` rolled left ``k``
    positions for ``k = 1 .. depth``.

    Row ``t`` of entry ``k - 1`` is ``hidden[t + k]``, the position whose main-head prediction
    targets the same token as depth ``k`` at ``t`` (zero where ``t + k`` leaves the sequence;
    those positions have ``mask_k == 0`` in ``mtp_targets``). Same sequences, padding and CP
    exchange as ``mtp_targets``, given the same ``layout`` (``roll_layout``); the result is detached.
    """
    rolled = hidden.detach().permute(1, 2, 0)  # [b, h, s]: mcore rolls the last dim
    out = []
    for _ in range(depth):
        rolled, _sum = _mcore.roll_left(rolled, cp_group, layout)
        out.append(rolled.permute(2, 0, 1))
    return out


def roll_layout(packed_seq_params: Any, cp_group: Any, padded: Any = None) -> Any:
    """The layout the targets roll by: ``padded`` (``packed_layout(packed_seq_params)``, computed
    here when ``None``) less the empty slots mcore's CP roll cannot index; ``None`` if not packed."""
    if packed_seq_params is None:
        return None
    return _without_empty_slots(packed_layout(packed_seq_params) if padded is None else padded, cp_group)


def packed_layout(packed_seq_params: Any) -> Any:
    """``packed_seq_params`` whose ``cu_seqlens_q`` / ``_kv`` are the padded layout, for mcore's MTP rolls.

    mcore's ``roll_tensor`` (loss targets, and the MTP layers' shifted input ids) reads
    ``cu_seqlens_q`` as the layout of the packed row. Returns the argument itself when it has no
    distinct ``cu_seqlens_q_padded``; otherwise a copy with the padded bounds (equal bounds give
    the same rolls). Real tokens precede the padding of each slot, so causal attention over a whole
    slot gives the real tokens the same result. ``max_seqlen_q`` / ``_kv`` stay the caller's: with
    padded bounds Transformer Engine (so stock's own decoder) already reads them as the widest
    padded slot, as Megatron-LM, verl and NeMo-RL pass them. No host read.
    """
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    unpadded = packed_seq_params.cu_seqlens_q
    if padded is None or padded is unpadded:
        return packed_seq_params
    if padded.shape != unpadded.shape:
        raise bad_argument(
            "packed_seq_params",
            "cu_seqlens_q_padded shaped like cu_seqlens_q",
            f"{tuple(padded.shape)} and {tuple(unpadded.shape)}",
        )
    kv_padded = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
    return dataclasses.replace(
        packed_seq_params, cu_seqlens_q=padded, cu_seqlens_kv=padded if kv_padded is None else kv_padded
    )


def _without_empty_slots(layout: Any, cp_group: Any) -> Any:
    """``layout`` minus zero-length slots, which hold no token but make mcore's CP roll index an
    empty chunk (``IndexError`` in 0.16.1). Without CP mcore rolls slot by slot, where an empty one
    is harmless, and ``layout`` is returned as it is (``unique_consecutive`` syncs on a GPU)."""
    if group_size(cp_group) == 1:
        return layout
    bounds = layout.cu_seqlens_q
    kept = torch.unique_consecutive(bounds)
    return layout if kept.numel() == bounds.numel() else dataclasses.replace(layout, cu_seqlens_q=kept)


def _real_tokens(
    packed_seq_params: Any, length: int, cp_group: Any, device: torch.device, validate: Validate
) -> Tensor:
    """``[length]`` float: 1 at this rank's positions that hold a real token of some sequence.

    Computed on the device from the slot bounds (no host read of ``cu_seqlens``); a layout that
    does not fit the row is refused through ``checks.require`` (``validate``: a device-side check by
    default, the full message at once on CPU or with ``"host"``).
    """
    unpadded = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.long)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    bounds = unpadded if padded is None else padded.to(device=device, dtype=torch.long)
    tokens, slots = unpadded[1:] - unpadded[:-1], bounds[1:] - bounds[:-1]
    cp, cp_rank = group_size(cp_group), group_rank(cp_group)
    fits = ((tokens >= 0) & (tokens <= slots)).all()
    require(fits, validate, lambda: _layout_error(bounds, tokens, slots, length, cp, "tokens"))
    if cp > 1:
        even = ((slots % (2 * cp) == 0) & (bounds[:-1] % cp == 0)).all()
        require(even, validate, lambda: _layout_error(bounds, tokens, slots, length, cp, "even"))
    inside = bounds[-1] // cp <= length if bounds.numel() else torch.ones((), dtype=torch.bool, device=device)
    require(inside, validate, lambda: _layout_error(bounds, tokens, slots, length, cp, "inside"))
    if slots.numel() == 0:
        return torch.zeros(length, dtype=torch.float32, device=device)
    local = torch.arange(length, device=device)
    starts = bounds[:-1] // cp  # each slot's first position on this rank
    slot = torch.searchsorted(starts, local, right=True).sub_(1).clamp_(min=0)
    offset = local - starts[slot]  # position within the slot's part on this rank
    if cp > 1:  # chunks cp_rank and 2cp - 1 - cp_rank of the slot, c tokens each
        chunk = slots[slot] // (2 * cp)
        offset = torch.where(offset < chunk, cp_rank * chunk + offset, (2 * cp - 1 - cp_rank) * chunk + offset - chunk)
    past_start = local >= starts[0]
    in_slot = local < bounds[-1] // cp
    return (past_start & in_slot & (offset < tokens[slot])).float()


def _layout_error(bounds: Tensor, tokens: Tensor, slots: Tensor, length: int, cp: int, failed: str) -> MTPHooksError:
    """The error for a packed layout that does not fit this rank's row, naming the first bad slot."""
    starts, ends, counts = bounds[:-1].tolist(), bounds[1:].tolist(), tokens.tolist()
    for start, end, count in zip(starts, ends, counts):
        slot = end - start
        if failed == "tokens" and not 0 <= count <= slot:
            return bad_argument(
                "packed_seq_params",
                "sequence lengths (cu_seqlens_q) within their padded slots (cu_seqlens_q_padded)",
                f"{count} tokens in a slot of {slot}",
            )
        if failed == "even" and (slot % (2 * cp) or start % cp):
            return bad_argument(
                "packed_seq_params", f"slots divisible into 2 * cp = {2 * cp} chunks", f"slot [{start}, {end})"
            )
    return bad_argument(
        "packed_seq_params",
        f"slots within the {length} tokens of this rank",
        f"slots up to {int(bounds[-1])} over cp = {cp}",
    )
