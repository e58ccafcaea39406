"""Real Megatron-Core GPT models with MTP layers, runnable on CPU.

Test-only support. Three things keep stock mcore code off CUDA on a CPU machine:

* ``cuda_current_device_is_cpu``: mcore asks ``torch.cuda.current_device()`` for the device of
  a few buffers (MTP loss tracker, TP gathers, RoPE). Inside this context manager it answers
  ``"cpu"``. The library under test never relies on this.
* ``SDPAttention``: mcore's local ``DotProductAttention`` builds CUDA masks; this module is a
  causal scaled-dot-product attention with the same call signature, honouring packed
  sequences (``cu_seqlens``, padded or not) by masking across sequence boundaries and context
  parallelism (mcore's load-balanced split) by gathering keys and values over the CP group.
* ``cuda_calls_on_cpu``: for the few places (pipeline schedules, tied embeddings across
  pipeline stages) that hard-code ``device="cuda"`` or call ``.cuda()``.
* ``init_parallel``: a gloo process group and mcore's ``parallel_state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import socket
import sys
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
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


class _CudaToCpu(TorchFunctionMode):
    """Turns ``device="cuda"`` of tensor factories into CPU and ``Tensor.cuda()`` into a no-op."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """While open, tensors that mcore creates with ``device="cuda"`` or moves with ``.cuda()`` stay on CPU.

    Needed by mcore's pipeline schedules (a token counter made on ``"cuda"``) and by tied or MTP
    embeddings on a later pipeline stage (``setup_embeddings_and_output_layer`` calls ``.cuda()``).
    Every torch call goes through this mode, so open it only where those paths run.
    """
    with _CudaToCpu():
        yield


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch ``LayerNorm`` for sequence-parallel CPU models (mcore's ``WrappedTorchNorm`` refuses SP).

    Marks its parameters ``sequence_parallel`` as Apex's and TE's norms do, so mcore knows their
    gradients are partial sums over the sequence shards of the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "LayerNorm":
            raise NotImplementedError(f"SequenceParallelLayerNorm: normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _replace_module_class(spec: Any, old: type, new: type, seen: Optional[set[int]] = None) -> Any:
    """Replace ``old`` by ``new`` wherever it appears as a module class in an mcore spec tree (in place)."""
    seen = set() if seen is None else seen
    if id(spec) in seen:
        return spec
    seen.add(id(spec))
    if isinstance(spec, list):
        spec[:] = [new if item is old else _replace_module_class(item, old, new, seen) for item in spec]
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            setattr(spec, field.name, new if value is old else _replace_module_class(value, old, new, seen))
    return spec


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
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        # The process groups arrive as ``pg_collection`` (0.15+) or ``model_comm_pgs`` (0.14).
        groups = pg_collection if pg_collection is not None else kwargs.get("model_comm_pgs")
        self.cp_group = getattr(groups, "cp", None)

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
        if query.dim() == 3:  # THD packed sequences: [t, heads, d], batch dimension 1
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        # [s, b, heads, d] -> [b, heads, s, d]
        s, b, heads, d = query.shape
        if key.shape[2] != heads:  # grouped-query attention
            repeat = heads // key.shape[2]
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # Positions in the full (packed) row of this rank's queries and of the keys.
        positions = key_positions = torch.arange(s, device=query.device)
        bounds = None
        if packed_seq_params is not None:
            # Sequence i occupies [bounds[i], bounds[i + 1]) of the packed layout; with padding
            # the layout is cu_seqlens_q_padded and each sequence's padding follows its tokens.
            bounds = packed_seq_params.cu_seqlens_q_padded
            if bounds is None:
                bounds = packed_seq_params.cu_seqlens_q
        if self.cp_group is not None and self.cp_group.size() > 1:
            # Context parallel: of every sequence this rank holds chunks r and 2cp-1-r of 2cp
            # (mcore's load-balanced split); keys and values come from every rank.
            cp = self.cp_group.size()
            layout = s * cp if bounds is None else bounds.tolist()
            positions = context_parallel_positions(layout, self.cp_group.rank(), cp, device=query.device)
            if positions.numel() != s:
                raise NotImplementedError(f"SDPAttention: {s} local tokens, but the packed layout gives this rank {positions.numel()}")
            key_positions = torch.cat([context_parallel_positions(layout, r, cp, device=query.device) for r in range(cp)])
            k, v = (_GatherSequence.apply(t, self.cp_group) for t in (k, v))
        mask = positions[:, None] >= key_positions[None, :]
        if bounds is not None:
            starts = bounds[1:-1].to(device=query.device, dtype=positions.dtype)
            query_segment = torch.bucketize(positions, starts, right=True)
            key_segment = torch.bucketize(key_positions, starts, right=True)
            mask = mask & (query_segment[:, None] == key_segment[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def context_parallel_positions(layout: int | list[int], cp_rank: int, cp_size: int, device: Any = None) -> Tensor:
    """Positions (in the full row) that CP rank ``cp_rank`` holds, in its local order.

    Of every sequence the rank holds chunks ``r`` and ``2cp-1-r`` of ``2cp`` equal chunks (mcore's
    load-balanced split). ``layout`` is the row length (one sequence) or the packed sequence
    boundaries ``[0, b1, ..., total]`` (``cu_seqlens``, padded where there is padding).
    """
    bounds = [0, layout] if isinstance(layout, int) else layout
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        parts.append(torch.arange(start + cp_rank * chunk, start + (cp_rank + 1) * chunk, device=device))
        parts.append(torch.arange(start + (2 * cp_size - 1 - cp_rank) * chunk, start + (2 * cp_size - cp_rank) * chunk, device=device))
    return torch.cat(parts)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[b, heads, s, d]`` along ``s`` over a group; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=2)[ctx.group.rank()].contiguous(), None


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
        vp_stage = model_kwargs.get("vp_stage")
        mtp_spec = None
        if self.mtp_num_layers:
            # None on pipeline stages (and virtual stages) without the MTP layers.
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
        decoder_spec: Any = spec
        if config.sequence_parallel:
            layers = get_num_layers_to_build(config, vp_stage=vp_stage)
            decoder_spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=WrappedTorchNorm)
            for tree in (decoder_spec, mtp_spec):
                _replace_module_class(tree, WrappedTorchNorm, SequenceParallelLayerNorm)
        return GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type=self.position_embedding_type,
            mtp_block_spec=mtp_spec,
            **model_kwargs,
        )


def _hybrid_mtp_missing() -> Optional[str]:
    """Why this mcore cannot build a ``HybridModel`` with MTP layers, or ``None``."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: F401
    except ImportError:
        return "megatron.core.models.hybrid.HybridModel is missing (megatron-core < 0.18)"
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    if "hybrid_submodules" not in inspect.signature(MultiTokenPredictionLayer.__init__).parameters:
        return "MultiTokenPredictionLayer has no hybrid_submodules (no HybridModel MTP in this megatron-core)"
    return None


