"""Tiny real mcore ``GPTModel``s with MTP layers, built on CPU: GPT-style and Qwen-style (GQA).

A shape (``TinyGPT``, ``TinyQwen``) is a dataclass of the few sizes a test varies; ``build(seed)``
seeds torch and builds the model, so two builds with one seed are identical twins. The layers are
mcore's local (no Transformer Engine) ones with ``SDPAttention``; the config is
``cpu_safe_config()`` plus the shape and the parallel layout of mcore's ``parallel_state``
(``init_parallel()`` first).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_hooks.testing.config import cpu_safe_config
from mtp_hooks.testing.environ import environ_kept
from mtp_hooks.testing.specs import SequenceParallelLayerNorm, local_layer_spec, replace_module_class

__all__ = ["TinyGPT", "TinyQwen"]

MTP_LOSS_SCALING_FACTOR = 0.3


@dataclasses.dataclass
class TinyGPT:
    """Shape of a tiny GPT model with MTP layers (LayerNorm, GeLU MLP, biases, learned positions).

    ``num_query_groups`` below ``num_attention_heads`` gives grouped-query attention;
    ``config_overrides`` reach ``TransformerConfig`` last.

    Example::

        init_parallel()
        with cuda_current_device_is_cpu():
            model = TinyGPT(mtp_num_layers=2).build(seed=0)
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    max_sequence_length: int = 64
    mtp_num_layers: Optional[int] = 2
    tied: bool = False
    position_embedding_type: str = "learned_absolute"
    params_dtype: torch.dtype = torch.float32
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_query_groups: Optional[int] = None

    def config(self) -> TransformerConfig:
        """The ``TransformerConfig`` of this shape under mcore's current parallel layout."""
        return TransformerConfig(**self.config_kwargs())

    def config_kwargs(self) -> dict[str, Any]:
        """The config's arguments: the shape's sizes, the parallel layout, ``cpu_safe_config()``,
        then ``config_overrides``."""
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            mtp_num_layers=self.mtp_num_layers,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            pipeline_dtype=self.params_dtype,
            **cpu_safe_config(),
        )
        if self.mtp_num_layers:
            kwargs["mtp_loss_scaling_factor"] = MTP_LOSS_SCALING_FACTOR
        kwargs.update(self.config_overrides)
        return kwargs

    def layer_spec(self) -> ModuleSpec:
        """The decoder layer spec: mcore's local one with ``SDPAttention``."""
        return local_layer_spec()

    def build(self, seed: int = 1234, **model_kwargs: Any) -> GPTModel:
        """Build the model with a fixed seed, so two builds are identical twins.

        ``model_kwargs`` go to ``GPTModel`` (``pre_process``, ``post_process``, ``vp_stage``, ...).
        The process environment is given back (``environ_kept``): mcore's attention-backend
        variables do not outlive the build.
        """
        torch.manual_seed(seed)
        config = self.config()
        decoder_spec, mtp_spec = self.block_specs(config, model_kwargs.get("vp_stage"))
        with environ_kept():
            return GPTModel(
                config=config,
                transformer_layer_spec=decoder_spec,
                mtp_block_spec=mtp_spec,
                **self.model_arguments(),
                **model_kwargs,
            )

    def model_arguments(self) -> dict[str, Any]:
        """The model arguments this shape decides besides config and specs: vocabulary, positions, tying."""
        return dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type=self.position_embedding_type,
        )

    def block_specs(self, config: TransformerConfig, vp_stage: Optional[int]) -> tuple[Any, Optional[ModuleSpec]]:
        """The decoder's spec (``layer_spec()``, in a block with sequence parallelism) and the MTP
        block's (``None`` without MTP layers, and on pipeline stages without them)."""
        spec = self.layer_spec()
        mtp_spec = None
        if self.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
        decoder_spec: Any = spec
        if config.sequence_parallel:
            layers = get_num_layers_to_build(config, vp_stage=vp_stage)
            decoder_spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=WrappedTorchNorm)
            for tree in (decoder_spec, mtp_spec):
                replace_module_class(tree, WrappedTorchNorm, SequenceParallelLayerNorm)
        return decoder_spec, mtp_spec


QWEN_STYLE: dict[str, Any] = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,  # SwiGLU
    activation_func=F.silu,
    add_bias_linear=False,
    add_qkv_bias=True,
)


@dataclasses.dataclass
class TinyQwen(TinyGPT):
    """Shape of a tiny Qwen2-style model: grouped-query attention (4 heads, 2 key/value groups),
    RMSNorm, SwiGLU, RoPE, biases on the QKV projection only, untied head, MTP layers alike."""

    num_query_groups: Optional[int] = 2
    position_embedding_type: str = "rope"

    def config(self) -> TransformerConfig:
        return TinyGPT.config(dataclasses.replace(self, config_overrides={**QWEN_STYLE, **self.config_overrides}))

    def layer_spec(self) -> ModuleSpec:
        return local_layer_spec(normalization="RMSNorm")
