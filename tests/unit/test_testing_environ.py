"""``mtp_hooks.testing``'s builders give the process environment back.

Building an mcore model sets ``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN`` and ``NVTE_UNFUSED_ATTN`` from
its attention backend and refuses a later model whose backend disagrees with them (DeepSeek-V3's
bridge asks for ``fused`` after a tiny model's ``auto`` set all three to 1). Every testing model is
built here from a clean environment and the whole ``os.environ`` is compared before and after.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

from mtp_hooks.testing import TinyDeepSeek, TinyGPT, TinyHybrid, TinyHybridMoE, TinyQwen, environ_kept, moe_mla_on_cpu
from mtp_hooks.testing import deepseek_missing, hybrid_moe_missing, hybrid_mtp_missing
from mtp_hooks.testing import engine_models

ATTENTION = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")

# name: (what builds it, why this megatron-core cannot, or None)
SHAPES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "TinyGPT": (TinyGPT, lambda: None),
    "TinyGPT tied, one depth": (lambda: TinyGPT(tied=True, mtp_num_layers=1), lambda: None),
    "TinyGPT without MTP": (lambda: TinyGPT(mtp_num_layers=None), lambda: None),
    "TinyQwen": (TinyQwen, lambda: None),
    "TinyDeepSeek": (TinyDeepSeek, deepseek_missing),
    "TinyHybrid": (TinyHybrid, hybrid_mtp_missing),
    "TinyHybridMoE": (TinyHybridMoE, hybrid_moe_missing),
    **{
        f"engine_models {name}": (lambda name=name: engine_models.shape(name), lambda name=name: engine_models.family_missing(name))
        for name in engine_models.FAMILIES
    },
}


@pytest.fixture
def clean_attention_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ``NVTE_*`` attention variable set, as in a fresh process."""
    for name in ATTENTION:
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.usefixtures("clean_attention_environment", "one_intra_op_thread")
@pytest.mark.parametrize("name", list(SHAPES))
def test_building_a_testing_model_leaves_the_process_environment_as_it_was(name: str) -> None:
    shape, missing = SHAPES[name]
    why = missing()
    if why is not None:
        pytest.skip(f"{name} cannot be built on this megatron-core: {why}")
    before = dict(os.environ)
    with moe_mla_on_cpu():
        model = shape().build(seed=0)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert dict(os.environ) == before
    assert not [variable for variable in ATTENTION if variable in os.environ]


@pytest.mark.usefixtures("clean_attention_environment")
def test_a_value_set_before_the_build_stays_as_it_was() -> None:
    os.environ["NVTE_FLASH_ATTN"] = "1"
    before = dict(os.environ)
    TinyGPT(mtp_num_layers=1).build(seed=0)
    assert dict(os.environ) == before


def test_environ_kept_undoes_additions_changes_and_removals_also_when_the_body_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTP_HOOKS_TEST_CHANGED", "old")
    monkeypatch.setenv("MTP_HOOKS_TEST_REMOVED", "kept")
    monkeypatch.delenv("MTP_HOOKS_TEST_ADDED", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="inside"):
        with environ_kept():
            os.environ["MTP_HOOKS_TEST_ADDED"] = "new"
            os.environ["MTP_HOOKS_TEST_CHANGED"] = "new"
            del os.environ["MTP_HOOKS_TEST_REMOVED"]
            raise RuntimeError("inside")
    assert dict(os.environ) == before
