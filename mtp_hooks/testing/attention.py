"""Causal core attention for mcore models on CPU, call-compatible with mcore's ``DotProductAttention``.

mcore's local ``DotProductAttention`` builds its masks on CUDA. ``SDPAttention`` is causal
``scaled_dot_product_attention`` with the same constructor and call signature, and covers what
the tiny models need:

* grouped-query attention (``num_query_groups`` < heads: Qwen, Llama): keys and values are
  repeated over the heads of their group;
* multi-latent attention (DeepSeek): the value head dimension may differ from the query/key one,
  the output is ``heads * value_head_dim`` wide;
* packed sequences (``cu_seqlens``, padded or not): no attention across sequence boundaries;
* context parallelism (mcore's load-balanced split): keys and values are gathered over the CP group;
* a given ``attention_mask`` (mcore's convention: ``[b or 1, 1, s, s]``, True where masked) narrows the causal mask
  further, for unpacked sequences on one CP rank (a token always sees itself, so no row is empty). mcore's own
  softmax does the same with a given mask (its causal type only fills in a missing one).

Swap it into a spec with ``mtp_hooks.testing.local_layer_spec()`` or ``replace_module_class``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SDPAttention", "context_parallel_positions"]


class SDPAttention(MegatronModule):
    """Causal attention for CPU models, call-compatible with mcore's ``DotProductAttention``.

    Inputs are ``[s, b, heads, d]`` (or THD ``[t, heads, d]``); keys and values may have fewer
    heads (query groups) and values another head dimension. Returns ``[s, b, heads * d_value]``.
    Attention dropout is not applied (the tiny models set it to 0).
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
        **_: Any,
    ) -> Tensor:
        if query.dim() == 3:  # THD packed sequences: [t, heads, d], batch dimension 1
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        s, b, heads = query.shape[:3]
        groups = key.shape[2]
        if groups != heads:  # grouped-query attention: each key/value head serves heads // groups queries
            if heads % groups:
                raise ValueError(f"SDPAttention: {heads} query heads cannot share {groups} key/value heads evenly")
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
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
                raise NotImplementedError(
                    f"SDPAttention: {s} local tokens, but the packed layout gives this rank {positions.numel()}"
                )
            key_positions = torch.cat(
                [context_parallel_positions(layout, r, cp, device=query.device) for r in range(cp)]
            )
            k, v = (_GatherSequence.apply(t, self.cp_group) for t in (k, v))
        mask = positions[:, None] >= key_positions[None, :]
        if attention_mask is not None and bounds is None and positions is key_positions:
            diagonal = torch.eye(s, dtype=torch.bool, device=query.device)
            mask = mask & (~attention_mask.to(device=query.device, dtype=torch.bool) | diagonal)
        if bounds is not None:
            starts = bounds[1:-1].to(device=query.device, dtype=positions.dtype)
            query_segment = torch.bucketize(positions, starts, right=True)
            key_segment = torch.bucketize(key_positions, starts, right=True)
            mask = mask & (query_segment[:, None] == key_segment[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


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
        parts.append(
            torch.arange(
                start + (2 * cp_size - 1 - cp_rank) * chunk, start + (2 * cp_size - cp_rank) * chunk, device=device
            )
        )
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
