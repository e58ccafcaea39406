"""``draft_recycle="unnormed"`` and ``draft_layers="cyclic"``: what each later step reads, and which layer runs it.

Held out from the parity matrix's stock references (``chain`` values ``k3_unnormed``,
``engine_first_k3_argmax_unnormed``, ``cyclic_k3_argmax``): here the calls are watched as they run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TWO = TinyGPT(vocab_size=64, mtp_num_layers=2, position_embedding_type="rope")
ONE = TinyGPT(vocab_size=64, mtp_num_layers=1, position_embedding_type="rope")


def watched(model: nn.Module, **options: Any) -> tuple[list[tuple[int, torch.Tensor]], list[torch.Tensor]]:
    """Each MTP layer call of one training step (the layer's index and the hidden states it ran on) and each MTP
    final norm's input, in call order."""
    calls: list[tuple[int, torch.Tensor]] = []
    norm_inputs: list[torch.Tensor] = []
    handles = []
    for index, layer in enumerate(model.mtp.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, k, o, i=index: calls.append((i, k["hidden_states"].detach().clone())), with_kwargs=True))
        handles.append(layer.final_layernorm.register_forward_pre_hook(
            lambda m, a: norm_inputs.append(a[0].detach().clone())))
    with mtp_hooks.attached(model, **options) as hooks:
        hooked_train_step(model, hooks, make_batch(64, seq=10, seed=1))
    for handle in handles:
        handle.remove()
    return calls, norm_inputs


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        (TWO, {"draft_steps": 3}),
        (TWO, {"draft_steps": 3, "draft_layers": "first", "draft_inputs": "argmax"}),
        (ONE, {"draft_steps": 3, "draft_geometry": "engine", "draft_inputs": "argmax"}),
        (TWO, {"draft_steps": 4, "draft_layers": "cyclic", "detach_encoder": True, "detach_between_depths": True}),
    ],
    ids=["per_step_k3", "first_k3_argmax", "engine_k3_argmax", "cyclic_k4_detached"],
)
def test_each_later_step_reads_the_previous_steps_output_before_its_final_norm(shape: Any, options: dict[str, Any]) -> None:
    model = shape.build(3)
    with torch.no_grad():
        for layer in model.mtp.layers:  # far from 1: the normed and unnormed states differ
            layer.final_layernorm.weight.uniform_(0.2, 3.0)
    calls, norm_inputs = watched(model, draft_recycle="unnormed", **options)
    normed_calls, _ = watched(model, **options)
    steps = [hidden for index, hidden in calls if options.get("draft_layers") != "first" or index == 0]
    assert len(steps) == options["draft_steps"] and len(normed_calls) == len(calls)
    step_norms = norm_inputs if options.get("draft_layers") != "first" else [norm_inputs[0], *norm_inputs[2:]]
    for j in range(1, len(steps)):
        torch.testing.assert_close(steps[j], step_norms[j - 1], rtol=0, atol=0, msg=f"step {j + 1}")
    torch.testing.assert_close(calls[0][1], normed_calls[0][1], rtol=0, atol=0)  # step 1 reads the trunk either way
    assert not torch.allclose(steps[1], normed_calls[1][1])  # by default step 2 reads the normed output


def test_cyclic_layers_run_in_turn_past_the_blocks_own() -> None:
    model = TWO.build(3)
    calls, _ = watched(model, draft_steps=5, draft_layers="cyclic", draft_inputs="argmax")
    assert [index for index, _ in calls] == [0, 1, 0, 1, 0]
    with mtp_hooks.attached(model, draft_steps=5, draft_layers="cyclic") as hooks:
        assert hooks.draft_plan() == (0, 1, 0, 1, 0)
    per_step, _ = watched(model, draft_steps=5)
    assert [index for index, _ in per_step] == [0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("options", "argument"),
    [({"draft_recycle": "raw"}, "draft_recycle"), ({"draft_layers": "cyclic", "draft_steps": 1}, "draft_steps")],
)
def test_bad_recycle_and_cyclic_options_are_refused(options: dict[str, Any], argument: str) -> None:
    model = TWO.build(3)
    with pytest.raises(mtp_hooks.MTPHooksError, match=rf"^{argument}: bad value"):
        mtp_hooks.attach(model, **options)
    assert mtp_hooks.hooks_of(model) is None
