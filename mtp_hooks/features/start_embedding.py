"""``start_embedding``: the token embedding MTP layer 1 reads at each sequence's position 0.

``"kept"`` (default): mcore's, the embedding of the sequence's second token. ``"zeroed"``: zeros, as vLLM's
DeepSeek-V3, GLM-4.5 and MiMo drafters feed it ("masking inputs at position 0, as not needed by MTP"), so that every
later position's attention back to the sequence's start reads the key and value the engine computes there. The
block's call of MTP layer 1 (draft step 1; a chain's later steps run at later positions in the engine) gets its
embedding module through ``ZeroedStart``, whose output has this rank's position-0 rows zeroed: row 0 of an unpacked
batch on the rank that holds it (context-parallel rank 0, and tensor-parallel rank 0 under sequence parallelism),
each packed sequence's first row on context-parallel rank 0. The embedding's output enters the layer as an argument,
so a full activation recompute of the layer recomputes from the zeroed tensor.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.ops.vocab_parallel import group_rank, group_size
from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import ForwardOnlyProxy


def wanted(options: Options) -> bool:
    return options.start_embedding == "zeroed"


def layer_keywords(options: Options) -> tuple[str, ...]:
    """The MTP layers' keyword arguments ``on_layer_pre`` rewrites (checked against the release at ``attach``)."""
    return ("embedding", "hidden_states") if wanted(options) else ()


class ZeroedStart(ForwardOnlyProxy):
    """An embedding module whose output ``[s, b, h]`` has the rows ``starts`` zeroed: ``None`` for row 0, or ``[n]``
    indices on the output's device, where an index equal to ``s`` stands for a sequence start on another rank."""

    def __init__(self, embedding: Any, starts: Optional[Tensor]) -> None:
        super().__init__(embedding)
        self._self_starts = starts

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        out = self.__wrapped__(*args, **kwargs)
        if self._self_starts is None:
            return torch.cat([torch.zeros_like(out[:1]), out[1:]])
        rows = torch.zeros(out.shape[0] + 1, dtype=torch.bool, device=out.device)
        rows.scatter_(0, self._self_starts, True)
        return out.masked_fill(rows[:-1].view(-1, *([1] * (out.dim() - 1))), 0.0)


def _sequence_parallel_rank(model: nn.Module) -> int:
    """This rank in the tensor-parallel group that splits the embedding's rows (0 without sequence parallelism)."""
    if not getattr(model.config, "sequence_parallel", False):
        return 0
    return group_rank(_mcore.tp_group_of(model.embedding.word_embeddings))


def starts_on_this_rank(model: nn.Module, packed: Any, rows: int) -> tuple[bool, Optional[Tensor]]:
    """Whether a sequence may start among this rank's ``rows`` embedding rows, and where: ``None`` for row 0 of an
    unpacked batch, else ``[n]`` row indices on the layout's device (``rows`` for a packed sequence's start on another
    rank). Computed on the device from the layout: no host read of ``cu_seqlens``."""
    cp_group = _mcore.cp_group_of(model, packed)
    on_cp_start, tp_rank = group_rank(cp_group) == 0, _sequence_parallel_rank(model)
    if packed is None:
        return on_cp_start and tp_rank == 0, None
    bounds = getattr(packed, "cu_seqlens_q_padded", None)
    bounds = packed.cu_seqlens_q if bounds is None else bounds
    local = bounds[:-1].to(torch.long) // group_size(cp_group) - tp_rank * rows  # each slot's first row here
    inside = (local >= 0) & (local < rows) & on_cp_start
    return on_cp_start, torch.where(inside, local, torch.full_like(local, rows))


def on_layer_pre(options: Options, forward: Forward, packed_layout: Any, kwargs: dict[str, Any]) -> None:
    """With ``"zeroed"``, the block's call of MTP layer 1 in a training forward: its embedding zeroed at position 0.
    ``packed_layout``: the block's padded packed layout (``features.packing``), ``None`` unpacked."""
    embedding = kwargs.get("embedding")
    if not wanted(options) or forward.mtp_layer_calls != 0 or embedding is None:
        return
    # The embedding's rows on this rank are the layer's hidden states' ([s, b, h], split alike).
    holds_a_start, starts = starts_on_this_rank(forward.model, packed_layout, kwargs["hidden_states"].shape[0])
    if holds_a_start:
        kwargs["embedding"] = ZeroedStart(embedding, starts)
