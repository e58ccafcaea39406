"""What vLLM accepts of the drafts ``mtp_hooks`` exports, for every layout vLLM's ``method="mtp"`` resolves.

For DeepSeek-V3 (``deepseek_mtp``: MLA, MoE MTP layer), GLM-4.5 (``glm4_moe_mtp``: GQA, MoE) and
MiMo (``mimo_mtp``: dense, ``input_proj`` halves swapped), one engine each, started on a folder
whose MTP layers ``mtp_hf_weights`` wrote from a real mcore model (``tests/support/engine_models``):

* a "copy" draft (weights that predict the counting target exactly) is accepted 1.000 at T = 0;
* drafts pushed into the running engine (``VLLMSync``) are accepted as their weights predict:
  the engine's per-position acceptance equals the weights' own (their argmax agreement over the
  engine's steps, replayed) within 0.02, for a noisy draft and a random one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

from mtp_hooks.engine import VLLMSync, generate_greedy
from mtp_hooks.export import mtp_hf_weights
from mtp_hooks.testing import engine_models as em
from tests.engine.conftest import copy_draft_engine

PROMPTS = em.counting_prompts(16)
TOKENS = 64


@dataclasses.dataclass
class Served:
    family: str
    model: torch.nn.Module  # the trainer
    llm: Any
    sync: VLLMSync

    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        return list(mtp_hf_weights(self.model, em.LAYOUTS[self.family]))

    def eh_proj(self) -> torch.Tensor:
        return self.model.state_dict()["mtp.layers.0.eh_proj.weight"]


@pytest.fixture(scope="module", params=em.FAMILIES)
def served(request: pytest.FixtureRequest, engines: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Served:
    model, llm = copy_draft_engine(request.param, engines, tmp_path_factory)
    return Served(request.param, model, llm, VLLMSync(llm))


def _set_draft(served: Served, draft: str, sigma: float = 0.0) -> None:
    with torch.no_grad():
        served.model.state_dict(keep_vars=True)["mtp.layers.0.eh_proj.weight"].copy_(em.draft_matrix(draft, sigma))


def test_copy_draft_exported_by_mtp_hooks_is_accepted_fully(served: Served) -> None:
    measured = generate_greedy(served.llm, PROMPTS, TOKENS)
    assert em.predicted_acceptance(served.eh_proj(), PROMPTS, TOKENS) == 1.0
    assert measured.counts.drafts > 0 and measured.per_position == (1.0,), served.family
    assert measured.token_ids[0][:4] == tuple(PROMPTS[0][-1] + 1 + j for j in range(4))  # the target counts


@pytest.mark.parametrize("draft, sigma", [("noisy", 3.0), ("noisy", 5.0), ("random", 0.0)])
def test_pushed_draft_is_accepted_as_its_weights_predict(served: Served, draft: str, sigma: float) -> None:
    _set_draft(served, draft, sigma)
    served.sync.push(served.pairs())
    served.sync.check(served.pairs())
    predicted = em.predicted_acceptance(served.eh_proj(), PROMPTS, TOKENS)
    measured = generate_greedy(served.llm, PROMPTS, TOKENS).per_position[0]
    assert abs(measured - predicted) <= 0.02, (served.family, draft, sigma, measured, predicted)
    if draft == "random":
        assert predicted < 0.05
    else:
        assert 0.05 < predicted < 0.95  # neither extreme: the comparison can fail


def test_copy_draft_pushed_back_is_accepted_fully_again(served: Served) -> None:
    _set_draft(served, "copy")
    served.sync.push(served.pairs())
    assert served.sync.check(served.pairs()) == len(served.pairs())
    assert generate_greedy(served.llm, PROMPTS, TOKENS).per_position == (1.0,)
