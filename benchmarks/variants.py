"""What each benchmark variant does for one training and one inference micro-batch.

Training micro-batch = forward + main-head loss + backward. The main-head loss is mcore's own
``vocab_parallel_cross_entropy`` everywhere (stock computes it inside the model; the
logits-returning variants call the same function on the returned logits), so differences come
from the MTP work alone. Inference micro-batch = forward under ``torch.no_grad``.

Variants:

* ``stock``: mcore as shipped. Labels in, per-token loss out. It cannot run without labels
  (``_postprocess`` clones them), so its inference micro-batch runs *with* labels under
  ``no_grad``, which is what stock users do: MTP block, MTP heads and CE all run.
* ``patched``: ``baseline_patch`` (``_postprocess`` replaced on the instance); returns logits.
* ``no_mtp``: the same model built without MTP layers; the floor for inference.
* ``hooks_<loss_impl>``: ``mtp_hooks.attach(model, loss_impl=...)``, one per value of
  ``HOOKS_LOSS_IMPLS``; ``hooks_lean_detach_head`` adds ``detach_head=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

import mtp_hooks
from benchmarks import baseline_patch
from benchmarks.configs import Config
from benchmarks.models import Batch

# ``loss_impl`` values benchmarked, each as variant ``hooks_<value>``. "lean" is the library's
# automatic choice (the default); a value the installed library refuses is skipped with its reason.
HOOKS_LOSS_IMPLS: tuple[str, ...] = ("lean", "recompute", "dense")
DEFAULT_HOOKS = "hooks_lean"  # the variant the goals are stated for: attach(model) as users call it
DETACH_HEAD = "hooks_lean_detach_head"


def masked_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def main_loss(logits: Tensor, batch: Batch) -> Tensor:
    """The user's main-head loss from ``[b, s, V]`` logits, with mcore's CE (as stock uses)."""
    return masked_mean(vocab_parallel_cross_entropy(logits, batch.labels), batch.loss_mask)


# ----------------------------------------------------------------------------------- steps


def _stock_train(model: nn.Module, batch: Batch, state: Any) -> None:
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()


def _stock_infer(model: nn.Module, batch: Batch, state: Any) -> None:
    with torch.no_grad():
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def _patched_train(model: nn.Module, batch: Batch, state: Any) -> None:
    main_loss(model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch).backward()


def _plain_train(model: nn.Module, batch: Batch, state: Any) -> None:
    main_loss(model(*batch.model_args), batch).backward()


def _plain_infer(model: nn.Module, batch: Batch, state: Any) -> None:
    with torch.no_grad():
        model(*batch.model_args)


def _hooks_train(model: nn.Module, batch: Batch, hooks: mtp_hooks.MTPHooks) -> None:
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        loss = main_loss(model(*batch.model_args), batch)  # the logits are not kept past the loss, as in stock
    loss.backward()


# ------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running a micro-batch; ``prepare`` returns the state the steps get.

    ``prepare`` raising ``mtp_hooks.MTPHooksError`` means the installed library refuses the
    variant's options: the benchmark skips it and says why.
    """

    name: str
    label: str
    with_mtp: bool
    prepare: Callable[[nn.Module, Config], Any]
    train: Callable[[nn.Module, Batch, Any], None]
    infer: Callable[[nn.Module, Batch, Any], None]
    hooks_options: Optional[dict[str, Any]] = None  # attach() keywords, for hooks variants


def _nothing(model: nn.Module, config: Config) -> None:
    return None


def _patch(model: nn.Module, config: Config) -> None:
    baseline_patch.patch(model)


def _hooks(**options: Any) -> Callable[[nn.Module, Config], mtp_hooks.MTPHooks]:
    def prepare(model: nn.Module, config: Config) -> mtp_hooks.MTPHooks:
        return mtp_hooks.attach(model, chunk_size=config.chunk_size, **options)

    return prepare


def _hooks_variant(name: str, label: str, **options: Any) -> Variant:
    return Variant(name, label, True, _hooks(**options), _hooks_train, _plain_infer, hooks_options=options)


def loss_path(state: Any) -> Optional[str]:
    """Which loss path the last hooks forward took, where the library reports it (else ``None``)."""
    if not isinstance(state, mtp_hooks.MTPHooks):
        return None
    path = getattr(state, "loss_path", None)
    return None if path is None else str(path)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("stock", "stock mcore", True, _nothing, _stock_train, _stock_infer),
        Variant("patched", "instance patch", True, _patch, _patched_train, _plain_infer),
        Variant("no_mtp", "no MTP layers", False, _nothing, _plain_train, _plain_infer),
        *(_hooks_variant(f"hooks_{impl}", f"mtp_hooks {impl}", loss_impl=impl) for impl in HOOKS_LOSS_IMPLS),
        _hooks_variant(DETACH_HEAD, "mtp_hooks lean + detach_head", loss_impl="lean", detach_head=True),
    )
}
