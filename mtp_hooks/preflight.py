"""``attach``'s one check phase: everything ``attach`` refuses, refused before anything is built or
registered on the model, so a refused ``attach`` leaves no trace.

In this order: the model (an mcore language model with MTP layers, no hooks attached yet, MTP
layers on the output layer's stage), the options against its config, then what each option needs
of the model and its release, each option's own ``check(model, options)`` (``features``: the
protocol) among the checks of the output layer and of the release's call conventions. A new option
with an attach-time check adds one line here.
"""

from __future__ import annotations

from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.features import chain, detach, layer_keywords
from mtp_hooks.head import check_bias_free
from mtp_hooks.models import check_model, find_language_model
from mtp_hooks.options import Options


def check(model: nn.Module, options: Options) -> nn.Module:
    """Refuse what ``attach(model, **options)`` cannot serve (``MTPHooksError``); return the language model.

    ``model``: as ``attach`` was given it (a wrapper such as DDP, or the language model itself).
    """
    language_model = find_language_model(model)
    check_model(language_model)
    options.check_config(language_model.config)
    detach.check(model, options)
    check_bias_free(language_model)
    _mcore.check_call_conventions(language_model, layer_keywords(options))
    chain.check(model, options)
    return language_model
