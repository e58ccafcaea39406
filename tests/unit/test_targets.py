"""``mtp_hooks.mtp_targets`` against a brute-force reading of its contract.

The reference walks every position of every sequence: depth ``k`` at ``t`` targets
``labels[t + k]`` under ``loss_mask[t + k]`` when ``t + k`` is a real token of the sequence of
``t``, and has mask 0 otherwise. Layouts are random packed (THD) rows with and without padded
slots, zero-length and all-padding sequences, sequences shorter than ``N + 1`` tokens, all-masked
sequences and tokens after the last slot, plus plain ``[b, s]`` batches.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import roll_tensor

import mtp_hooks
from mtp_hooks import _mcore
from tests.support.mcore_cpu import needs_packed_mtp

BOUNDED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass
class Slot:
    """One packed sequence: ``real`` tokens at the start of ``size`` positions from ``start``."""

    start: int
    size: int
    real: int


def reference_targets(
    labels: Tensor, loss_mask: Optional[Tensor], depth: int, slots: Optional[list[Slot]]
) -> list[tuple[Tensor, Tensor]]:
    """The contract, position by position. ``slots=None``: every row is one unpadded sequence."""
    b, s = labels.shape
    mask = torch.ones(b, s) if loss_mask is None else loss_mask.float()
    rows = [(row, Slot(0, s, s)) for row in range(b)] if slots is None else [(0, slot) for slot in slots]
    out = []
    for k in range(1, depth + 1):
        labels_k = torch.full_like(labels, -1)
        mask_k = torch.zeros(b, s)
        for row, slot in rows:
            for offset in range(slot.size):
                if offset + k < slot.real:
                    t = slot.start + offset
                    labels_k[row, t] = labels[row, t + k]
                    mask_k[row, t] = mask[row, t + k]
        out.append((labels_k, mask_k))
    return out


def assert_targets_equal(actual: list[tuple[Tensor, Tensor]], expected: list[tuple[Tensor, Tensor]]) -> None:
    """Masks equal everywhere; labels equal where the mask counts (elsewhere they are unspecified)."""
    assert len(actual) == len(expected)
    for k, ((labels_k, mask_k), (ref_labels, ref_mask)) in enumerate(zip(actual, expected), start=1):
        assert mask_k.dtype == torch.float32
        torch.testing.assert_close(mask_k, ref_mask, rtol=0, atol=0, msg=lambda m: f"depth {k} mask: {m}")
        counted = ref_mask != 0
        assert torch.equal(labels_k[counted], ref_labels[counted]), f"depth {k}: labels differ where the mask counts"


def packed_params(slots: list[Slot], padded: bool) -> PackedSeqParams:
    """THD params: real lengths in ``cu_seqlens_q``, the slots in ``cu_seqlens_q_padded`` when ``padded``."""
    real = torch.tensor([0] + [slot.real for slot in slots]).cumsum(0).to(torch.int32)
    layout = torch.tensor([0] + [slot.size for slot in slots]).cumsum(0).to(torch.int32)
    widest = max([slot.size for slot in slots], default=0)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real if padded else layout,
        cu_seqlens_kv=real if padded else layout,
        cu_seqlens_q_padded=layout if padded else None,
        cu_seqlens_kv_padded=layout if padded else None,
        max_seqlen_q=widest,
        max_seqlen_kv=widest,
    )


@st.composite
def packed_cases(draw: st.DrawFn) -> tuple[Tensor, Optional[Tensor], int, list[Slot], bool]:
    """A packed row: random sequence lengths (0 included), optional padding per slot, masks."""
    depth = draw(st.integers(1, 4))
    padded = draw(st.booleans())
    slots, start = [], 0
    for _ in range(draw(st.integers(1, 5))):
        real = draw(st.integers(0, 7))
        size = real + (draw(st.integers(0, 3)) if padded else 0)
        slots.append(Slot(start, size, real))
        start += size
    tail = draw(st.integers(0, 3))  # tokens after the last slot
    length = start + tail
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (1, length), generator=gen)
    mask_kind = draw(st.sampled_from(["none", "random", "ones", "some_sequences_all_masked"]))
    loss_mask: Optional[Tensor] = None
    if mask_kind == "random":
        loss_mask = (torch.rand(1, length, generator=gen) > 0.3).float()
    elif mask_kind == "ones":
        loss_mask = torch.ones(1, length)
    elif mask_kind == "some_sequences_all_masked":
        loss_mask = torch.ones(1, length)
        for slot in slots:
            if draw(st.booleans()):
                loss_mask[0, slot.start : slot.start + slot.size] = 0
    return labels, loss_mask, depth, slots, padded


@needs_packed_mtp
@settings(max_examples=150, **BOUNDED)
@given(case=packed_cases())
def test_packed_targets_follow_the_contract(case: tuple[Tensor, Optional[Tensor], int, list[Slot], bool]) -> None:
    labels, loss_mask, depth, slots, padded = case
    actual = mtp_hooks.mtp_targets(labels, loss_mask, depth, packed_seq_params=packed_params(slots, padded))
    assert_targets_equal(actual, reference_targets(labels, loss_mask, depth, slots))


@settings(max_examples=40, **BOUNDED)
@given(
    b=st.integers(1, 3),
    s=st.integers(1, 9),
    depth=st.integers(1, 4),
    with_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_unpacked_targets_follow_the_contract(b: int, s: int, depth: int, with_mask: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (b, s), generator=gen)
    loss_mask = (torch.rand(b, s, generator=gen) > 0.3).float() if with_mask else None
    assert_targets_equal(mtp_hooks.mtp_targets(labels, loss_mask, depth), reference_targets(labels, loss_mask, depth, None))


def stock_rolls(labels: Tensor, loss_mask: Tensor, depth: int, packed: Optional[PackedSeqParams]) -> list[tuple[Tensor, Tensor]]:
    """What stock mcore 0.16.1's ``_postprocess`` computes: ``roll_tensor`` once more per depth."""
    out, mask = [], loss_mask
    extra = {} if packed is None else {"packed_seq_params": packed}
    for _ in range(depth):
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, **extra)
        mask, _ = roll_tensor(mask, shifts=-1, dims=-1, **extra)
        out.append((labels, mask))
    return out


