"""mcore's names of an MTP layer's tensors -> the HF names of the engine's layer, one table.

An MTP layer's tensors are ``mtp.layers.{i}.{rest}``: the layout's four wrapper tensors
(``layouts.py``) and the transformer layer's, under ``transformer_layer.`` (``mtp_model_layer.``
from mcore 0.17.1). The transformer layer's names come in two spellings, both read here:

* Transformer Engine specs fuse the norms into the next linear layer
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``,
  MLA's ``linear_q_up_proj`` / ``linear_kv_up_proj.layer_norm_weight``) and group the experts'
  weights (``mlp.experts.linear_fc1.weight{e}``);
* local specs keep them apart (``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``,
  ``kv_layernorm``, ``mlp.experts.local_experts.{e}.linear_fc1.weight``).

The HF names are the decoder layer's of DeepSeek-V3 (multi-latent attention), GLM-4.5 / Qwen2
(``q_proj``, ``k_proj``, ``v_proj``, with bias where the model has one) and the MLP of either,
dense or MoE. Expert numbers must be global (``gather.py`` makes them so).

The main model's tensors take the same decoder-layer names under ``model.layers.{n}.`` (n: the
layer's global 0-based number), plus the embedding, the final norm and the head (``main_target``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export.layouts import Layout

__all__ = ["MAIN_TOP", "Target", "hf_target", "main_target", "split_name"]

COPY, GATE_UP, QKV, SWAP_HALVES = "copy", "gate_up", "qkv", "swap_halves"


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one mcore tensor goes: its HF names (full) and how the tensor splits into them."""

    names: tuple[str, ...]
    split: str  # COPY (one name), GATE_UP (gate, up), QKV (q, k, v) or SWAP_HALVES (one name)


def _one(name: str) -> tuple[tuple[str, ...], str]:
    return (name,), COPY


