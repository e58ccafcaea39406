"""The switchboard: the hooks of one language model, installed once (after ``preflight``) and kept in order.

A forward meets them in this order: (1) the model pre-hook (``on_model_pre``) starts the forward
(``runtime.flight``: one at a time, one thread), takes ``labels`` / ``loss_mask`` out of the call so
mcore returns logits, picks the forward's targets (``runtime.micro_batch``) and decides training or
inference, changing nothing on the model; (2) the decoder's, MTP block's, MTP layers' and output
layer's hooks open and close the window (``runtime.forward``) that keeps stock's own MTP loss off,
and call the option modules (``features``) that act there, in a fixed order; (3) the model's
forward hooks (``always_call``): ``on_model_post`` closes the window if a fault left it open and
returns the log-prob output; ``on_model_done``, kept last, counts the forward only if it and every
hook before it completed, and finishes it. Copies (``deepcopy``, ``pickle``) get their own hooks.

Every hook acts only on the thread whose forward is in flight and on the model that forward runs
(``Forward.model``), never on a stored reference.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Any, Optional

import torch
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.checks import check_label_range
from mtp_hooks.errors import bad_argument
from mtp_hooks.features import chain, deferral, detach, engine_geometry, logprobs, mtp_input, mtp_loss, packing
from mtp_hooks.features import layer_keywords, start_embedding
from mtp_hooks.features import tied_copy
from mtp_hooks.head import Head
from mtp_hooks.metrics import MTPMetrics
from mtp_hooks.models import mtp_layer_body
from mtp_hooks.options import Options
from mtp_hooks.runtime.arguments import CallArguments, HookResult
from mtp_hooks.runtime.binding import ModelBinding
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.order import HookOrder


@dataclasses.dataclass
class InFlight(Forward):
    """One forward in flight: the runtime's ``Forward`` and each option's own per-forward fields."""

    losses: mtp_loss.Losses = dataclasses.field(default_factory=mtp_loss.Losses)
    chain: chain.ChainCall = dataclasses.field(default_factory=chain.ChainCall)
    scoring: Optional[logprobs.Scoring] = None  # output="logprobs"
    main_call: deferral.MainCall = dataclasses.field(default_factory=deferral.MainCall)
    packing: packing.Packing = dataclasses.field(default_factory=packing.Packing)
    tied: tied_copy.Served = dataclasses.field(default_factory=tied_copy.Served)
    before_norm: mtp_input.BeforeNorm = dataclasses.field(default_factory=mtp_input.BeforeNorm)
    engine_steps: engine_geometry.EngineSteps = dataclasses.field(default_factory=engine_geometry.EngineSteps)


class ForwardHooks:
    """The hooks of one language model and the state they share between and within forwards.

    A deep copy (or pickle) of the hooked model copies this object too, as torch's hook dicts hold
    its bound methods; its ``binding`` rebinds to the copied model (``runtime.binding``).
    """

    def __init__(self, model: nn.Module, options: Options) -> None:
        self.options = options
        self.depth: int = options.steps(model.config)  # draft steps trained: the layers, or ``draft_steps``
        layer_modules = len(model.mtp.layers) if model.mtp_process else 1
        self.plan = chain.Plan.of(self.depth, model.config, layer_modules, options.draft_layers)
        self.metrics = MTPMetrics(self.depth)
        # A chain past the model's N depths grows mcore's process-wide tracker; ``close`` undoes it.
        self._tracker = _mcore.TrackerGrowth() if self.depth > model.config.mtp_num_layers else None
        self.loss_path: Optional[str] = None  # of the last completed training forward
        self.binding = ModelBinding(model, model.config, bool(model.mtp_process), options.validate)
        self._tied_mark = tied_copy.Mark.of(model)  # undone by ``close``
        self._arguments = CallArguments(model)
        self._order = HookOrder()  # hooks kept first / last in their dicts

    def _forward_here(self) -> Optional[InFlight]:
        """The one guard of every submodule hook: the forward in flight on this thread, if any."""
        return self.binding.flight.here()  # an InFlight: on_model_pre starts only those

    def install(self, model: nn.Module) -> list[Any]:
        """Register the hooks on ``model`` (``preflight`` passed it): each site's where it can act."""
        options, keep = self.options, self._order.keep
        handles = [
            model.register_forward_pre_hook(self.on_model_pre, with_kwargs=True),
            model.register_forward_hook(self.on_model_post, with_kwargs=True, always_call=True),
            keep(model.register_forward_hook(self.on_model_done, with_kwargs=True, always_call=True)),
        ]
        if model.post_process:
            output_layer = model.output_layer
            first = output_layer.register_forward_pre_hook(self.on_output_layer_first, prepend=True)
            handles.append(keep(first, "output_layer", pre=True, last=False))
            handles.append(output_layer.register_forward_pre_hook(self.on_output_layer_pre, with_kwargs=True))
            handles.append(output_layer.register_forward_hook(self.on_output_layer_post))
            handles.append(keep(model.decoder.register_forward_hook(self.on_decoder_post), "decoder"))
        if model.mtp_process:
            handles.append(keep(model.mtp.register_forward_hook(self.on_mtp_block_post), "mtp"))
            handles.append(model.mtp.register_forward_pre_hook(self.on_mtp_block_pre, with_kwargs=True))
            step_layers, pre = self.plan.step_layers(model.mtp.layers), self.on_mtp_layer_pre
            if options.feeds_drafts or layer_keywords(options):  # an option rewrites the layers' arguments
                handles.extend(layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in step_layers)
            for norm, field in mtp_input.norms(options, model, step_layers):
                keep_input = functools.partial(self.on_norm_pre, field)
                handles.append(norm.register_forward_pre_hook(keep_input, with_kwargs=True))
            if self.plan.changes_block:  # the chain rebuilds the block's output: record its call of the step layer
                step_layer = model.mtp.layers[self.plan.layer]
                recorder = step_layer.register_forward_pre_hook(self.on_step_layer_pre, with_kwargs=True, prepend=True)
                handles.append(recorder)
                handles.append(step_layer.register_forward_hook(self.on_step_layer_post))
                if options.draft_geometry == "engine":
                    core = engine_geometry.core_attention(mtp_layer_body(step_layer))
                    handles.append(core.register_forward_hook(self.on_step_attention_post, with_kwargs=True))
        return handles

    # ------------------------------------------------------------------ the model's own hooks
    def on_model_pre(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        options, arguments, micro_batches = self.options, self._arguments, self.binding.micro_batches
        fwd = InFlight(model, kwargs, threading.get_ident(), sys.exc_info()[1])
        self.binding.flight.start(model, fwd)
        self._order.restore(model)
        grad = torch.is_grad_enabled()
        args, (targets, bound, regions) = micro_batches.of_call(arguments, args, kwargs, grad)
        fwd.recompute = bound is not None and bound.trained
        train = targets is not None and grad and model.post_process
        if train and arguments.get(args, kwargs, "output_processor") is not None:
            # mcore 0.18+: the processor replaces the output layer call the MTP loss hangs on.
            expected = "None in a training micro-batch (mtp_hooks needs the output layer call)"
            raise bad_argument("output_processor", expected, "a processor")
        fwd.targets = targets if train else None
        fwd.packing.params = arguments.get(args, kwargs, "packed_seq_params")
        if targets is not None and (train or regions.forward):  # a recompute's was bound with its targets
            fwd.losses.scale = targets.loss_scale if bound is not None else mtp_loss.forward_scale(
                options, targets, arguments.named(args, kwargs)
            )
        scores = options.output == "logprobs" and model.post_process
        vocab_size = getattr(model, "vocab_size", None)
        if vocab_size is not None and targets is not None and bound is None and (train or scores):
            check_label_range(targets.labels, targets.loss_mask, vocab_size, options.validate)
        if scores:
            fwd.scoring = logprobs.begin(targets, micro_batches.pending)
        micro_batches.bind_for_recomputes(regions, targets, fwd.losses.scale, train)
        return args, kwargs

    def on_model_post(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """In registration order: the model is stock for later hooks, which see what it returns."""
        fwd = self.binding.flight.own_post(model, kwargs)
        if fwd is None:
            return None
        fwd.close_window()
        if fwd.scoring is None or output is None:
            return None
        return fwd.scoring.output

    def on_model_done(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Kept last: counts the forward only if it and every hook before this one completed."""
        fwd = self.binding.flight.own_post(model, kwargs)
        if fwd is None:
            self.binding.flight.refused_post()
            return None
        self.binding.flight.finish(fwd)
        if fwd.failed(output):
            return None  # the forward, or a hook before this one, raised: it counts for nothing
        if fwd.train:
            mtp_loss.check_finished(fwd.losses)
            if not fwd.recompute:  # its metrics; stock mcore tracks only in training mode
                self.loss_path = fwd.losses.path
                mtp_loss.count(fwd.losses, self.metrics, self.depth, model.training, self._tracker)
        return None

    # ------------------------------------------------------------------ the submodules' hooks
    def on_decoder_post(self, decoder: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """An inference forward opens the window here: ``mtp_process = False``, the MTP block does not run."""
        fwd = self._forward_here()
        if fwd is None or fwd.train or not fwd.model.mtp_process:
            return None
        weight = tied_copy.served(fwd.model)  # read before the window hides a later stage's tied copy
        self.binding.open_window(fwd)
        tied_copy.keep(fwd.tied, fwd.model, weight)
        return None

    def on_mtp_block_pre(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        fwd = self._forward_here()
        if fwd is None:
            return None
        return packing.on_block_pre(fwd, fwd.packing, block, args, kwargs)

    def on_mtp_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        fwd = self._forward_here()
        if fwd is None or not fwd.train:
            return None
        if self.options.feeds_drafts:  # the draft from the normed state handed on; detach wraps its embedding
            chain.feed_draft(self.options, fwd, fwd.chain, kwargs)
        mtp_input.on_layer_pre(self.options, fwd, fwd.before_norm, kwargs)  # the state the step reads: detach cuts it
        start_embedding.on_layer_pre(self.options, fwd, fwd.packing.layout, kwargs)  # step 1's start embedding
        if self.options.detach_encoder:
            detach.on_layer_pre(fwd, kwargs, self.options.detach_between_depths)
        fwd.mtp_layer_calls += 1
        return args, kwargs

    def on_norm_pre(self, field: str, norm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A norm's input that the MTP layers read (``mtp_input.norms``), kept in ``fwd.before_norm.<field>``."""
        fwd = self._forward_here()
        if fwd is not None and fwd.train:
            mtp_input.keep_norm_input(fwd.before_norm, field, args, kwargs)
        return None

    def on_step_attention_post(self, core: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """``draft_geometry="engine"``: step 1 keeps its keys, steps 2..k attend as the engine's cache lets them."""
        fwd = self._forward_here()
        if fwd is None or not fwd.train:
            return None
        return engine_geometry.on_core_attention(fwd.engine_steps, core, args, kwargs, out)

    def on_step_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Kept first among the step layer's pre-hooks: the chain records the block's own arguments."""
        fwd = self._forward_here()
        if fwd is not None and fwd.train:
            chain.record_call(fwd.chain, kwargs)
        return None

    def on_step_layer_post(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        fwd = self._forward_here()
        if fwd is not None and fwd.train:
            chain.record_output(fwd.chain, output)
        return None

    def on_mtp_block_post(self, block: nn.Module, args: tuple[Any, ...], output: Any) -> Optional[Tensor]:
        """Kept last: the block's output (as the chain's steps, ``chain.Plan``) opens the training window."""
        fwd = self._forward_here()
        if fwd is None or not fwd.train:
            return None
        extended = None
        if self.plan.changes_block:  # before the swaps end: the extra calls run as the block's did
            engine = fwd.engine_steps.of(fwd.model, fwd.packing.params, self.options)
            extended = chain.extend(fwd.chain, self.plan, block, output, engine)
        fwd.restore_swaps()
        fwd.block_output = output if extended is None else extended
        self.binding.open_window(fwd)
        return extended

    def on_output_layer_first(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        """Kept first among the output layer's pre-hooks: the window closes before any user hook runs."""
        fwd = self._forward_here()
        if fwd is not None and fwd.close_window():
            fwd.main_pending = True
        return None

    def on_output_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        """The main head's call, matched by identity (a user's own call of the output layer is stock's)."""
        fwd = self._forward_here()
        if fwd is None or fwd.losses.in_own_head_call:
            return None
        hidden = args[0]
        if fwd.train:
            if fwd.losses.attached or hidden is not fwd.block_output:
                return None  # someone else's call of the output layer (a logit lens): stock's
        elif not fwd.main_pending:
            return None
        fwd.main_pending = False
        served = tied_copy.serve(fwd.tied, kwargs)  # an inference forward's tied copy (``on_decoder_post``)
        weight = kwargs.get("weight")
        if weight is None:
            weight = layer.weight
        if not fwd.train and fwd.scoring is None:
            return (args, kwargs) if served else None
        own_call = functools.partial(mtp_loss.own_head_call, layer, fwd.losses)
        head = Head.of(layer, weight, self.options.chunk_size, own_call)
        if fwd.train:
            mtp_head = detach.mtp_head(self.options, fwd.model.config, head)
            hidden = mtp_loss.attach(self.options, fwd, fwd.losses, mtp_head, hidden, self.depth, fwd.packing)
            if fwd.scoring is None:  # log-probs drop this call's logits: nothing to undefer
                deferral.undefer_main_call(fwd, fwd.main_call, layer, hidden)
        if fwd.scoring is not None:
            hidden = logprobs.score(self.options, fwd.scoring, head, hidden)
        return (hidden, *args[1:]), kwargs

    def on_output_layer_post(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The main head's call returned: deferral's undeferred call ends, or the log-probs link to
        mcore's own call."""
        fwd = self._forward_here()
        if fwd is None or not args:
            return None
        if deferral.end_main_call(fwd, fwd.main_call, layer, args[0], output):
            return None
        if fwd.scoring is not None:
            logprobs.on_head_post(fwd.scoring, args[0], output)
        return None

    # ------------------------------------------------------------------ removal
    def close(self) -> None:
        """For ``remove``: the model stock again (``ModelBinding.close``, the tied copy unmarked) and
        mcore's tracker back to the depths it held before this chain grew it."""
        self.binding.close()
        self._tied_mark.undo()
        if self._tracker is not None:
            self._tracker.undo()
