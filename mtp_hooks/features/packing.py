"""Packed (THD) micro-batches: the MTP layers get the padded layout, so their shifted input ids stay
within each sequence (mcore rolls them by ``cu_seqlens_q``; see ``targets.packed_layout``), and the
targets roll by the same layout (``Forward.packed_layout``, read once per forward)."""

from __future__ import annotations

from typing import Any

from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.runtime.arguments import HookResult
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import config_view
from mtp_hooks.targets import packed_layout


def on_block_pre(forward: Forward, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
    """The MTP block's call: its packed batch's padded layout, kept for the targets' rolls."""
    packed = kwargs.get("packed_seq_params")
    if packed is None:
        return None
    if forward.train and block.training and _mcore.recompute_breaks_packed(block.config):
        # Stock 0.16 - 0.17 recompute would hand the PackedSeqParams to save_for_backward
        # (TypeError): the MTP layers run without recompute for this block call (same gradients).
        for layer in block.layers:
            forward.swap(layer, "config", config_view(layer.config, lambda: True, "recompute_granularity"))
    forward.packed_layout = layout = packed_layout(packed)
    if layout is packed:
        return None
    kwargs["packed_seq_params"] = layout
    return args, kwargs
