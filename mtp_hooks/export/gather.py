"""The tensors of one pipeline stage as full tensors: TP shards and EP experts gathered.

Each tensor of the stage's MTP layers (``mtp_units``) or of its main model (``main_units``:
embedding, decoder layers, final norm, output layer) — parameters, and persistent buffers such as
the router's ``expert_bias`` — becomes one *unit*: the full tensors it contributes, under mcore's
unsharded names (``mtp.layers.{i}.…``, ``decoder.layers.{n}.…`` with n global, experts numbered
globally):

* a tensor-parallel parameter (mcore's ``tensor_model_parallel`` attribute) is all-gathered over
  its layer's TP group and concatenated along its ``partition_dim``: 0 for column-parallel layers
  (``linear_qkv``, ``linear_fc1``, ``eh_proj``, MLA's projections), 1 for row-parallel ones
  (``linear_proj``, ``linear_fc2``). A gated ``linear_fc1`` holds ``cat(gate_r, up_r)`` on rank
  r, so its shards are split and the gates and ups concatenated apart;
* a routed expert's weight is gathered over the expert-TP group the same way, then all-gathered
  over the expert-parallel group: local expert e of EP rank r is global expert
  ``r * num_local_experts + e``, each rank's unit holds the expert at e of every EP rank;
* everything else (norms, router, ``expert_bias``, replicated projections) is taken as it is.

Every rank of the stage must run the units in the same order (they are collectives); every rank
ends up with the same full tensors. Tensors that need no gathering are the model's own (detached,
no copy).
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.export.names import EXPERT, expert_name

__all__ = ["main_units", "mtp_units"]

Unit = list[tuple[str, Tensor]]


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _all_gather(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    shards = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _gather_tensor_parallel(tensor: Tensor, group: Optional[dist.ProcessGroup], gated: bool) -> Tensor:
    """The full tensor of a TP-sharded parameter (``gated``: a gated ``linear_fc1``)."""
    if not getattr(tensor, "tensor_model_parallel", False) or _size(group) == 1:
        return tensor.detach()
    dim = getattr(tensor, "partition_dim", 0)
    shards = _all_gather(tensor.detach(), group)
    if gated:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _is_gated_fc1(rest: str, config: Any) -> bool:
    fc1 = rest.endswith("linear_fc1.weight") or ".linear_fc1.weight" in rest
    return bool(getattr(config, "gated_linear_unit", False)) and fc1


def _owner(layer: nn.Module, rest: str) -> nn.Module:
    module_path = rest.rpartition(".")[0]
    return layer.get_submodule(module_path) if module_path else layer


def _layer_units(prefix: str, layer: nn.Module, body: str, config: Any) -> Iterator[Unit]:
    """The units of one transformer layer's tensors, named ``prefix + rest``; ``body`` is the attribute
    path of the transformer layer inside ``layer`` (``""``: ``layer`` is one), under which routed experts
    are gathered over expert TP and EP."""
    for rest, tensor in layer.state_dict(keep_vars=True).items():
        if rest.endswith("_extra_state") or not isinstance(tensor, Tensor):
            continue
        owner = _owner(layer, rest)
        inner = rest if not body else rest[len(body) + 1 :] if rest.startswith(body + ".") else None
        expert = EXPERT.match(inner) if inner is not None else None
        if expert is None:
            full = _gather_tensor_parallel(tensor, _mcore.tp_group_of(owner), _is_gated_fc1(rest, config))
            yield [(prefix + rest, full)]
            continue
        experts = layer.get_submodule(f"{body}.mlp.experts" if body else "mlp.experts")
        full = _gather_tensor_parallel(tensor, _mcore.expert_tp_group_of(owner), _is_gated_fc1(rest, config))
        local = int(expert.group("local") if expert.group("local") is not None else expert.group("te"))
        ep_group = _mcore.expert_parallel_group_of(experts)
        peers = _all_gather(full, ep_group) if _size(ep_group) > 1 else [full]
        per_rank = experts.num_local_experts
        where = f"{prefix}{body}." if body else prefix
        yield [(f"{where}{expert_name(inner, rank * per_rank + local)}", peer) for rank, peer in enumerate(peers)]


def mtp_units(language_model: nn.Module) -> Iterator[Unit]:
    """The units of every MTP layer this stage holds, layer by layer, in ``state_dict`` order.

    A stage without MTP layers has none. With ``mtp_use_repeated_layer`` (0.19+) the one layer
    built is exported once, as MTP layer 0.
    """
    block = getattr(language_model, "mtp", None)
    if block is None or not getattr(language_model, "mtp_process", False):
        return
    for index, layer in enumerate(block.layers):
        yield from _layer_units(f"mtp.layers.{index}.", layer, _mcore.mtp_layer_body_name(layer), language_model.config)


def main_units(language_model: nn.Module) -> Iterator[Unit]:
    """The units of the main model's tensors this stage (or model chunk) holds, in ``state_dict`` order,
    under unsharded names: ``embedding.word_embeddings.weight`` on the first stage only (the MTP stage
    holds a copy), each decoder layer as ``decoder.layers.{n}.*`` with n its global 0-based number
    (mcore's ``layer_number - 1``), then ``decoder.final_layernorm`` and ``output_layer`` where this
    stage has them. The MTP layers are not in it (``mtp_units``)."""
    layers = getattr(getattr(language_model, "decoder", None), "layers", None) or []
    numbers = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}." for i, layer in enumerate(layers)}
    config = language_model.config
    done: set[str] = set()
    for name, tensor in language_model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(tensor, Tensor) or name.startswith("mtp."):
            continue
        if name.startswith("embedding.") and not getattr(language_model, "pre_process", True):
            continue
        local = re.match(r"^decoder\.layers\.\d+\.", name)
        if local is None:
            yield [(name, _gather_tensor_parallel(tensor, _mcore.tp_group_of(_owner(language_model, name)), False))]
        elif local.group(0) not in done:  # a whole layer at once: its experts gather together
            done.add(local.group(0))
            layer = language_model.get_submodule(local.group(0)[:-1])
            yield from _layer_units(numbers[local.group(0)], layer, "", config)
