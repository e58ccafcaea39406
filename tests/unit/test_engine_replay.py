"""``mtp_hooks.testing.engine_replay`` without an engine: which hidden state the first MTP layer reads in the
prediction (the decoder's output after the final norm, as mcore trains it, or the norm's input, as vLLM's MiMo
drafter reads it), and the hits on a model whose drafts are known."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import engine_models as em
from mtp_hooks.testing.engine_drafts import engine_step_drafts
from mtp_hooks.testing.engine_replay import draft_hits

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
RULE: dict[str, Any] = dict(draft_inputs="argmax", accept_rule="argmax", draft_layers="first", agreement_metrics=True)


def _inputs(model: nn.Module, mtp_input: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(what MTP layer 1 received as hidden state, the final norm's input, its output) in one draft_hits forward."""
    seen: dict[str, torch.Tensor] = {}

    def layer_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        seen.setdefault("layer", kwargs["hidden_states"].detach().clone())  # as the layer ran: after every pre-hook

    def norm(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seen["before"], seen["after"] = args[0].detach().clone(), output.detach().clone()

    handles = [model.mtp.layers[0].register_forward_hook(layer_input, with_kwargs=True), model.decoder.final_layernorm.register_forward_hook(norm)]
    hooks = mtp_hooks.attach(model, draft_steps=2, **RULE)
    try:
        draft_hits(model, hooks, torch.randint(2, em.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)), prompt=4, mtp_input=mtp_input)
    finally:
        hooks.remove()
        for handle in handles:
            handle.remove()
    return seen["layer"], seen["before"], seen["after"]


def test_pre_final_norm_feeds_the_mtp_layer_the_norms_input_and_the_default_its_output() -> None:
    model = em.trainer("mimo", "copy", mtp_num_layers=2)
    with torch.no_grad():
        model.decoder.final_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    received, before, after = _inputs(model, "pre_final_norm")
    assert torch.equal(received, before) and not torch.allclose(received, after)
    received, before, after = _inputs(model, "decoder_output")
    assert torch.equal(received, after)
    with pytest.raises(ValueError, match="mtp_input"):
        _inputs(model, "after")


def test_pre_final_norm_leaves_the_main_head_on_the_norms_output() -> None:
    """On the model's own greedy continuation, under a final-norm weight far from uniform, the main head picks
    every token in both modes: only MTP layer 1's input changes."""
    model = em.shape("mimo", 2).build(seed=3)
    with torch.no_grad():
        model.decoder.final_layernorm.weight.uniform_(0.0, 4.0, generator=torch.Generator().manual_seed(1))
    sequences = torch.randint(2, em.VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    hooks = mtp_hooks.attach(model, draft_steps=2, **RULE)
    try:
        with torch.no_grad():  # inference forwards: the MTP block does not run
            while sequences.shape[1] < 12:
                picked = model(sequences, torch.arange(sequences.shape[1]).expand_as(sequences).contiguous(), None)[:, -1].argmax(-1)
                sequences = torch.cat([sequences, picked[:, None]], dim=1)
        agreements = [draft_hits(model, hooks, sequences, prompt=4, mtp_input=m)[1] for m in ("decoder_output", "pre_final_norm")]
    finally:
        hooks.remove()
    assert agreements == [1.0, 1.0]


def test_copy_draft_hits_every_counting_step_at_step_1() -> None:
    model = em.trainer("mimo", "copy", mtp_num_layers=2)
    sequences = torch.tensor([em.counting_prompts(2, 12)[i] for i in range(2)])
    hooks = mtp_hooks.attach(model, draft_steps=2, **RULE)
    try:
        hits, agreement = draft_hits(model, hooks, sequences, prompt=4)
    finally:
        hooks.remove()
    assert agreement == 1.0  # the counting target picks every next token
    assert hits[0, :, : 12 - 2].all() and hits[1, :, : 12 - 3].all()  # layer 1, a perfect draft, runs both steps
    assert not hits[0, :, 12 - 2 :].any()  # no token to compare with past the end


def _step1_states(model: nn.Module, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer 1's body input and its output in one teacher-forced forward of ``sequences``."""
    seen: dict[str, torch.Tensor] = {}
    layer = model.mtp.layers[0]
    body = getattr(layer, "mtp_model_layer", None) or layer.transformer_layer

    def body_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.setdefault("inputs", kwargs["hidden_states"].detach())

    def output(module: nn.Module, args: Any, out: Any) -> None:
        seen.setdefault("outputs", (out if isinstance(out, torch.Tensor) else out[0]).detach())

    handles = [body.register_forward_pre_hook(body_input, with_kwargs=True), layer.register_forward_hook(output)]
    hooks = mtp_hooks.attach(model, draft_steps=3, **RULE)
    try:
        draft_hits(model, hooks, sequences, prompt=4, geometry="engine")
    finally:
        hooks.remove()
        for handle in handles:
            handle.remove()
    return seen["inputs"], seen["outputs"]


def test_engine_geometry_drafts_each_start_as_its_own_unpadded_sequence() -> None:
    """Batched starts (padded to one length, causal attention) draft what each start drafts alone, and step 1
    is the teacher-forced draft; steps 2..3 read step 1's states before the start, not their own."""
    model = em.shape("mimo", 2).build(seed=5)
    sequences = torch.randint(2, em.VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    inputs, outputs = _step1_states(model, sequences)
    batched = engine_step_drafts(model, inputs, outputs, steps=3, first=3)
    alone = engine_step_drafts(model, inputs, outputs, steps=3, first=3, chunk=1)
    assert torch.equal(batched, alone)
    assert (batched[:, :, :3] == -1).all() and (batched[:, :, 3:] >= 0).all()
    # The start at p sees only positions <= p of step 1: changing a later token's step-1 state changes nothing.
    changed = inputs.clone()
    changed[10:] += 1.0
    again = engine_step_drafts(model, changed, outputs, steps=3, first=3)
    assert torch.equal(again[:, :, :10], batched[:, :, :10])


def test_engine_geometry_needs_the_first_layer_schedule() -> None:
    model = em.trainer("mimo", "copy", mtp_num_layers=2)
    hooks = mtp_hooks.attach(model, draft_steps=2, **{**RULE, "draft_layers": "per_step"})
    try:
        with pytest.raises(ValueError, match="geometry='engine'"):
            draft_hits(model, hooks, torch.tensor(em.counting_prompts(2, 12)), prompt=4, geometry="engine")
    finally:
        hooks.remove()
