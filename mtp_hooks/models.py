"""Which models the hooks serve: finding the mcore language model inside a wrapper, and refusing
before anything is registered a model the hooks cannot serve; ``mtp_layer_body``, an MTP layer's transformer
layer under any release's name. ``STATE_KEY`` is where ``attach`` keeps the handle in the language model's
``__dict__``."""

from __future__ import annotations

from typing import Any

from torch import nn

from mtp_hooks._quiet import megatron_notices_silenced

with megatron_notices_silenced():  # the module's first megatron-core import, when imported on its own
    from megatron.core.models.common.language_module.language_module import LanguageModule

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError, bad_argument

STATE_KEY = "_mtp_hooks"


def find_language_model(model: nn.Module) -> nn.Module:
    """The mcore language model inside ``model`` (itself, ``.module`` chains, ``.language_model``)."""
    return wrapper_chain(model)[-1]


def wrapper_chain(model: nn.Module) -> list[Any]:
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


def mtp_layer_body(layer: nn.Module) -> nn.Module:
    """The transformer layer inside an MTP layer (a ``MultiTokenPredictionLayer``), under the name the installed
    release gives it (``transformer_layer``, ``mtp_model_layer``): what code outside the hooks hooks or calls."""
    return getattr(layer, _mcore.mtp_layer_body_name(layer))


def check_model(language_model: nn.Module) -> None:
    """Refuse a model the hooks cannot serve, before anything is registered."""
    config = language_model.config
    if not getattr(config, "mtp_num_layers", None):
        raise bad_argument(
            "model", "a model with MTP layers (config.mtp_num_layers >= 1)", f"mtp_num_layers={config.mtp_num_layers!r}"
        )
    unsupported = _mcore.unsupported_config(config)
    if unsupported is not None:
        raise MTPHooksError(f"model: mtp_hooks cannot reproduce stock MTP with {unsupported}")
    if STATE_KEY in language_model.__dict__:
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

