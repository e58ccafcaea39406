"""Which drafts of the hooked model equal the engine's tokens: one training-style forward over them.

One forward of the hooked model (``attach(draft_steps=k, draft_inputs="argmax", accept_rule="argmax",
draft_layers=...)``) over the prompts followed by the tokens the engine generated gives, at every position
``t``, the draft of each step the hooks run (the argmax of the main head on that step's MTP output; step j
at ``t`` drafts token ``t + j + 1``), and whether it equals the engine's token there (``draft_hits``).

Which layer runs step j is the hooks' own plan (``MTPHooks.draft_plan()``, from ``draft_layers``), so the
same call predicts vLLM 0.32 (``"first"``) or SGLang (``"per_step"``). The hooks' metrics tie the
indicators to them: ``mtp_j/acc`` (the masked share of step j's drafts equal to the labels, here the
engine's tokens) must equal the indicators' mean, or ``AssertionError``. Unsharded models (tensor
parallelism 1) on one device.

``mtp_input``: what the first MTP layer reads as the main model's hidden state. mcore feeds it the decoder's
output, after the final norm (``"decoder_output"``), and vLLM's DeepSeek-V3 and GLM-4.5 drafters read the same;
vLLM's MiMo drafter (``mimo_mtp``) reads the target's hidden state before the final norm
(``"pre_final_norm"``: the norm's input, swapped in for the block's call of MTP layer 1 by a pre-hook). The
two agree only while the final norm's weight is uniform.

``geometry``: ``"chain"`` runs steps 2..k as the hooks' chain does (each over the whole sequence);
``"engine"`` as vLLM's proposer does (``engine_steps``: one token at a time over step 1's states).
``recycle``: what step j + 1 reads of step j there (``engine_steps.RECYCLES``): ``"normed"`` (mcore's, and
vLLM's DeepSeek-V3 drafter's) or ``"unnormed"`` (vLLM 0.32 / 0.33's GLM-4.5 drafter); in the chain geometry
it is the hooks' own ``draft_recycle``.

``start_embedding``: what MTP layer 1 reads as the next token's embedding at each sequence's position 0: mcore
trains it (``"kept"``); vLLM's DeepSeek-V3, GLM-4.5 and MiMo drafters replace it by zeros (``"zeroed"``, "not needed
by MTP"), so the draft's attention there sees another key and value than it was trained with. It matters where
the draft attends back to the sequence's start (short prompts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor, nn

from mtp_hooks.models import mtp_layer_body
from mtp_hooks.predict.engine_steps import RECYCLES, engine_step_drafts
from mtp_hooks.predict.head import head_argmax

if TYPE_CHECKING:
    from mtp_hooks import MTPHooks

__all__ = ["GEOMETRIES", "MTP_INPUTS", "START_EMBEDDINGS", "draft_hits"]

MTP_INPUTS = ("decoder_output", "pre_final_norm")
GEOMETRIES = ("chain", "engine")
START_EMBEDDINGS = ("kept", "zeroed")


def _positions(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()


def _block_steps(plan: Sequence[int], depths: int, modules: int) -> int:
    """How many leading draft steps are the MTP block's own calls: step j runs the layer the block calls at
    depth j (layer j - 1, or the one module that serves every depth); the steps after them are the
    chain's calls after the block returned."""
    kept = 0
    while kept < min(len(plan), depths) and plan[kept] == min(kept, modules - 1):
        kept += 1
    return kept


