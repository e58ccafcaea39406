"""``draft_step_weights``: each draft step's loss times its weight, held out from the parity matrix's stock reference.

The loss is linear in the weights, so the gradients of weights ``(a, b)`` are ``a`` times those of ``(1, 0)`` plus ``b``
times those of ``(0, 1)``, each run on a fresh build of the same weights; the per-step metrics stay the unweighted
means and report the weights. The parity matrix (``chain`` values ``weighted`` and ``k3_argmax_decay``) compares the
option with stock mcore whose i-th depth loss is weighted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = TinyGPT(vocab_size=64, mtp_num_layers=2)
SEED = 5


def trained(weights: Any, **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every parameter's gradient and the metrics after one hooked training step with ``weights``."""
    model: nn.Module = SHAPE.build(SEED)
    with torch.no_grad():  # norm weights away from 1 and a larger init: the steps' gradients differ clearly
        for name, param in model.named_parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0).add_(0.3 if "layernorm" in name or "norm" in name else 0.0)
    hooks = mtp_hooks.attach(model, draft_step_weights=weights, **options)
    hooked_train_step(model, hooks, make_batch(64, seq=12, seed=SEED))
    metrics = hooks.metrics()
    hooks.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, metrics


@pytest.mark.parametrize("options", [{}, {"draft_steps": 3, "draft_inputs": "argmax"}], ids=["depths", "chain_k3_argmax"])
def test_gradients_are_linear_in_the_step_weights(options: dict[str, Any]) -> None:
    steps = options.get("draft_steps", 2)
    units = [tuple(float(i == j) for i in range(steps)) for j in range(steps)]
    weights = tuple(0.5 + 0.75 * j for j in range(steps))
    combined, _ = trained(weights, **options)
    parts = [trained(unit, **options)[0] for unit in units]
    main_only, _ = trained(None, loss_scale=0.0, **options)  # the main loss alone
    for name, grad in combined.items():
        # the main loss's own gradient is in every run: count it once
        expected = sum(w * (part[name] - main_only[name]) for w, part in zip(weights, parts)) + main_only[name]
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.allclose(parts[0][name], parts[1][name]) for name in combined if name.startswith("mtp."))
    if not options:  # step 1 alone never reaches MTP layer 2, step 2 does
        assert "mtp.layers.1.eh_proj.weight" not in parts[0] or not parts[0]["mtp.layers.1.eh_proj.weight"].any()
        assert parts[1]["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_a_decay_is_the_weights_it_names() -> None:
    decayed, decay_metrics = trained(0.6, draft_steps=3)
    listed, _ = trained((1.0, 0.6, 0.36), draft_steps=3)
    for name, grad in decayed.items():
        torch.testing.assert_close(grad, listed[name], atol=1e-6, rtol=1e-5)
    assert [decay_metrics[f"mtp_{j}/weight"] for j in (1, 2, 3)] == pytest.approx([1.0, 0.6, 0.36])


def test_metrics_keep_the_unweighted_step_losses_and_report_the_weights() -> None:
    _, plain = trained(None)
    _, weighted = trained((0.25, 1.75))
    for key, value in plain.items():
        assert weighted[key] == pytest.approx(value, rel=1e-6), key
    assert (weighted["mtp_1/weight"], weighted["mtp_2/weight"]) == (0.25, 1.75)
    assert not any(key.endswith("/weight") for key in plain)
