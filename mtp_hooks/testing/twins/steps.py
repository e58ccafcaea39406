"""One training micro-batch through a stock mcore model, and through a hooked twin.

Stock mcore is the reference: called with ``labels`` it returns the per-token main loss and adds
its MTP loss itself (per-depth values land in mcore's process-wide MTP tracker); its main logits
are recorded on the way (``output_layer_calls``). A model under ``mtp_hooks`` returns logits,
its labels given through ``hooks.micro_batch`` or as ``labels=`` keywords; the user computes the
same masked-mean cross-entropy from them. Both steps run the backward of that loss.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, NamedTuple, Optional

from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing.twins.batches import Batch, main_ce_from_logits, masked_mean

__all__ = [
    "PATHS",
    "StockRun",
    "hooked_forward",
    "hooked_train_step",
    "output_layer_calls",
    "stock_main_only_step",
    "stock_mtp_losses",
    "stock_train_step",
    "tracked_mtp_losses",
]

PATHS = ("context", "kwargs")


class StockRun(NamedTuple):
    """What a stock training micro-batch produced: its loss, main logits ``[b, s, V]`` and per-depth MTP losses."""

    loss: Tensor
    logits: Tensor
    mtp_losses: list[float]


def tracked_mtp_losses() -> Optional[Tensor]:
    """The per-depth MTP loss sums in stock mcore's tracker (``None`` before any), left in place.

    The tracker key is ``"values"`` up to 0.18 and ``"loss_values"`` from 0.19 (which also
    records acceptance counts under other keys).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return tracker.get("loss_values", tracker.get("values"))


def stock_mtp_losses() -> list[float]:
    """Per-depth MTP losses stock mcore recorded in its tracker (then clears it). Syncs with the host."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = tracked_mtp_losses()
    out = [] if values is None else values.tolist()
    MTPLossLoggingHelper.tracker.clear()
    return out


@contextlib.contextmanager
def output_layer_calls(model: nn.Module, keep_graph: bool = False) -> Iterator[list[Tensor]]:
    """Record every ``output_layer`` output (``[s, b, V]`` logits, detached clones) while the context is open.

    In a stock training forward the calls are depth 1 .. N of MTP, then the main head.
    Recorded by a profile function, not a module hook: a hook on the output layer would itself
    change what the hooks do (they send an output layer carrying foreign hooks down the dense path).
    ``keep_graph``: clones that keep their graph, so a loss on them backpropagates through the model.
    """
    calls: list[Tensor] = []
    layer = model.output_layer
    forward_code = type(layer).forward.__code__
    previous = sys.getprofile()

    def profile(frame: Any, event: str, value: Any) -> None:
        if (
            event == "return"
            and frame.f_code is forward_code
            and frame.f_locals.get("self") is layer
            and value is not None
        ):
            calls.append(value[0].clone() if keep_graph else value[0].detach().clone())
        if previous is not None:  # an enclosing recorder (of another model) keeps recording
            previous(frame, event, value)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def _language_model(model: nn.Module) -> nn.Module:
    """The language model inside DDP-style (``.module``) or multimodal-style (``.language_model``) wrappers."""
    while not hasattr(model, "output_layer"):
        model = getattr(model, "module", None) or model.language_model
    return model


def stock_train_step(model: nn.Module, batch: Batch) -> StockRun:
    """Stock mcore: labels in, per-token loss out; backward of the masked mean.

    Empties mcore's MTP tracker first, so that the losses returned are this step's alone (hooked
    models record into the same process-wide tracker); the tracker then keeps them, as after a
    stock step in a training loop. ``model`` may be wrapped (``.module``, ``.language_model``).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    with output_layer_calls(_language_model(model)) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    tracked = tracked_mtp_losses()
    return StockRun(loss.detach(), calls[-1].transpose(0, 1), [] if tracked is None else tracked.tolist())


def stock_main_only_step(model: nn.Module, batch: Batch) -> Tensor:
    """Stock mcore with the MTP loss weighted 0 (and all-ones MTP mask, so no 0/0): main-head gradients only.

    The reference for the trunk's gradients where the hooks keep the MTP loss off the trunk
    (``detach_encoder``). Returns the loss.
    """
    factor = model.config.mtp_loss_scaling_factor
    model.config.mtp_loss_scaling_factor = 0.0
    try:
        per_token = model(*batch.model_args, labels=batch.labels)
    finally:
        model.config.mtp_loss_scaling_factor = factor
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    return loss.detach()


def hooked_forward(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, path: str = "context") -> Tensor:
    """One hooked training forward, labels through the ``micro_batch`` context or the ``labels=`` keywords."""
    if path == "context":
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            return model(*batch.model_args)
    if path != "kwargs":
        raise AssertionError(f"path: expected one of {PATHS}, received {path!r}")
    return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def hooked_train_step(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch, path: str = "context") -> Tensor:
    """With ``mtp_hooks``: logits out (``hooked_forward``); backward of the same masked mean. Returns the logits."""
    logits = hooked_forward(model, hooks, batch, path)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return logits.detach()
