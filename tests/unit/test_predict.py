"""``mtp_hooks.predict`` without an engine: which hidden state the first MTP layer reads in the prediction (the
decoder's output after the final norm, as mcore trains it, or the norm's input, as vLLM's MiMo drafter reads it),
the hits on a model whose drafts are known, the hooks' plan of which layer runs each step, and a model whose head
is tied to its embedding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.models import mtp_layer_body
from mtp_hooks.predict import draft_hits, engine_step_drafts, predict_engine_acceptance
from mtp_hooks import testing
from mtp_hooks.testing import engine_models as em

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
    body = mtp_layer_body(layer)

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


@pytest.mark.parametrize(
    ("options", "plan"),
    [
        (dict(draft_layers="first", draft_steps=3), (0, 0, 0)),  # vLLM 0.32: layer 1 drafts every step
        (dict(draft_layers="per_step", draft_steps=3), (0, 1, 1)),  # mcore's depths, then the last layer
        (dict(draft_layers="per_step"), (0, 1)),
        (dict(draft_layers="first"), (0, 0)),
    ],
)
def test_draft_plan_names_the_layer_of_each_step(options: dict[str, Any], plan: tuple[int, ...]) -> None:
    model = em.shape("mimo", 2).build(seed=5)
    hooks = mtp_hooks.attach(model, **{**RULE, **options})
    try:
        assert hooks.draft_plan() == plan and len(plan) == hooks.depth
    finally:
        hooks.remove()
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="draft_plan"):
        hooks.draft_plan()


def test_per_step_plan_past_the_block_replays_the_hooks_own_steps() -> None:
    """Steps 1..2 are the block's calls of layers 1 and 2, step 3 the chain's call of layer 2 after it:
    ``draft_hits`` picks those outputs and checks each step against the hooks' ``mtp_j/acc``."""
    model = em.shape("mimo", 2).build(seed=5)
    sequences = torch.randint(2, em.VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    hooks = mtp_hooks.attach(model, draft_steps=3, **{**RULE, "draft_layers": "per_step"})
    try:
        hits, _ = draft_hits(model, hooks, sequences, prompt=4)
    finally:
        hooks.remove()
    assert hits.shape == (3, 2, 12)


def _tied_and_untied_twin() -> tuple[nn.Module, nn.Module]:
    """A model whose head is its embedding (``share_embeddings_and_output_weights``: its output layer holds no
    weight) and an untied twin with the same weights, its output layer a copy of the embedding. A vocabulary of 8
    tokens, so that random drafts hit often."""
    tied = testing.TinyQwen(vocab_size=8, tied=True).build(seed=5)
    untied = testing.TinyQwen(vocab_size=8, tied=False).build(seed=5)
    assert tied.output_layer.weight is None
    untied.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        untied.output_layer.weight.copy_(tied.embedding.word_embeddings.weight)
    return tied, untied


@pytest.mark.parametrize("geometry", ["chain", "engine"])
def test_tied_embeddings_predict_with_the_embedding_as_the_head(geometry: str) -> None:
    """The prediction on a tied model is the one on its untied twin (the head's weight is the embedding's), and
    its drafts' hits match the hooks' own ``mtp_j/acc`` (``draft_hits`` checks)."""
    sequences = torch.randint(0, 8, (4, 16), generator=torch.Generator().manual_seed(2))
    prompts, tokens = sequences[:, :4].tolist(), sequences[:, 4:].tolist()
    replays = []
    for model in _tied_and_untied_twin():
        hooks = mtp_hooks.attach(model, draft_steps=3, **RULE)
        try:
            replays.append(predict_engine_acceptance(model, hooks, prompts, tokens, max_tokens=9, geometry=geometry))
        finally:
            hooks.remove()
    assert replays[0] == replays[1]
    assert replays[0].accepted_per_position[0] > 0


def _recycled_drafts(model: nn.Module, sequences: torch.Tensor, recycle: str) -> torch.Tensor:
    """``engine_step_drafts`` of 3 steps from MTP layer 1's teacher-forced states, ``recycle`` as given."""
    layer = model.mtp.layers[0]
    unnormed: list[torch.Tensor] = []
    handle = layer.final_layernorm.register_forward_pre_hook(lambda module, args: unnormed.append(args[0].detach()))
    try:
        inputs, outputs = _step1_states(model, sequences)
    finally:
        handle.remove()
    return engine_step_drafts(model, inputs, outputs, steps=3, first=3, recycle=recycle, step1_unnormed=unnormed[0])


def test_unnormed_recycle_equals_normed_while_the_final_norm_is_uniform() -> None:
    """Step 2 reading the MTP layer's output before its final norm (vLLM 0.32's GLM-4.5 drafter) or after it
    (mcore's, DeepSeek-V3's) drafts the same while the norm's weight is one constant (the RMS norm of a constant
    multiple is the same); a weight far from uniform makes them differ, and step 1 is the same either way."""
    model = em.shape("mimo", 1).build(seed=5)
    sequences = torch.randint(2, em.VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    weight = model.mtp.layers[0].final_layernorm.weight
    with torch.no_grad():
        weight.fill_(2.5)
    assert torch.equal(_recycled_drafts(model, sequences, "normed"), _recycled_drafts(model, sequences, "unnormed"))
    with torch.no_grad():
        weight.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(4)) * 4 + 0.1)
    normed, unnormed = _recycled_drafts(model, sequences, "normed"), _recycled_drafts(model, sequences, "unnormed")
    assert torch.equal(normed[0], unnormed[0]) and not torch.equal(normed[1:], unnormed[1:])


