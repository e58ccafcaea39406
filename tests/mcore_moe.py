"""DeepSeek-style Megatron-Core models (multi-latent attention, MoE, MTP) runnable on CPU.

Test-only support, next to ``tests.mcore_cpu``. ``TinyDeepSeek`` builds a real ``GPTModel`` from
mcore's local (no Transformer Engine) decoder block spec: multi-latent attention in every layer,
the first ``first_dense_layers`` layers dense and the others MoE (a shared expert and a top-k
router with the auxiliary load-balancing loss over routed experts run one by one,
``SequentialMLP``), and MTP layers built from the last decoder layer's spec, so they are MoE too.

Three things keep stock mcore's MoE and MLA code runnable without Transformer Engine, all undone
when ``moe_mla_on_cpu`` closes:

* ``moe_utils.te_general_gemm``: the router's gating linear tests it against ``None``, but some
  releases only define the name when Transformer Engine imports.
* ``multi_latent_attention.TELinear``: MLA tests ``isinstance(linear_proj, TELinear)``, where the
  name is ``None`` (or an import stub) without Transformer Engine; a private empty type stands in.
* ``MLACoreAttention``: causal scaled-dot-product attention whose output width follows the value
  head dimension (MLA's ``v_head_dim`` differs from its query/key head dimension).

The MoE dispatcher is ``"allgather"`` (``"alltoall"`` creates a CUDA stream when built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.mcore_cpu import SDPAttention, TinyHybrid, _replace_module_class

_ABSENT = object()


class _NoTransformerEngineLinear:
    """Stands in for Transformer Engine's ``TELinear`` type: no module is ever an instance of it."""


@contextlib.contextmanager
def moe_mla_on_cpu() -> Iterator[None]:
    """While open, mcore's MoE router and MLA find the names they expect from Transformer Engine.

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


def moe_tracker() -> dict[str, Any]:
    """mcore's process-wide MoE auxiliary-loss tracker (name -> {"values": per-layer sums, groups}).

    From 0.18 ``get_moe_layer_wise_logging_tracker`` returns a new dict over the entries of
    ``moe_logging.get_moe_metrics_tracker()`` on each call (the ``values`` tensors are shared).
    """
    from megatron.core.transformer.moe import moe_utils

    legacy = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
    if legacy is not None:
        return legacy()
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return {name: {"values": entry.values} for name, entry in get_moe_metrics_tracker().metrics.items()}


def reduce_moe_tracker() -> None:
    """mcore's ``reduce_aux_losses_tracker_across_ranks()``: all-reduce the tracker over PP (and its groups)."""
    from megatron.core.transformer.moe import moe_utils

    reduce = getattr(moe_utils, "reduce_aux_losses_tracker_across_ranks", None)
    if reduce is not None:
        reduce()
        return
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker._sync_metrics(list(tracker.metrics), None)


def _clear_moe_tracker() -> None:
    """Remove every entry (names and per-layer sums) from mcore's MoE tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # up to 0.17: the legacy dict is the tracker itself
        moe_tracker().clear()
    else:
        get_moe_metrics_tracker().metrics.clear()


def moe_tracker_values() -> dict[str, Tensor]:
    """A copy of the tracker's per-layer sums, by loss name."""
    return {name: entry["values"].detach().clone() for name, entry in moe_tracker().items()}


def reset_moe_process_state() -> None:
    """Empty the MoE tracker (names included) and unset the aux-loss backward scale.

    Unset, mcore's aux-loss backward uses 1 and a pipeline schedule installs its own scale (a
    ``[1]`` tensor, which a 0-d scale left from an earlier test could not take).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    _clear_moe_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


class MLACoreAttention(MegatronModule):
    """Causal attention for CPU tests, call-compatible with mcore's ``DotProductAttention``.

    Unlike ``tests.mcore_cpu.SDPAttention`` its output is ``heads * value_head_dim`` wide, as MLA
    needs; it supports neither packed sequences nor context parallelism (it refuses both).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        groups = pg_collection if pg_collection is not None else kwargs.get("model_comm_pgs")
        cp_group = getattr(groups, "cp", None)
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("MLACoreAttention: context parallelism")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("MLACoreAttention: packed sequences")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _deepseek_missing() -> Optional[str]:
    """Why this mcore cannot build the tiny DeepSeek-style model on CPU, or ``None``."""
    try:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
    except ImportError:
        return "megatron.core has no MLATransformerConfig (no multi-latent attention)"
    from megatron.core.models.gpt import gpt_layer_specs

    if not hasattr(gpt_layer_specs, "get_gpt_decoder_block_spec"):
        return "gpt_layer_specs has no get_gpt_decoder_block_spec (no per-layer MoE spec)"
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    for name in ("moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_token_dispatcher_type", "rope_type", "v_head_dim"):
        if name not in fields:
            return f"MLATransformerConfig has no {name}"
    return None


DEEPSEEK_MISSING: Optional[str] = _deepseek_missing()


