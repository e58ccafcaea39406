"""The pieces of T > 0 generation that need no engine: the per-token expansion of
``vllm_cpu_spec_sampling_fix`` and ``generate_sampled``'s refusal of T <= 0 (the engine tests
measure both in vLLM: ``tests/engine/test_engine_sampling.py``)."""

from __future__ import annotations

import pytest
import torch

from mtp_hooks.engine import generate_sampled
from mtp_hooks.engine.vllm_cpu_fix import _expand_per_token
from mtp_hooks.errors import MTPHooksError


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expansion_repeats_each_requests_value_for_its_tokens_replacing_one_value(dtype: torch.dtype) -> None:
    values = torch.tensor([0.0, 7.0, 3.0, 0.0], dtype=torch.float32).to(dtype)  # a request with no tokens: the third
    cu_num_tokens = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    expanded = _expand_per_token(values, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert expanded.dtype == dtype
    assert expanded.tolist() == [1, 1, 7, 7, 7, 1]
    assert _expand_per_token(torch.tensor([0.7, 1.0]), torch.tensor([1, 3]), 3).tolist() == pytest.approx([0.7, 1.0, 1.0])
    assert _expand_per_token(torch.tensor([0.7]), torch.tensor([0]), 0).numel() == 0


@pytest.mark.parametrize("temperature", [0.0, -1.0, True, "1.0"])
def test_generate_sampled_refuses_a_temperature_not_above_zero(temperature: object) -> None:
    with pytest.raises(MTPHooksError, match="temperature: bad value\n  expected: a number > 0"):
        generate_sampled(None, [[2, 3]], 4, temperature)  # type: ignore[arg-type]
