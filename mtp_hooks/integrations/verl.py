"""verl's Megatron engine: ``attach_engine_mtp`` in place of ``patch_engine_mtp``.

verl 0.9.1 wires MTP with ``verl.utils.megatron_utils.patch_engine_mtp(module, model_config)``,
which replaces ``GPTModel._postprocess`` (and, with ``model_config.mtp.detach_encoder``,
``MultiTokenPredictionLayer._get_embeddings``; always ``_checkpointed_forward``) on every model
chunk. ``attach_engine_mtp`` takes the same arguments and gives the same MTP losses and
gradients with ``mtp_hooks.attach`` on every chunk, per installed megatron-core release:

* ``detach_encoder``: the next-token embedding and the trunk's hidden state entering the first
  MTP layer are detached; the hidden states between depths stay attached (``detach_encoder=True``).
* Without ``process_mtp_loss`` (0.14 - 0.16) verl's own loop detaches the output layer's
  parameters for MTP (``detach_head=True``) and, with ``calculate_per_token_loss``, rescales
  depth k by original / rolled token count (``per_token_rescale=True``).
* With it (0.17+) verl delegates to ``process_mtp_loss``: the head trains unless
  ``config.mtp_detach_heads``; with ``calculate_per_token_loss`` the MTP weight is multiplied by
  ``packed_seq_params._verl_mtp_loss_normalization_factor`` when verl's engine set it
  (routed / loss tokens, ``call_loss_scale``).
* Target rolls and the embedding path use ``packed_seq_params.cp_group`` when present (the
  hooks do so for every user).

verl itself is not imported here.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.hooks import MTPHooks, attach
from mtp_hooks.models import find_language_model

# Where verl's engine (``gptmodel_forward_model_engine``) puts its per-micro-batch factor.
NORMALIZATION_FACTOR_ATTR = "_verl_mtp_loss_normalization_factor"

__all__ = ["NORMALIZATION_FACTOR_ATTR", "attach_engine_mtp", "verl_options"]


def verl_options(model_config: Any, config: Any) -> dict[str, Any]:
    """The ``attach`` options that reproduce verl 0.9.1's MTP patch on this megatron-core release.

    ``model_config``: verl's ``HFModelConfig`` (or anything whose ``.mtp.detach_encoder`` is a
    bool); ``config``: the model's ``TransformerConfig``.
    """
    mtp = getattr(model_config, "mtp", None)
    detach_encoder = getattr(mtp, "detach_encoder", None)
    if not isinstance(detach_encoder, bool):
        raise bad_argument("model_config", "verl's model config, whose .mtp (MtpConfig) has a bool detach_encoder", describe(model_config))
    legacy = not _mcore.PER_TOKEN_LOSS_RESCALED  # no process_mtp_loss: verl's own loop
    options: dict[str, Any] = dict(detach_encoder=detach_encoder, detach_head=legacy, per_token_rescale=True)
    if not legacy and getattr(config, "calculate_per_token_loss", False):
        options["call_loss_scale"] = normalization_factor
    return options


def normalization_factor(call: Mapping[str, Any]) -> Optional[float]:
    """verl's routed / loss token factor on this forward's ``packed_seq_params``, or ``None``."""
    factor = getattr(call.get("packed_seq_params"), NORMALIZATION_FACTOR_ATTR, None)
    if factor is not None and not factor > 0:
        raise bad_argument(f"packed_seq_params.{NORMALIZATION_FACTOR_ATTR}", "a factor > 0 (routed / loss tokens)", describe(factor))
    return factor


def attach_engine_mtp(module: Any, model_config: Any, **overrides: Any) -> list[MTPHooks]:
    """``mtp_hooks.attach`` on every model chunk with verl 0.9.1's MTP semantics.

    Args:
        module: a model chunk (``GPTModel`` or a DDP / Float16Module wrapper of one) or a list of
            them (virtual pipeline stages), as verl's ``patch_engine_mtp`` takes.
        model_config: verl's ``HFModelConfig``; ``model_config.mtp`` is its ``MtpConfig``, of which
            only ``detach_encoder`` changes the patch (``mtp_loss_scaling_factor`` reaches the model
            through its ``TransformerConfig``, as in verl).
        overrides: further ``attach`` options (e.g. ``loss_impl="dense"``), or replacements of
            the ones verl's semantics set.

    Returns:
        One ``MTPHooks`` per chunk, in order; ``remove()`` on each restores stock mcore. Chunks
        attached before a refused one are removed again.
    """
    chunks = module if isinstance(module, (list, tuple)) else [module]
    if not chunks or not all(isinstance(chunk, nn.Module) for chunk in chunks):
        raise bad_argument("module", "a model chunk (nn.Module) or a non-empty list of them", describe(module))
    attached: list[MTPHooks] = []
    try:
        for chunk in chunks:
            options = {**verl_options(model_config, find_language_model(chunk).config), **overrides}
            attached.append(attach(chunk, **options))
    except MTPHooksError:
        for hooks in attached:
            hooks.remove()
        raise
    return attached
