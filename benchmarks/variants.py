"""What each benchmark variant does for one training and one inference micro-batch.

Training micro-batch = forward + main-head loss + backward. The main-head loss is mcore's own
``vocab_parallel_cross_entropy`` everywhere (stock computes it inside the model; the
logits-returning variants call the same function on the returned logits), so differences come
from the MTP work alone. Inference micro-batch = forward under ``torch.no_grad``.

Variants:

* ``stock``: mcore 0.16.1 as shipped. Labels in, per-token loss out. It cannot run without
  labels (``_postprocess`` clones them), so its inference micro-batch runs *with* labels under
  ``no_grad``, which is what stock users do: MTP block, MTP heads and CE all run.
* ``patched``: ``baseline_patch`` (``_postprocess`` replaced on the instance); returns logits.
* ``no_mtp``: the same model built without MTP layers; the floor for inference.
* ``hooks_dense`` / ``hooks_lean``: ``mtp_hooks.attach(model, loss_impl=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

import mtp_hooks
from benchmarks import baseline_patch
from benchmarks.configs import VARIANT_LABELS, Config
from benchmarks.models import Batch


def masked_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def main_loss(logits: Tensor, batch: Batch) -> Tensor:
    """The user's main-head loss from ``[b, s, V]`` logits, with mcore's CE (as stock uses)."""
    return masked_mean(vocab_parallel_cross_entropy(logits, batch.labels), batch.loss_mask)


# ----------------------------------------------------------------------------------- steps


def _stock_train(model: nn.Module, batch: Batch, state: Any) -> None:
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()


def _stock_infer(model: nn.Module, batch: Batch, state: Any) -> Tensor:
    with torch.no_grad():
        return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def _patched_train(model: nn.Module, batch: Batch, state: Any) -> None:
    main_loss(model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch).backward()


def _plain_train(model: nn.Module, batch: Batch, state: Any) -> None:
    main_loss(model(*batch.model_args), batch).backward()


def _plain_infer(model: nn.Module, batch: Batch, state: Any) -> Tensor:
    with torch.no_grad():
        return model(*batch.model_args)


def _hooks_train(model: nn.Module, batch: Batch, hooks: mtp_hooks.MTPHooks) -> None:
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        loss = main_loss(model(*batch.model_args), batch)  # the logits are not kept past the loss, as in stock
    loss.backward()


# ------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running a micro-batch; ``prepare`` returns the state the steps get."""

    name: str
    label: str
    with_mtp: bool
    prepare: Callable[[nn.Module, Config], Any]
    train: Callable[[nn.Module, Batch, Any], None]
    infer: Callable[[nn.Module, Batch, Any], Optional[Tensor]]


def _nothing(model: nn.Module, config: Config) -> None:
    return None


def _patch(model: nn.Module, config: Config) -> None:
    baseline_patch.patch(model)


def _hooks(loss_impl: str) -> Callable[[nn.Module, Config], mtp_hooks.MTPHooks]:
    def prepare(model: nn.Module, config: Config) -> mtp_hooks.MTPHooks:
        return mtp_hooks.attach(model, loss_impl=loss_impl, chunk_size=config.chunk_size)

    return prepare


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("stock", VARIANT_LABELS["stock"], True, _nothing, _stock_train, _stock_infer),
        Variant("patched", VARIANT_LABELS["patched"], True, _patch, _patched_train, _plain_infer),
        Variant("no_mtp", VARIANT_LABELS["no_mtp"], False, _nothing, _plain_train, _plain_infer),
        Variant("hooks_dense", VARIANT_LABELS["hooks_dense"], True, _hooks("dense"), _hooks_train, _plain_infer),
        Variant("hooks_lean", VARIANT_LABELS["hooks_lean"], True, _hooks("lean"), _hooks_train, _plain_infer),
    )
}
assert list(VARIANTS) == list(VARIANT_LABELS)
