"""``hf_weights`` (the whole model) under TP = 2, EP = 2 and PP = 2 (two gloo ranks) equals the one-rank export.

As ``tests/distributed/test_export_parallel.py`` does for the MTP layers: every rank builds the model on one
rank's layout and exports it (the reference), then builds it under the parallel layout, gives it the
reference's weights sharded as mcore shards them (that test's ``_shard``; under PP each stage's decoder
layers by their global numbers, the embedding on the first stage and on the MTP stage, the head on the
last) and exports it again:

* TP = 2 (DeepSeek-style MLA + MoE; Qwen-style GQA with QKV bias): both ranks yield the reference's pairs,
  the embedding and the head gathered over the vocabulary, bit for bit;
* EP = 2: both ranks yield every expert of every MoE layer, decoder and MTP;
* PP = 2: with ``all_stages`` (default) both stages yield the reference's pairs (the first stage's decoder
  layer and embedding, the last stage's decoder layer, norm, head and MTP layers); with ``all_stages=False``
  each stage yields its own, and together they are the reference's.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import pytest
import torch
from torch import Tensor

from mtp_hooks.export import hf_weights
from tests.distributed.test_export_parallel import _shape, _shard
from tests.support.distributed import SpawnedGroup
from tests.support.export_cases import set_expert_bias
from tests.support.mcore_moe import DEEPSEEK_MISSING

pytestmark = pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")

SEED = 11
LAYOUTS = {"deepseek": "deepseek_v3", "qwen": "mimo"}


def _pairs(model: torch.nn.Module, layout: str, **kwargs: Any) -> dict[str, Tensor]:
    pairs = list(hf_weights(model, layout, **kwargs))
    assert len(pairs) == len({name for name, _ in pairs}), "a name repeats"
    return {name: tensor.clone() for name, tensor in pairs}


def _shard_stage(model: torch.nn.Module, full: dict[str, Tensor]) -> None:
    """PP: this stage's tensors from the one-rank state, decoder layers by their global numbers."""
    numbers = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}." for i, layer in enumerate(model.decoder.layers)}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or not isinstance(tensor, Tensor):
                continue
            local = re.match(r"^decoder\.layers\.\d+\.", name)
            tensor.copy_(full[numbers[local.group(0)] + name[local.end():] if local else name])


def scenario_whole_export(family: str, layout: dict[str, int]) -> dict[str, Any]:
    """Reference on one rank's layout, then the parallel layout; asserts on every rank."""
    from megatron.core import parallel_state

    from mtp_hooks.testing import cuda_calls_on_cpu, init_parallel, moe_mla_on_cpu
    from tests.support.mcore_moe import reset_moe_process_state

    pipeline = layout.get("pipeline_model_parallel_size", 1) > 1
    shape, name = _shape(family, pipeline), LAYOUTS[family]
    with moe_mla_on_cpu(), cuda_calls_on_cpu():
        init_parallel()
        reference_model = shape.build(SEED)
        set_expert_bias(reference_model)
        reference = _pairs(reference_model, name)
        full = {k: v.detach().clone() for k, v in reference_model.state_dict().items() if isinstance(v, Tensor)}
        reset_moe_process_state()
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**layout)
        try:
            stage: dict[str, Any] = {}
            if pipeline:
                stage = {"pre_process": parallel_state.is_pipeline_first_stage(), "post_process": parallel_state.is_pipeline_last_stage()}
            model = shape.build(SEED + 1, **stage)  # other initial weights: every value must come from the shards
            _shard_stage(model, full) if pipeline else _shard(model, full)
            gathered = _pairs(model, name)
            assert set(gathered) == set(reference), sorted(set(gathered) ^ set(reference))
            for key, tensor in reference.items():
                assert gathered[key].dtype == tensor.dtype and torch.equal(gathered[key], tensor), key
            own = _pairs(model, name, all_stages=False)
            assert all(torch.equal(tensor, reference[key]) for key, tensor in own.items())
            reset_moe_process_state()
            return {"pairs": len(gathered), "own": sorted(own)}
        finally:
            parallel_state.destroy_model_parallel()
            init_parallel()


@pytest.fixture(scope="module")
def group() -> Iterator[SpawnedGroup]:
    with SpawnedGroup(world_size=2) as spawned:
        yield spawned


@pytest.mark.parametrize("family, layout", [
    ("deepseek", {"tensor_model_parallel_size": 2}),
    ("qwen", {"tensor_model_parallel_size": 2}),
    ("deepseek", {"expert_model_parallel_size": 2}),
    ("qwen", {"pipeline_model_parallel_size": 2}),
    ("deepseek", {"pipeline_model_parallel_size": 2}),
])
def test_whole_export_gathers_the_one_rank_export_on_every_rank(group: SpawnedGroup, family: str, layout: dict[str, int]) -> None:
    results = group.run(scenario_whole_export, {}, family=family, layout=layout, timeout_s=300.0)
    assert results[0]["pairs"] == results[1]["pairs"]
    if "pipeline_model_parallel_size" in layout:  # each stage its own, together the whole model, no name twice
        first, last = (set(r["own"]) for r in results)
        assert not first & last and len(first | last) == results[0]["pairs"]
        assert "model.embed_tokens.weight" in first and {"lm_head.weight", "model.norm.weight"} <= last
    else:
        assert all(len(r["own"]) == r["pairs"] for r in results)