@dataclasses.dataclass
class TinyDeepSeek:
    """Shape of a tiny DeepSeek-V3-style model: MLA everywhere, dense then MoE layers, MoE MTP layers.

    ``first_dense_layers`` of the ``num_layers`` decoder layers are dense (DeepSeek's
    ``first_k_dense_replace``); the rest, and every MTP layer, are MoE with ``num_experts`` routed
    experts (top ``topk``), a shared expert and the auxiliary load-balancing loss.
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    first_dense_layers: int = 1
    num_attention_heads: int = 4
    max_sequence_length: int = 64
    mtp_num_layers: Optional[int] = 2
    num_experts: int = 4
    topk: int = 2
    tied: bool = False
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def config(self) -> TransformerConfig:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=2 * self.hidden_size,
            mtp_num_layers=self.mtp_num_layers,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            add_bias_linear=False,  # mcore's shared experts refuse biases
            normalization="RMSNorm",
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            pipeline_dtype=torch.float32,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
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
        if self.mtp_num_layers:
            kwargs["mtp_loss_scaling_factor"] = 0.3
        kwargs.update(self.config_overrides)
        return MLATransformerConfig(**kwargs)

    def build(self, seed: int = 1234, **model_kwargs: Any) -> torch.nn.Module:
        """Build the model with a fixed seed, so two builds are identical twins (open ``moe_mla_on_cpu``)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if DEEPSEEK_MISSING is not None:
            raise RuntimeError(DEEPSEEK_MISSING)
        torch.manual_seed(seed)
        config = self.config()
        vp_stage = model_kwargs.get("vp_stage")
        block_kwargs: dict[str, Any] = {"normalization": "RMSNorm"}
        if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters:
            block_kwargs["vp_stage"] = vp_stage
        decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **block_kwargs)
        _replace_module_class(decoder_spec, DotProductAttention, MLACoreAttention)
        mtp_spec = None
        if self.mtp_num_layers:
            # The MTP layers copy the last decoder layer's spec: MoE, with MLACoreAttention
            # (None on pipeline stages without the MTP layers).
            mtp_spec = get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=False, vp_stage=vp_stage)
        return GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type="rope",  # MLA applies its own rotary embedding
            mtp_block_spec=mtp_spec,
            **model_kwargs,
        )


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every MoE router in ``model`` by name (decoder and MTP layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {name: module for name, module in model.named_modules() if isinstance(module, TopKRouter)}


def mtp_moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The MoE layers inside the MTP block, by name."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return {name: module for name, module in model.named_modules() if name.startswith("mtp.") and isinstance(module, MoELayer)}


@contextlib.contextmanager
def forward_calls(modules: dict[str, torch.nn.Module]) -> Iterator[list[str]]:
    """Record the name of each of ``modules`` whose forward runs while the context is open."""
    calls: list[str] = []
    handles = [module.register_forward_hook(lambda m, a, o, name=name: calls.append(name)) for name, module in modules.items()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _hybrid_moe_missing() -> Optional[str]:
    """Why this mcore cannot build a ``HybridModel`` with MoE layers and MTP, or ``None``."""
    from tests.mcore_cpu import HYBRID_MTP_MISSING

    if HYBRID_MTP_MISSING is not None:
        return HYBRID_MTP_MISSING
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    if "moe_layer" not in {f.name for f in dataclasses.fields(HybridStackSubmodules)}:
        return "HybridStackSubmodules has no moe_layer (no MoE layers in HybridModel)"
    if getattr(Symbols, "MOE", None) is None:
        return "the hybrid layer pattern has no MoE symbol"
    return None


try:
    HYBRID_MOE_MISSING: Optional[str] = _hybrid_moe_missing()
except ImportError as error:  # a release whose hybrid modules are laid out otherwise
    HYBRID_MOE_MISSING = f"megatron.core.models.hybrid: {error}"


_TINY_MOE = dict(
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
    (4 sequential experts, top-2, a shared expert, auxiliary load-balancing loss).
    """

    def config(self) -> TransformerConfig:
        with_moe = dataclasses.replace(self, config_overrides={**_TINY_MOE, **self.config_overrides})
        return TinyHybrid.config(with_moe)

    @property
    def pattern(self) -> str:
        return "*E" * (self.num_layers // 2) + "/*E" * (self.mtp_num_layers or 0)

    def build(self, seed: int = 1234, **model_kwargs: Any) -> torch.nn.Module:
        """Build the model with a fixed seed, so two builds are identical twins (open ``moe_mla_on_cpu``)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import transformer_layer

        if HYBRID_MOE_MISSING is not None:
            raise RuntimeError(HYBRID_MOE_MISSING)
        if self.num_layers % 2:
            raise ValueError(f"TinyHybridMoE needs an even num_layers, got {self.num_layers}")
        torch.manual_seed(seed)
        config = self.config()
        local = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        moe_layer = getattr(transformer_layer, "MoETransformerLayer", transformer_layer.TransformerLayer)
        return self.hybrid_from_local_spec(config, local, "moe_layer", moe_layer, **model_kwargs)