def _zero_start_embedding(layer: nn.Module) -> Any:
    """A pre-hook that zeroes the token embedding the block's call of MTP layer 1 reads at position 0 (the sequences'
    first row: prompts of one length) before its norm, as vLLM's drafters zero it (and ``attach(start_embedding=
    "zeroed")`` trains it); the chain's later calls of the layer are left alone."""
    calls: list[int] = []

    def zero(module: nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        calls.append(1)
        if len(calls) != 1:
            return None
        zeroed = args[0].clone()
        zeroed[0] = 0.0  # [s, b, h]
        return (zeroed, *args[1:])

    return layer.enorm.register_forward_pre_hook(zero)


def _check(hooks: MTPHooks, mtp_input: str, geometry: str, recycle: str) -> None:
    if recycle not in RECYCLES:
        raise ValueError(f"recycle: expected one of {RECYCLES}, received {recycle!r}")
    if geometry == "chain" and recycle != hooks.options.draft_recycle:
        raise ValueError(f"recycle: the chain geometry replays the hooks' own steps, which recycle "
                         f"{hooks.options.draft_recycle!r} (attach(draft_recycle=)): expected that, "
                         f"received {recycle!r}")
    if mtp_input not in MTP_INPUTS:
        raise ValueError(f"mtp_input: expected one of {MTP_INPUTS}, received {mtp_input!r}")
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: expected one of {GEOMETRIES}, received {geometry!r}")
    if geometry == "engine" and hooks.options.draft_layers != "first":
        raise ValueError(f"geometry='engine' replays vLLM's proposer, which runs MTP layer 1 for every step: "
                         f"expected hooks with draft_layers='first', received {hooks.options.draft_layers!r}")


def draft_hits(
    model: nn.Module, hooks: MTPHooks, sequences: Tensor, prompt: int,
    mtp_input: str = "decoder_output", geometry: str = "chain", recycle: str = "normed", start_embedding: str = "kept",
) -> tuple[Tensor, float]:
    """``[k, b, s]`` bool: step j's draft at position t equals ``sequences[:, t + j + 1]`` (False where
    that is past the end), and the share of the tokens after the prompt that the main head's argmax
    picks. One training-style forward (grad enabled so the MTP block runs, never backpropagated) under
    ``hooks``, whose ``draft_steps`` is k; ``prompt`` tokens are not scored."""
    _check(hooks, mtp_input, geometry, recycle)
    if start_embedding not in START_EMBEDDINGS:
        raise ValueError(f"start_embedding: expected one of {START_EMBEDDINGS}, received {start_embedding!r}")
    zeroed_by_hooks = hooks.options.start_embedding == "zeroed"  # attach(start_embedding=): the forward zeroes it
    if zeroed_by_hooks and start_embedding != "zeroed":
        raise ValueError("start_embedding: the hooks zero MTP layer 1's start embedding (attach(start_embedding="
                         f"'zeroed')), so the forward replays 'zeroed': expected that, received {start_embedding!r}")
    layers = list(model.mtp.layers)
    plan = hooks.draft_plan()
    steps, depths = len(plan), model.config.mtp_num_layers
    kept = _block_steps(plan, depths, len(layers))
    outputs: list[Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        outputs.append((output if isinstance(output, Tensor) else output[0]).detach())

    device = next(model.parameters()).device
    ids = sequences.to(device)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(ids.shape, dtype=torch.float32, device=device)
    mask[:, prompt - 1 : -1] = 1.0
    before_norm: list[Tensor] = []

    def keep_norm_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        before_norm.append(args[0])

    first_calls: list[int] = []

    def feed_before_norm(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The block's call of MTP layer 1 only (not the chain's later calls of it, fed the step before), after
        the hooks' own pre-hooks recorded the block's arguments: the main head still reads the norm's output."""
        if not first_calls:
            first_calls.append(1)
            kwargs["hidden_states"] = before_norm[-1]
        return args, kwargs

    body_inputs: list[Tensor] = []

    def keep_body_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        body_inputs.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach())

    before_final_norm: list[Tensor] = []

    def keep_unnormed(module: nn.Module, args: tuple[Any, ...]) -> None:
        before_final_norm.append(args[0].detach())

    handles = [layer.register_forward_hook(keep) for layer in layers]
    if geometry == "engine":
        handles.append(mtp_layer_body(layers[0]).register_forward_pre_hook(keep_body_input, with_kwargs=True))
        handles.append(layers[0].final_layernorm.register_forward_pre_hook(keep_unnormed))
    if mtp_input == "pre_final_norm":
        handles.append(model.decoder.final_layernorm.register_forward_pre_hook(keep_norm_input))
        handles.append(layers[0].register_forward_pre_hook(feed_before_norm, with_kwargs=True))
    if start_embedding == "zeroed" and not zeroed_by_hooks:
        handles.append(_zero_start_embedding(layers[0]))
    try:
        with torch.enable_grad(), hooks.micro_batch(labels=labels, loss_mask=mask):
            logits = model(ids, _positions(ids), None)
    finally:
        for handle in handles:
            handle.remove()
    metrics = hooks.metrics()
    if len(outputs) != depths + steps - kept:
        raise AssertionError(f"{len(outputs)} MTP layer calls, expected {depths} + {steps - kept}")
    chosen = outputs[:kept] + outputs[depths:]
    b, s = ids.shape
    hits = torch.zeros(steps, b, s, dtype=torch.bool)
    for j, hidden in enumerate(chosen, start=1):
        drafts = head_argmax(model, hidden).t().cpu()  # [b, s]
        hits[j - 1, :, : s - j - 1] = drafts[:, : s - j - 1] == sequences[:, j + 1 :]
        scored = mask.cpu()[:, j:]  # the hooks roll the mask with the labels: step j at t is scored where t + j is
        share = float((hits[j - 1, :, : s - j] & scored.bool()).sum() / scored.sum())
        reported = metrics.get(f"mtp_{j}/acc")
        if reported is not None and abs(reported - share) > 1e-6:
            raise AssertionError(
                f"step {j}: drafts equal to the engine's tokens {share:.6f}, the hooks' mtp_{j}/acc {reported:.6f}"
            )
    if geometry == "engine" and steps > 1:  # steps 2..k as the engine's proposer runs them (engine_steps)
        drafts = engine_step_drafts(
            model, body_inputs[0], chosen[0], steps, prompt - 1, recycle=recycle, step1_unnormed=before_final_norm[0]
        )
        for j in range(2, steps + 1):
            hits[j - 1] = False
            hits[j - 1, :, : s - j - 1] = drafts[j - 1, :, : s - j - 1] == sequences[:, j + 1 :]
    picked = logits.detach()[:, prompt - 1 : -1].argmax(-1).cpu()
    return hits, float((picked == sequences[:, prompt:]).float().mean())
