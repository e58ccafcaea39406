"""``hf_config``: the ``config.json`` of an mcore model written as one of the engines' HF families.

vLLM picks the model class by ``architectures`` and builds it from the config's sizes; ``method="mtp"``
then resolves to the family's drafter. Three families, each with its layout (``FAMILIES``):

* ``"deepseek_v3"``: ``DeepseekV3ForCausalLM`` (``deepseek_mtp``): multi-latent attention, MoE with a
  sigmoid router and expert bias (``topk_method="noaux_tc"``), the first k layers dense;
* ``"glm4_moe"``: ``Glm4MoeForCausalLM`` (``glm4_moe_mtp``): the same MoE with grouped-query attention;
* ``"mimo"``: ``MiMoForCausalLM`` (``mimo_mtp``): dense Qwen2 layers (GQA with a QKV bias).

Every value comes from the model: sizes, heads, layers and MTP layers, norm epsilon, RoPE (base,
partial rotary share, DeepSeek's YaRN scaling), MLA's ranks and head dims, MoE's experts, top-k,
shared experts, groups, scaling and dense prefix; vocabulary, maximum positions and tying from the
``GPTModel``. What a config cannot express, or an engine would compute otherwise, is refused.
``bos_token_id`` / ``eos_token_id`` are the tokenizer's (``None`` here). Overrides replace or add keys.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Union

import torch
from torch import nn

from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.export.family_checks import dense_prefix, refusals
from mtp_hooks.export.layouts import check_config, layout_named
from mtp_hooks.models import find_language_model

__all__ = ["FAMILIES", "hf_config"]

# family -> the layout its checkpoint keeps the MTP layers in
FAMILIES: Mapping[str, str] = MappingProxyType(
    {"deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "mimo": "mimo"}
)

_ARCHITECTURES = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "glm4_moe": ("Glm4MoeForCausalLM", "glm4_moe"),
    "mimo": ("MiMoForCausalLM", "qwen2"),
}

# What only the GPTModel knows: given as overrides when ``model`` is a bare TransformerConfig.
_MODEL_KEYS = ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta", "partial_rotary_factor")


def _model_facts(model: Any, family: str, overrides: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(TransformerConfig, the model-level values) of a GPTModel (or wrapper, or chunk list) or of a
    bare config whose model-level values are all in ``overrides``."""
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        model = model[0]
    if isinstance(model, nn.Module):
        language_model = find_language_model(model)
        config = language_model.config
        facts = dict(
            position_embedding_type=language_model.position_embedding_type,
            vocab_size=int(language_model.vocab_size),
            max_position_embeddings=int(language_model.max_sequence_length),
            tie_word_embeddings=bool(language_model.share_embeddings_and_output_weights),
            rope_theta=float(getattr(language_model, "rotary_base", None) or getattr(config, "rotary_base", 10000)),
            partial_rotary_factor=float(getattr(language_model, "rotary_percent", 1.0)),
        )
        return config, facts
    if not hasattr(model, "hidden_size") or not hasattr(model, "num_layers"):
        expected = "an mcore GPTModel (or a wrapper, or a stage's chunks), or its TransformerConfig"
        raise bad_argument("model", expected, describe(model))
    unneeded = {"rope_theta"} if getattr(model, "multi_latent_attention", False) else set()
    if family != "glm4_moe":
        unneeded.add("partial_rotary_factor")
    needed = [key for key in _MODEL_KEYS if key not in overrides and key not in unneeded]
    if needed:
        expected = f"with a bare TransformerConfig, the model-level values {', '.join(needed)} as keyword arguments"
        raise bad_argument("overrides", expected, f"only {sorted(overrides) or 'none'}")
    return model, {"rope_theta": float(getattr(model, "rotary_base", 10000)), "partial_rotary_factor": 1.0}


