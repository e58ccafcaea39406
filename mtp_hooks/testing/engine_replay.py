"""The acceptance a greedy (T = 0) engine measures, predicted by the trainer on the engine's own tokens.

vLLM drafts k tokens per verification step and, at T = 0, keeps draft j while drafts 1..j all equal
the target's argmax; its per-position rate is (steps whose drafts 1..j were kept) / steps. The
trainer predicts it without an engine in the loop: one training-style forward of the hooked model
(``attach(draft_steps=k, draft_inputs="argmax", accept_rule="argmax", draft_layers=...)``) over
the prompts followed by the tokens the engine generated gives, at every position ``t``, the draft
of each step the hooks run (the argmax of the main head on that step's MTP output; step j at ``t``
drafts token ``t + j + 1``), and whether it equals the engine's token there. ``replay`` then
walks the engine's verification steps over those indicators: from the first generated token, each
step drafts after the last token, keeps the leading drafts that hit, and moves on by one plus them.

Which layer runs step j is the hooks' ``draft_layers`` (``mtp_hooks.features.chain.Plan``), so the
same call predicts vLLM 0.32 (``"first"``) or SGLang (``"per_step"``). The hooks' own metrics tie
the indicators to them: ``mtp_j/acc`` (the masked share of step j's drafts equal to the labels,
here the engine's tokens) must equal the indicators' mean, or ``AssertionError``.
Unsharded models (tensor parallelism 1) on one device; prompts of equal length.

``mtp_input``: what the first MTP layer reads as the main model's hidden state. mcore feeds it the decoder's
output, after the final norm (``"decoder_output"``), and vLLM's DeepSeek-V3 and GLM-4.5 drafters read the same;
vLLM's MiMo drafter (``mimo_mtp``) reads the target's hidden state before the final norm
(``"pre_final_norm"``: the norm's input, swapped in for the block's call of MTP layer 1 by a pre-hook). The
two agree only while the final norm's weight is uniform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks import _mcore
from mtp_hooks.features.chain import Plan
from mtp_hooks.testing.engine_drafts import engine_step_drafts, head_argmax

__all__ = ["MTP_INPUTS", "Replay", "draft_hits", "predict_engine_acceptance", "replay"]

MTP_INPUTS = ("decoder_output", "pre_final_norm")
GEOMETRIES = ("chain", "engine")


@dataclasses.dataclass(frozen=True)
class Replay:
    """Predicted counts of a greedy engine run: verification steps (``drafts``), and per draft position
    how many steps kept it (``accepted_per_position``), as vLLM's counters count them."""

    drafts: int
    accepted_per_position: tuple[int, ...]
    # Share of the generated tokens the trainer's main head also picks (its argmax after the token before):
    # below 1, the trainer's target is not the engine's, and neither are the hidden states the drafts start from.
    target_agreement: float = float("nan")

    @property
    def per_position(self) -> tuple[float, ...]:
        return tuple(a / self.drafts for a in self.accepted_per_position) if self.drafts else ()

    @property
    def mean_length(self) -> float:
        return 1 + sum(self.accepted_per_position) / self.drafts if self.drafts else float("nan")


