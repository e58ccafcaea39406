"""``mtp_input="pre_final_norm"``: MTP layer 1 reads the decoder's final norm input, as vLLM's MiMo drafter reads the
target's state, while the main head reads the normed output; held out from the parity matrix's stock reference
(``chain`` values ``pre_norm``, ``first_k2_argmax_pre_norm``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = TinyGPT(vocab_size=64, mtp_num_layers=2)


def seen_by_layer_1(model: nn.Module, **options: Any) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Each MTP layer 1 call's hidden states (as it ran), the final norm's input, and the logits of one training step."""
    calls: list[torch.Tensor] = []
    norm_input: list[torch.Tensor] = []
    handles = [
        model.mtp.layers[0].register_forward_hook(
            lambda m, a, k, o: calls.append(k["hidden_states"].detach().clone()), with_kwargs=True
        ),
        model.decoder.final_layernorm.register_forward_pre_hook(lambda m, a: norm_input.append(a[0].detach().clone())),
    ]
    with mtp_hooks.attached(model, **options) as hooks:
        logits = hooked_train_step(model, hooks, make_batch(64, seq=10, seed=1))
    for handle in handles:
        handle.remove()
    return calls, norm_input[0], logits


@pytest.mark.parametrize("options", [{}, {"draft_steps": 3, "draft_inputs": "argmax", "draft_layers": "first"},
                                     {"detach_encoder": True}], ids=["depths", "first_k3_argmax", "detach_encoder"])
def test_layer_1_reads_the_final_norms_input_and_the_head_the_normed_output(options: dict[str, Any]) -> None:
    model = SHAPE.build(3)
    with torch.no_grad():
        model.decoder.final_layernorm.weight.uniform_(0.2, 3.0)  # far from 1: the two states differ
    calls, before, logits = seen_by_layer_1(model, mtp_input="pre_final_norm", **options)
    default_calls, _, default_logits = seen_by_layer_1(model, **options)
    assert torch.equal(calls[0], before) and not torch.equal(default_calls[0], before)
    torch.testing.assert_close(logits, default_logits, rtol=0, atol=0)  # the main head: the normed output as before
    assert len(calls) == len(default_calls)
    if len(calls) > 1:  # later steps read the previous step's output, as by default
        assert not torch.equal(calls[1], before)


def test_mtp_input_is_checked() -> None:
    model = SHAPE.build(3)
    with pytest.raises(mtp_hooks.MTPHooksError, match="^mtp_input: bad value"):
        mtp_hooks.attach(model, mtp_input="pre_norm")
    assert mtp_hooks.hooks_of(model) is None
