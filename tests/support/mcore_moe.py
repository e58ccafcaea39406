"""DeepSeek-style Megatron-Core models (multi-latent attention, MoE, MTP) on CPU: the test suite's helpers.

``TinyDeepSeek``, ``TinyHybridMoE``, ``moe_mla_on_cpu`` and the core attention (``SDPAttention``,
formerly ``MLACoreAttention`` here: its output follows MLA's value head dimension) are
``mtp_hooks.testing``; tests import them from there. What stays here is test-only: the skip
reasons (``DEEPSEEK_MISSING``, ``HYBRID_MOE_MISSING``), mcore's MoE auxiliary-loss tracker
across releases (``moe_tracker``, ``moe_tracker_values``, ``reduce_moe_tracker``,
``reset_moe_process_state``) and module finders (``routers``, ``mtp_moe_layers``, ``forward_calls``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import Tensor

from mtp_hooks.testing import deepseek_missing, hybrid_moe_missing, moe_mla_on_cpu

# tests/support/bridge_models.py and megatron_bridge_models.py still import it from here under this name.
from mtp_hooks.testing import SDPAttention as MLACoreAttention  # noqa: F401

DEEPSEEK_MISSING: Optional[str] = deepseek_missing()
HYBRID_MOE_MISSING: Optional[str] = hybrid_moe_missing()


def moe_tracker() -> dict[str, Any]:
    """mcore's process-wide MoE auxiliary-loss tracker (name -> {"values": per-layer sums, groups}).

    From 0.18 ``get_moe_layer_wise_logging_tracker`` returns a new dict over the entries of
    ``moe_logging.get_moe_metrics_tracker()`` on each call (the ``values`` tensors are shared).
    """
    from megatron.core.transformer.moe import moe_utils

    legacy = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
    if legacy is not None:
        return legacy()
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return {name: {"values": entry.values} for name, entry in get_moe_metrics_tracker().metrics.items()}


def reduce_moe_tracker() -> None:
    """mcore's ``reduce_aux_losses_tracker_across_ranks()``: all-reduce the tracker over PP (and its groups)."""
    from megatron.core.transformer.moe import moe_utils

    reduce = getattr(moe_utils, "reduce_aux_losses_tracker_across_ranks", None)
    if reduce is not None:
        reduce()
        return
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker._sync_metrics(list(tracker.metrics), None)


def _clear_moe_tracker() -> None:
    """Remove every entry (names and per-layer sums) from mcore's MoE tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # up to 0.17: the legacy dict is the tracker itself
        moe_tracker().clear()
    else:
        get_moe_metrics_tracker().metrics.clear()


def moe_tracker_values() -> dict[str, Tensor]:
    """A copy of the tracker's per-layer sums, by loss name."""
    return {name: entry["values"].detach().clone() for name, entry in moe_tracker().items()}


def reset_moe_process_state() -> None:
    """Empty the MoE tracker (names included) and unset the aux-loss backward scale.

    Unset, mcore's aux-loss backward uses 1 and a pipeline schedule installs its own scale (a
    ``[1]`` tensor, which a 0-d scale left from an earlier test could not take).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    _clear_moe_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.fixture(autouse=True)
def moe_on_cpu() -> Iterator[None]:
    """mcore's MoE router and MLA runnable without Transformer Engine; an empty MoE tracker around each
    test. Autouse in the modules that import it."""
    with moe_mla_on_cpu():
        reset_moe_process_state()
        try:
            yield
        finally:
            reset_moe_process_state()


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every MoE router in ``model`` by name (decoder and MTP layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {name: module for name, module in model.named_modules() if isinstance(module, TopKRouter)}


def mtp_moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The MoE layers inside the MTP block, by name."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return {name: module for name, module in model.named_modules() if name.startswith("mtp.") and isinstance(module, MoELayer)}


@contextlib.contextmanager
def forward_calls(modules: dict[str, torch.nn.Module]) -> Iterator[list[str]]:
    """Record the name of each of ``modules`` whose forward runs while the context is open."""
    calls: list[str] = []
    handles = [module.register_forward_hook(lambda m, a, o, name=name: calls.append(name)) for name, module in modules.items()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
