"""The label / loss-mask contract of MTP, as mcore defines it.

``labels[b, t]`` is the token that follows position ``t`` (next-token labels, as for the main
head) and ``loss_mask`` is aligned with ``labels``. Depth ``k`` (1-based) predicts the token
``k`` steps after that: its targets are ``labels`` rolled left ``k`` times with mcore's
``roll_tensor``, which zero-fills the tail of every sequence (so a target never crosses a packed
sequence boundary) and exchanges boundary tokens between context-parallel ranks. The rolled
mask is zero wherever the rolled label does not exist.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from mtp_hooks import _mcore
from mtp_hooks.errors import bad_argument, describe


def mtp_targets(
    labels: Tensor,
    loss_mask: Optional[Tensor],
    depth: int,
    *,
    packed_seq_params: Any = None,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> list[tuple[Tensor, Tensor]]:
    """Per-depth ``(labels_k, loss_mask_k)`` for ``k = 1 .. depth``.

    Args:
        labels: ``[b, s]`` integer next-token labels (CP-local when context parallel).
        loss_mask: ``[b, s]`` 0/1 mask aligned with ``labels``; ``None`` means all ones.
        depth: number of MTP layers.
        packed_seq_params: mcore ``PackedSeqParams`` of a THD batch (``b == 1``), or ``None``.
        cp_group: context-parallel group, or ``None``.

    Returns:
        ``depth`` pairs; masks are float tensors of ``labels``' shape.
    """
    if not isinstance(depth, int) or depth < 1:
        raise bad_argument("depth", "an int >= 1", describe(depth))
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    mask = loss_mask.float()
    out = []
    for _ in range(depth):
        labels, _sum = _mcore.roll_left(labels, cp_group, packed_seq_params)
        mask, _sum = _mcore.roll_left(mask, cp_group, packed_seq_params)
        out.append((labels, mask))
    return out
