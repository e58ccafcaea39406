"""Tiny mcore ``HybridModel``s with MTP depths on CPU (megatron-core 0.18+), attention and MLP or MoE layers.

mcore 0.18 added ``HybridModel`` (``models/hybrid``), whose MTP depths are part of its layer
pattern. ``TinyHybrid`` uses attention (``*``) and MLP (``-``) layers only, ``TinyHybridMoE``
attention and MoE (``E``) layers, so no Mamba kernel is needed; the layers are the local ones
of ``TinyGPT`` with ``SDPAttention``. ``hybrid_mtp_missing()`` / ``hybrid_moe_missing()`` say
why a release cannot build them (``None`` when it can). Build ``TinyHybridMoE`` inside
``moe_mla_on_cpu()``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_hooks.testing.attention import SDPAttention
from mtp_hooks.testing.environ import environ_kept
from mtp_hooks.testing.gpt import TinyGPT
from mtp_hooks.testing.specs import local_layer_spec

__all__ = ["TinyHybrid", "TinyHybridMoE", "hybrid_moe_missing", "hybrid_mtp_missing"]


@functools.cache
def hybrid_mtp_missing() -> Optional[str]:
    """Why this megatron-core cannot build a ``HybridModel`` with MTP layers, or ``None``."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: F401
    except ImportError:
        return "megatron.core.models.hybrid.HybridModel is missing (megatron-core < 0.18)"
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    if "hybrid_submodules" not in inspect.signature(MultiTokenPredictionLayer.__init__).parameters:
        return "MultiTokenPredictionLayer has no hybrid_submodules (no HybridModel MTP in this megatron-core)"
    return None


@functools.cache
def hybrid_moe_missing() -> Optional[str]:
    """Why this megatron-core cannot build a ``HybridModel`` with MoE layers and MTP, or ``None``."""
    missing = hybrid_mtp_missing()
    if missing is not None:
        return missing
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    except ImportError as error:  # a release whose hybrid modules are laid out otherwise
        return f"megatron.core.models.hybrid: {error}"
    if "moe_layer" not in {f.name for f in dataclasses.fields(HybridStackSubmodules)}:
        return "HybridStackSubmodules has no moe_layer (no MoE layers in HybridModel)"
    if getattr(Symbols, "MOE", None) is None:
        return "the hybrid layer pattern has no MoE symbol"
    return None


