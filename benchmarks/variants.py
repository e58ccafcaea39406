"""What each benchmark variant does for one training and one inference micro-batch.

Training micro-batch = forward + main-head loss + backward. The main-head loss is mcore's own
``vocab_parallel_cross_entropy`` everywhere (stock computes it inside the model; the
logits-returning variants call the same function on the returned logits), so differences come
from the MTP work alone. Inference micro-batch = forward under ``torch.no_grad``.

Variants:

* ``stock``: mcore as shipped. Labels in, per-token loss out. It cannot run without labels
  (``_postprocess`` clones them), so its inference micro-batch runs *with* labels under
  ``no_grad``, which is what stock users do: MTP block, MTP heads and CE all run.
* ``verl``: verl 0.9.1's MTP patch (``verl_baseline``), run as verl's engine runs it: labels and
  loss mask passed to every forward, its ``no_grad`` log-prob passes included; returns logits.
  Skipped, with the reason, where verl is not importable.
* ``no_mtp``: the same model built without MTP layers; the floor for inference.
* ``hooks_<loss_impl>``: ``mtp_hooks.attach(model, loss_impl=...)``, one per value of
  ``HOOKS_LOSS_IMPLS``; ``hooks_lean_detach_head`` adds ``detach_head=True``.
* ``hooks_chain_k3`` / ``hooks_chain_k4_sample``: the draft chain, ``draft_steps`` = N + 1 (teacher-forced)
  and N + 2 with every step after the first fed its own sampled draft (``CHAIN_VARIANTS``).
* ``trainer_logits`` / ``trainer_logprobs``: an RL trainer's own loss, a policy gradient with an entropy
  bonus from per-token log-probs and entropies: from the returned logits (``log_softmax`` in fp32,
  ``gather``, entropy), or from ``output="logprobs", entropy=True``. Their inference micro-batch is the
  old-policy pass: the same log-probs under ``no_grad``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

import mtp_hooks
from benchmarks import verl_baseline
from benchmarks.configs import Config
from benchmarks.models import Batch

# ``loss_impl`` values benchmarked, each as variant ``hooks_<value>``. "lean" is the library's
# automatic choice (the default); a value the installed library refuses is skipped with its reason.
HOOKS_LOSS_IMPLS: tuple[str, ...] = ("lean", "recompute", "dense")
DEFAULT_HOOKS = "hooks_lean"  # the variant the goals are stated for: attach(model) as users call it
DETACH_HEAD = "hooks_lean_detach_head"
# The draft chain (``mtp_hooks.chain``) past the base shape's N = 2 layers: one teacher-forced step
# more, and two more fed their own sampled drafts (each such step adds one no-grad head matmul).
CHAIN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hooks_chain_k3": ("mtp_hooks lean, draft_steps=3", {"draft_steps": 3}),
    "hooks_chain_k4_sample": ("mtp_hooks lean, draft_steps=4, sampled drafts", {"draft_steps": 4, "draft_inputs": "sample"}),
}


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


def _labelled_train(model: nn.Module, batch: Batch, state: Any) -> None:
    """verl's engine: labels and loss mask into the forward, logits back, the user's loss on them."""
    main_loss(model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch).backward()


def _labelled_infer(model: nn.Module, batch: Batch, state: Any) -> None:
    """verl's engine also passes labels to its ``no_grad`` log-prob passes."""
    with torch.no_grad():
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def _plain_train(model: nn.Module, batch: Batch, state: Any) -> None:
    main_loss(model(*batch.model_args), batch).backward()


def _plain_infer(model: nn.Module, batch: Batch, state: Any) -> None:
    with torch.no_grad():
        model(*batch.model_args)


def _hooks_train(model: nn.Module, batch: Batch, hooks: mtp_hooks.MTPHooks) -> None:
    with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        loss = main_loss(model(*batch.model_args), batch)  # the logits are not kept past the loss, as in stock
    loss.backward()


ENTROPY_BONUS = 0.01


@dataclasses.dataclass
class TrainerState:
    hooks: mtp_hooks.MTPHooks
    advantages: Tensor


