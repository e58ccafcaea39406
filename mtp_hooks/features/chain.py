"""The draft chain (``attach(draft_steps=k, draft_inputs=...)``): train the MTP layers the way a
speculative decoder runs them.

mcore trains depth j on the data's token at ``t + j`` (teacher forcing) and has exactly N depths.
An engine drafting k tokens reuses the last MTP layer for steps past N and feeds step j the token
step j - 1 drafted, with that step's output hidden state. The chain here does the same inside the
training forward, with hooks only:

* which layer runs step j (``draft_layers``, ``Plan``): ``"per_step"``, layer j for j <= N and the
  last layer past N (mcore's depths; SGLang), ``"cyclic"``, layer ((j - 1) mod N) + 1 (vLLM 0.34's
  model runner V2), or ``"first"``, layer 1 for every step (vLLM 0.32, whose proposer never runs
  layers 2..N): the block's steps run by other layers are dropped;
* steps past those the block ran: when the MTP block returns, the step layer is called again
  (``extra_steps``), each call with the block's own keyword arguments for that layer and the
  previous call's returned hidden state, ids and positions; the outputs join the block's output,
  so the heads see ``1 + k`` chunks and train k steps against labels rolled k times (the layer's
  call is recorded by a pre-hook kept first and a forward hook: ``record_call``);
* own drafts: the pre-hook of every MTP layer call after the first gives the layer's embedding
  call the previous step's draft (``DraftEmbedding``): the argmax, or a sample at
  ``draft_temperature``, of the main head's weight on the hidden state that call receives
  (``step_drafts``, lean and vocab-parallel). The token is a discrete, detached choice: no
  gradient flows through it (``feed_draft``). The hidden state keeps its gradient (step j's loss trains steps
  before it through the state it was handed, as mcore's depths do), unless
  ``detach_between_depths`` cuts it.

Each step's attention runs over that step's states at every position: mcore's depth geometry,
that of a full draft forward. An engine's cache holds, for earlier positions, the states of its
first step: ``draft_geometry="engine"`` trains steps 2..k in that geometry (``engine_geometry``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from mtp_hooks.errors import bad_argument
from mtp_hooks.features import engine_geometry
from mtp_hooks.features.engine_geometry import EngineSteps
from mtp_hooks.head import Head
from mtp_hooks.models import find_language_model
from mtp_hooks.ops.drafts import draft_tokens
from mtp_hooks.options import Options
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import ForwardOnlyProxy


@dataclasses.dataclass
class ChainCall:
    """Per training forward: the step layer's call (``Plan.layer``; its kwargs before any hook rewrote them, and
    its output) and the main head as the own drafts read it (``draft_head``, once per forward)."""

    step_layer_kwargs: Optional[dict[str, Any]] = None
    step_layer_output: Any = None
    draft_head: Optional[Head] = None


class DraftEmbedding(ForwardOnlyProxy):
    """An embedding module called with the chain's draft tokens ``[b, s]`` in place of the input
    ids the MTP layer rolled (the positions it rolled are kept). Built by ``of``: wrapt's own
    constructor, then the tokens, which ``torch.compile`` traces (it cannot trace a subclass's
    ``__init__`` calling wrapt's)."""

    _self_tokens: Tensor

    @classmethod
    def of(cls, embedding: Any, tokens: Tensor) -> DraftEmbedding:
        proxy = cls(embedding)
        proxy._self_tokens = tokens
        return proxy

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if "input_ids" in kwargs:
            kwargs["input_ids"] = self._self_tokens
        else:
            args = (self._self_tokens, *args[1:])
        return self.__wrapped__(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How k draft steps map onto the MTP block's calls (``draft_layers``).

    The block makes ``block_steps`` chunks past the main one (N, one per layer call); the first
    ``kept`` of them are draft steps 1..kept, and ``layer`` (an index into ``block.layers``) is
    called ``reruns`` more times for the steps after them. ``step_layers``: the layers whose calls
    are draft steps (the others' outputs are dropped).
    """

    block_steps: int
    kept: int
    layer: int
    reruns: int
    cyclic: bool = False  # the reruns cycle through the layers from layer 1 (else all run ``layer``)

    @classmethod
    def of(cls, steps: int, config: Any, layer_modules: int, draft_layers: str) -> Plan:
        n = config.mtp_num_layers
        if draft_layers == "first" and layer_modules > 1:  # one module serving every depth is "first" already
            return cls(n, 1, 0, steps - 1)
        return cls(n, n, layer_modules - 1, max(steps - n, 0), draft_layers == "cyclic" and layer_modules > 1)

    def rerun_index(self, i: int) -> int:
        """The layer (an index into the block's layers) of the ``i``-th call after the block's, step ``kept + i + 1``:
        ``(kept + i) mod N`` when cyclic, else the step layer."""
        return (self.kept + i) % (self.layer + 1) if self.cyclic else self.layer

    def rerun_layers(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        return [layers[self.rerun_index(i)] for i in range(self.reruns)]

    @property
    def changes_block(self) -> bool:
        """Whether the block's output is cut or extended (else it is the k steps as it is); then the
        step layer's call is recorded (``record_call``)."""
        return self.kept < self.block_steps or self.reruns > 0

    def step_layers(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        return list(layers) if self.kept == self.block_steps else [layers[self.layer]]


def record_call(chain: ChainCall, kwargs: dict[str, Any]) -> None:
    """The block's own arguments of its step layer's call (``Plan.layer``), before any hook rewrites them."""
    chain.step_layer_kwargs, chain.step_layer_output = dict(kwargs), None


def record_output(chain: ChainCall, output: Any) -> None:
    if chain.step_layer_kwargs is not None:
        chain.step_layer_output = output


def extend(
    chain: ChainCall, plan: Plan, block: nn.Module, output: Tensor, engine: Optional[EngineSteps] = None
) -> Tensor:
    """The MTP block's output as the plan's k steps: its kept chunks, then ``plan.reruns`` more calls
    of the step layer. With a step layer that runs first (``draft_layers="first"``) the output is
    built anew from that layer's recorded input (the block's chunk 0) and output, so the dropped
    layers are not in the backward graph at all."""
    if chain.step_layer_kwargs is None:
        raise AssertionError("mtp_hooks: the MTP block returned without a call of its step layer")
    kwargs, last = chain.step_layer_kwargs, chain.step_layer_output
    kept = [output] if plan.kept == plan.block_steps else [kwargs["hidden_states"], last[0]]
    return torch.cat([*kept, *extra_steps(plan.rerun_layers(block.layers), kwargs, last, engine)])


def feed_draft(options: Options, forward: Forward, chain: ChainCall, kwargs: dict[str, Any]) -> None:
    """An MTP layer call of step j >= 2: its embedding embeds the previous step's own draft, from
    the hidden state that step hands on."""
    if forward.mtp_layer_calls == 0 or kwargs.get("embedding") is None:
        return
    if chain.draft_head is None:
        chain.draft_head = draft_head(forward.model, options.chunk_size)
    temperature = options.draft_temperature if options.draft_inputs == "sample" else None
    kwargs["embedding"] = DraftEmbedding.of(
        kwargs["embedding"], step_drafts(chain.draft_head, kwargs["hidden_states"], temperature)
    )


def draft_head(model: nn.Module, chunk_size: Optional[int]) -> Head:
    """The main head as the drafts use it: the output layer with the weight mcore hands it."""
    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight
    head = Head.of(layer, weight, chunk_size)
    head.require_reproducible(
        "draft_inputs", "own drafts are chosen from the head's logits", "use draft_inputs='labels'"
    )
    return head


def step_drafts(head: Head, hidden: Tensor, temperature: Optional[float]) -> Tensor:
    """The drafts ``[b, s]`` the head proposes from an MTP layer's output ``hidden`` ``[s(/tp), b, h]``."""
    with torch.no_grad():
        full = head.input(hidden.detach())
        s, b = full.shape[0], full.shape[1]
        tokens = draft_tokens(
            full.reshape(s * b, -1), head.weight.detach(), head.tp_group, head.chunk(s * b), temperature
        )
    return tokens.view(s, b).t().contiguous()


def extra_steps(
    layers: Sequence[nn.Module], kwargs: dict[str, Any], output: Any, engine: Optional[EngineSteps] = None
) -> list[Tensor]:
    """Call each of ``layers`` in turn, each on the previous call's ``output`` ``(hidden, input_ids,
    position_ids[, padding_mask])`` with the block's ``kwargs`` for it; with ``engine`` (``draft_geometry="engine"``)
    each call is step j of it: rotary advanced, attention over step 1's cache."""
    hidden_states = []
    try:
        for i, layer in enumerate(layers):
            call = dict(kwargs, hidden_states=output[0], input_ids=output[1], position_ids=output[2])
            if len(output) > 3:
                call["padding_mask"] = output[3]
            if engine is not None:
                engine.step = i + 2
                engine_geometry.shifted_rotary(call, i + 1, engine.cp_group is not None)
            output = layer(**call)
            if engine is not None:
                engine_geometry.check_step_ran(engine, i + 2)
            hidden_states.append(output[0])
    finally:
        if engine is not None:
            engine.step = 0
    return hidden_states


def check(model: nn.Module, options: Options) -> None:
    """Refuse a chain the model (as ``attach`` was given it) cannot run (``check_chain``), and an engine geometry
    it cannot train (``engine_geometry.check``)."""
    language_model = find_language_model(model)
    check_chain(language_model, options.draft_steps, options.draft_inputs, options.draft_layers)
    if options.draft_geometry == "engine" and getattr(language_model, "mtp_process", False):  # the MTP stage's
        steps, modules = options.steps(language_model.config), len(language_model.mtp.layers)
        plan = Plan.of(steps, language_model.config, modules, options.draft_layers)
        engine_geometry.check(language_model, plan, steps)


def check_chain(model: nn.Module, steps: Optional[int], inputs: str, draft_layers: str) -> None:
    """Refuse a chain the model cannot run, once at ``attach``."""
    mcore_depths = steps is None and inputs == "labels" and draft_layers == "per_step"  # no chain to check
    if mcore_depths or not getattr(model, "mtp_process", False):
        return
    depth = model.config.mtp_num_layers
    layers = list(model.mtp.layers)
    parameters = inspect.signature(type(layers[-1]).forward).parameters
    if "input_ids" not in parameters or "embedding" not in parameters:
        raise bad_argument(
            "draft_steps", "a megatron-core release whose MTP layers take input_ids and embedding (0.14 - 0.19)",
            f"{type(layers[-1]).__name__}.forward without them"
        )
    repeated = bool(getattr(model.config, "mtp_use_repeated_layer", False))
    if len(layers) != (1 if repeated else depth) or not getattr(model, "post_process", False):
        raise bad_argument(
            "draft_steps",
            "every MTP layer on the pipeline stage of the output layer (the chain calls its step layer again)",
            f"{len(layers)} of {depth} MTP layers on a stage {'with' if model.post_process else 'without'} "
            "the output layer",
        )