def test_recycle_is_checked() -> None:
    model = em.trainer("mimo", "copy")
    sequences = torch.tensor(em.counting_prompts(2, 12))
    hooks = mtp_hooks.attach(model, draft_steps=2, **RULE)
    try:
        with pytest.raises(ValueError, match="recycle: expected one of"):
            draft_hits(model, hooks, sequences, prompt=4, geometry="engine", recycle="raw")
        with pytest.raises(ValueError, match="attach\\(draft_recycle=\\)"):  # the chain replays the hooks' own rule
            draft_hits(model, hooks, sequences, prompt=4, geometry="chain", recycle="unnormed")
    finally:
        hooks.remove()
    with mtp_hooks.attached(model, draft_steps=2, draft_recycle="unnormed", **RULE) as hooks:
        hits, _ = draft_hits(model, hooks, sequences, prompt=4, geometry="chain", recycle="unnormed")
        assert hits.shape[0] == 2
    with pytest.raises(ValueError, match="step1_unnormed"):
        engine_step_drafts(model, torch.zeros(4, 1, em.HIDDEN), torch.zeros(4, 1, em.HIDDEN), 2, 1, recycle="unnormed")


def _eh_proj_inputs(model: nn.Module, start_embedding: str) -> list[torch.Tensor]:
    """The input of MTP layer 1's ``eh_proj`` (``cat(enorm(embedding), hnorm(hidden))``) at each of its calls in one
    ``draft_hits`` forward drafting 2 steps in the chain geometry (the block's call, then the chain's)."""
    seen: list[torch.Tensor] = []
    handle = model.mtp.layers[0].eh_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    hooks = mtp_hooks.attach(model, draft_steps=2, **RULE)
    try:
        draft_hits(model, hooks, torch.randint(2, em.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)), prompt=4,
                   start_embedding=start_embedding)
    finally:
        hooks.remove()
        handle.remove()
    return seen


def test_zeroed_start_embedding_zeroes_layer_1s_token_embedding_at_position_0_only() -> None:
    """vLLM's drafters zero MTP layer 1's token embedding at position 0: the prediction's block call of layer 1 reads
    zeros there (its normed embedding half, row 0) and the very same values everywhere else; the chain's later call
    of the layer is untouched."""
    model = em.trainer("mimo", "noisy", sigma=1.0)
    kept, zeroed = _eh_proj_inputs(model, "kept"), _eh_proj_inputs(model, "zeroed")
    hidden = model.config.hidden_size
    assert len(kept) == len(zeroed) == 2
    assert kept[0][0, :, :hidden].abs().sum() > 0 and torch.all(zeroed[0][0, :, :hidden] == 0)
    assert torch.equal(zeroed[0][0, :, hidden:], kept[0][0, :, hidden:]) and torch.equal(zeroed[0][1:], kept[0][1:])
    assert zeroed[1][0, :, :hidden].abs().sum() > 0  # the chain's call: its draft embedding at position 0 kept
    assert not torch.equal(zeroed[1], kept[1])  # it reads step 1's output, which the zero changed
    with pytest.raises(ValueError, match="start_embedding"):
        _eh_proj_inputs(model, "masked")


def test_hooks_that_zero_the_start_are_replayed_as_they_train() -> None:
    """Hooks attached with ``start_embedding="zeroed"`` (every vLLM profile) already zero it in the forward: MTP layer
    1's block call reads zeros there, the hits are the prediction's own zeroing on hooks that keep it, and a replay
    that keeps it is refused."""
    model = em.trainer("mimo", "noisy", sigma=1.0)
    sequences = torch.randint(2, em.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []
    handle = model.mtp.layers[0].eh_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    with mtp_hooks.attached(model, draft_steps=2, **RULE) as hooks:
        expected, _ = draft_hits(model, hooks, sequences, prompt=4, start_embedding="zeroed")
    with mtp_hooks.attached(model, draft_steps=2, start_embedding="zeroed", **RULE) as hooks:
        hits, _ = draft_hits(model, hooks, sequences, prompt=4, start_embedding="zeroed")
        with pytest.raises(ValueError, match="^start_embedding: the hooks zero"):
            draft_hits(model, hooks, sequences, prompt=4)
    handle.remove()
    hidden = model.config.hidden_size
    assert torch.equal(hits, expected)
    assert torch.all(seen[2][0, :, :hidden] == 0) and torch.equal(seen[2], seen[0])  # the block's call, as the prediction's
