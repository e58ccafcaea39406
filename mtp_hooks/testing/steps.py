"""One micro-batch through a stock mcore model and through a hooked twin, and the comparison of the two.

Stock mcore is the reference: called with ``labels`` it returns the per-token main loss and adds
its MTP loss itself (per-depth values land in mcore's MTP tracker). A model under ``mtp_hooks``
returns logits; the user computes the same masked-mean cross-entropy from them. After one step
of each, ``assert_same_grads`` compares every parameter's gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Batch",
    "assert_same_grads",
    "grads_of",
    "hooked_train_step",
    "main_ce_from_logits",
    "make_batch",
    "masked_mean",
    "stock_mtp_losses",
    "stock_train_step",
    "tracked_mtp_losses",
]


@dataclasses.dataclass
class Batch:
    """One micro-batch: ``[b, s]`` token ids, positions, next-token labels and loss mask."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Optional[Tensor]

    @property
    def model_args(self) -> tuple[Tensor, Tensor, None]:
        """``(input_ids, position_ids, attention_mask=None)``: the positional arguments of ``GPTModel``."""
        return (self.input_ids, self.position_ids, None)


def make_batch(vocab_size: int, batch: int = 2, seq: int = 8, mask: str = "random", seed: int = 0) -> Batch:
    """A deterministic batch; ``mask`` is ``"random"``, ``"ones"``, ``"zeros"``, ``"last"`` or ``"none"``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    labels = torch.roll(ids, -1, 1)
    loss_mask: Optional[Tensor]
    if mask == "random":
        loss_mask = (torch.rand(batch, seq, generator=gen) > 0.3).float()
    elif mask == "ones":
        loss_mask = torch.ones(batch, seq)
    elif mask == "zeros":
        loss_mask = torch.zeros(batch, seq)
    elif mask == "last":
        loss_mask = torch.zeros(batch, seq)
        loss_mask[:, -1] = 1
    elif mask == "none":
        loss_mask = None
    else:
        raise ValueError(f"mask: expected 'random', 'ones', 'zeros', 'last' or 'none', received {mask!r}")
    return Batch(ids, positions, labels, loss_mask)


def masked_mean(per_token: Tensor, loss_mask: Optional[Tensor]) -> Tensor:
    """The user's main-head loss: masked mean of a ``[b, s]`` per-token loss."""
    if loss_mask is None:
        return per_token.mean()
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def main_ce_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token CE ``[b, s]`` of the main head from (gathered, TP=1) ``[b, s, V]`` logits."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)


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


def stock_train_step(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Stock mcore: labels in, per-token loss out; backward of the masked mean. Returns the loss.

    Empties mcore's MTP tracker first, so that it then holds this step's losses only (hooked
    models record into the same process-wide tracker).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    return loss.detach()


def hooked_train_step(model: torch.nn.Module, hooks: Any, batch: Batch) -> Tensor:
    """With ``mtp_hooks``: logits out under ``micro_batch``; backward of the same masked mean. Returns logits."""
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return logits.detach()


def grads_of(model: torch.nn.Module) -> dict[str, Optional[Tensor]]:
    """A copy of every parameter's ``.grad`` (``None`` where it has none), by parameter name."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_same_grads(actual: torch.nn.Module, expected: torch.nn.Module, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Every parameter's gradient of ``actual`` equals ``expected``'s (None matches None or zeros)."""
    expected_grads = grads_of(expected)
    for name, grad in grads_of(actual).items():
        ref = expected_grads[name]
        if ref is None or grad is None:
            other = grad if ref is None else ref
            assert other is None or not other.any(), f"{name}: one gradient is None, the other is not zero"
            continue
        torch.testing.assert_close(grad, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
