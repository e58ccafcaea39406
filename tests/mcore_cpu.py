"""Real Megatron-Core GPT models with MTP layers, runnable on CPU.

Test-only support. Three things keep stock mcore code off CUDA on a CPU machine:

* ``cuda_current_device_is_cpu``: mcore asks ``torch.cuda.current_device()`` for the device of
  a few buffers (MTP loss tracker, TP gathers, RoPE). Inside this context manager it answers
  ``"cpu"``. The library under test never relies on this.
* ``SDPAttention``: mcore's local ``DotProductAttention`` builds CUDA masks; this module is a
  causal scaled-dot-product attention with the same call signature, honouring packed
  sequences (``cu_seqlens``) by masking across sequence boundaries.
* ``init_parallel``: a gloo process group and mcore's ``parallel_state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


@contextlib.contextmanager
def cuda_current_device_is_cpu() -> Iterator[None]:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` while the context is open."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class SDPAttention(MegatronModule):
    """Causal attention for CPU tests, call-compatible with mcore's ``DotProductAttention``."""

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
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        # [s, b, heads, d] -> [b, heads, s, d]
        s, b, heads, d = query.shape
        if key.shape[2] != heads:  # grouped-query attention
            repeat = heads // key.shape[2]
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
        if packed_seq_params is not None:
            segment = torch.zeros(s, dtype=torch.long, device=query.device)
            bounds = packed_seq_params.cu_seqlens_q
            for start in bounds[1:-1].tolist():
                segment[start:] += 1
            mask = mask & (segment[:, None] == segment[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> None:
    """Start a gloo process group (single process unless launched with RANK/WORLD_SIZE) and mcore's groups."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        torch.distributed.init_process_group(
            "gloo",
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )


@dataclasses.dataclass
class TinyGPT:
    """Shape of a tiny GPT model with MTP layers."""

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

    def config(self) -> TransformerConfig:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            mtp_num_layers=self.mtp_num_layers,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            tensor_model_parallel_size=tp,
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            pipeline_dtype=self.params_dtype,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
        )
        if self.mtp_num_layers:
            kwargs["mtp_loss_scaling_factor"] = 0.3
        kwargs.update(self.config_overrides)
        return TransformerConfig(**kwargs)

    def build(self, seed: int = 1234, **model_kwargs: Any) -> GPTModel:
        """Build the model with a fixed seed, so two builds are identical twins."""
        torch.manual_seed(seed)
        config = self.config()
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
        mtp_spec = None
        if self.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type=self.position_embedding_type,
            mtp_block_spec=mtp_spec,
            **model_kwargs,
        )


# --------------------------------------------------------------------------- side-by-side helpers


@dataclasses.dataclass
class Batch:
    """One micro-batch: ``[b, s]`` token ids, positions, next-token labels and loss mask."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Optional[Tensor]

    @property
    def model_args(self) -> tuple[Tensor, Tensor, None]:
        return (self.input_ids, self.position_ids, None)


def make_batch(
    vocab_size: int,
    batch: int = 2,
    seq: int = 8,
    mask: str = "random",
    seed: int = 0,
) -> Batch:
    """A deterministic batch; ``mask`` is ``"random"``, ``"ones"``, ``"zeros"``, ``"last"`` or ``"none"``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    labels = torch.roll(ids, -1, 1)
    loss_mask: Optional[Tensor]
    if mask == "random":
        loss_mask = (torch.rand(batch, seq, generator=gen) > 0.3).float()
    elif mask == "ones":
        loss_mask = torch.ones(batch, seq)
    elif mask == "zeros":
        loss_mask = torch.zeros(batch, seq)
    elif mask == "last":
        loss_mask = torch.zeros(batch, seq)
        loss_mask[:, -1] = 1
    elif mask == "none":
        loss_mask = None
    else:
        raise ValueError(mask)
    return Batch(ids, positions, labels, loss_mask)


def masked_mean(per_token: Tensor, loss_mask: Optional[Tensor]) -> Tensor:
    """The user's main-head loss: masked mean of a ``[b, s]`` per-token loss."""
    if loss_mask is None:
        return per_token.mean()
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def main_ce_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token CE ``[b, s]`` of the main head from (gathered, TP=1) ``[b, s, V]`` logits."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)


def stock_mtp_losses() -> list[float]:
    """Per-depth MTP losses stock mcore recorded in its tracker (then clears it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = MTPLossLoggingHelper.tracker.get("values")
    out = [] if values is None else values.tolist()
    MTPLossLoggingHelper.tracker.clear()
    return out


def stock_train_step(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Stock mcore: labels in, per-token loss out; backward of the masked mean. Returns the loss."""
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    return loss.detach()


def grads_of(model: torch.nn.Module) -> dict[str, Optional[Tensor]]:
    return {
        name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()
    }


def assert_same_grads(
    actual: torch.nn.Module,
    expected: torch.nn.Module,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> None:
    """Every parameter's gradient of ``actual`` equals ``expected``'s (None matches None or zeros)."""
    expected_grads = grads_of(expected)
    for name, grad in grads_of(actual).items():
        ref = expected_grads[name]
        if ref is None or grad is None:
            other = grad if ref is None else ref
            assert other is None or not other.any(), f"{name}: one gradient is None, the other is not zero"
            continue
        torch.testing.assert_close(grad, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