HYBRID_MTP_MISSING: Optional[str] = _hybrid_mtp_missing()


@dataclasses.dataclass
class TinyHybrid(TinyGPT):
    """Shape of a tiny ``HybridModel`` with MTP layers: attention (``*``) and MLP (``-``) layers only.

    The decoder pattern alternates attention and MLP (``num_layers`` must be even) and each MTP
    depth is one attention and one MLP layer: ``"*-*-/*-/*-"`` for 4 layers and 2 depths, so no
    Mamba kernel is needed. Layers are the local (no Transformer Engine) ones of ``TinyGPT``.
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
        """Build the model with a fixed seed, so two builds are identical twins."""
        from megatron.core.ssm.mlp_layer import MLPLayer

        if HYBRID_MTP_MISSING is not None:
            raise RuntimeError(HYBRID_MTP_MISSING)
        if self.num_layers % 2:
            raise ValueError(f"{type(self).__name__} needs an even num_layers, got {self.num_layers}")
        torch.manual_seed(seed)
        config = self.config()
        local = get_gpt_layer_local_spec()
        return self.hybrid_from_local_spec(config, local, "mlp_layer", MLPLayer, **model_kwargs)

    def hybrid_from_local_spec(self, config: TransformerConfig, local: Any, ffn_field: str, ffn_module: type, **model_kwargs: Any) -> torch.nn.Module:
        """A ``HybridModel`` whose attention and feed-forward layers (``ffn_field`` of the stack's
        submodules, built as ``ffn_module``) come from a local GPT layer spec, with SDPA attention."""
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
                input_layernorm=parts.input_layernorm, self_attention=parts.self_attention, self_attn_bda=parts.self_attn_bda
            ),
        )
        ffn = ModuleSpec(
            module=ffn_module,
            submodules=TransformerLayerSubmodules(pre_mlp_layernorm=parts.pre_mlp_layernorm, mlp=parts.mlp, mlp_bda=parts.mlp_bda),
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
        return HybridModel(
            config=config,
            hybrid_stack_spec=stack,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            hybrid_layer_pattern=self.pattern,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type=self.position_embedding_type,
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


def tracked_mtp_losses() -> Optional[Tensor]:
    """The per-depth MTP loss sums in stock mcore's tracker (``None`` before any), left in place.

    The tracker key is ``"values"`` up to 0.18 and ``"loss_values"`` from 0.19 (which also
    records acceptance counts under other keys).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return tracker.get("loss_values", tracker.get("values"))


