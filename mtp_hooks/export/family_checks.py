"""What an engine family's HF config cannot say about an mcore model, or says otherwise than mcore computes.

``hf_config`` refuses such a model rather than write a config.json the engine would load and run
differently: each check names the mcore setting and what the family's HF model does instead.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch.nn.functional as F

__all__ = ["dense_prefix", "refusals"]


def dense_prefix(config: Any) -> Optional[int]:
    """k when mcore's MoE layer pattern is k dense layers then MoE layers only, else ``None``."""
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    k = pattern.index(1) if 1 in pattern else len(pattern)
    return k if pattern == [0] * k + [1] * (len(pattern) - k) else None


def _attention(config: Any, family: str, facts: Mapping[str, Any]) -> list[str]:
    problems = []
    mla = bool(getattr(config, "multi_latent_attention", False))
    if facts.get("position_embedding_type", "rope") != "rope" and not mla:
        kind = facts["position_embedding_type"]
        problems.append(f"position_embedding_type={kind!r} (the families' layers apply RoPE)")
    if getattr(config, "rotary_interleaved", False):
        problems.append("rotary_interleaved=True (the families' RoPE rotates halves)")
    if family == "deepseek_v3" and not mla:
        problems.append("multi_latent_attention=False (DeepSeek-V3 is MLA; GQA with MoE: family 'glm4_moe')")
    if family == "glm4_moe" and mla:
        problems.append("multi_latent_attention=True (GLM-4.5 uses grouped-query attention; MLA: family 'deepseek_v3')")
    if mla and getattr(config, "rope_type", "rope") not in ("rope", "yarn"):
        problems.append(f"rope_type={config.rope_type!r} (DeepSeek-V3: 'rope' or 'yarn')")
    if family == "mimo":
        if getattr(config, "qk_layernorm", False):
            problems.append("qk_layernorm=True (Qwen2 / MiMo attention has no q / k norm)")
        if not getattr(config, "add_qkv_bias", False):
            problems.append("add_qkv_bias=False (Qwen2 / MiMo attention has a QKV bias)")
        if facts.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append(f"rotary_percent={facts['partial_rotary_factor']} (Qwen2 / MiMo rotate every head dim)")
        if not mla and config.kv_channels * config.num_attention_heads != config.hidden_size:
            problems.append(f"kv_channels={config.kv_channels} (Qwen2 / MiMo heads are hidden_size / heads wide)")
    return problems


def _moe(config: Any, family: str) -> list[str]:
    if not getattr(config, "num_moe_experts", None):
        if family in ("deepseek_v3", "glm4_moe"):
            experts = getattr(config, "num_moe_experts", None)
            return [f"num_moe_experts={experts!r} (the family's layers after the first k are MoE)"]
        return []
    problems = []
    sigmoid = getattr(config, "moe_router_score_function", "softmax") == "sigmoid"
    if not sigmoid or not getattr(config, "moe_router_enable_expert_bias", False):
        problems.append("a router other than sigmoid scores with expert bias (the families' topk_method 'noaux_tc')")
    groups = getattr(config, "moe_router_num_groups", None)
    group_topk = getattr(config, "moe_router_group_topk", None) or 1
    if groups and groups > 1 and config.moe_router_topk // group_topk != 2:
        problems.append(f"moe_router_topk // moe_router_group_topk = {config.moe_router_topk // group_topk} "
                        "(the engines score a group by its top 2 experts; mcore by its top topk // group_topk)")
    if dense_prefix(config) is None:
        pattern = config.moe_layer_freq
        problems.append(f"moe_layer_freq={pattern!r} (the families: k dense layers, then MoE layers only)")
    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    if shared and shared % config.moe_ffn_hidden_size:
        problems.append(f"moe_shared_expert_intermediate_size={shared} "
                        f"(a multiple of moe_ffn_hidden_size={config.moe_ffn_hidden_size})")
    return problems


def refusals(config: Any, family: str, facts: Mapping[str, Any]) -> list[str]:
    """The mcore settings of ``config`` (and the model's ``facts``) that ``family``'s HF config cannot express."""
    problems = []
    if getattr(config, "activation_func", None) is not F.silu:
        name = getattr(config.activation_func, "__name__", config.activation_func)
        problems.append(f"activation_func={name} (the families' MLPs are SwiGLU: silu)")
    if getattr(config, "add_bias_linear", False):
        problems.append("add_bias_linear=True (no biases on the families' output and MLP projections)")
    return problems + _attention(config, family, facts) + _moe(config, family)
