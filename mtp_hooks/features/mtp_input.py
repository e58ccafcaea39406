"""``mtp_input``: which hidden state of the main model MTP layer 1 reads.

``"decoder_output"`` (default): the decoder's output, after its final norm, as mcore trains MTP layer 1 and
vLLM's DeepSeek-V3 and GLM-4.5 drafters read it. ``"pre_final_norm"``: the final norm's input, as vLLM's MiMo
drafter reads the target's hidden state (``mimo.py`` hands the MTP layer the state before the norm). A
pre-hook on the decoder's final norm keeps its input (``keep_norm_input``), and the block's first call of
MTP layer 1 reads it in place of the block's hidden states (``feed_layer``); the block's own chunk 0, which
the main head reads, stays the normed output. The MTP loss then trains the decoder through the state before
the norm, not through the norm (unless ``detach_encoder``). A decoder without a final norm has one state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor, nn

from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward


@dataclasses.dataclass
class BeforeNorm:
    """Per training forward: the decoder's final norm input (``None`` until the norm ran)."""

    hidden: Optional[Tensor] = None


def wanted(options: Options) -> bool:
    return options.mtp_input == "pre_final_norm"


def layer_keywords(options: Options) -> tuple[str, ...]:
    """The MTP layers' keyword arguments ``feed_layer`` rewrites (checked against the release at ``attach``)."""
    return ("hidden_states",) if wanted(options) else ()


def final_norm(model: nn.Module) -> Optional[nn.Module]:
    """The decoder's final norm, or ``None`` (no norm: its output is its input)."""
    return getattr(model.decoder, "final_layernorm", None)


def keep_norm_input(before: BeforeNorm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    before.hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def feed_layer(forward: Forward, before: BeforeNorm, kwargs: dict[str, Any]) -> None:
    """The block's first MTP layer call of a training forward reads the state before the final norm."""
    if forward.mtp_layer_calls == 0 and before.hidden is not None:
        kwargs["hidden_states"] = before.hidden
