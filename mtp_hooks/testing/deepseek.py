"""Tiny DeepSeek-V3-style mcore models on CPU: multi-latent attention, dense then MoE layers, MoE MTP layers.

``TinyDeepSeek`` builds a real ``GPTModel`` from mcore's local (no Transformer Engine) decoder
block spec: MLA in every layer, the first ``first_dense_layers`` layers dense and the others MoE
(a shared expert and a top-k router with the auxiliary load-balancing loss over routed experts
run one by one, ``SequentialMLP``), and MTP layers built from the last decoder layer's spec, so
they are MoE too. Core attention is ``SDPAttention`` (its output follows MLA's value head dim).
The MoE dispatcher is ``"allgather"`` (``"alltoall"`` creates a CUDA stream when built).

Build and run it inside ``moe_mla_on_cpu()``: mcore's MoE router and MLA look for Transformer
Engine names that some releases leave undefined without it; the context supplies them and takes
them away again on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Iterator, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_hooks.testing.attention import SDPAttention
from mtp_hooks.testing.gpt import TinyGPT
from mtp_hooks.testing.specs import replace_module_class

__all__ = ["TinyDeepSeek", "deepseek_missing", "moe_mla_on_cpu"]

_ABSENT = object()


class _NoTransformerEngineLinear:
    """Stands in for Transformer Engine's ``TELinear`` type: no module is ever an instance of it."""


@contextlib.contextmanager
def moe_mla_on_cpu() -> Iterator[None]:
    """While open, mcore's MoE router and MLA find the names they expect from Transformer Engine.

    * ``moe_utils.te_general_gemm``: the router's gating linear tests it against ``None``, but
      some releases only define the name when Transformer Engine imports;
    * ``multi_latent_attention.TELinear``: MLA tests ``isinstance(linear_proj, TELinear)``, where
      the name is ``None`` (or an import stub) without Transformer Engine; an empty type stands in.

    Only names that are missing or not usable are replaced; every one is restored on exit.
    """
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    saved: list[tuple[Any, str, Any]] = []
    if getattr(moe_utils, "te_general_gemm", _ABSENT) is _ABSENT:
        saved.append((moe_utils, "te_general_gemm", _ABSENT))
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    te_linear = getattr(multi_latent_attention, "TELinear", _ABSENT)
    if not isinstance(te_linear, type):
        saved.append((multi_latent_attention, "TELinear", te_linear))
        multi_latent_attention.TELinear = _NoTransformerEngineLinear  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            if value is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, value)


@functools.cache
def deepseek_missing() -> Optional[str]:
    """Why this megatron-core cannot build ``TinyDeepSeek`` on CPU, or ``None`` when it can."""
    try:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
    except ImportError:
        return "megatron.core has no MLATransformerConfig (no multi-latent attention)"
    from megatron.core.models.gpt import gpt_layer_specs

    if not hasattr(gpt_layer_specs, "get_gpt_decoder_block_spec"):
        return "gpt_layer_specs has no get_gpt_decoder_block_spec (no per-layer MoE spec)"
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    for name in (
        "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_token_dispatcher_type", "rope_type", "v_head_dim"
    ):
        if name not in fields:
            return f"MLATransformerConfig has no {name}"
    return None


@dataclasses.dataclass
class TinyDeepSeek(TinyGPT):
    """Shape of a tiny DeepSeek-V3-style model: MLA everywhere, dense then MoE layers, MoE MTP layers.

    ``TinyGPT``'s sizes, plus: ``first_dense_layers`` of the ``num_layers`` decoder layers are
    dense (DeepSeek's ``first_k_dense_replace``); the rest, and every MTP layer, are MoE with
    ``num_experts`` routed experts (top ``topk``), a shared expert and the auxiliary
    load-balancing loss. Positions are rotary (MLA applies its own), ``num_query_groups`` is unused.
    """

    position_embedding_type: str = "rope"
    first_dense_layers: int = 1
    num_experts: int = 4
    topk: int = 2

    def config(self) -> TransformerConfig:
        """The ``MLATransformerConfig`` of this shape under mcore's current parallel layout."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        style: dict[str, Any] = dict(
            ffn_hidden_size=2 * self.hidden_size,
            add_bias_linear=False,  # mcore's shared experts refuse biases
            normalization="RMSNorm",
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            # multi-latent attention: low-rank queries and keys/values, decoupled RoPE part
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_head_dim=8,
            qk_pos_emb_head_dim=4,
            v_head_dim=12,  # differs from the query/key head dim (8 + 4), as in DeepSeek-V3
            rope_type="rope",
            # MoE
            num_moe_experts=self.num_experts,
            moe_router_topk=self.topk,
            moe_ffn_hidden_size=self.hidden_size // 2,
            moe_shared_expert_intermediate_size=self.hidden_size // 2,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.01,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_layer_freq=[0] * self.first_dense_layers + [1] * (self.num_layers - self.first_dense_layers),
        )
        styled = dataclasses.replace(self, config_overrides={**style, **self.config_overrides})
        return MLATransformerConfig(**TinyGPT.config_kwargs(styled))

    def build(self, seed: int = 1234, **model_kwargs: Any) -> torch.nn.Module:
        """Build the model with a fixed seed, so two builds are identical twins (open ``moe_mla_on_cpu``)."""
        missing = deepseek_missing()
        if missing is not None:
            raise RuntimeError(missing)
        return super().build(seed, **model_kwargs)

    def block_specs(self, config: TransformerConfig, vp_stage: Optional[int]) -> tuple[Any, Optional[ModuleSpec]]:
        """mcore's local decoder block spec (dense, then MoE layers) with ``SDPAttention``; the MTP
        layers copy its last layer's spec, so they are MoE too."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        block_kwargs: dict[str, Any] = {"normalization": "RMSNorm"}
        if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters:
            block_kwargs["vp_stage"] = vp_stage
        decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **block_kwargs)
        replace_module_class(decoder_spec, DotProductAttention, SDPAttention)
        mtp_spec = None
        if self.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=False, vp_stage=vp_stage)
        return decoder_spec, mtp_spec