def _token_logprobs(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """What a trainer computes from ``[b, s, V]`` logits: the labels' log-probs and the entropy."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _policy_loss(logprobs: Tensor, entropy: Tensor, batch: Batch, advantages: Tensor) -> Tensor:
    return -masked_mean(advantages * logprobs + ENTROPY_BONUS * entropy, batch.loss_mask)


def _trainer_logits_train(model: nn.Module, batch: Batch, state: TrainerState) -> None:
    with state.hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
        logits = model(*batch.model_args)
    logprobs, entropy = _token_logprobs(logits, batch.labels)
    del logits  # as a trainer's loss function: only the graph keeps it
    _policy_loss(logprobs, entropy, batch, state.advantages).backward()


def _trainer_logits_infer(model: nn.Module, batch: Batch, state: TrainerState) -> None:
    with torch.no_grad():
        _token_logprobs(model(*batch.model_args), batch.labels)


def _trainer_logprobs_train(model: nn.Module, batch: Batch, state: TrainerState) -> None:
    out = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    _policy_loss(out.logprobs, out.entropy, batch, state.advantages).backward()


def _trainer_logprobs_infer(model: nn.Module, batch: Batch, state: TrainerState) -> None:
    with torch.no_grad():
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


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


def _verl(model: nn.Module, config: Config) -> None:
    verl_baseline.patch(model)  # raises verl_baseline.Unavailable where verl cannot be imported


def _trainer(**options: Any) -> Callable[[nn.Module, Config], TrainerState]:
    def prepare(model: nn.Module, config: Config) -> TrainerState:
        hooks = mtp_hooks.attach(model, chunk_size=config.chunk_size, **options)
        first = next(model.parameters())
        gen = torch.Generator().manual_seed(1)
        shape = (config.base.batch, model.max_sequence_length)
        return TrainerState(hooks, torch.randn(shape, generator=gen).to(first.device))

    return prepare


def _hooks(**options: Any) -> Callable[[nn.Module, Config], mtp_hooks.MTPHooks]:
    def prepare(model: nn.Module, config: Config) -> mtp_hooks.MTPHooks:
        return mtp_hooks.attach(model, chunk_size=config.chunk_size, **options)

    return prepare


def _hooks_variant(name: str, label: str, **options: Any) -> Variant:
    return Variant(name, label, True, _hooks(**options), _hooks_train, _plain_infer, hooks_options=options)


def loss_path(state: Any) -> Optional[str]:
    """Which loss path the last hooks forward took, where the library reports it (else ``None``)."""
    if isinstance(state, TrainerState):
        state = state.hooks
    if not isinstance(state, mtp_hooks.MTPHooks):
        return None
    path = getattr(state, "loss_path", None)
    return None if path is None else str(path)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("stock", "stock mcore", True, _nothing, _stock_train, _stock_infer),
        Variant("verl", f"verl {verl_baseline.VERL_VERSION} patch", True, _verl, _labelled_train, _labelled_infer),
        Variant("no_mtp", "no MTP layers", False, _nothing, _plain_train, _plain_infer),
        *(_hooks_variant(f"hooks_{impl}", f"mtp_hooks {impl}", loss_impl=impl) for impl in HOOKS_LOSS_IMPLS),
        _hooks_variant(DETACH_HEAD, "mtp_hooks lean + detach_head", loss_impl="lean", detach_head=True),
        *(_hooks_variant(name, label, loss_impl="lean", **options) for name, (label, options) in CHAIN_VARIANTS.items()),
        Variant("trainer_logits", "trainer loss on logits", True, _trainer(output="logits"),
                _trainer_logits_train, _trainer_logits_infer),
        Variant("trainer_logprobs", 'trainer loss on output="logprobs"', True, _trainer(output="logprobs", entropy=True),
                _trainer_logprobs_train, _trainer_logprobs_infer),
    )
}
TRAINER_VARIANTS: tuple[str, ...] = ("trainer_logits", "trainer_logprobs")