def _moe(config: Any) -> dict[str, Any]:
    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    topk = config.moe_router_topk
    return dict(
        intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        n_shared_experts=shared // config.moe_ffn_hidden_size if shared else None,
        n_routed_experts=config.num_moe_experts,
        num_experts_per_tok=topk,
        n_group=getattr(config, "moe_router_num_groups", None) or 1,
        topk_group=getattr(config, "moe_router_group_topk", None) or 1,
        first_k_dense_replace=dense_prefix(config),
        routed_scaling_factor=float(getattr(config, "moe_router_topk_scaling_factor", None) or 1.0),
        norm_topk_prob=topk > 1,  # mcore's sigmoid router normalises the top-k probabilities only for k > 1
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def _mla(config: Any) -> dict[str, Any]:
    found = dict(
        num_key_value_heads=config.num_attention_heads,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.qk_pos_emb_head_dim,
        qk_nope_head_dim=config.qk_head_dim,
        v_head_dim=config.v_head_dim,
        rope_theta=float(config.rotary_base),
    )
    if getattr(config, "rope_type", "rope") == "yarn":
        found["rope_scaling"] = dict(
            type="yarn",
            factor=float(config.rotary_scaling_factor),
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=float(config.beta_fast),
            beta_slow=float(config.beta_slow),
            mscale=float(config.mscale),
            mscale_all_dim=float(config.mscale_all_dim),
        )
    return found


def hf_config(
    model: Any, family: str, *, dtype: Union[torch.dtype, str] = torch.bfloat16, **overrides: Any
) -> dict[str, Any]:
    """The HF ``config.json`` (a dict) of ``model`` written as ``family``, derived from its mcore config.

    Args:
        model: the mcore ``GPTModel`` (or a wrapper, or a stage's chunk list), or its ``TransformerConfig``
            (then pass what only the model knows: ``vocab_size``, ``max_position_embeddings``,
            ``tie_word_embeddings``, ``rope_theta`` without MLA, ``partial_rotary_factor`` for
            ``"glm4_moe"``).
        family: ``"deepseek_v3"``, ``"glm4_moe"`` or ``"mimo"`` (``FAMILIES``).
        dtype: the checkpoint's dtype (``config.json``'s ``dtype``).
        overrides: keys replacing the derived ones (in place) or added after them, e.g.
            ``bos_token_id``, ``eos_token_id``, ``max_position_embeddings``.

    Returns:
        The config dict: the family's ``architectures`` and ``model_type``, its sizes, attention,
        RoPE and MoE keys, and ``num_nextn_predict_layers`` = the MTP layers.

    Raises:
        MTPHooksError: an unknown family, or a model the family's HF config cannot describe: the
            layout's refusals (``export.layouts``), an activation other than SwiGLU, linear biases,
            interleaved RoPE, MLA outside ``"deepseek_v3"`` or GQA inside it, a dense model in a MoE
            family, Qwen2's fixed QKV bias, no q / k norm and full rotary for ``"mimo"``, a router
            other than sigmoid with expert bias, MoE layers not after a dense prefix.

    Example::

        config = hf_config(model, "mimo", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    """
    if family not in FAMILIES:
        raise bad_argument("family", f"one of {', '.join(repr(name) for name in FAMILIES)}", describe(family))
    config, facts = _model_facts(model, family, overrides)
    check_config(config, layout_named(FAMILIES[family]))
    given = {key: overrides[key] for key in ("partial_rotary_factor",) if key in overrides}
    problems = refusals(config, family, {**facts, **given})
    if problems:
        raise MTPHooksError(
            f"model: its config does not fit the HF family {family!r}\n"
            "  expected: a config the family's HF model computes alike (or another family)\n"
            f"  received: {'; '.join(problems)}"
        )
    architecture, model_type = _ARCHITECTURES[family]
    found: dict[str, Any] = dict(
        vocab_size=facts.get("vocab_size"),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_nextn_predict_layers=config.mtp_num_layers,
        rms_norm_eps=float(config.layernorm_epsilon),
        # DeepSeek-V3's and GLM-4.5's engine models do not tie: hf_weights writes the shared head as lm_head
        tie_word_embeddings=facts.get("tie_word_embeddings") if family == "mimo" else False,
        max_position_embeddings=facts.get("max_position_embeddings"),
        bos_token_id=None,
        eos_token_id=None,
        dtype=str(dtype).removeprefix("torch."),
        hidden_act="silu",
    )
    kv_heads = config.num_query_groups or config.num_attention_heads
    if family == "mimo":
        found.update(architectures=[architecture], model_type=model_type, intermediate_size=config.ffn_hidden_size,
                     num_key_value_heads=kv_heads, rope_theta=facts["rope_theta"], use_sliding_window=False)
    elif family == "glm4_moe":
        found.update(_moe(config), architectures=[architecture], model_type=model_type, num_key_value_heads=kv_heads,
                     head_dim=config.kv_channels, partial_rotary_factor=facts["partial_rotary_factor"],
                     use_qk_norm=bool(config.qk_layernorm), attention_bias=bool(config.add_qkv_bias),
                     rope_theta=facts["rope_theta"])
    else:
        found.update(_moe(config), architectures=[architecture], model_type=model_type, **_mla(config))
    found.update(overrides)
    return found
