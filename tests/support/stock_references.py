"""Stock mcore given the definition of a knob it lacks, with plain autograd and its own modules.

Test-only support for the parity matrix (``parity``): where stock has no reference for an option
(the detach flags, the draft chain), hooks on the stock twin apply the option's definition, so
the hooked twin is compared with stock's own computation of it. Each reference is checked to
differ from plain stock (``tests/parity/test_parity_matrix.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

DETACH_OPTIONS = {
    "none": {},
    "encoder": {"detach_encoder": True},
    "head": {"detach_head": True},
    "both": {"detach_encoder": True, "detach_head": True},
    "between": {"detach_encoder": True, "detach_between_depths": True},
}

# The draft chain (``mtp_hooks.features.chain``) on the N = 2 twins: (draft_steps, draft_inputs, draft_layers).
CHAIN: dict[str, tuple[Optional[int], str, str]] = {
    "none": (None, "labels", "per_step"),
    "k2_argmax": (2, "argmax", "per_step"),
    "k3": (3, "labels", "per_step"),
    "k4_argmax": (4, "argmax", "per_step"),
    "first_k2": (2, "labels", "first"),
    "first_k3_argmax": (3, "argmax", "first"),
    "weighted": (None, "labels", "per_step"),
    "k3_argmax_decay": (3, "argmax", "per_step"),
    "pre_norm": (None, "labels", "per_step"),
    "first_k2_argmax_pre_norm": (2, "argmax", "first"),
    "engine_first_k3": (3, "labels", "first"),
    "engine_first_k2_argmax_decay": (2, "argmax", "first"),
    "cyclic_k3_argmax": (3, "argmax", "cyclic"),
    "k3_unnormed": (3, "labels", "per_step"),
    "engine_first_k3_argmax_unnormed": (3, "argmax", "first"),
    "zeroed_start": (None, "labels", "per_step"),
}
DEPTH = 2
# ``draft_step_weights`` of the chain values that set one: per-step weights, or a decay.
STEP_WEIGHTS: dict[str, Any] = {"weighted": (0.25, 1.75), "k3_argmax_decay": 0.6, "engine_first_k2_argmax_decay": 0.6}
# The chain values whose MTP layer 1 reads the decoder's final norm input (``mtp_input="pre_final_norm"``).
PRE_NORM = ("pre_norm", "first_k2_argmax_pre_norm")
# The chain values trained in the engine's geometry (``draft_geometry="engine"``; ``stock_engine_geometry``), on
# twins with rotary positions (the geometry refuses learned absolute ones).
ENGINE = ("engine_first_k3", "engine_first_k2_argmax_decay", "engine_first_k3_argmax_unnormed")
# The chain values whose step j + 1 reads step j's output before its final norm (``draft_recycle="unnormed"``).
UNNORMED = ("k3_unnormed", "engine_first_k3_argmax_unnormed")
# The chain values whose MTP layer 1 embeds zeros at position 0 in step 1 (``start_embedding="zeroed"``).
ZEROED = ("zeroed_start",)


def step_weights(chain: str) -> Optional[list[float]]:
    """The weight on each draft step's loss under ``chain`` (``None``: stock's, all 1)."""
    weights = STEP_WEIGHTS.get(chain)
    if weights is None:
        return None
    steps = CHAIN[chain][0] or DEPTH
    return [weights**j for j in range(steps)] if isinstance(weights, float) else list(weights)


@contextlib.contextmanager
def removed_on_exit(handles: list[Any]) -> Iterator[None]:
    """Remove the hook ``handles`` when the block ends, also after an error."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def gather_vocab(logits: Tensor) -> Tensor:
    """``[..., V/tp]`` logits gathered over the tensor-parallel group (as they are on one rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits) if parallel_state.get_tensor_model_parallel_world_size() > 1 else logits


@contextlib.contextmanager
def stock_detaches(model: nn.Module, detach: str, steps: int) -> Iterator[None]:
    """The detach flags' definition on stock mcore, with plain autograd (stock has no such options):
    every MTP layer's embedding output detached, the first MTP layer call's hidden states (the
    trunk's) detached (with ``between`` every call's input), and with ``detach_head`` the MTP heads' output weight detached
    (the first N output-layer calls of a forward; the last is the main head)."""
    flags = DETACH_OPTIONS[detach]
    handles = []
    if flags.get("detach_encoder"):
        layer_calls = [0]
        handles.append(model.register_forward_pre_hook(lambda *_: layer_calls.__setitem__(0, 0)))

        def detach_inputs(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            embedding = kwargs["embedding"]
            kwargs["embedding"] = lambda **call: embedding(**call).detach()
            if layer_calls[0] == 0 or flags.get("detach_between_depths"):  # the trunk's hidden states: the first call's
                kwargs["hidden_states"] = kwargs["hidden_states"].detach()
            layer_calls[0] += 1
            return args, kwargs

        for layer in model.mtp.layers:
            handles.append(layer.register_forward_pre_hook(detach_inputs, with_kwargs=True))
    if flags.get("detach_head"):
        calls = [0]
        depth = steps  # the MTP heads: N = 2, or the chain's k (``stock_chain``)
        handles.append(model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, 0)))

        def detach_weight(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            calls[0] += 1
            if calls[0] <= depth:
                weight = kwargs.get("weight")
                kwargs["weight"] = (layer.weight if weight is None else weight).detach()
            return args, kwargs

        handles.append(model.output_layer.register_forward_pre_hook(detach_weight, with_kwargs=True))
    with removed_on_exit(handles):
        yield


@contextlib.contextmanager
def stock_chain(model: nn.Module, chain: str) -> Iterator[None]:
    """The draft chain (``stock_steps``), its step weights (``stock_step_weights``) and MTP layer 1's input
    (``stock_pre_norm_input``) on stock mcore."""
    with stock_step_weights(chain), stock_steps(model, chain), stock_pre_norm_input(model, chain), stock_recycle(model, chain), \
            stock_zeroed_start(model, chain):
        yield


@contextlib.contextmanager
def stock_zeroed_start(model: nn.Module, chain: str) -> Iterator[None]:
    """``start_embedding="zeroed"`` on stock mcore, by vLLM's own rule (zeros where the position is 0): MTP layer 1's
    first call per forward gets an embedding whose output rows are zeroed where the call's ``position_ids`` are 0 (this
    rank's rows of them under sequence parallelism, which splits the embedding's output along the sequence)."""
    if chain not in ZEROED:
        yield
        return
    seen: list[int] = []

    def wrap(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if seen:
            return None
        seen.append(1)
        embedding, positions = kwargs["embedding"], kwargs["position_ids"]

        def zeroed(**call: Any) -> Tensor:
            out = embedding(**call)  # [s, b, h]
            at_start = positions.t() == 0  # [s, b] of the whole (CP-local) sequence
            if at_start.shape[0] != out.shape[0]:  # sequence parallel: this TP rank's rows
                from megatron.core import parallel_state

                rank = parallel_state.get_tensor_model_parallel_rank()
                at_start = at_start[rank * out.shape[0] : (rank + 1) * out.shape[0]]
            return out.masked_fill(at_start.unsqueeze(-1), 0.0)

        kwargs["embedding"] = zeroed
        return args, kwargs

    handles = [model.register_forward_pre_hook(lambda *_: seen.clear()),
               model.mtp.layers[0].register_forward_pre_hook(wrap, with_kwargs=True, prepend=True)]
    with removed_on_exit(handles):
        yield


@contextlib.contextmanager
def stock_recycle(model: nn.Module, chain: str) -> Iterator[None]:
    """``draft_recycle="unnormed"`` on stock mcore (the chain geometry; ``stock_engine_geometry`` does its own): every
    step-layer call after a forward's first reads the previous step call's final norm input, by a pre-hook run after
    the chain's own (an own draft is chosen from the normed state) and before the detach references'."""
    if chain not in UNNORMED or chain in ENGINE:
        yield
        return
    steps, _, draft_layers = CHAIN[chain]
    layers = list(model.mtp.layers)[:1] if draft_layers == "first" else list(model.mtp.layers)
    seen: dict[str, Any] = {}

    def start(*_: Any) -> None:
        seen.clear()

    def keep(norm: nn.Module, args: tuple[Any, ...]) -> None:
        seen["unnormed"] = args[0]

    def swap(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if "unnormed" in seen:
            kwargs["hidden_states"] = seen["unnormed"]
        return args, kwargs

    handles = [model.register_forward_pre_hook(start)]
    for layer in layers:
        handles.append(layer.final_layernorm.register_forward_pre_hook(keep))
        handles.append(layer.register_forward_pre_hook(swap, with_kwargs=True))
    with removed_on_exit(handles):
        yield


@contextlib.contextmanager
def stock_pre_norm_input(model: nn.Module, chain: str) -> Iterator[None]:
    """``mtp_input="pre_final_norm"`` on stock mcore: the block's first call of MTP layer 1 in each forward reads the
    decoder's final norm input in place of the block's hidden states (a pre-hook run before every other)."""
    if chain not in PRE_NORM:
        yield
        return
    seen: dict[str, Any] = {}

    def start(*_: Any) -> None:
        seen.clear()

    def keep(norm: nn.Module, args: tuple[Any, ...]) -> None:
        seen["before"] = args[0]

    def swap(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if "swapped" not in seen:
            seen["swapped"] = True
            kwargs["hidden_states"] = seen["before"]
        return args, kwargs

    handles = [
        model.register_forward_pre_hook(start),
        model.decoder.final_layernorm.register_forward_pre_hook(keep),
        model.mtp.layers[0].register_forward_pre_hook(swap, with_kwargs=True, prepend=True),
    ]
    with removed_on_exit(handles):
        yield


@contextlib.contextmanager
def stock_step_weights(chain: str) -> Iterator[None]:
    """``draft_step_weights``' definition on stock mcore: its i-th ``MTPLossAutoScaler.apply`` of a forward (depth i
    of k, in order) hangs ``w_i`` times the loss it was given, for the length of the block."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    weights = step_weights(chain)
    if weights is None:
        yield
        return
    original, calls = MTPLossAutoScaler.apply, [0]

    def weighted(hidden: Tensor, loss: Tensor) -> Tensor:
        weight = weights[calls[0] % len(weights)]
        calls[0] += 1
        return original(hidden, loss * weight)

    MTPLossAutoScaler.apply = weighted  # the class's own attribute, over the inherited one
    try:
        yield
    finally:
        del MTPLossAutoScaler.apply


