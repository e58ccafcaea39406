"""Full mcore MTP tensors -> (HF name, tensor) pairs: the splits and the one swap.

* ``linear_fc1`` of a gated MLP (dense, shared or routed expert) is ``cat(gate, up)`` along its
  output dim: the first half is ``gate_proj``, the second ``up_proj``.
* ``linear_qkv`` is grouped and interleaved: for each of the G query groups, its queries
  (heads / G heads of ``kv_channels`` rows each), then its key, then its value. ``q_proj``,
  ``k_proj`` and ``v_proj`` take the groups' parts in group order (weights and biases alike).
* ``eh_proj`` in the ``"mimo"`` layout: MiMo's ``input_proj`` reads ``cat(hidden, embedding)``,
  mcore's ``eh_proj`` ``cat(embedding, hidden)``: the two column halves change places.

The main model's decoder layers split the same way (``main_hf_pairs``). Every other tensor keeps
its values and layout. The tensors are full ones (``gather.py`` makes
them so); a split returns views where it can (no copy), so they alias the model's parameters.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export.layouts import Layout
from mtp_hooks.export.names import COPY, GATE_UP, QKV, SWAP_HALVES, Target, hf_target, main_target

__all__ = ["hf_pairs", "main_hf_pairs", "split_gate_up", "split_qkv", "swap_halves"]


def split_gate_up(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """``linear_fc1`` of a gated MLP -> (gate, up)."""
    gate, up = tensor.chunk(2, dim=0)
    return gate, up


def split_qkv(tensor: Tensor, config: Any) -> tuple[Tensor, Tensor, Tensor]:
    """mcore's grouped interleaved ``linear_qkv`` weight ``[(H + 2G) d, h]`` (or bias) -> (q, k, v)."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels
    per_group = heads // groups
    grouped = tensor.reshape(groups, (per_group + 2) * head_dim, *tensor.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    rest = tensor.shape[1:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def swap_halves(tensor: Tensor) -> Tensor:
    """The two halves of a ``[h, 2h]`` projection's input columns, exchanged (a new tensor)."""
    first, second = tensor.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def hf_pairs(name: str, tensor: Tensor, config: Any, layout: Layout) -> list[tuple[str, Tensor]]:
    """One full MTP tensor (``mtp.layers.{i}.*``, global expert numbers) under its HF names."""
    return _split(hf_target(name, config, layout), tensor, config)


def main_hf_pairs(name: str, tensor: Tensor, config: Any) -> list[tuple[str, Tensor]]:
    """One full main-model tensor (``names.main_target``'s names) under its HF names."""
    return _split(main_target(name, config), tensor, config)


def _split(target: Target, tensor: Tensor, config: Any) -> list[tuple[str, Tensor]]:
    if target.split == COPY:
        parts: tuple[Tensor, ...] = (tensor,)
    elif target.split == SWAP_HALVES:
        parts = (swap_halves(tensor),)
    elif target.split == GATE_UP:
        parts = split_gate_up(tensor)
    else:
        assert target.split == QKV, target.split
        parts = split_qkv(tensor, config)
    return list(zip(target.names, parts))


def hf_pairs_of_state_dict(state_dict: Mapping[str, Any], config: Any, layout: Layout) -> Iterator[tuple[str, Tensor]]:
    """The MTP tensors of an unsharded mcore ``GPTModel`` state dict under HF names (checked eagerly)."""
    names = [name for name in state_dict if name.startswith("mtp.layers.") and not name.endswith("_extra_state")]
    if not names:
        raise MTPHooksError(
            "state_dict: no MTP layer tensors\n  expected: an mcore GPTModel state dict with mtp.layers.{i}.* keys\n"
            f"  received: {len(state_dict)} keys, none under mtp.layers."
        )
    for name in names:
        hf_target(name, config, layout)  # every name has a target before the first pair leaves
    return (pair for name in names for pair in hf_pairs(name, state_dict[name], config, layout))
