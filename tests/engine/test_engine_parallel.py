"""Drafts exported from tensor-, pipeline- and expert-parallel trainers, decided by vLLM.

Two gloo ranks build DeepSeek-V3 (MLA, MoE MTP layer: ``tests/support/engine_models``) under
TP = 2, PP = 2 (MTP on the last stage) or EP = 2, give it the counting target and a draft (full
tensors from seeded generators, each rank keeping its shard), and export its MTP layers with
``mtp_hf_weights``, which gathers the shards. The pairs of rank 0 are pushed into one engine
(started on an unsharded build's random draft) with ``VLLMSync``:

* the push takes every pair and reaches every draft parameter (experts from both EP ranks);
* a copy draft is accepted 1.000 at T = 0;
* a noisy draft's ``eh_proj`` (split over the TP ranks) is accepted as the full matrix predicts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch

from mtp_hooks.engine import VLLMSync, generate_greedy
from mtp_hooks.testing import engine_models as em
from tests.support.distributed import SpawnedGroup

FAMILY = "deepseek_v3"
PROMPTS = em.counting_prompts(16)
TOKENS = 64
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "ep2": {},  # expert parallelism is set up by the scenario
}


def scenario_export(parallel: str, draft: str, sigma: float) -> Any:
    """On every rank: build, set the weights, export (collective); rank 0 returns the pairs."""
    from megatron.core import parallel_state

    from mtp_hooks.export import mtp_hf_weights
    from mtp_hooks.testing import cuda_calls_on_cpu

    if parallel == "ep2":
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        stage = {"pre_process": parallel_state.is_pipeline_first_stage(), "post_process": parallel_state.is_pipeline_last_stage()}
        with cuda_calls_on_cpu():  # the pipeline stages' shared embedding is set up with .cuda()
            model = em.trainer(FAMILY, draft, sigma, **stage)
            pairs = [(name, tensor.detach().clone()) for name, tensor in mtp_hf_weights(model, em.LAYOUTS[FAMILY])]
        local_experts = sum(1 for name, _ in model.named_parameters() if ".local_experts." in name and name.endswith("linear_fc2.weight"))
        return {"rank": torch.distributed.get_rank(), "pairs": pairs, "local_experts": local_experts, "holds_mtp": model.mtp_process}
    finally:
        if parallel == "ep2":
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel()


@pytest.fixture(scope="module")
def group() -> Iterator[SpawnedGroup]:
    with SpawnedGroup(world_size=2) as spawned:
        yield spawned


@pytest.fixture(scope="module")
def served(engines: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, VLLMSync]:
    model = em.trainer(FAMILY, "random")
    llm = engines(em.engine_folder(tmp_path_factory.mktemp(FAMILY), FAMILY, model), 1)
    return llm, VLLMSync(llm)


def _exported(group: SpawnedGroup, parallel: str, draft: str, sigma: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    results = group.run(scenario_export, LAYOUTS[parallel], timeout_s=600.0, parallel=parallel, draft=draft, sigma=sigma)
    first, second = sorted(results, key=lambda r: r["rank"])
    if parallel == "ep2":
        # half the experts on each rank, in decoder layer 1 and in the MTP layer
        assert first["local_experts"] == second["local_experts"] == 2 * (em.shape(FAMILY).num_experts // 2)
    if parallel == "pp2":
        assert (first["holds_mtp"], second["holds_mtp"]) == (False, True)
    # every rank yields the same full tensors (all_stages: the MTP stage broadcasts them)
    assert [n for n, _ in first["pairs"]] == [n for n, _ in second["pairs"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first["pairs"], second["pairs"]))
    return first["pairs"]


@pytest.mark.parametrize("parallel", sorted(LAYOUTS))
def test_copy_draft_exported_from_a_parallel_trainer_is_accepted_fully(group: SpawnedGroup, served: tuple[Any, VLLMSync], parallel: str) -> None:
    llm, sync = served
    pairs = _exported(group, parallel, "copy")
    sync.push(pairs)  # raises unless every pair is taken and every draft parameter reached
    sync.check(pairs)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,), parallel
    sync.push([(name, torch.randn_like(t) * 0.02 if name.endswith("eh_proj.weight") else t) for name, t in pairs])
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position[0] < 0.05  # the engine did change: the next push counts


def test_noisy_draft_split_over_tensor_parallel_ranks_is_accepted_as_the_full_matrix_predicts(group: SpawnedGroup, served: tuple[Any, VLLMSync]) -> None:
    llm, sync = served
    pairs = _exported(group, "tp2", "noisy", 3.0)
    sync.push(pairs)
    predicted = em.predicted_acceptance(em.draft_matrix("noisy", 3.0), PROMPTS, TOKENS)
    measured = generate_greedy(llm, PROMPTS, TOKENS).per_position[0]
    assert 0.05 < predicted < 0.95 and abs(measured - predicted) <= 0.02, (measured, predicted)
