"""The mcore shapes of the engine tests' three families (``engine_models`` gives them their counting weights).

``shape(family)`` is the model as vLLM's ``method="mtp"`` resolves it at the sizes vLLM's CPU kernels take:
``"deepseek_v3"`` (``TinyDeepSeek``: MLA without a query down-projection, DeepSeek-V3's qk norms and sigmoid
router with expert bias), ``"glm4_moe"`` (``TinyGlm``: the same layers with grouped-query attention) and ``"mimo"``
(``TinyQwen``). ``family_missing`` says why this megatron-core cannot build one on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, Optional

import torch.nn.functional as F

from mtp_hooks.testing.deepseek import TinyDeepSeek, deepseek_missing
from mtp_hooks.testing.gpt import TinyQwen

__all__ = ["DEEPSEEK_V3_STYLE", "EPS", "FAMILIES", "HIDDEN", "LAYERS", "TinyGlm", "VOCAB", "family_missing", "shape"]

FAMILIES = ("deepseek_v3", "glm4_moe", "mimo")
VOCAB, HIDDEN, LAYERS = 1024, 128, 2
EPS = 1e-6  # RMSNorm epsilon on both sides

# What DeepSeek-V3's (and GLM-4.5's) HF layer computes and TinyDeepSeek's defaults leave out.
DEEPSEEK_V3_STYLE: dict[str, Any] = dict(
    gated_linear_unit=True,
    activation_func=F.silu,
    qk_layernorm=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
)
_MLA = dict(
    q_lora_rank=None, kv_lora_rank=512, qk_head_dim=32, qk_pos_emb_head_dim=64, v_head_dim=32, layernorm_epsilon=EPS
)


@dataclasses.dataclass
class TinyGlm(TinyDeepSeek):
    """``TinyDeepSeek``'s layers (dense then MoE, MoE MTP layers) with grouped-query attention, as
    GLM-4.5: qk norms, a bias on the QKV projection only."""

    num_query_groups: int = 2

    def config(self) -> Any:
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        mla = TinyDeepSeek.config(self)
        plain = dataclasses.fields(TransformerConfig)
        mla_only = {f.name for f in dataclasses.fields(MLATransformerConfig)} - {f.name for f in plain}
        kwargs = {f.name: getattr(mla, f.name) for f in plain if f.init and f.name not in mla_only}
        head = self.hidden_size // self.num_attention_heads
        kwargs.update(multi_latent_attention=False, num_query_groups=self.num_query_groups, kv_channels=head)
        kwargs.update(qk_layernorm=True, add_qkv_bias=True)
        return TransformerConfig(**kwargs)


@functools.cache
def family_missing(family: str) -> Optional[str]:
    """Why this megatron-core cannot build ``family``'s shape on CPU, or ``None`` when it can."""
    if family == "mimo":
        return None
    missing = deepseek_missing()
    if missing is not None or family != "deepseek_v3":
        return missing
    # 0.19 resolves MLA's qk norm anew: without a query down-projection the query norm must be fused into
    # linear_q_proj, and only Transformer Engine has such a layer.
    resolver = importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None
    if resolver and importlib.util.find_spec("transformer_engine") is None:
        return (
            "this megatron-core builds MLA with qk_layernorm and no query down-projection (q_lora_rank=None, "
            "the engine's DeepSeek-V3 shape) only with Transformer Engine's fused norm+linear, absent here"
        )
    return None


def shape(
    family: str,
    mtp_num_layers: int = 1,
    *,
    hidden_size: int = HIDDEN,
    num_layers: int = LAYERS,
    vocab_size: int = VOCAB,
) -> Any:
    """The mcore shape of ``family`` (build inside ``moe_mla_on_cpu()`` for the MoE families).
    The counting weights need the default sizes; other sizes serve benchmarks with random weights."""
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, mtp_num_layers=mtp_num_layers)
    sizes["max_sequence_length"] = 512
    if family == "deepseek_v3":
        return TinyDeepSeek(num_attention_heads=2, config_overrides={**DEEPSEEK_V3_STYLE, **_MLA}, **sizes)
    if family == "glm4_moe":
        overrides = {**DEEPSEEK_V3_STYLE, "layernorm_epsilon": EPS}
        return TinyGlm(num_attention_heads=hidden_size // 32, config_overrides=overrides, **sizes)
    if family == "mimo":
        heads, groups = hidden_size // 32, hidden_size // 64
        overrides = {"layernorm_epsilon": EPS}
        return TinyQwen(num_attention_heads=heads, num_query_groups=groups, config_overrides=overrides, **sizes)
    raise ValueError(f"family: expected one of {FAMILIES}, received {family!r}")