@contextlib.contextmanager
def stock_steps(model: nn.Module, chain: str) -> Iterator[None]:
    """The draft chain's definition on stock mcore (which trains N depths, teacher-forced): stock's
    own loss over k depths (``config.mtp_num_layers = k`` from the block's return to the end of the
    forward; the block runs its N layers). The step layer (the last one; with ``first``, the first
    one, whose block call is then the only step the block's output keeps) is called again when the
    block returns, each call on the previous call's hidden state, ids and positions with the block's
    arguments for it; with ``argmax`` every step after the first embeds the first argmax of the
    full-vocabulary logits (gathered, dense) of the hidden state it receives."""
    steps, inputs, draft_layers = CHAIN[chain]
    if steps is None or chain in ENGINE:
        yield
        return
    config, layers, handles = model.config, list(model.mtp.layers), []
    first = draft_layers == "first"
    step_layer, kept = (layers[0], 1) if first else (layers[-1], DEPTH)
    calls = [0]
    captured: dict[str, Any] = {}
    handles.append(model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, 0)))

    def feed(layer: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if first and layer is not step_layer:
            return args, kwargs  # its output is dropped: not a step
        calls[0] += 1
        if inputs == "argmax" and calls[0] > 1:
            drafts = dense_drafts(model, kwargs["hidden_states"])
            embedding = kwargs["embedding"]
            kwargs["embedding"] = lambda **call: embedding(**{**call, "input_ids": drafts})
        return args, kwargs

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(feed, with_kwargs=True, prepend=True))
    handles.append(step_layer.register_forward_pre_hook(lambda layer, args, kwargs: captured.__setitem__("kwargs", dict(kwargs)), with_kwargs=True, prepend=True))
    handles.append(step_layer.register_forward_hook(lambda layer, args, output: captured.__setitem__("output", output)))

    def extend(block: nn.Module, args: Any, output: Tensor) -> Tensor:
        kwargs, out, extra = captured["kwargs"], captured["output"], []
        for i in range(steps - kept):  # "cyclic": step kept + i + 1 runs layer (kept + i) mod N + 1
            layer = layers[(kept + i) % DEPTH] if draft_layers == "cyclic" else step_layer
            out = layer(**dict(kwargs, hidden_states=out[0], input_ids=out[1], position_ids=out[2]))
            extra.append(out[0])
        config.mtp_num_layers = steps  # the post-processing's loss over k depths (0.19's block runs mtp_num_layers layers)
        kept_chunks = list(torch.chunk(output, 1 + DEPTH))[: 1 + kept]
        return torch.cat([*kept_chunks, *extra])

    def layers_only(*_: Any) -> None:
        config.mtp_num_layers = DEPTH

    if steps != DEPTH or first:
        handles.append(model.mtp.register_forward_pre_hook(layers_only))
        handles.append(model.mtp.register_forward_hook(extend))
        handles.append(model.register_forward_hook(layers_only, always_call=True))
    try:
        yield
    finally:
        layers_only()
        for handle in handles:
            handle.remove()


def dense_drafts(model: nn.Module, hidden: Tensor) -> Tensor:
    """``[b, s]`` first argmax of the output weight's full logits on ``hidden`` ``[s(/tp), b, h]``."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    with torch.no_grad():
        tied = model.share_embeddings_and_output_weights
        weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
        if model.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden)
        logits = gather_vocab((hidden @ weight.t()).float())
        return logits.argmax(-1).t().contiguous()