@pytest.mark.parametrize(
    "layout", ["unpacked", pytest.param("packed", marks=needs_packed_mtp), pytest.param("packed_padded_equal", marks=needs_packed_mtp)]
)
def test_targets_are_stock_rolls_where_stock_is_well_defined(layout: str) -> None:
    gen = torch.Generator().manual_seed(4)
    labels = torch.randint(0, 50, (1, 14), generator=gen)
    loss_mask = (torch.rand(1, 14, generator=gen) > 0.2).float()
    packed = None
    if layout != "unpacked":
        packed = packed_params([Slot(0, 5, 5), Slot(5, 2, 2), Slot(7, 7, 7)], padded=False)
    if layout == "packed_padded_equal":
        packed = dataclasses.replace(packed, cu_seqlens_q_padded=packed.cu_seqlens_q.clone())
    actual = mtp_hooks.mtp_targets(labels, loss_mask, 3, packed_seq_params=packed)
    for (labels_k, mask_k), (stock_labels, stock_mask) in zip(actual, stock_rolls(labels, loss_mask, 3, packed)):
        assert torch.equal(mask_k, stock_mask)
        assert torch.equal(labels_k, stock_labels)


@needs_packed_mtp
def test_stock_rolls_cross_sequences_on_padded_layouts_where_targets_do_not() -> None:
    """Why ``mtp_targets`` rolls by ``cu_seqlens_q_padded``: stock rolls by the unpadded lengths.

    Two sequences of 3 real tokens, each padded to 4. Stock's second roll window is [3, 6) of
    the row: it makes the padding token at 3 predict the first token of sequence 2 and leaves
    position 6 (a real token) predicting itself.
    """
    slots = [Slot(0, 4, 3), Slot(4, 4, 3)]
    labels = torch.arange(10, 18).unsqueeze(0)
    loss_mask = torch.ones(1, 8)
    loss_mask[0, [3, 7]] = 0  # padding
    packed = packed_params(slots, padded=True)
    stock_labels, stock_mask = stock_rolls(labels, loss_mask, 1, packed)[0]
    assert stock_mask[0, 3] == 1 and stock_labels[0, 3] == labels[0, 4]  # padding -> next sequence
    assert stock_mask[0, 6] == 1 and stock_labels[0, 6] == labels[0, 6]  # not rolled at all
    actual = mtp_hooks.mtp_targets(labels, loss_mask, 1, packed_seq_params=packed)
    assert_targets_equal(actual, reference_targets(labels, loss_mask, 1, slots))
    assert actual[0][1][0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]


@needs_packed_mtp
def test_padding_never_becomes_a_target_even_when_the_mask_covers_it() -> None:
    slots = [Slot(0, 4, 2), Slot(4, 4, 4)]
    labels = torch.arange(8).unsqueeze(0)
    (_, mask_1), (_, mask_2) = mtp_hooks.mtp_targets(labels, None, 2, packed_seq_params=packed_params(slots, padded=True))
    assert mask_1[0].tolist() == [1, 0, 0, 0, 1, 1, 1, 0]
    assert mask_2[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: mtp_hooks.mtp_targets(torch.zeros(2, 4, dtype=torch.long), None, 0), "depth"),
        (lambda: mtp_hooks.mtp_targets(torch.zeros(2, 4, dtype=torch.long), None, True), "depth"),
        (lambda: mtp_hooks.mtp_targets(torch.zeros(4, dtype=torch.long), None, 1), "labels"),
        (lambda: mtp_hooks.mtp_targets(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3), 1), "loss_mask"),
        (
            lambda: mtp_hooks.mtp_targets(
                torch.zeros(2, 4, dtype=torch.long), None, 1, packed_seq_params=packed_params([Slot(0, 4, 4)], False)
            ),
            r"\[1, t\]",
        ),
        (
            lambda: mtp_hooks.mtp_targets(
                torch.zeros(1, 4, dtype=torch.long), None, 1, packed_seq_params=packed_params([Slot(0, 6, 6)], False)
            ),
            "within the 4 tokens",
        ),
    ],
    ids=["depth_0", "depth_bool", "labels_1d", "mask_shape", "packed_batch_2", "slot_past_row"],
)
def test_bad_arguments_are_refused(call: object, match: str) -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=match):
        call()  # type: ignore[operator]


def test_sequence_longer_than_its_padded_slot_is_refused() -> None:
    packed = packed_params([Slot(0, 4, 4)], padded=True)
    packed = dataclasses.replace(packed, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(mtp_hooks.MTPHooksError, match="within their padded slots"):
        mtp_hooks.mtp_targets(torch.zeros(1, 4, dtype=torch.long), None, 1, packed_seq_params=packed)


@pytest.mark.skipif(_mcore.ROLLS_PACKED_SEQUENCES, reason="pins the refusal of megatron-core < 0.16.1; this megatron-core rolls packed sequences")
def test_packed_sequences_are_refused_before_megatron_core_0_16_1() -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match="need megatron-core >= 0.16.1"):
        mtp_hooks.mtp_targets(torch.zeros(1, 4, dtype=torch.long), None, 1, packed_seq_params=packed_params([Slot(0, 4, 4)], False))