@dataclasses.dataclass
class TinyHybrid(TinyGPT):
    """Shape of a tiny ``HybridModel`` with MTP layers: attention (``*``) and MLP (``-``) layers only.

    The decoder pattern alternates attention and MLP (``num_layers`` must be even) and each MTP
    depth is one attention and one MLP layer: ``"*-*-/*-/*-"`` for 4 layers and 2 depths.
    ``HybridStack`` hard-codes Transformer Engine's norm for the decoder's final norm, so the tiny
    decoder goes without it (``post_layer_norm=False``); every MTP layer keeps its own norms.
    """

    num_layers: int = 4

    @property
    def pattern(self) -> str:
        return "*-" * (self.num_layers // 2) + "/*-" * (self.mtp_num_layers or 0)

    def config(self) -> TransformerConfig:
        config = super().config()
        config.is_hybrid_model = True
        return config

    def build(self, seed: int = 1234, **model_kwargs: Any) -> torch.nn.Module:
        """Build the model with a fixed seed, so two builds are identical twins (the environment given back)."""
        missing = self._missing()
        if missing is not None:
            raise RuntimeError(missing)
        if self.num_layers % 2:
            raise ValueError(f"{type(self).__name__} needs an even num_layers, got {self.num_layers}")
        torch.manual_seed(seed)
        config = self.config()
        local, ffn_field, ffn_module = self._feed_forward(config)
        return self.hybrid_from_local_spec(config, local, ffn_field, ffn_module, **model_kwargs)

    def _missing(self) -> Optional[str]:
        return hybrid_mtp_missing()

    def _feed_forward(self, config: TransformerConfig) -> tuple[Any, str, type]:
        """The local layer spec, the stack's feed-forward field and the layer built there: MLP layers."""
        from megatron.core.ssm.mlp_layer import MLPLayer

        return local_layer_spec(), "mlp_layer", MLPLayer

    def hybrid_from_local_spec(
        self, config: TransformerConfig, local: Any, ffn_field: str, ffn_module: type, **model_kwargs: Any
    ) -> torch.nn.Module:
        """A ``HybridModel`` whose attention and feed-forward layers (``ffn_field`` of the stack's
        submodules, built as ``ffn_module``) come from a local GPT layer spec with SDPA attention."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        from megatron.core.transformer.multi_token_prediction import (
            MultiTokenPredictionBlock,
            MultiTokenPredictionBlockSubmodules,
            MultiTokenPredictionLayer,
            MultiTokenPredictionLayerSubmodules,
        )
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

        local.submodules.self_attention.submodules.core_attention = SDPAttention
        parts = local.submodules
        gpt_mtp_layer = get_gpt_mtp_block_spec(config, local, use_transformer_engine=False).layer_specs[0].submodules
        attention = ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=parts.input_layernorm,
                self_attention=parts.self_attention,
                self_attn_bda=parts.self_attn_bda,
            ),
        )
        ffn = ModuleSpec(
            module=ffn_module,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=parts.pre_mlp_layernorm, mlp=parts.mlp, mlp_bda=parts.mlp_bda
            ),
        )
        mtp_layer = ModuleSpec(
            module=MultiTokenPredictionLayer,
            submodules=MultiTokenPredictionLayerSubmodules(
                enorm=gpt_mtp_layer.enorm,
                hnorm=gpt_mtp_layer.hnorm,
                eh_proj=gpt_mtp_layer.eh_proj,
                mtp_model_layer=None,  # built by the layer from the pattern and the stack's submodules
                layer_norm=gpt_mtp_layer.layer_norm,
            ),
        )
        stack = ModuleSpec(
            module=HybridStack,
            submodules=HybridStackSubmodules(
                attention_layer=attention,
                mtp_block_spec=ModuleSpec(
                    module=MultiTokenPredictionBlock,
                    submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]),
                ),
                **{ffn_field: ffn},
            ),
            params={"post_layer_norm": False},  # HybridStack's final norm is Transformer Engine's
        )
        with environ_kept():
            return HybridModel(
                config=config,
                hybrid_stack_spec=stack,
                hybrid_layer_pattern=self.pattern,
                **self.model_arguments(),
                **model_kwargs,
            )


_TINY_MOE: dict[str, Any] = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.01,
    moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False,
    add_bias_linear=False,
)


@dataclasses.dataclass
class TinyHybridMoE(TinyHybrid):
    """``TinyHybrid`` with MoE (``E``) layers instead of MLP layers, MTP depths included.

    Pattern ``"*E" * (num_layers // 2) + "/*E" * depth``; the MoE layers are mcore's local ones
    (4 sequential experts, top-2, a shared expert, auxiliary load-balancing loss). Build it inside
    ``moe_mla_on_cpu()``.
    """

    def config(self) -> TransformerConfig:
        with_moe = dataclasses.replace(self, config_overrides={**_TINY_MOE, **self.config_overrides})
        return TinyHybrid.config(with_moe)

    @property
    def pattern(self) -> str:
        return "*E" * (self.num_layers // 2) + "/*E" * (self.mtp_num_layers or 0)

    def _missing(self) -> Optional[str]:
        return hybrid_moe_missing()

    def _feed_forward(self, config: TransformerConfig) -> tuple[Any, str, type]:
        """MoE layers (build the model inside ``moe_mla_on_cpu``)."""
        from megatron.core.transformer import transformer_layer

        local = local_layer_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        moe_layer = getattr(transformer_layer, "MoETransformerLayer", transformer_layer.TransformerLayer)
        return local, "moe_layer", moe_layer
