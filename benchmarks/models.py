"""Real mcore GPT models and micro-batches for the benchmarks, on CPU or on one CUDA device.

On CUDA the model is stock mcore's local spec (``DotProductAttention``, which builds its causal
mask on the GPU). On CPU two shims from ``mtp_hooks.testing`` are needed and used only there:
an SDPA core attention (mcore's local attention allocates CUDA buffers) and
``torch.cuda.current_device()`` answering ``"cpu"`` (mcore's MTP loss tracker asks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from benchmarks.configs import Config, Shape
from mtp_hooks.testing import cpu_safe_config, cuda_current_device_is_cpu, free_port, init_parallel, local_layer_spec

MTP_LOSS_SCALE = 0.3


def setup(config: Config, stack: contextlib.ExitStack) -> None:
    """One-rank process group and mcore parallel state (TP = PP = CP = 1) for ``config.device``."""
    if config.device == "cpu":
        stack.enter_context(cuda_current_device_is_cpu())
        init_parallel()
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"config {config.name!r} needs a CUDA device; none is visible")
    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def build(config: Config, shape: Shape, mtp: Optional[int], seed: int = 1234) -> GPTModel:
    """A GPTModel of ``shape`` with ``mtp`` MTP layers (``None``: none), untied head, dropout off."""
    cpu = config.device == "cpu"
    torch.manual_seed(seed)
    if not cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        mtp_num_layers=mtp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=config.dtype,
        bf16=config.dtype == torch.bfloat16,
        pipeline_dtype=config.dtype,
        **cpu_safe_config(use_cpu_initialization=cpu),  # every fused kernel off
    )
    if mtp:
        kwargs["mtp_loss_scaling_factor"] = MTP_LOSS_SCALE
    transformer_config = TransformerConfig(**kwargs)
    spec = local_layer_spec(config.device)  # mcore's local spec; on CPU with an SDPA core attention
    mtp_spec = get_gpt_mtp_block_spec(transformer_config, spec, use_transformer_engine=False) if mtp else None
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        share_embeddings_and_output_weights=False,
        position_embedding_type=config.position_embedding,
        mtp_block_spec=mtp_spec,
    )
    # Whole-model cast, as mcore's Float16Module does (norms included).
    return model.to(device=config.device, dtype=config.dtype)


@dataclasses.dataclass
class Batch:
    """``[b, s]`` token ids, positions, next-token labels and loss mask."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Tensor

    @property
    def model_args(self) -> tuple[Tensor, Tensor, None]:
        return (self.input_ids, self.position_ids, None)


def make_batch(config: Config, shape: Shape, seed: int = 0) -> Batch:
    """A deterministic micro-batch; about 10% of positions masked out (as prompts would be)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen)
    positions = torch.arange(shape.seq).expand(shape.batch, shape.seq).contiguous()
    mask = (torch.rand(shape.batch, shape.seq, generator=gen) > 0.1).float()
    device = config.device
    return Batch(ids.to(device), positions.to(device), torch.roll(ids, -1, 1).to(device), mask.to(device))
