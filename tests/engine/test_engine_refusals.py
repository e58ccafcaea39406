"""Mistakes on the engine path get a typed error before anything changes, and a refused push is atomic.

One engine per family (DeepSeek-V3: MLA, whose derived tensors vLLM computes after loading; GLM-4.5;
MiMo), started on the trainer's copy draft and given one good push; then each mistake:

* pairs of the wrong type (a dict, bare tensors, integer tensors), a tensor of the wrong shape, a
  partial push of random values (3 tensors), a push under another layer's names: ``MTPHooksError``
  naming ``weights``; the engine still drafts the good push (acceptance 1.000) and ``check`` of the
  good pairs passes;
* vLLM failing once its loader has started writing (a fault injected into the draft's
  ``load_weights`` after its first tensor): the engine is marked stale, every ``check`` says why,
  until a good push;
* ``start_vllm`` on a missing folder: ``MTPHooksError`` (a push after ``stop_vllm``: test_engine_shutdown.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mtp_hooks.engine import StaleDraftError, VLLMSync, generate_greedy, start_vllm
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export import mtp_hf_weights
from mtp_hooks.testing import engine_models as em
from tests.engine.conftest import ENGINE_CONFIG, copy_draft_engine
from tests.support import engine_pushes

PROMPTS = em.counting_prompts(8)
TOKENS = 32


@dataclasses.dataclass
class Served:
    family: str
    model: torch.nn.Module
    llm: Any
    sync: VLLMSync

    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        return list(mtp_hf_weights(self.model, em.LAYOUTS[self.family]))

    def holds_the_good_push(self) -> None:
        assert self.sync.check(self.pairs()) == len(self.pairs())
        assert generate_greedy(self.llm, PROMPTS, TOKENS).per_position == (1.0,)


@pytest.fixture(scope="module", params=em.FAMILIES)
def served(request: pytest.FixtureRequest, engines: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Served:
    model, llm = copy_draft_engine(request.param, engines, tmp_path_factory)
    found = Served(request.param, model, llm, VLLMSync(llm))
    found.sync.push(found.pairs())
    found.holds_the_good_push()
    return found


def _refused(served: Served, weights: Any, match: str) -> None:
    with pytest.raises(MTPHooksError, match=match):
        served.sync.push(weights)
    served.holds_the_good_push()


def test_pairs_of_the_wrong_type_are_refused_naming_the_argument(served: Served) -> None:
    pairs = served.pairs()
    _refused(served, dict(pairs), r"^weights: bad value\n  expected: an iterable of \(hf_name, tensor\) pairs \(for a dict: weights.items\(\)\)")
    _refused(served, [t for _, t in pairs], r"^weights\[0\]: bad value\n  expected: a \(hf_name: str, tensor\) pair\n  received: tensor of dtype")
    _refused(served, [(pairs[0][0], pairs[0][1].to(torch.int64))], r"floating-point tensor")
    _refused(served, pairs + pairs[:1], r"each name once")


def test_a_tensor_of_the_wrong_shape_is_refused_before_anything_is_written(served: Served) -> None:
    pairs = served.pairs()
    name, tensor = next((n, t) for n, t in pairs if t.dim() == 2 and t.shape[0] != t.shape[1])
    wrong = [(n, t.t().contiguous() if n == name else t) for n, t in pairs]
    _refused(served, wrong, r"would not take the push whole; nothing was written")


def test_a_partial_push_of_random_values_is_refused_and_the_engine_keeps_the_good_draft(served: Served) -> None:
    generator = torch.Generator().manual_seed(0)
    partial = [(n, torch.randn(t.shape, generator=generator)) for n, t in served.pairs()[:3]]
    _refused(served, partial, r"(?s)nothing was written.*parameters the push would leave unwritten \['")


def test_a_push_under_another_layers_names_is_refused_with_the_librarys_error(served: Served) -> None:
    """vLLM's DeepSeek-V3 loader raises its own ``ValueError`` (layer weights missing) for such a push:
    the rehearsal meets it on meta and refuses with ``MTPHooksError``."""

    def elsewhere(name: str) -> str:
        return re.sub(r"(layers|mtp_layers)\.(\d+)\.", lambda m: f"{m.group(1)}.{int(m.group(2)) + 7}.", name, count=1)

    _refused(served, [(elsewhere(n), t) for n, t in served.pairs()], r"nothing was written")


def test_a_load_that_fails_midway_marks_the_engine_stale_until_a_good_push(served: Served) -> None:
    served.llm.collective_rpc(engine_pushes.fail_next_load_after_first_tensor)
    with pytest.raises(MTPHooksError, match=r"failed after writing began; the engine is marked stale"):
        served.sync.push(served.pairs())
    with pytest.raises(StaleDraftError, match=r"(?s)expected: the last push complete\n  received: vLLM's load failed midway: RuntimeError: injected"):
        served.sync.check(served.pairs())
    served.sync.push(served.pairs())
    served.holds_the_good_push()


def test_stale_draft_error_names_both_sides_and_why_they_differ(served: Served) -> None:
    pairs = served.pairs()
    changed = [(n, t + 1 if i == 0 else t) for i, (n, t) in enumerate(pairs)]
    with pytest.raises(StaleDraftError, match=rf"^{re.escape(pairs[0][0])}: (?s:.*)names: the trainer's {re.escape(pairs[0][0])} is held by the engine's model\."):
        served.sync.check(changed)


def test_start_vllm_on_a_missing_folder_is_refused_naming_the_argument(tmp_path: Path) -> None:
    with pytest.raises(MTPHooksError, match=r"^model: bad value\n  expected: a local HF folder with config.json(?s:.*)no such folder"):
        start_vllm(str(tmp_path / "missing"), 1, config=ENGINE_CONFIG)
    with pytest.raises(MTPHooksError, match=r"a folder without config.json"):
        start_vllm(str(tmp_path), 1, config=ENGINE_CONFIG)
