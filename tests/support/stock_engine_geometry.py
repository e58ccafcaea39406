"""``draft_geometry="engine"`` on stock mcore: each later step is one call of the step layer over all the steps so far.

Test-only support for the parity matrix (``stock_references.stock_chain``). The hooked option replaces the step
layer's core attention output for steps 2..k; this reference takes another road through mcore's own modules, as
EAGLE-3's training-time test does: step j is a call of the step layer's own ``forward`` over a sequence of ``j * s``
tokens, the concatenation of step 1's inputs and steps 2..j's (step i's hidden input is step i - 1's output, before
its final norm with ``draft_recycle="unnormed"``; its token the data's, rolled i times, or the argmax of the full
logits on step i - 1's normed output), with

* an attention mask where step i's token at start p sees step 1's tokens at positions <= p and steps 2..i's tokens
  at p only (mcore's own softmax honours a given mask; the layer's causal type only fills in a missing one);
* rotary angles at p + i - 1 for step i's token at p (the model's own rotary table);
* under sequence parallelism, a rank-major layout (``joined_layout``): each rank's chunk of the joined sequence is its
  own chunk of every part, so the layer's input is the parts' local chunks joined, and each rank's share of the
  gradient of a sequence-parallel weight is the hooked twin's.

Its last part is step j's output; step 1's keys are recomputed from the same inputs in each call (same values, and the
gradient reaches what they read as the cached keys' does). The block's own call stays step 1; ``config.mtp_num_layers``
is k for the post-processing, as in ``stock_references.stock_steps``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from tests.support.stock_references import CHAIN, DEPTH, ENGINE, UNNORMED, dense_drafts, removed_on_exit


def _chunks(model: nn.Module) -> int:
    """How many ranks share the sequence: the tensor-parallel size under sequence parallelism, else 1."""
    if not model.config.sequence_parallel:
        return 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def joined_layout(steps: int, s: int, chunks: int) -> tuple[Tensor, Tensor]:
    """``(part, position)`` of each slot of the joined sequence: rank-major, so each rank's chunk holds its own chunk of
    every part (steps 1..``steps``, in order): the layer's input is each part's local chunk, joined."""
    local = s // chunks
    part = torch.arange(steps).repeat_interleave(local).repeat(chunks)
    position = (torch.arange(local).repeat(steps)[None, :] + local * torch.arange(chunks)[:, None]).flatten()
    return part, position


def engine_mask(part: Tensor, position: Tensor) -> Tensor:
    """``[1, 1, L, L]``, True where masked: step i at p sees step 1 at <= p and steps 2..i at p."""
    first = (part[None, :] == 0) & (position[None, :] <= position[:, None])
    own = (part[None, :] >= 1) & (part[None, :] <= part[:, None]) & (position[None, :] == position[:, None])
    return ~(first | own)[None, None]


def _rolled(ids: Tensor, shift: int) -> Tensor:
    """The data's tokens ``shift`` positions on, as mcore's depth-``shift`` roll gives them (zeros past the end)."""
    return torch.cat([ids[:, shift:], torch.zeros_like(ids[:, :shift])], 1)


@contextlib.contextmanager
def stock_engine_steps(model: nn.Module, chain: str) -> Iterator[None]:
    """Steps 2..k of layer 1 in the engine's geometry on stock (module docstring); the block's layer-2 output dropped."""
    if chain not in ENGINE:
        yield
        return
    steps, inputs, _ = CHAIN[chain]
    assert steps is not None
    config, layer = model.config, model.mtp.layers[0]
    seen: dict[str, Any] = {}

    def start(*_: Any) -> None:
        seen.clear()

    def record(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen.setdefault("kwargs", dict(kwargs))

    def record_hidden(norm: nn.Module, args: tuple[Any, ...]) -> None:  # step 1's hidden input, after every pre-hook
        seen.setdefault("hidden", args[0])

    def record_output(module: nn.Module, args: Any, output: Any) -> None:
        seen.setdefault("output", output)

    def record_unnormed(norm: nn.Module, args: tuple[Any, ...]) -> None:  # each call's output before its final norm
        seen.setdefault("unnormed", []).append(args[0])

    def extend(block: nn.Module, args: Any, output: Tensor) -> Tensor:
        kwargs, first = seen["kwargs"], seen["output"]
        ids = kwargs["input_ids"]
        s = ids.shape[1]
        rotary = model.rotary_pos_emb(s + steps)
        hiddens, tokens, outs, unnormed = [seen["hidden"]], [_rolled(ids, 1)], [first[0]], [seen["unnormed"][0]]
        for j in range(2, steps + 1):
            previous = outs[-1]
            hiddens.append(unnormed[-1] if chain in UNNORMED else previous)  # the draft: from the normed one
            tokens.append(dense_drafts(model, previous) if inputs == "argmax" else _rolled(ids, j))
            part, position = joined_layout(j, s, _chunks(model))
            joined = torch.stack(tokens)[part, :, position].t()  # [b, j * s] in the joined layout
            embedding = kwargs["embedding"]
            call = dict(
                kwargs,
                hidden_states=torch.cat(hiddens),  # this rank's chunk of each part, joined
                embedding=lambda embedding=embedding, joined=joined, **c: embedding(**{**c, "input_ids": joined}),
                attention_mask=engine_mask(part, position),
                rotary_pos_emb=rotary[position + part],
            )
            out, local = layer(**call)[0], previous.shape[0]
            outs.append(out[(j - 1) * local:])
            unnormed.append(seen["unnormed"][-1][(j - 1) * local:])
        config.mtp_num_layers = steps
        return torch.cat([*list(torch.chunk(output, 1 + DEPTH))[:2], *outs[1:]])

    def layers_only(*_: Any) -> None:
        config.mtp_num_layers = DEPTH

    handles = [
        model.register_forward_pre_hook(start),
        layer.register_forward_pre_hook(record, with_kwargs=True, prepend=True),
        layer.hnorm.register_forward_pre_hook(record_hidden),
        layer.register_forward_hook(record_output),
        layer.final_layernorm.register_forward_pre_hook(record_unnormed),
        model.mtp.register_forward_pre_hook(layers_only),
        model.mtp.register_forward_hook(extend),
        model.register_forward_hook(layers_only, always_call=True),
    ]
    try:
        with removed_on_exit(handles):
            yield
    finally:
        layers_only()
