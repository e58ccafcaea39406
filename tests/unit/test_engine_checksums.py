"""The checksum both sides of ``VLLMSync.check`` compute, and the comparison that raises ``StaleDraftError``
(no engine needed: ``tests/engine`` runs them against vLLM)."""

from __future__ import annotations

import pytest
import torch

from mtp_hooks.engine import StaleDraftError, VLLMSync, Write, checksums, tensor_checksum
from mtp_hooks.engine.ledger import compare
from mtp_hooks.errors import MTPHooksError


def _value(tensor: torch.Tensor) -> int:
    return int(tensor_checksum(tensor).item())


def test_checksum_reads_the_logical_order_whatever_the_strides() -> None:
    value = torch.randn(300, 70)
    assert _value(value) == _value(value.t().contiguous().t()) == _value(value.clone())
    assert _value(value[:, :35]) == _value(value[:, :35].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_single_byte_change_changes_the_checksum(dtype: torch.dtype) -> None:
    value = (torch.randn(3 << 18) * 50).to(dtype)  # over 3 chunks of 2**20 bytes for fp32
    expected = _value(value)
    generator = torch.Generator().manual_seed(0)
    raw = value.view(torch.uint8)
    for position in [0, raw.numel() - 1, min(1 << 20, raw.numel() - 2), *torch.randint(0, raw.numel(), (50,), generator=generator).tolist()]:
        changed = raw.clone()
        changed[position] ^= 1 << int(torch.randint(0, 8, (1,), generator=generator))
        assert _value(changed.view(dtype)) != expected, position


def test_moved_values_change_the_checksum() -> None:
    value = torch.randn(128, 256)
    halves_swapped = torch.cat([value[:, 128:], value[:, :128]], dim=1)  # as a bridge that forgets MiMo's swap
    rows_swapped = value[torch.tensor([1, 0, *range(2, 128)])]
    assert len({_value(value), _value(halves_swapped), _value(rows_swapped)}) == 3
    large = torch.randn(1 << 19)  # two chunks of 2**20 bytes
    assert _value(large) != _value(torch.cat([large[1 << 18 :], large[: 1 << 18]]))


def test_checksum_is_a_device_scalar_and_empty_tensors_give_zero() -> None:
    found = tensor_checksum(torch.randn(10))
    assert found.shape == () and found.dtype == torch.int64 and found.device.type == "cpu"
    assert _value(torch.empty(0)) == 0


def test_checksums_cast_each_tensor_to_its_dtype_first() -> None:
    weight = torch.randn(64, 32)
    found = checksums([("a", weight), ("b", weight)], {"a": torch.bfloat16, "b": torch.float32})
    assert list(found) == ["a", "b"]
    assert found["a"] == _value(weight.to(torch.bfloat16)) != found["b"] == _value(weight)
    assert checksums([("a", weight)], torch.bfloat16) == {"a": found["a"]}


def _write(name: str, loaded: int, live: int | None = None) -> Write:
    return Write(name, "model.layers.2.eh_proj.weight", (4, 8), 0, (4, 8), (8, 1), "torch.bfloat16", loaded, live)


def test_compare_passes_when_every_tensor_is_the_one_pushed() -> None:
    ledger = {"x": [_write("x", 5, 7)], "y": [_write("y", 6)]}
    assert compare({"x": 5, "y": 6}, {"x": (4, 8), "y": (32,)}, ledger, {("x", 0): 7, ("y", 0): None}) == 2


def test_compare_names_a_tensor_never_pushed() -> None:
    with pytest.raises(StaleDraftError, match=r"^x: the engine's draft is not the trainer's\n  expected: checksum 5 (.|\n)*no push since the engine started"):
        compare({"x": 5}, {"x": (4, 8)}, {}, {})


def test_compare_names_the_first_tensor_changed_since_the_push_with_both_checksums() -> None:
    ledger = {"x": [_write("x", 5)], "y": [_write("y", 6)], "z": [_write("z", 7)]}
    with pytest.raises(StaleDraftError, match=r"^y: (.|\n)*expected: checksum 9 (.|\n)*received: checksum 6 (.|\n)*without a push"):
        compare({"x": 5, "y": 9, "z": 1}, {k: (4, 8) for k in "xyz"}, ledger, {})


def test_compare_names_an_engine_tensor_changed_since_the_push() -> None:
    with pytest.raises(StaleDraftError, match=r"^x: (.|\n)*expected: checksum 7 (.|\n)*received: checksum 8 \(the same view now\)(.|\n)*changed since the push"):
        compare({"x": 5}, {"x": (4, 8)}, {"x": [_write("x", 5, 7)]}, {("x", 0): 8})
    with pytest.raises(StaleDraftError, match=r"received: nothing \(the parameter is gone\)"):
        compare({"x": 5}, {"x": (4, 8)}, {"x": [_write("x", 5, 7)]}, {("x", 0): None})


def test_compare_names_a_tensor_of_another_size() -> None:
    with pytest.raises(StaleDraftError, match=r"^x: (.|\n)*another size"):
        compare({"x": 5}, {"x": (4, 9)}, {"x": [_write("x", 5)]}, {})


def test_stale_draft_error_is_the_projects_bad_input_error() -> None:
    assert issubclass(StaleDraftError, MTPHooksError) and issubclass(StaleDraftError, ValueError)


def test_sync_refuses_what_is_not_an_engine() -> None:
    with pytest.raises(MTPHooksError, match=r"^llm: bad value\n  expected: a vllm.LLM"):
        VLLMSync(object())
