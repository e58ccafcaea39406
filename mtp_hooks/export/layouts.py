"""Where an engine's checkpoint keeps each MTP layer: the layouts ``mtp_hf_weights`` writes.

A layout fixes three things per MTP layer i of a model with L decoder layers: the prefix of its
tensors, the names of the four tensors that wrap its transformer layer (mcore's ``enorm``,
``hnorm``, ``eh_proj``, ``final_layernorm``), and the column order of ``eh_proj``. The
transformer layer itself takes the HF decoder-layer names of ``names.py`` under the same prefix.

* ``"deepseek_v3"``: ``model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm}``, ``eh_proj``
  in mcore's order ``cat(enorm(embedding), hnorm(hidden))``. vLLM's ``method="mtp"`` loads it
  for DeepSeek-V3 (``deepseek_mtp``), GLM-4.5 (``glm4_moe_mtp``) and GLM-4.7-Flash
  (``glm4_moe_lite_mtp``), all with ``num_nextn_predict_layers`` = N.
* ``"mimo"``: ``model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm}``; MiMo (HF and vLLM's ``mimo_mtp``) computes ``input_proj(cat(hidden,
  embedding))``, so ``input_proj`` is ``eh_proj`` with its two column halves swapped.
"""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType
from typing import Any, Mapping, Optional

from mtp_hooks.errors import MTPHooksError, bad_argument, describe

__all__ = ["LAYOUTS", "Layout", "layout_named"]


_WRAPPER = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One engine checkpoint layout for MTP layers (see the module docstring)."""

    name: str
    # Names' prefix of MTP layer i: "{n}" is L + i (L: the main model's decoder layers), "{i}" is i.
    prefix: str
    # The layout's names of mcore's wrapper tensors, in ``_WRAPPER``'s order (relative to ``prefix``).
    wrapper_leaves: tuple[str, ...]
    # Whether ``eh_proj``'s halves change places (the engine concatenates (hidden, embedding)).
    swap_input_halves: bool
    # Families of this layout (docs and messages).
    families: str

    @property
    def wrapper(self) -> dict[str, str]:
        """mcore's wrapper tensors (relative to ``mtp.layers.{i}.``) -> the layout's names."""
        return dict(zip(_WRAPPER, self.wrapper_leaves))

    def layer_prefix(self, num_layers: int, index: int) -> str:
        """The names' prefix of MTP layer ``index`` (0-based) of a model with ``num_layers`` decoder layers."""
        return self.prefix.format(i=index, n=num_layers + index)

    def mtp_layer_of(self, hf_name: str, num_layers: int) -> Optional[int]:
        """The MTP layer (0-based) whose range ``hf_name`` falls in, or ``None`` for a main-model name.

        A deepseek_v3 name ``model.layers.{k}.*`` belongs to MTP layer ``k - L`` when ``k >= L``,
        whatever ``k`` (also a layer the model does not have, as a bridge may write it).
        """
        pattern = "^" + re.escape(self.prefix).replace(r"\{n\}", r"(\d+)").replace(r"\{i\}", r"(\d+)")
        found = re.match(pattern, hf_name)
        if found is None:
            return None
        number = int(found.group(1))
        if "{n}" not in self.prefix:
            return number
        return number - num_layers if number >= num_layers else None


LAYOUTS: Mapping[str, Layout] = MappingProxyType({
    layout.name: layout
    for layout in (
        Layout(
            "deepseek_v3",
            "model.layers.{n}.",
            ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"),
            False,
            "DeepSeek-V3, GLM-4.5, GLM-4.7-Flash",
        ),
        Layout(
            "mimo",
            "model.mtp_layers.{i}.",
            ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"),
            True,
            "MiMo",
        ),
    )
})


def layout_named(layout: Any) -> Layout:
    """The ``Layout`` called ``layout`` (a ``Layout`` passes through); ``MTPHooksError`` otherwise."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise bad_argument("layout", f"one of {', '.join(repr(name) for name in LAYOUTS)}", describe(layout))
    return LAYOUTS[layout]


def check_config(config: Any, layout: Layout) -> None:
    """Refuse a model whose MTP layers the layout's engine layer cannot hold, before any tensor moves.

    The engines' decoder layers for these families are RMSNorm, gated (SwiGLU) MLPs; DeepSeek-style
    multi-latent attention normalises its latent queries and keys/values; MiMo's MTP layer is a
    dense Qwen2 layer. What differs in values but not in names (LayerNorm, a zero-centred gamma, an
    ungated MLP, attention without its latent norms) would load and silently compute something else.
    """
    problems = []
    if not getattr(config, "mtp_num_layers", None):
        problems.append(f"mtp_num_layers={getattr(config, 'mtp_num_layers', None)!r} (no MTP layers)")
    if getattr(config, "normalization", None) != "RMSNorm":
        problems.append(f"normalization={getattr(config, 'normalization', None)!r} (the engines' layers use RMSNorm)")
    if getattr(config, "layernorm_zero_centered_gamma", False):
        problems.append("layernorm_zero_centered_gamma=True (the engines' norms scale by the weight itself)")
    if not getattr(config, "gated_linear_unit", False):
        problems.append("gated_linear_unit=False (the engines' MLPs are gated: gate_proj and up_proj)")
    if getattr(config, "attention_output_gate", False):
        problems.append("attention_output_gate=True (no gated attention in these layouts)")
    if getattr(config, "multi_latent_attention", False):
        if layout.name == "mimo":
            problems.append("multi_latent_attention=True (MiMo's MTP layer is a Qwen2 layer)")
        elif not getattr(config, "qk_layernorm", False):
            problems.append("multi_latent_attention without qk_layernorm (DeepSeek-V3 normalises the latent q and kv)")
    if layout.name == "mimo" and getattr(config, "num_moe_experts", None):
        problems.append(f"num_moe_experts={config.num_moe_experts} (MiMo's MTP layer is dense)")
    if problems:
        raise MTPHooksError(
            f"model: its MTP layers do not fit layout {layout.name!r} ({layout.families})\n"
            f"  expected: a config the layout's engine layer computes alike\n"
            f"  received: {'; '.join(problems)}"
        )
