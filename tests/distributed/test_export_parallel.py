"""``mtp_hf_weights`` under TP = 2, EP = 2 and PP = 2 (two gloo ranks) equals the one-rank export of the same weights.

Every rank first builds the model on one rank's layout (TP = PP = EP = 1) and exports it: the
reference. It then builds the same shape under the parallel layout and gives it the reference's
weights, sharded here as mcore shards them (column-parallel tensors along dim 0, a gated
``linear_fc1`` as ``cat(gate_r, up_r)`` per rank, row-parallel ones along dim 1; local expert e of
EP rank r is global expert ``r * local + e``). That the sharded model is the reference's model is
checked by stock mcore itself: its MTP losses on one batch equal the reference's. Then:

* TP = 2 (DeepSeek-style MLA + MoE with expert TP, and Qwen-style GQA with qkv bias): both ranks
  yield the reference's pairs, bit for bit;
* EP = 2 (two of four experts per rank): both ranks yield all four experts, as the reference;
* PP = 2 (the MTP layers on the last stage): with ``all_stages`` (default) both stages yield the
  reference's pairs; with ``all_stages=False`` the last stage does and the first yields nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from mtp_hooks.export import mtp_hf_weights
from tests.support.distributed import SpawnedGroup
from tests.support.export_cases import VOCAB, deepseek_v3_shape, qwen_shape, set_expert_bias
from tests.support.mcore_moe import DEEPSEEK_MISSING

pytestmark = pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")

SEED = 11
LAYOUTS = {"deepseek": "deepseek_v3", "qwen": "mimo"}


def _shape(family: str, pipeline: bool) -> Any:
    if family == "deepseek":
        overrides = {"batch_p2p_comm": False} if pipeline else {}
        return deepseek_v3_shape(mtp_num_layers=2, **overrides)
    return qwen_shape(mtp_num_layers=2)


def _mtp_losses(model: torch.nn.Module) -> list[float]:
    """Stock mcore's per-depth MTP losses of one training step. The MoE layers run in eval mode:
    under TP, mcore refuses training MoE layers without sequence parallelism, which the CPU norms
    lack; their routing and outputs are the same (no aux loss, no bias update, no jitter here)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mtp_hooks.testing import make_batch, stock_mtp_losses, stock_train_step

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.eval()
    stock_train_step(model, make_batch(VOCAB, batch=2, seq=16, seed=4))
    return stock_mtp_losses()


def _shard(model: torch.nn.Module, full: dict[str, Tensor]) -> int:
    """Copy ``full`` (one rank's state) into ``model``'s shards as mcore lays them out; returns the
    number of tensors that are sharded on this layout."""
    import re

    from megatron.core import parallel_state as ps

    gated = model.config.gated_linear_unit
    sharded = 0
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or not isinstance(tensor, Tensor):
                continue
            source = name
            expert = re.search(r"local_experts\.(\d+)\.", name)
            if expert is not None:
                per_rank = len(model.get_submodule(name[: expert.start()] + "local_experts"))
                number = ps.get_expert_model_parallel_rank() * per_rank + int(expert.group(1))
                source = name[: expert.start()] + f"local_experts.{number}." + name[expert.end() :]
                sharded += ps.get_expert_model_parallel_world_size() > 1
            value = full[source]
            if getattr(tensor, "tensor_model_parallel", False):
                if expert is not None:
                    size, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
                else:
                    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
                if gated and "linear_fc1.weight" in name:
                    gate, up = value.chunk(2)
                    value = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
                else:
                    value = value.chunk(size, dim=tensor.partition_dim)[rank]
                sharded += size > 1
            tensor.copy_(value)
    return sharded


def _pairs(model: torch.nn.Module, layout: str, **kwargs: Any) -> dict[str, Tensor]:
    pairs = list(mtp_hf_weights(model, layout, **kwargs))
    assert len(pairs) == len({name for name, _ in pairs}), "a name repeats"
    return {name: tensor.clone() for name, tensor in pairs}


