"""What the MTP layers read: ``mtp_input`` (layer 1, of the main model) and ``draft_recycle`` (step j + 1, of step j).

``mtp_input="decoder_output"`` (default): the decoder's output, after its final norm, as mcore trains MTP layer 1 and
vLLM's DeepSeek-V3 and GLM-4.5 drafters read it. ``"pre_final_norm"``: the final norm's input, as vLLM's MiMo
drafter reads the target's hidden state (``mimo.py`` hands the MTP layer the state before the norm). A
pre-hook on the decoder's final norm keeps its input (``keep_norm_input``), and the block's first call of
MTP layer 1 reads it in place of the block's hidden states (``on_layer_pre``); the block's own chunk 0, which
the main head reads, stays the normed output. The MTP loss then trains the decoder through the state before
the norm, not through the norm (unless ``detach_encoder``). A decoder without a final norm has one state.

``draft_recycle="normed"`` (default): step j + 1 reads step j's output after the MTP layer's final norm, as mcore's
block hands it on. ``"unnormed"``: the norm's input, as vLLM 0.32 / 0.33's GLM-4.5 drafter hands step 2 the layer's
hidden state before its final norm; a pre-hook on each step layer's final norm keeps the input of its last call, and
every later step-layer call reads it. The head (and an own draft, chosen from the head's logits) reads the normed one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward


@dataclasses.dataclass
class BeforeNorm:
    """Per training forward: the decoder's final norm input (``hidden``) and the last step layer call's final norm
    input (``step``); ``None`` until the norm ran."""

    hidden: Optional[Tensor] = None
    step: Optional[Tensor] = None


def wanted(options: Options) -> bool:
    return options.mtp_input == "pre_final_norm"


def recycles_unnormed(options: Options) -> bool:
    return options.draft_recycle == "unnormed"


def layer_keywords(options: Options) -> tuple[str, ...]:
    """The MTP layers' keyword arguments ``on_layer_pre`` rewrites (checked against the release at ``attach``)."""
    return ("hidden_states",) if wanted(options) or recycles_unnormed(options) else ()


def norms(options: Options, model: nn.Module, step_layers: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
    """The norms whose input the options read, each with the ``BeforeNorm`` field that keeps it."""
    found = []
    norm = final_norm(model)
    if wanted(options) and norm is not None and model.post_process:
        found.append((norm, "hidden"))
    if recycles_unnormed(options):
        found.extend((layer.final_layernorm, "step") for layer in step_layers)
    return found


def final_norm(model: nn.Module) -> Optional[nn.Module]:
    """The decoder's final norm, or ``None`` (no norm: its output is its input)."""
    return getattr(model.decoder, "final_layernorm", None)


def keep_norm_input(before: BeforeNorm, field: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    setattr(before, field, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])


def on_layer_pre(options: Options, forward: Forward, before: BeforeNorm, kwargs: dict[str, Any]) -> None:
    """The block's first MTP layer call of a training forward reads the state before the decoder's final norm
    (``mtp_input``); each later one the previous step's output before its final norm (``draft_recycle``)."""
    if forward.mtp_layer_calls == 0:
        if wanted(options) and before.hidden is not None:
            kwargs["hidden_states"] = before.hidden
    elif recycles_unnormed(options) and before.step is not None:
        kwargs["hidden_states"] = before.step
