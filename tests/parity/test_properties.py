"""Property tests: random shapes, depths, heads, masks and dtypes, hooks against stock mcore.

Each example builds a hooked model and a stock reference with the same weights, runs the same
micro-batch through both and compares the per-depth MTP losses, the main logits and every
parameter's gradient.

The reference is stock mcore with only the depths that have at least one masked-in target.
Depth ``k`` predicts ``labels[t + k]`` under ``loss_mask[t + k]``, so it has no target at all when
the mask is zero from column ``k`` on (all-zero masks, only column 0 set, ``s <= k``). Stock
mcore 0.16.1 divides such a depth's masked CE sum by its zero token count and its gradients turn
NaN; ``mtp_hooks`` gives that depth a loss of exactly 0. The depths with targets always form a
prefix ``1 .. K``, and a depth's loss never depends on deeper MTP layers, so "stock mcore with K
MTP layers (same weights, ``mtp_loss_scaling_factor`` scaled by ``K / N`` to keep the per-depth
weight), or without MTP when ``K == 0``" is exactly the expected result: the empty depths
contribute zero, and their MTP layers get no gradient.

Labels at masked-out positions are sometimes replaced by ``-100`` (the usual ignore index): they
must change nothing.

bf16 runs the real mcore mixed-precision wrapper (``Float16Module``) on both sides, with tiny
shapes (bf16 matmuls are slow on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, main_ce_from_logits, make_batch, masked_mean, output_layer_calls, stock_mtp_losses

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FACTOR = 0.3  # TinyGPT's mtp_loss_scaling_factor
MASKS = ("random", "ones", "zeros", "last", "none")

# bf16 tolerance. Stock computes MTP logits in bf16 and the CE from them; the lean loss computes
# bf16 matmuls but reduces in fp32, and the bf16 gradients are rounded at different points. bf16
# keeps 8 significant bits (relative spacing 2**-7 = 0.0078); we allow two spacings relative, plus
# an absolute term of 2**-7 times the largest reference gradient of that parameter for entries that
# cancel to near zero, and one spacing relative on the per-depth losses. Measured over 80 random
# bf16 cases: worst gradient error 0.49 of this tolerance, i.e. at most 0.81% of the parameter's
# largest gradient entry.
BF16_RTOL = 2 * 2**-7
BF16_ATOL_OF_MAX = 2**-7
BF16_LOSS_RTOL = 2**-7


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn example."""

    batch: int
    seq: int
    depth: int
    vocab: int
    tied: bool
    mask: str
    ignore_masked_labels: bool
    loss_impl: str
    dtype: torch.dtype
    seed: int

    def spec(self, depth: Optional[int]) -> TinyGPT:
        """Model shape with ``depth`` MTP layers, each depth weighted like one of ``self.depth``."""
        small = self.dtype == torch.bfloat16
        return TinyGPT(
            vocab_size=self.vocab,
            hidden_size=8 if small else 16,
            num_layers=1,
            num_attention_heads=2,
            max_sequence_length=8,
            mtp_num_layers=depth,
            tied=self.tied,
            params_dtype=self.dtype,
            config_overrides={} if not depth else {"mtp_loss_scaling_factor": FACTOR * depth / self.depth},
        )

    def micro_batch(self) -> Batch:
        """The drawn micro-batch; with ``ignore_masked_labels``, masked-out labels become -100."""
        batch = make_batch(self.vocab, self.batch, self.seq, self.mask, seed=self.seed)
        if self.ignore_masked_labels and batch.loss_mask is not None:
            batch.labels = batch.labels.masked_fill(batch.loss_mask == 0, -100)
        return batch


def cases(dtype: torch.dtype) -> st.SearchStrategy[Case]:
    """Drawn examples; bf16 ones stay tiny (hidden 8, s <= 5, vocab <= 24)."""
    small = dtype == torch.bfloat16
    return st.builds(
        Case,
        batch=st.integers(1, 2 if small else 3),
        seq=st.integers(2, 5 if small else 8),
        depth=st.integers(1, 3),
        vocab=st.integers(8, 24 if small else 64),
        tied=st.booleans(),
        mask=st.sampled_from(MASKS),
        ignore_masked_labels=st.booleans(),
        loss_impl=st.sampled_from(("lean", "dense")),
        dtype=st.just(dtype),
        seed=st.integers(0, 2**16),
    )


def depths_with_targets(loss_mask: Optional[Tensor], seq: int, depth: int) -> int:
    """How many leading depths have at least one masked-in target (depth k reads columns k..s-1)."""
    if loss_mask is None:
        return min(depth, seq - 1)
    return sum(1 for k in range(1, depth + 1) if bool(loss_mask[:, k:].any()))