def _assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))  # EP: experts come by local slot
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


def scenario_export(family: str, layout: dict[str, int]) -> dict[str, Any]:
    """Reference on one rank's layout, then the parallel layout; asserts on every rank."""
    from megatron.core import parallel_state

    from mtp_hooks.testing import cuda_calls_on_cpu, init_parallel
    from mtp_hooks.testing import moe_mla_on_cpu
    from tests.support.mcore_moe import reset_moe_process_state

    pipeline = layout.get("pipeline_model_parallel_size", 1) > 1
    shape = _shape(family, pipeline)
    name = LAYOUTS[family]
    with moe_mla_on_cpu(), cuda_calls_on_cpu():
        init_parallel()
        reference_model = shape.build(SEED)
        set_expert_bias(reference_model)
        reference = _pairs(reference_model, name)
        reference_losses = [] if pipeline else _mtp_losses(reference_model)
        full = {k: v.detach().clone() for k, v in reference_model.state_dict().items() if not k.endswith("_extra_state")}
        reset_moe_process_state()
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**layout)
        try:
            stage: dict[str, Any] = {}
            if pipeline:
                stage = {"pre_process": parallel_state.is_pipeline_first_stage(), "post_process": parallel_state.is_pipeline_last_stage()}
            model = shape.build(SEED + 1, **stage)  # other initial weights: every MTP value must come from the shards
            if pipeline:
                sharded = _shard_mtp_by_name(model, full)
            else:
                sharded = _shard(model, full)
                torch.testing.assert_close(_mtp_losses(model), reference_losses, atol=1e-6, rtol=1e-5)
            gathered = _pairs(model, name)
            _assert_same(gathered, reference)
            own_stage = _pairs(model, name, all_stages=False)
            if getattr(model, "mtp_process", False):
                _assert_same(own_stage, reference)
            else:
                assert own_stage == {}
            reset_moe_process_state()
            return {"sharded": sharded, "pairs": len(gathered), "own_stage": len(own_stage), "holds_mtp": bool(getattr(model, "mtp_process", False))}
        finally:
            parallel_state.destroy_model_parallel()
            init_parallel()


def _shard_mtp_by_name(model: torch.nn.Module, full: dict[str, Tensor]) -> int:
    """PP: the MTP layers sit whole on the last stage, under the one-rank names."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.startswith("mtp.") and isinstance(tensor, Tensor) and not name.endswith("_extra_state"):
                tensor.copy_(full[name])
    return 0


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_tensor_parallel_export_gathers_the_one_rank_export_on_both_ranks(group: SpawnedGroup, family: str) -> None:
    results = group.run(scenario_export, {}, family=family, layout={"tensor_model_parallel_size": 2}, timeout_s=300.0)
    assert all(r["sharded"] > 0 and r["pairs"] == r["own_stage"] == 2 * (30 if family == "deepseek" else 16) for r in results)


def test_expert_parallel_export_holds_every_expert_on_both_ranks(group: SpawnedGroup) -> None:
    results = group.run(scenario_export, {}, family="deepseek", layout={"expert_model_parallel_size": 2}, timeout_s=300.0)
    # 3 MoE layers (decoder layer 1, 2 MTP layers) x 2 local experts x (fc1, fc2) taken from other experts' numbers
    assert all(r["sharded"] == 3 * 2 * 2 and r["pairs"] == 60 for r in results)


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_pipeline_export_reaches_every_stage_or_only_the_mtp_stage(group: SpawnedGroup, family: str) -> None:
    results = group.run(scenario_export, {}, family=family, layout={"pipeline_model_parallel_size": 2}, timeout_s=300.0)
    pairs = 2 * (30 if family == "deepseek" else 16)
    assert [r["holds_mtp"] for r in results] == [False, True]
    assert [r["pairs"] for r in results] == [pairs, pairs]
    assert [r["own_stage"] for r in results] == [0, pairs]
