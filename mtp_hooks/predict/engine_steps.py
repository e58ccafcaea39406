"""Draft steps 2..k as a greedy engine runs them: one token at a time over the draft's KV cache.

The hooks' chain runs draft step j over the whole sequence at once: at every position the MTP layer
attends over step j's own states at the positions before. An engine drafting from one verification
start ``p`` does not: vLLM's proposer fills the draft's KV cache with step 1 (the target's hidden
state and the next token, teacher-forced) at every position up to ``p``, then appends the later
steps one token each, at ``p + 1``, ``p + 2``, ...: step j's query attends over step 1's states
before ``p`` and over steps 2..j-1's own appended ones. ``engine_step_drafts`` computes exactly that,
for every start at once (one padded sequence per start; causal attention leaves the padding
unread), from the step-1 states of one forward: the MTP layer body's input (``step1_inputs``, after
the ``eh_proj`` projection) and the layer's output (``step1_outputs``, after its final norm).

What step j + 1 receives from step j (``recycle``, the engine's rule): ``"normed"``, the MTP layer's output
after its final norm (mcore's MTP layers hand each other that; vLLM's DeepSeek-V3 drafter and GLM-4.5's from
0.34), or ``"unnormed"``, the layer's output before it (``residual + hidden``: vLLM 0.32 / 0.33's GLM-4.5
drafter). The draft token is the head's pick on the normed state either way. The two agree only while the
final norm's weight is uniform.

Every step runs the first MTP layer, as vLLM 0.32 does (``draft_layers="first"``). Unsharded models
(tensor parallelism 1), one device, rotary or no position embedding.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from mtp_hooks.models import mtp_layer_body
from mtp_hooks.predict.head import head_argmax

__all__ = ["RECYCLES", "engine_step_drafts"]

RECYCLES = ("normed", "unnormed")


def _project(layer: nn.Module, embedded: Tensor, hidden: Tensor) -> Tensor:
    """The MTP layer's input projection: ``eh_proj(cat(enorm(embedding), hnorm(hidden)))``."""
    projected = layer.eh_proj(torch.cat((layer.enorm(embedded), layer.hnorm(hidden)), -1))
    return projected[0] if isinstance(projected, tuple) else projected


def _body(model: nn.Module, layer: nn.Module, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The MTP layer's transformer layer over ``[L, n, h]`` causal sequences: its output, and that after the
    layer's final norm."""
    body = mtp_layer_body(layer)
    rotary = getattr(model, "rotary_pos_emb", None)
    kwargs: dict[str, Any] = {"hidden_states": inputs, "attention_mask": None}
    if rotary is not None:
        kwargs["rotary_pos_emb"] = rotary(inputs.shape[0])
    out = body(**kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out, layer.final_layernorm(out)


@torch.no_grad()
def engine_step_drafts(
    model: nn.Module, step1_inputs: Tensor, step1_outputs: Tensor, steps: int, first: int, chunk: int = 256,
    recycle: str = "normed", step1_unnormed: Optional[Tensor] = None,
) -> Tensor:
    """``[steps, b, s]`` draft token ids: step j's draft from the start at position ``p`` (it drafts the
    token at ``p + j + 1``), for ``p >= first``; -1 elsewhere. ``step1_inputs`` / ``step1_outputs``:
    ``[s, b, h]``, the first MTP layer's body input and output (after its final norm) of a teacher-forced
    forward; ``step1_unnormed``: that output before the final norm, which ``recycle="unnormed"`` needs."""
    if recycle not in RECYCLES:
        raise ValueError(f"recycle: expected one of {RECYCLES}, received {recycle!r}")
    if recycle == "unnormed" and step1_unnormed is None:
        raise ValueError("recycle='unnormed' hands step 2 step 1's output before the final norm: pass step1_unnormed")
    handed_on = step1_unnormed if recycle == "unnormed" else step1_outputs
    layer = model.mtp.layers[0]
    s, b, h = step1_inputs.shape
    drafts = torch.full((steps, b, s), -1, dtype=torch.long)
    drafts[0, :, first:] = head_argmax(model, step1_outputs[first:]).t().cpu()
    starts = [(p, row) for p in range(first, s) for row in range(b)]
    for lo in range(0, len(starts), chunk):
        batch = starts[lo : lo + chunk]
        length = max(p for p, _ in batch) + steps
        seqs = step1_inputs.new_zeros(length, len(batch), h)
        for i, (p, row) in enumerate(batch):
            seqs[: p + 1, i] = step1_inputs[: p + 1, row]
        ends = torch.tensor([p for p, _ in batch], device=seqs.device)
        index = torch.arange(len(batch), device=seqs.device)
        rows = torch.tensor([row for _, row in batch])
        hidden = handed_on[ends, rows.to(seqs.device)]  # [n, h]: what step 2 reads
        token = head_argmax(model, step1_outputs[ends, rows.to(seqs.device)])
        for j in range(2, steps + 1):
            at = ends + j - 1  # step j's query position
            embedded = model.embedding(input_ids=token[:, None], position_ids=at[:, None])[0]  # [n, h]
            seqs[at, index] = _project(layer, embedded, hidden)
            unnormed, normed = _body(model, layer, seqs)
            hidden = (unnormed if recycle == "unnormed" else normed)[at, index]
            token = head_argmax(model, normed[at, index])
            drafts[j - 1, rows, ends.cpu()] = token.cpu()
    return drafts
