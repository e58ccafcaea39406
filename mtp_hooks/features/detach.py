"""``detach_encoder``, ``detach_between_depths``, ``detach_head``: what the MTP loss may not train.

* ``detach_encoder``: each MTP layer call gets a ``DetachedEmbedding`` (the next-token embeddings
  without a gradient into them) and detached trunk hidden states (depth 1's input; every depth's
  input with ``detach_between_depths``), so the MTP loss trains neither the decoder nor, through
  the MTP layers' input, the embedding (``on_layer_pre``);
* ``detach_head`` (or a config whose release detaches the heads, ``_mcore.config_detaches_heads``):
  the MTP heads multiply by a detached output weight (``mtp_head``);
* ``check``: the one pipeline case mcore's DDP cannot run with ``detach_encoder``, refused at
  ``attach``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.head import Head
from mtp_hooks.models import wrapper_chain
from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import ForwardOnlyProxy


class DetachedEmbedding(ForwardOnlyProxy):
    """An embedding module whose call returns a detached tensor."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.__wrapped__(*args, **kwargs).detach()


def mtp_head(options: Options, config: Any, head: Head) -> Head:
    """The output layer as the MTP heads use it: with a detached weight under ``detach_head`` (or a
    config whose release detaches the heads), else ``head`` itself."""
    return head.detached() if options.detach_head or _mcore.config_detaches_heads(config) else head


def layer_keywords(options: Options) -> tuple[str, ...]:
    """The MTP layers' keyword arguments ``on_layer_pre`` rewrites (checked against the release at ``attach``)."""
    return ("hidden_states", "embedding") if options.detach_encoder else ()


def on_layer_pre(forward: Forward, kwargs: dict[str, Any], between_depths: bool) -> None:
    """An MTP layer call of a training forward: a detached embedding and detached trunk hidden
    states (every depth's input with ``between_depths``)."""
    if kwargs.get("embedding") is not None:
        kwargs["embedding"] = DetachedEmbedding(kwargs["embedding"])
    if forward.mtp_layer_calls == 0 or between_depths:
        # Depth 0: the trunk's hidden states (the block's own chunk 0, the main head's input,
        # stays attached). Later depths, with detach_between_depths: the previous depth's output.
        # requires_grad keeps full activation recompute working on a detached input.
        kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_(True)


def check(model: nn.Module, options: Options) -> None:
    """Refuse, before anything is registered, ``detach_encoder`` where the wrappers ``attach`` was
    given (``model``) cannot run it.

    On a pipeline stage after the first (PP > 1) with untied heads, the stage's copy of the word
    embeddings is kept by mcore for the MTP layers alone, so ``detach_encoder`` leaves it without a
    gradient. mcore's DDP with ``overlap_grad_reduce`` counts the gradients that arrive while grad
    sync is on (the last micro-batch's backward) and, from the second step, asserts that every
    parameter of a bucket got one. Under Megatron's default wiring (``align_grad_reduce``: the
    config's ``grad_sync_func`` is set) the schedules of stages after the first never run a backward
    with grad sync on, so nothing is counted; without it (``no_sync_func`` alone) DDP asserts.
    Refused only where that wiring is visible at ``attach``, under a DDP with ``overlap_grad_reduce``;
    a schedule wired later is DDP's to check.
    """
    chain = wrapper_chain(model)
    language_model = chain[-1]
    if not options.detach_encoder or not _embedding_copy_for_mtp_alone(language_model):
        return
    for wrapper in chain[:-1]:
        if not getattr(getattr(wrapper, "ddp_config", None), "overlap_grad_reduce", False):
            continue
        configs = [c for c in (getattr(wrapper, "config", None), language_model.config) if c is not None]
        if any(getattr(c, "grad_sync_func", None) is not None for c in configs):
            continue  # align_grad_reduce: nothing is counted on this stage
        if not any(getattr(c, "no_sync_func", None) is not None for c in configs):
            continue  # the schedule is not wired yet
        raise MTPHooksError(
            "detach_encoder: on this pipeline stage the word embeddings are a copy the MTP layers alone use, "
            "so detach_encoder leaves it without a gradient, and mcore's DDP with overlap_grad_reduce, whose schedule "
            "counts the last micro-batch's gradients (no grad_sync_func), then asserts from the second step\n"
            "  expected: the config's grad_sync_func set as Megatron's align_grad_reduce=True sets it (the default), "
            "DistributedDataParallelConfig(overlap_grad_reduce=False), or detach_encoder=False on a pipeline stage "
            "after the first\n"
            f"  received: detach_encoder=True under a {type(wrapper).__name__} with overlap_grad_reduce=True, "
            "no_sync_func set "
            "and grad_sync_func None, on a stage without pre_process (pipeline_model_parallel_size > 1)"
        )


def _embedding_copy_for_mtp_alone(language_model: nn.Module) -> bool:
    """Whether the model's word embeddings are the MTP layers' own copy (a stage with the MTP
    layers but without ``pre_process``) that nothing else trains (untied: the main head has its own weight)."""
    if not getattr(language_model, "mtp_process", False) or getattr(language_model, "pre_process", True):
        return False
    if getattr(language_model, "share_embeddings_and_output_weights", False):
        return False
    embedding = getattr(language_model, "embedding", None)
    return embedding is not None and embedding.word_embeddings.weight.requires_grad
