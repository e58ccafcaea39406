"""Which models the hooks serve: finding the mcore language model inside a wrapper, and refusing
before anything is registered a model the hooks cannot serve."""

from __future__ import annotations

from typing import Any

from torch import nn

from megatron.core.models.common.language_module.language_module import LanguageModule

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError, bad_argument

_STATE_KEY = "_mtp_hooks"


def find_language_model(model: nn.Module) -> nn.Module:
    """The mcore language model inside ``model`` (itself, ``.module`` chains, ``.language_model``)."""
    return _chain(model)[-1]


def _chain(model: nn.Module) -> list[Any]:
    """``model``, the wrappers inside it and, last, the mcore language model they hold."""
    chain: list[Any] = []
    current: Any = model
    for _ in range(16):
        chain.append(current)
        if isinstance(current, LanguageModule) and hasattr(current, "mtp_process"):
            return chain
        current = getattr(current, "module", None) or getattr(current, "language_model", None)
        if current is None:
            break
    raise bad_argument(
        "model",
        "an mcore GPTModel, a wrapper exposing one as .module (DDP, Float16Module), or a model with .language_model",
        type(model).__name__,
    )


def check_model(language_model: nn.Module) -> None:
    """Refuse a model the hooks cannot serve, before anything is registered."""
    config = language_model.config
    if not getattr(config, "mtp_num_layers", None):
        raise bad_argument("model", "a model with MTP layers (config.mtp_num_layers >= 1)", f"mtp_num_layers={config.mtp_num_layers!r}")
    unsupported = _mcore.unsupported_config(config)
    if unsupported is not None:
        raise MTPHooksError(f"model: mtp_hooks cannot reproduce stock MTP with {unsupported}")
    if _STATE_KEY in language_model.__dict__:
        raise bad_argument(
            "model",
            "a model without mtp_hooks attached (remove() the first hooks before attaching again)",
            f"a {type(language_model).__name__} with mtp_hooks already attached",
        )
    if bool(language_model.post_process) != bool(language_model.mtp_process):
        # A custom pipeline_model_parallel_layout can put the MTP layers on an earlier stage
        # ("mtp_standalone"): their output then travels to the output layer's stage over p2p.
        raise MTPHooksError(
            "model: the MTP layers sit on another pipeline stage than the output layer (custom pipeline layout); "
            "mtp_hooks needs them on the same stage, the last one (the default without a layout)"
        )


def check_wrappers(model: nn.Module, detach_encoder: bool) -> None:
    """Refuse, before anything is registered, options the wrappers ``attach`` was given cannot run.

    ``detach_encoder`` on a pipeline stage after the first (PP > 1): the stage's copy of the word
    embeddings, which mcore keeps there for the MTP layers alone (untied heads), then gets no
    gradient at all. mcore's DDP with ``overlap_grad_reduce`` counts the gradients that arrive while
    grad sync is on (the last micro-batch's backward) and, from the second step, asserts that every
    parameter of a bucket got one. Under Megatron's default wiring (``align_grad_reduce``: the
    config's ``grad_sync_func`` is set) the schedules of stages after the first never run a backward
    with grad sync on (they launch the reduction themselves), so nothing is counted and nothing
    asserts; without it (``no_sync_func`` alone) the last micro-batch's backward counts and DDP
    asserts. ``use_distributed_optimizer`` changes neither. Refused only where that wiring is
    visible at ``attach`` (a config with ``no_sync_func`` and no ``grad_sync_func``) under a DDP
    (``model`` is or wraps it) with ``overlap_grad_reduce``; a schedule wired later is DDP's to check.
    """
    chain = _chain(model)
    language_model = chain[-1]
    if not detach_encoder or not _embedding_copy_for_mtp_alone(language_model):
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
            "DistributedDataParallelConfig(overlap_grad_reduce=False), or detach_encoder=False on a pipeline stage after the first\n"
            f"  received: detach_encoder=True under a {type(wrapper).__name__} with overlap_grad_reduce=True, no_sync_func set "
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