def stock_mtp_losses() -> list[float]:
    """Per-depth MTP losses stock mcore recorded in its tracker (then clears it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = tracked_mtp_losses()
    out = [] if values is None else values.tolist()
    MTPLossLoggingHelper.tracker.clear()
    return out


def _mtp_recompute_broken() -> Optional[str]:
    """Why stock MTP layers cannot run under full activation recompute in this mcore, or ``None``."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    forward = inspect.signature(MultiTokenPredictionLayer.forward).parameters
    checkpointed = inspect.signature(MultiTokenPredictionLayer._checkpointed_forward).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in checkpointed.values())
    if "padding_mask" in forward and "padding_mask" not in checkpointed and not open_kwargs:
        return (
            "stock MTP full recompute is broken in this megatron-core: MultiTokenPredictionLayer.forward passes "
            "padding_mask to _checkpointed_forward, which does not take it (TypeError)"
        )
    return None


MTP_RECOMPUTE_BROKEN: Optional[str] = _mtp_recompute_broken()


def mtp_inner_layer(layer: torch.nn.Module) -> torch.nn.Module:
    """The transformer layer inside an MTP layer: ``transformer_layer`` up to 0.16, ``mtp_model_layer`` from 0.17."""
    inner = getattr(layer, "mtp_model_layer", None)
    return inner if inner is not None else layer.transformer_layer


