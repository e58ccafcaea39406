"""``draft_geometry="engine"``: draft steps 2..k trained in the geometry of an engine that reuses one MTP layer.

From a start p an engine such as vLLM's proposer fills the draft layer's cache with step 1 (the target's hidden
state and the real next token) at every position up to p, then appends steps 2..k one token at a time: step j's
query sits at position p + j - 1 and attends over step 1's keys at positions <= p and over steps 2..j's own keys
of that start. The chain (``features.chain``) calls the step layer again for steps 2..k over the whole sequence;
here, for every start at once:

* the block's call of the step layer (step 1) keeps its core attention's keys and values (``keep_step_one``),
  with their gradient, so steps 2..k train the cached states too;
* each later call's rotary embedding is shifted by j - 1 positions (``shifted_rotary``; a start past the end of
  the sequence has no target, so the last positions repeat the last angle);
* that call's core attention output is replaced (``step_attention``): its query attends, per start, over step
  1's keys up to the start and the diagonal of steps 2..j (EAGLE-3's training-time-test mask), computed here
  in fp32 whatever the backend, so any core attention serves (its own output for that call is discarded).

In packed THD sequences (``[t, heads, d]`` with ``packed_seq_params``) step 1's cache stops at each sequence's start
(its padded bounds, as mcore's rotary counts positions), and the shifted rotary advances every sequence's positions.

Under context parallelism step 1's keys and values are gathered from every rank (``_GatherKeys``) and masked by
their sequence positions; the rotary angles advance linearly (mcore hands each rank its own rows only).

Refused at ``attach`` (``check``) where that cannot be honoured: a step served by another layer than step 1's,
learned absolute positions or MLA (whose rotary lives inside the attention), activation recompute, attention
dropout, and a softmax other than the plain one; at the forward a ``torch.compile``'d forward and packed sequences
under context parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.errors import bad_argument

__all__ = ["EngineSteps", "check", "on_core_attention", "shifted_rotary", "step_attention"]


@dataclasses.dataclass
class EngineSteps:
    """Per training forward: the step layer's keys and values, step 1's first, the step now running (0: the
    block's own call) and the context-parallel group (``None``: the whole sequence is here)."""

    keys: list[tuple[Tensor, Tensor]] = dataclasses.field(default_factory=list)
    step: int = 0
    cp_group: Optional[Any] = None

    def of(self, model: nn.Module, packed_seq_params: Any, options: Any) -> Optional[EngineSteps]:
        """This forward's steps with ``model``'s context-parallel group, or ``None`` where the geometry is the
        chain's."""
        if options.draft_geometry != "engine":
            return None
        group = _mcore.cp_group_of(model, packed_seq_params)
        self.cp_group = group if group is not None and group.size() > 1 else None
        return self


def check(model: nn.Module, plan: Any, steps: int) -> None:
    """Refuse the engine geometry where the model or the plan cannot run it (``plan``: ``chain.Plan``)."""
    config = model.config

    def refuse(expected: str, received: str) -> None:
        raise bad_argument("draft_geometry", f"'chain', or 'engine' with {expected}", received)

    if steps < 2 or plan.kept != 1 or plan.reruns != steps - 1:
        refuse("one MTP layer drafting every step (draft_layers='first', or one MTP layer) and draft_steps >= 2",
               f"draft_steps={steps} over {plan.block_steps} block step(s), {plan.kept} kept")
    position = getattr(model, "position_embedding_type", "rope")
    if position not in ("rope", "none") or getattr(config, "multi_latent_attention", False):
        refuse("rotary or no position embedding outside the attention (not learned absolute, not MLA)",
               f"position_embedding_type={position!r}, multi_latent_attention="
               f"{getattr(config, 'multi_latent_attention', False)}")
    for name, fine in (("recompute_granularity", None), ("attention_dropout", 0.0),
                       ("window_size", None), ("apply_query_key_layer_scaling", False)):
        value = getattr(config, name, fine)
        if value != fine:
            refuse(f"config.{name} = {fine!r}", f"config.{name} = {value!r}")
    softmax = getattr(config, "softmax_type", "vanilla")
    if softmax != "vanilla":
        refuse("the plain softmax", f"config.softmax_type = {softmax!r}")


def check_step_ran(steps: EngineSteps, step: int) -> None:
    """After step ``step``'s call: its attention ran in the engine's geometry (it added its keys). In a
    ``torch.compile``'d forward the core attention's forward hook does not run for the steps the chain adds (the
    backend's own attention would stand), so that is refused, never trained silently in another geometry."""
    if len(steps.keys) != step:
        raise bad_argument("draft_geometry", "'engine' in an eager forward, or 'chain' (in a torch.compile'd forward "
                           "the engine geometry's attention hook does not run)",
                           f"step {step} ran without it ({len(steps.keys)} of {step} steps' keys kept)")


def core_attention(body: nn.Module) -> nn.Module:
    """The step layer's core attention module (``body``: its transformer layer)."""
    return body.self_attention.core_attention


def keep_step_one(steps: EngineSteps, key: Tensor, value: Tensor) -> None:
    if not steps.keys:
        steps.keys.append((key, value))


def shifted_rotary(kwargs: dict[str, Any], shift: int, cp: bool = False) -> None:
    """Step ``shift + 1``'s call: its rotary embedding ``[s, 1, 1, d]`` moved ``shift`` positions on. Under context
    parallelism (``cp``) mcore hands the layers this rank's rows only (two chunks of the sequence), so the angles
    are advanced instead: rotary angles grow linearly with the position, and rows 0 and 1 are consecutive ones."""
    rotary = kwargs.get("rotary_pos_emb")
    if rotary is None or shift == 0:
        return
    if not isinstance(rotary, Tensor):
        raise bad_argument("draft_geometry", "'engine' with one rotary embedding tensor", type(rotary).__name__)
    if cp:
        if rotary.shape[0] < 4:
            raise bad_argument("draft_geometry", "'engine' under context parallelism with at least 2 tokens per "
                               "sequence chunk", f"{rotary.shape[0]} tokens on this rank")
        kwargs["rotary_pos_emb"] = rotary + shift * (rotary[1:2] - rotary[0:1])
        return
    kwargs["rotary_pos_emb"] = torch.cat([rotary[shift:], rotary[-1:].expand(shift, *rotary.shape[1:])])


class _GatherKeys(torch.autograd.Function):
    """Step 1's keys or values ``[s, b, g, d]`` of every context-parallel rank, in rank order; backward: each
    rank's share of the gradient, summed over the ranks (every rank's queries read every rank's keys)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(group.size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size())[ctx.group.rank()].contiguous(), None


def cp_positions(local: int, rank: int, size: int, device: torch.device) -> Tensor:
    """The sequence positions of a context-parallel rank's ``local`` tokens: chunks ``rank`` and ``2 size - 1 -
    rank`` of ``2 size`` (mcore's load-balanced split)."""
    chunk = local // 2
    starts = (rank * chunk, (2 * size - 1 - rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def step_attention(
    steps: EngineSteps, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, segments: Optional[Tensor] = None
) -> Tensor:
    """Step j's attention (j = ``steps.step``): each start's query over step 1's keys up to it and the diagonal of
    steps 2..j; ``[s, b, heads * d_value]`` in the query's dtype. ``segments`` ``[s]``: each token's packed sequence
    (keys of another sequence are never seen)."""
    steps.keys.append((key, value))
    first_key, first_value = steps.keys[0]
    s, b, heads, _ = query.shape
    scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])

    def spread(t: Tensor) -> Tensor:  # grouped-query heads repeated over their queries, fp32
        return t.repeat_interleave(heads // t.shape[2], dim=2).float() if t.shape[2] != heads else t.float()

    q = query.float()
    positions = key_positions = torch.arange(s, device=q.device)
    group = steps.cp_group
    if group is not None:  # step 1's cache spans the ranks: every rank's keys, at their sequence positions
        first_key, first_value = _GatherKeys.apply(first_key, group), _GatherKeys.apply(first_value, group)
        positions = cp_positions(s, group.rank(), group.size(), q.device)
        key_positions = torch.cat([cp_positions(s, r, group.size(), q.device) for r in range(group.size())])
    cached = torch.einsum("sbhd,tbhd->bhst", q, spread(first_key)) * scale  # [b, h, s, s * cp]
    seen = key_positions[None, :] <= positions[:, None]
    if segments is not None:
        seen = seen & (segments[:, None] == segments[None, :])
    cached = cached.masked_fill(~seen, float("-inf"))
    own = torch.stack([(q * spread(k)).sum(-1) * scale for k, _ in steps.keys[1:]], -1)  # [s, b, h, j - 1]
    probs = torch.softmax(torch.cat([cached, own.permute(1, 2, 0, 3)], -1), -1)
    cached_count = cached.shape[-1]
    out = torch.einsum("bhst,tbhd->sbhd", probs[..., :cached_count], spread(first_value))
    own_values = torch.stack([spread(v) for _, v in steps.keys[1:]], -1)  # [s, b, h, d, j - 1]
    out = out + (own_values * probs[..., cached_count:].permute(2, 0, 1, 3).unsqueeze(3)).sum(-1)
    return out.reshape(s, b, -1).to(query.dtype)


def packed_segments(packed_seq_params: Any, tokens: int, device: torch.device) -> Tensor:
    """Each of ``tokens`` packed tokens' sequence index, from the padded bounds where the layout has them (a
    sequence's padding follows its tokens)."""
    bounds = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    return torch.bucketize(torch.arange(tokens, device=device), bounds[1:-1].to(device), right=True)


def inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Any]:
    """``(query, key, value, packed)`` of a core attention call, ``[s, b, heads, d]`` (packed THD input
    ``[t, heads, d]`` as ``[t, 1, heads, d]``, with its ``packed_seq_params``; else ``None``)."""
    names = ("query", "key", "value")
    found = [args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names)]
    packed = kwargs.get("packed_seq_params")
    if found[0].dim() == 3:
        if packed is None:
            raise bad_argument("draft_geometry", "'engine' with [s, b, heads, d] attention inputs, or packed THD "
                               "ones with packed_seq_params", f"query of shape {tuple(found[0].shape)}")
        found = [t.unsqueeze(1) for t in found]
    if packed is None or getattr(packed, "qkv_format", "thd") != "thd":
        packed = None
    return found[0], found[1], found[2], packed


def on_core_attention(
    steps: EngineSteps, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    """The step layer's core attention returned ``output``: step 1 keeps its keys and values (the output stands); a
    later step's output is replaced by its attention in the engine's geometry, in the backend's output shape."""
    query, key, value, packed = inputs(args, kwargs)
    if packed is not None and steps.cp_group is not None:
        raise bad_argument("draft_geometry", "'engine' with packed sequences on one context-parallel rank, or "
                           "unpacked ones under context parallelism", "packed THD sequences under context parallelism")
    if steps.step == 0:
        keep_step_one(steps, key, value)
        return None
    segments = None if packed is None else packed_segments(packed, query.shape[0], query.device)
    out = step_attention(steps, module, query, key, value, segments)
    shape = output.shape if isinstance(output, Tensor) else None
    return out if shape is None or shape == out.shape else out.reshape(shape)
