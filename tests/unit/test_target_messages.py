"""What the target checks say when they refuse a value: the argument, how many, where, why."""

from __future__ import annotations

import pytest
import torch

from mtp_hooks import MTPHooksError
from mtp_hooks.checks import check_label_range, check_targets


@pytest.mark.parametrize("validate", ["device", "host"])
def test_weighted_mask_is_refused_with_count_positions_and_reason(validate: str) -> None:
    labels = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.ones(2, 4)
    mask[0, 1] = 0.5
    mask[1, 3] = 0.25
    with pytest.raises(MTPHooksError) as error:
        check_targets(labels, mask, validate)
    message = str(error.value)
    assert message.startswith("loss_mask:"), message
    assert "2 values other than 0 and 1" in message, message
    assert "0.5 at [0, 1]" in message and "0.25 at [1, 3]" in message, message
    assert "why:" in message and "fix:" in message, message


def test_binary_float_and_bool_masks_pass() -> None:
    labels = torch.zeros(2, 4, dtype=torch.long)
    check_targets(labels, torch.tensor([[1.0, 0.0, 1.0, 1.0]] * 2), "host")
    check_targets(labels, torch.ones(2, 4, dtype=torch.bool), "host")


def test_host_validation_of_meta_targets_names_validate() -> None:
    labels = torch.zeros(2, 4, dtype=torch.long, device="meta")
    mask = torch.ones(2, 4, device="meta")
    with pytest.raises(MTPHooksError, match=r"(?s)^validate:.*meta tensors"):
        check_targets(labels, mask, "host")
    with pytest.raises(MTPHooksError, match=r"(?s)^validate:.*meta tensors"):
        check_label_range(labels, mask, 16, "host")


def test_meta_targets_pass_unchecked_with_device_or_off() -> None:
    labels = torch.zeros(2, 4, dtype=torch.long, device="meta")
    mask = torch.ones(2, 4, device="meta")
    for validate in ("device", "off"):
        check_targets(labels, mask, validate)
        check_label_range(labels, mask, 16, validate)