def _gate_up(mlp: str) -> tuple[tuple[str, ...], str]:
    return (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP


_NORMS_AND_MLP: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": _one("input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_weight": _one("input_layernorm.weight"),
    "pre_mlp_layernorm.weight": _one("post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_weight": _one("post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": _gate_up("mlp"),
    "mlp.linear_fc2.weight": _one("mlp.down_proj.weight"),
    "mlp.router.weight": _one("mlp.gate.weight"),
    "mlp.router.expert_bias": _one("mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": _gate_up("mlp.shared_experts"),
    "mlp.shared_experts.linear_fc2.weight": _one("mlp.shared_experts.down_proj.weight"),
}

# Grouped-query attention (GLM-4.5, Qwen2 / MiMo): mcore's fused QKV splits into three.
_ATTENTION: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_qkv.weight": (tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
    "self_attention.linear_qkv.bias": (tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), QKV),
    "self_attention.linear_proj.weight": _one("self_attn.o_proj.weight"),
    "self_attention.q_layernorm.weight": _one("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _one("self_attn.k_norm.weight"),
}

# Multi-latent attention (DeepSeek-V3, GLM-4.7-Flash): one HF tensor per mcore tensor, same layout.
_MLA: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_q_proj.weight": _one("self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": _one("self_attn.q_a_proj.weight"),
    "self_attention.q_layernorm.weight": _one("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.layer_norm_weight": _one("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": _one("self_attn.q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": _one("self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": _one("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": _one("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": _one("self_attn.kv_b_proj.weight"),
    "self_attention.linear_proj.weight": _one("self_attn.o_proj.weight"),
}

# Routed experts, local spec (SequentialMLP) or Transformer Engine's grouped GEMM (TEGroupedMLP).
EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<local>\d+)\.linear_fc(?P<fc>[12])\.weight"
    r"|linear_fc(?P<te_fc>[12])\.weight(?P<te>\d+))$"
)
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[int, str]:
    """``mtp.layers.{i}.{rest}`` -> ``(i, rest)``; ``MTPHooksError`` for a name outside the MTP layers."""
    found = _MTP_NAME.match(name)
    if found is None:
        raise MTPHooksError(
            f"state_dict: {name!r} is not an MTP layer's tensor\n  expected: mtp.layers.{{i}}.*\n  received: {name!r}"
        )
    return int(found.group(1)), found.group(2)


def expert_name(rest: str, expert: int) -> str:
    """An expert tensor's name within the transformer layer, renumbered to ``expert``."""
    found = EXPERT.match(rest)
    assert found is not None, f"not an expert tensor: {rest}"
    if found.group("local") is not None:
        return f"mlp.experts.local_experts.{expert}.linear_fc{found.group('fc')}.weight"
    return f"mlp.experts.linear_fc{found.group('te_fc')}.weight{expert}"


def _body_target(rest: str, config: Any) -> tuple[tuple[str, ...], str]:
    expert = EXPERT.match(rest)
    if expert is not None:
        number = expert.group("local") if expert.group("local") is not None else expert.group("te")
        fc = expert.group("fc") or expert.group("te_fc")
        mlp = f"mlp.experts.{int(number)}"
        return _gate_up(mlp) if fc == "1" else _one(f"{mlp}.down_proj.weight")
    attention = _MLA if getattr(config, "multi_latent_attention", False) else _ATTENTION
    found = _NORMS_AND_MLP.get(rest) or attention.get(rest)
    if found is None:
        raise KeyError(rest)
    return found


def hf_target(name: str, config: Any, layout: Layout) -> Target:
    """The HF names of the MTP tensor ``name`` (``mtp.layers.{i}.*``, global expert numbers).

    Raises ``MTPHooksError`` for a tensor the layout has no name for (a bias on a layer the
    engine's layer has without one, a shared-expert gate, ...), naming it.
    """
    index, rest = split_name(name)
    prefix = layout.layer_prefix(config.num_layers, index)
    if rest in layout.wrapper:
        split = SWAP_HALVES if rest == "eh_proj.weight" and layout.swap_input_halves else COPY
        return Target((prefix + layout.wrapper[rest],), split)
    body, _, inner = rest.partition(".")
    try:
        if body not in _mcore.MTP_LAYER_BODY_NAMES:
            raise KeyError(rest)
        names, split = _body_target(inner, config)
    except KeyError:
        raise MTPHooksError(
            f"model: MTP tensor {name!r} has no name in layout {layout.name!r}\n"
            f"  expected: the tensors of a {layout.families} MTP layer (wrapper {', '.join(layout.wrapper)}; "
            "attention, norms, dense or MoE MLP)\n"
            f"  received: {name!r}"
        ) from None
    return Target(tuple(prefix + n for n in names), split)


# The main model's tensors outside its decoder layers (unsharded mcore names -> HF names).
MAIN_TOP: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_DECODER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def main_target(name: str, config: Any) -> Target:
    """The HF names of the main model's tensor ``name``: one of ``MAIN_TOP``, or a decoder layer's
    ``decoder.layers.{n}.*`` (n global, 0-based; expert numbers global) under ``model.layers.{n}.``.

    Raises ``MTPHooksError`` for a tensor the families' HF model has no name for (learned position
    embeddings, a norm's bias, a bias on ``linear_proj`` or the MLP, ...), naming it.
    """
    if name in MAIN_TOP:
        return Target((MAIN_TOP[name],), COPY)
    found = _DECODER_NAME.match(name)
    try:
        if found is None:
            raise KeyError(name)
        names, split = _body_target(found.group(2), config)
    except KeyError:
        raise MTPHooksError(
            f"model: main-model tensor {name!r} has no HF name\n"
            f"  expected: the embedding, the final norm, the output layer or a decoder layer's tensors "
            "(RMSNorm weights; GQA or MLA attention; dense or MoE gated MLP, no linear biases)\n"
            f"  received: {name!r}"
        ) from None
    return Target(tuple(f"model.layers.{found.group(1)}.{n}" for n in names), split)