def stock_train_step(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Stock mcore: labels in, per-token loss out; backward of the masked mean. Returns the loss.

    Empties mcore's MTP tracker first, so that it then holds this step's losses only (hooked
    models record into the same process-wide tracker).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
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


def hooked_train_step(model: torch.nn.Module, hooks: Any, batch: Batch) -> Tensor:
    """With ``mtp_hooks``: logits out under ``micro_batch``; backward of the same masked mean. Returns logits."""
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    return logits.detach()


def stock_main_only_step(model: GPTModel, batch: Batch) -> Tensor:
    """Stock mcore with the MTP loss weighted 0 (and all-ones MTP mask, so no 0/0): main-head gradients only."""
    factor = model.config.mtp_loss_scaling_factor
    model.config.mtp_loss_scaling_factor = 0.0
    try:
        per_token = model(*batch.model_args, labels=batch.labels)
    finally:
        model.config.mtp_loss_scaling_factor = factor
    loss = masked_mean(per_token, batch.loss_mask)
    loss.backward()
    return loss.detach()


@contextlib.contextmanager
def output_layer_calls(model: GPTModel) -> Iterator[list[Tensor]]:
    """Record every ``output_layer`` output (detached ``[s, b, V]`` logits) while the context is open.

    In a stock training forward the calls are depth 1 .. N of MTP, then the main head.
    Recorded by a profile function, not a module hook: a hook on the output layer would itself
    change what the hooks do (they send an output layer carrying foreign hooks down the dense path).
    """
    calls: list[Tensor] = []
    layer = model.output_layer
    forward_code = type(layer).forward.__code__
    previous = sys.getprofile()

    def profile(frame: Any, event: str, value: Any) -> None:
        if event == "return" and frame.f_code is forward_code and frame.f_locals.get("self") is layer and value is not None:
            calls.append(value[0].detach().clone())
        if previous is not None:  # an enclosing recorder (of another model) keeps recording
            previous(frame, event, value)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def rolled(tensor: Tensor, k: int) -> Tensor:
    """Reference roll: ``out[..., t] = tensor[..., t + k]``, zero where ``t + k`` is past the end."""
    out = torch.zeros_like(tensor)
    if k < tensor.shape[-1]:
        out[..., : tensor.shape[-1] - k] = tensor[..., k:]
    return out


def thd_params(real: list[int], slot: list[int]) -> tuple[Any, Any]:
    """``PackedSeqParams`` for one THD row: sequence ``i`` has ``real[i]`` tokens at the start of a slot of ``slot[i]``.

    Returns what the model is given (real lengths in ``cu_seqlens_q``, slots in
    ``cu_seqlens_q_padded`` where they differ) and the slot layout (``cu_seqlens_q`` set to the
    slots, padded bounds where padded: how Megatron-LM, verl and NeMo-RL describe padded batches).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_real = torch.tensor([0, *real]).cumsum(0).to(torch.int32)
    cu_slot = torch.tensor([0, *slot]).cumsum(0).to(torch.int32)
    padded = real != slot

    def params(cu: Tensor, cu_padded: Optional[Tensor]) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(slot), max_seqlen_kv=max(slot),
        )

    given = params(cu_real, cu_slot) if padded else params(cu_slot, None)
    return given, params(cu_slot, cu_slot if padded else None)


class _FusedWeightGradientKernels:
    """CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (mcore's gradient-accumulation fusion).

    ``wgrad_gemm_accum_fp32(input, grad_output, main_grad)``: one GEMM ``grad_output.T @ input``
    of the 2-D operands, accumulated in fp32 and added to the fp32 ``main_grad`` (cuBLAS with
    ``beta = 1``). ``wgrad_gemm_accum_fp16``: the same into a half / bf16 ``main_grad``, the sum
    computed in fp32 and rounded once to its dtype.
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        assert main_grad.dtype == torch.float32 and input.dim() == grad_output.dim() == 2
        torch.addmm(main_grad, grad_output.detach().t().float(), input.detach().float(), out=main_grad)  # out=: counted by FlopCounterMode

    @staticmethod
    def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        assert main_grad.dtype in (torch.float16, torch.bfloat16) and input.dim() == grad_output.dim() == 2
        main_grad.copy_(torch.addmm(main_grad.float(), grad_output.t().float(), input.float()))


@contextlib.contextmanager
def fused_wgrad_kernel_on_cpu() -> Iterator[None]:
    """While open, mcore finds ``fused_weight_gradient_mlp_cuda`` (the CPU stand-in above), so
    layers built with ``gradient_accumulation_fusion=True`` construct and run on CPU."""
    import sys

    from megatron.core.tensor_parallel import layers

    kernels = _FusedWeightGradientKernels()
    saved_module = sys.modules.get("fused_weight_gradient_mlp_cuda")
    saved = {name: getattr(layers, name) for name in ("fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available") if hasattr(layers, name)}
    sys.modules["fused_weight_gradient_mlp_cuda"] = kernels  # type: ignore[assignment]
    layers.fused_weight_gradient_mlp_cuda = kernels  # type: ignore[attr-defined]
    layers._grad_accum_fusion_available = True
    try:
        yield
    finally:
        if saved_module is None:
            sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        else:
            sys.modules["fused_weight_gradient_mlp_cuda"] = saved_module
        for name in ("fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available"):
            if name in saved:
                setattr(layers, name, saved[name])
            elif hasattr(layers, name):
                delattr(layers, name)