def wrap(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """bf16 models run under mcore's own mixed-precision wrapper, as in Megatron training."""
    return Float16Module(model.config, model) if dtype == torch.bfloat16 else model


def attached_mtp_objectives(logits: Tensor) -> list[float]:
    """The per-depth MTP objectives that ride on ``logits``' graph through ``MTPLossAutoScaler``."""
    found: list[float] = []
    seen: set[int] = set()
    stack = [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == f"{MTPLossAutoScaler.__name__}Backward":
            found.append(float(node.saved_tensors[0].detach()))
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def run_case(case: Case) -> None:
    """Hooked model vs the stock reference described in the module docstring, on one micro-batch."""
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    batch = case.micro_batch()
    kept = depths_with_targets(batch.loss_mask, case.seq, case.depth)

    hooked_inner = case.spec(case.depth).build(case.seed)
    reference_inner = case.spec(kept or None).build(case.seed)
    weights = hooked_inner.state_dict()
    reference_inner.load_state_dict({k: v for k, v in weights.items() if k in reference_inner.state_dict()}, strict=True)
    hooked, reference = wrap(hooked_inner, case.dtype), wrap(reference_inner, case.dtype)

    with output_layer_calls(reference_inner) as calls:
        per_token = reference(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    reference_logits = calls[-1].transpose(0, 1).float()
    reference_losses = stock_mtp_losses()

    hooks = mtp_hooks.attach(hooked, loss_impl=case.loss_impl)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args)
    objectives = attached_mtp_objectives(logits)
    main_labels = batch.labels.clamp(min=0)  # ignored positions are masked out of the user's loss
    masked_mean(main_ce_from_logits(logits, main_labels), batch.loss_mask).backward()
    metrics = hooks.metrics()

    # Main logits: the same ops on the same trunk output, so bit-identical.
    assert torch.equal(logits.float(), reference_logits), "main logits differ from stock mcore"

    # Per-depth MTP losses; depths without targets report no tokens and contribute exactly 0.
    bf16 = case.dtype == torch.bfloat16
    assert len(reference_losses) == kept
    for k in range(1, case.depth + 1):
        tokens = batch.labels[:, k:].numel() if batch.loss_mask is None else batch.loss_mask[:, k:].sum().item()
        assert metrics[f"mtp_{k}/tokens"] == tokens, f"depth {k}"
        if k <= kept:
            tolerance = dict(rel=BF16_LOSS_RTOL) if bf16 else dict(rel=1e-5, abs=1e-6)
            assert metrics[f"mtp_{k}/loss"] == pytest.approx(reference_losses[k - 1], **tolerance), f"depth {k}"
        else:
            assert tokens == 0
            assert f"mtp_{k}/loss" not in metrics and f"mtp_{k}/acc" not in metrics, f"depth {k}"
    # The objectives riding on the logits: (factor / N) * loss_k, and exactly 0.0 for empty depths;
    # dense attaches one per depth (as stock), lean one for all depths (their sum).
    assert all(math.isfinite(value) for value in objectives), objectives
    expected = [FACTOR / case.depth * loss for loss in reference_losses] + [0.0] * (case.depth - kept)
    if case.loss_impl != "dense":
        assert len(objectives) == 1
        expected = [math.fsum(expected)]
    assert sorted(objectives) == pytest.approx(sorted(expected), rel=BF16_LOSS_RTOL if bf16 else 1e-5, abs=0.0)

    # Every gradient: finite; MTP layers without targets get none; the rest equal the reference.
    for name, param in hooked_inner.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), f"{name}: non-finite gradient"
    reference_names = dict(reference_inner.named_parameters())
    for name, param in hooked_inner.named_parameters():
        if name not in reference_names:
            assert param.grad is None or not param.grad.any(), f"{name}: depth without targets got a gradient"
    assert_grads_match(hooked_inner, reference_inner, bf16)
    hooks.remove()


def assert_grads_match(actual: nn.Module, expected: nn.Module, bf16: bool) -> None:
    """Every parameter the reference has: same gradient (None matches None or zeros).

    fp32: ``atol=1e-6, rtol=1e-5``. bf16: ``rtol=BF16_RTOL`` and ``atol=BF16_ATOL_OF_MAX`` times the
    largest reference gradient entry of that parameter.
    """
    reference = dict(expected.named_parameters())
    for name, param in actual.named_parameters():
        if name not in reference:
            continue
        grad, ref = param.grad, reference[name].grad
        if grad is None or ref is None:
            other = grad if ref is None else ref
            assert other is None or not other.any(), f"{name}: one gradient is None, the other is not zero"
            continue
        if bf16:
            rtol, atol = BF16_RTOL, BF16_ATOL_OF_MAX * float(ref.float().abs().max())
        else:
            rtol, atol = 1e-5, 1e-6
        torch.testing.assert_close(grad.float(), ref.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


BOUNDED = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


ALL_MASKED = dict(batch=2, seq=4, depth=2, vocab=16, tied=False, mask="zeros", ignore_masked_labels=True, seed=0)
SHORTER_THAN_DEPTH = dict(batch=1, seq=2, depth=3, vocab=16, tied=True, mask="last", ignore_masked_labels=False, seed=1)


@settings(max_examples=40, **BOUNDED)
@example(case=Case(**ALL_MASKED, loss_impl="lean", dtype=torch.float32))
@example(case=Case(**ALL_MASKED, loss_impl="dense", dtype=torch.float32))
@example(case=Case(**SHORTER_THAN_DEPTH, loss_impl="lean", dtype=torch.float32))
@given(case=cases(torch.float32))
def test_fp32_hooks_equal_stock_on_random_shapes_depths_heads_and_masks(case: Case) -> None:
    """Logits bit-identical, losses and gradients within fp32 rounding; the explicit examples pin an
    all-masked micro-batch (every MTP objective exactly 0.0, every gradient finite and zero, where
    stock 0.16.1 gives NaN) and a sequence shorter than the MTP depth."""
    run_case(case)


@settings(max_examples=12, **BOUNDED)
@example(case=Case(**ALL_MASKED, loss_impl="lean", dtype=torch.bfloat16))
@given(case=cases(torch.bfloat16))
def test_bf16_hooks_equal_stock_within_bf16_tolerance(case: Case) -> None:
    """Under ``Float16Module``: logits bit-identical, losses and gradients within the stated bf16 tolerance."""
    run_case(case)