def _positions(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()


def draft_hits(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, sequences: Tensor, prompt: int, mtp_input: str = "decoder_output", geometry: str = "chain"
) -> tuple[Tensor, float]:
    """``[k, b, s]`` bool: step j's draft at position t equals ``sequences[:, t + j + 1]`` (False where
    that is past the end), and the share of the tokens after the prompt that the main head's argmax
    picks. One training-style forward (grad enabled so the MTP block runs, never backpropagated) under
    ``hooks``, whose ``draft_steps`` is k; ``prompt`` tokens are not scored."""
    options = hooks.options
    if mtp_input not in MTP_INPUTS:
        raise ValueError(f"mtp_input: expected one of {MTP_INPUTS}, received {mtp_input!r}")
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: expected one of {GEOMETRIES}, received {geometry!r}")
    if geometry == "engine" and options.draft_layers != "first":
        raise ValueError(f"geometry='engine' replays vLLM's proposer, which runs MTP layer 1 for every step: "
                         f"expected hooks with draft_layers='first', received {options.draft_layers!r}")
    layers = list(model.mtp.layers)
    steps = options.draft_steps or model.config.mtp_num_layers
    plan = Plan.of(steps, model.config, len(layers), options.draft_layers)
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

    def feed_before_norm(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The block's call of MTP layer 1 only (not the chain's later calls of it, fed the step before), after
        the hooks' own pre-hooks recorded the block's arguments: the main head still reads the norm's output."""
        if not first_calls:
            first_calls.append(1)
            kwargs["hidden_states"] = before_norm[-1]
        return args, kwargs

    body_inputs: list[Tensor] = []

    def keep_body_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        body_inputs.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach())

    handles = [layer.register_forward_hook(keep) for layer in layers]
    if geometry == "engine":
        body = getattr(layers[0], _mcore.mtp_layer_body_name(layers[0]))
        handles.append(body.register_forward_pre_hook(keep_body_input, with_kwargs=True))
    if mtp_input == "pre_final_norm":
        handles.append(model.decoder.final_layernorm.register_forward_pre_hook(keep_norm_input))
        handles.append(layers[0].register_forward_pre_hook(feed_before_norm, with_kwargs=True))
    try:
        with torch.enable_grad(), hooks.micro_batch(labels=labels, loss_mask=mask):
            logits = model(ids, _positions(ids), None)
    finally:
        for handle in handles:
            handle.remove()
    metrics = hooks.metrics()
    if len(outputs) != plan.block_steps + plan.reruns:
        raise AssertionError(f"{len(outputs)} MTP layer calls, expected {plan.block_steps} + {plan.reruns}")
    chosen = outputs[: plan.kept] + outputs[plan.block_steps :]
    b, s = ids.shape
    hits = torch.zeros(steps, b, s, dtype=torch.bool)
    for j, hidden in enumerate(chosen, start=1):
        drafts = head_argmax(model, hidden).t().cpu()  # [b, s]
        hits[j - 1, :, : s - j - 1] = drafts[:, : s - j - 1] == sequences[:, j + 1 :]
        scored = mask.cpu()[:, j:]  # the hooks roll the mask with the labels: step j at t is scored where t + j is
        share = float((hits[j - 1, :, : s - j] & scored.bool()).sum() / scored.sum())
        reported = metrics.get(f"mtp_{j}/acc")
        if reported is not None and abs(reported - share) > 1e-6:
            raise AssertionError(f"step {j}: drafts equal to the engine's tokens {share:.6f}, the hooks' mtp_{j}/acc {reported:.6f}")
    if geometry == "engine" and steps > 1:  # steps 2..k as the engine's proposer runs them (engine_drafts)
        drafts = engine_step_drafts(model, body_inputs[0], chosen[0], steps, prompt - 1)
        for j in range(2, steps + 1):
            hits[j - 1] = False
            hits[j - 1, :, : s - j - 1] = drafts[j - 1, :, : s - j - 1] == sequences[:, j + 1 :]
    picked = logits.detach()[:, prompt - 1 : -1].argmax(-1).cpu()
    return hits, float((picked == sequences[:, prompt:]).float().mean())


def replay(hits: Tensor, prompt: int, max_tokens: int, target_agreement: float = float("nan")) -> Replay:
    """The engine's greedy verification steps over ``hits`` (``draft_hits``): per row the prefill
    gives the first token; while fewer than ``max_tokens`` are out, one step drafts k after the last
    token, keeps the leading hits and emits them plus the target's token."""
    k, rows, width = hits.shape
    drafts, accepted = 0, [0] * k
    for row in range(rows):
        last, produced = prompt, 1  # index of the last token out, tokens out
        while produced < max_tokens:
            drafts += 1
            kept = 0
            while kept < k and last - 1 < width and bool(hits[kept, row, last - 1]):
                accepted[kept] += 1
                kept += 1
            last, produced = last + 1 + kept, produced + 1 + kept
    return Replay(drafts, tuple(accepted), target_agreement)


def predict_engine_acceptance(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, prompts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]], max_tokens: int,
    mtp_input: str = "decoder_output", geometry: str = "chain",
) -> Replay:
    """The per-position acceptance a T = 0 engine drafting ``hooks.options.draft_steps`` tokens measures
    when it generates ``max_tokens`` tokens per prompt. ``token_ids``: the engine's generated tokens, at
    least ``max_tokens`` per prompt and ideally k more (the greedy continuation past the end, e.g.
    from a plain run), so the last steps' drafts have tokens to be compared with. ``mtp_input``: the module
    docstring's (``"pre_final_norm"`` for vLLM's MiMo drafter)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts: expected one length, received {sorted(lengths)}")
    width = min(len(t) for t in token_ids)
    if width < max_tokens:
        raise ValueError(f"token_ids: expected at least max_tokens={max_tokens} per prompt, received {width}")
    sequences = torch.tensor([list(p) + list(t[:width]) for p, t in zip(prompts, token_ids)], dtype=torch.long)
    prompt = lengths.pop()
    hits, agreement = draft_hits(model, hooks, sequences, prompt, mtp_input, geometry)
    return replay(hits, prompt, max_tokens, agreement)
