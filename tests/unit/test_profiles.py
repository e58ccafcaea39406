"""``mtp_hooks.profiles``: each engine row's options, ``attach(engine=)`` and ``predict_engine_acceptance(engine=)``
taking them, conflicts and unknown rows refused, and docs/engine.md's table being the code's.

The vLLM 0.32 rows are decided by the engine in ``tests/engine/test_engine_recycle.py`` (every family, the
profile's prediction within 0.03 of vLLM) and ``test_engine_layer_schedule.py``; the others are read from code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import mtp_hooks
from mtp_hooks.predict import draft_hits, predict_engine_acceptance, replay
from mtp_hooks.profiles import FAMILIES, MLA_GEOMETRY, EngineProfile, megatron, sglang, vllm
from mtp_hooks.testing import engine_models as em
from mtp_hooks.testing import moe_mla_on_cpu

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_0_32_drafts_with_layer_1_in_its_cache_geometry_and_each_familys_inputs(family: str) -> None:
    profile = vllm("0.32", family, k=3)
    mtp_input = "pre_final_norm" if family == "mimo" else "decoder_output"
    assert profile.attach_options() == dict(
        draft_steps=3, draft_layers="first", draft_inputs="argmax", accept_rule="argmax", mtp_input=mtp_input,
        draft_geometry="chain" if family == "deepseek_v3" else "engine",  # MLA: not in the engine's geometry yet
        draft_recycle="unnormed" if family == "glm4_moe" else "normed",
        start_embedding="zeroed",  # vLLM's drafters zero MTP layer 1's token embedding at position 0: trained so
    )
    assert profile.predict_options() == dict(
        mtp_input=mtp_input,
        geometry="engine",
        recycle="unnormed" if family == "glm4_moe" else "normed",
        start_embedding="zeroed",  # vLLM's drafters zero MTP layer 1's token embedding at position 0
    )
    assert profile.untrained == ((MLA_GEOMETRY,) if family == "deepseek_v3" else ())  # MLA's geometry: not trained yet
    assert vllm("0.32", family, k=1).draft_geometry == "chain"  # one step: nothing to lay out
    assert vllm("0.34", family, k=3).recycle == "normed"  # 0.34 hands GLM-4.5's normed output on


def test_other_engines_rows() -> None:
    assert sglang("0.5.23", "deepseek_v3", 3).attach_options()["draft_layers"] == "per_step"
    assert sglang("0.5.23", "mimo", 3).predict_options() == dict(mtp_input="decoder_output", geometry="chain", recycle="normed",
                                                                 start_embedding="kept")
    assert megatron("0.19", "mimo", 2).attach_options() == dict(
        draft_steps=2, draft_layers="per_step", draft_inputs="sample", accept_rule="match", mtp_input="decoder_output",
        draft_geometry="chain", draft_recycle="normed", start_embedding="kept",
    )
    assert vllm("0.32", "mimo", 1).untrained == ()  # one step: everything vLLM does trains


def test_vllm_0_34_with_two_mtp_layers_cycles_them_each_over_its_own_cache() -> None:
    profile = vllm("0.34", "glm4_moe", 3, mtp_layers=2)
    assert profile.attach_options()["draft_layers"] == "cyclic" and profile.draft_geometry == "chain"
    assert profile.predict_options() == dict(mtp_input="decoder_output", geometry="chain", recycle="normed",
                                             start_embedding="zeroed")
    assert profile.untrained == () and profile.attach_options()["start_embedding"] == "zeroed"
    assert vllm("0.34", "glm4_moe", 1, mtp_layers=2).draft_layers == "first"  # one step: layer 1 alone
    assert vllm("0.34", "glm4_moe", 3).draft_layers == "first"  # one layer: the 0.32 schedule


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: vllm("0.31", "mimo", 2), "version"),
        (lambda: vllm("0.32", "llama", 2), "family"),
        (lambda: vllm("0.32", "mimo", 0), "k"),
        (lambda: vllm("0.32", "mimo", True), "k"),
        (lambda: vllm("0.34", "glm4_moe", 2, mtp_layers=0), "mtp_layers"),
        (lambda: sglang("0.5.22", "mimo", 2), "version"),
        (lambda: megatron("0.18", "mimo", 2), "version"),
    ],
)
def test_rows_we_do_not_know_or_cannot_train_are_refused(build: Any, argument: str) -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=rf"^{argument}: bad value"):
        build()


def test_attach_with_a_profile_is_attach_with_its_options() -> None:
    model = em.trainer("mimo", "copy")
    profile = vllm("0.32", "mimo", 2)
    with mtp_hooks.attached(model, engine=profile, agreement_metrics=True) as hooks:
        by_profile = hooks.options
    with mtp_hooks.attached(model, **profile.attach_options(), agreement_metrics=True) as hooks:
        assert hooks.options == by_profile
    with pytest.raises(mtp_hooks.MTPHooksError, match="^draft_steps: bad value"):
        mtp_hooks.attach(model, engine=profile, draft_steps=3)
    with pytest.raises(mtp_hooks.MTPHooksError, match="^engine: bad value"):
        mtp_hooks.attach(model, engine="vllm")
    assert mtp_hooks.hooks_of(model) is None


def test_prediction_with_a_profile_is_the_prediction_with_its_options() -> None:
    model = em.trainer("glm4_moe", "noisy", sigma=2.0)
    with torch.no_grad():  # a final norm far from 1: the recycle rule shows
        weight = model.mtp.layers[0].final_layernorm.weight
        weight.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(1)) * 3 + 0.25)
    profile = vllm("0.32", "glm4_moe", 2)
    prompts = em.counting_prompts(4)
    tokens = [[2 + (p[-1] - 2 + i) % (em.VOCAB - 2) for i in range(1, 21)] for p in prompts]  # the target's greedy run
    with moe_mla_on_cpu(), mtp_hooks.attached(model, engine=profile) as hooks:
        by_profile = predict_engine_acceptance(model, hooks, prompts, tokens, 16, engine=profile)
        hits, agreement = draft_hits(model, hooks, torch.tensor([p + t for p, t in zip(prompts, tokens)]), len(prompts[0]),
                                     **profile.predict_options())
        explicit = replay(hits, len(prompts[0]), 16, agreement)
        with pytest.raises(ValueError, match="not both"):
            predict_engine_acceptance(model, hooks, prompts, tokens, 16, geometry="engine", engine=profile)
    assert by_profile == explicit and by_profile.drafts > 0
    with moe_mla_on_cpu(), mtp_hooks.attached(model, draft_steps=2, draft_inputs="argmax") as hooks:  # not vLLM's
        with pytest.raises(ValueError, match="not as vllm 0.32"):
            predict_engine_acceptance(model, hooks, prompts, tokens, 16, engine=profile)


def _engine_table() -> list[list[str]]:
    text = (ROOT / "docs" / "engine.md").read_text()
    section = text.split("\n## Which layer drafts step j\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| engine")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_docs_engine_table_is_the_profiles() -> None:
    """Each row of docs/engine.md's table names its profile call and quotes its options."""
    rows = _engine_table()
    assert len(rows) >= 4
    for cells in rows:
        call = re.search(r"`(vllm|sglang|megatron)\(([^`]*)\)`", cells[0])
        assert call is not None, cells[0]
        profile: EngineProfile = {"vllm": vllm, "sglang": sglang, "megatron": megatron}[call.group(1)](
            *ast.literal_eval(f"({call.group(2)},)")  # the call as written in the table
        )
        quoted = [re.findall(r'"([a-z_]+)"', cell)[:1] for cell in cells[1:7]]
        expected = [profile.accept_rule, profile.draft_layers, profile.draft_inputs, profile.mtp_input,
                    profile.recycle, profile.geometry]
        assert [q[0] if q else None for q in quoted] == expected, (cells[0], quoted)
