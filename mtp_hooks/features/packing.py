"""Packed (THD) micro-batches: the MTP layers get the padded layout, so their shifted input ids stay
within each sequence (mcore rolls them by ``cu_seqlens_q``; see ``targets.packed_layout``), and the
targets roll by the same layout (``Packing.layout``, read once per forward).

A packed batch may also carry its own context-parallel group (``packed_seq_params.cp_group``:
dynamic context parallelism, as verl uses): the MTP layers then roll their input ids with that
group, as the targets do (``_mcore.cp_group_of``), for the block's run only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.runtime.arguments import HookResult
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import config_view
from mtp_hooks.targets import packed_layout


@dataclasses.dataclass
class Packing:
    """Per forward: the call's ``packed_seq_params`` (``None``: not packed) and, once the MTP block
    was called, their padded layout (``targets.packed_layout``), which the targets roll by."""

    params: Any = None
    layout: Any = None


def on_block_pre(
    forward: Forward, packing: Packing, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> HookResult:
    """The MTP block's call: its packed batch's padded layout, kept for the targets' rolls; in a
    training forward, the MTP layers' recompute and CP group as the packed batch needs them."""
    packed = kwargs.get("packed_seq_params")
    if packed is None:
        return None
    if forward.train and block.training and _mcore.recompute_breaks_packed(block.config):
        # Stock 0.16 - 0.17 recompute would hand the PackedSeqParams to save_for_backward
        # (TypeError): the MTP layers run without recompute for this block call (same gradients).
        for layer in block.layers:
            forward.swap(layer, "config", config_view(layer.config, lambda: True, "recompute_granularity"))
    dynamic_cp = getattr(packed, "cp_group", None)
    if forward.train and dynamic_cp is not None:
        for layer in block.layers:
            if "cp_group" in layer.__dict__ and layer.__dict__["cp_group"] is not dynamic_cp:
                # The micro-batch's own CP group for the shifted input ids (dynamic context
                # parallelism), as the targets roll; restored when the MTP block returns.
                forward.swap(layer, "cp_group", dynamic_cp)
    packing.layout = layout = packed_layout(packed)
    if layout is packed:
        return None
    kwargs["packed_seq_params"] = layout
    return args, kwargs
