"""The lifecycle of one forward: the model's own pre- and post-hook, its lock, its targets.

A forward meets the hooks in this order: (1) the model pre-hook (``on_model_pre``) takes the
model's lock (one forward at a time, one thread), takes ``labels`` / ``loss_mask`` out of the call
so mcore returns logits, picks the forward's targets (``forward_targets``: the call's, the
``micro_batch`` block's, or a checkpoint recompute's, bound by ``recompute``) and decides training
or inference, changing nothing on the model; (2-5) the submodule hooks (``submodule_hooks``) open
and close the window (``state``) that keeps stock's own MTP loss off, and compute the MTP losses on
the output-layer call that carries the block's output (``heads``); (6) the model forward hooks
(``always_call``): ``on_model_post`` closes the window if a fault left it open and returns the
log-prob output; ``on_model_done``, kept last, counts the forward only if it and every hook before
it completed, and releases the lock. Copies (``deepcopy``, ``pickle``) get their own hooks.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.runtime.arguments import CallArguments
from mtp_hooks.features.chain import check_chain
from mtp_hooks.checks import check_against_inputs, check_label_range, check_loss_scale
from mtp_hooks.errors import bad_argument, bad_state, other_thread
from mtp_hooks.runtime.interrupts import forwards_on_stack
from mtp_hooks.ops.main_grad import mark_shared_copy, unmark_shared_copy
from mtp_hooks.metrics import MTPMetrics
from mtp_hooks.options import Options
from mtp_hooks.runtime.proxies import config_view
from mtp_hooks.runtime.micro_batch import ForwardTargets
from mtp_hooks.runtime.recompute import BoundTargets
from mtp_hooks.runtime.forward import ForwardState, MicroBatch, Originals
from mtp_hooks.submodule_hooks import SubmoduleHooks


_PER_MODEL = ("pending", "forward", "_model_ref", "_originals", "_lock", "_recovering", "_refused", "_bound", "_marked")  # bound to one model (_bind), never copied


class ForwardHooks(ForwardTargets, SubmoduleHooks):
    """The hooks of one language model and the state they share between and within forwards.

    A deep copy (or pickle) of the hooked model copies this object too, as torch's hook dicts hold
    its bound methods; the copy is rebound to the copied model (``__deepcopy__``).
    """

    def __init__(self, model: nn.Module, options: Options) -> None:
        self.options = options
        self.layers: int = model.config.mtp_num_layers
        self.depth: int = options.steps(model.config)  # draft steps trained: the layers, or ``draft_steps``
        self.metrics = MTPMetrics(self.depth)
        self.loss_path: Optional[str] = None  # of the last completed training forward
        self._arguments = CallArguments(model)
        self._last: dict[str, int] = {}  # hooks kept first / last in their dicts, by handle id
        self._warned_unused = False  # ``disarm`` warns once
        self._bind(model, model.config, bool(model.mtp_process))

    def _bind(self, model: nn.Module, config: Any, mtp_process: bool) -> None:
        """(Re)bind to ``model``: also what a copy of a hooked model does (``__deepcopy__``)."""
        self.pending: Optional[MicroBatch] = None
        self.forward: Optional[ForwardState] = None
        self._model_ref = weakref.ref(model)
        self._originals = Originals(config, mtp_process, config_view(config, self._view_live))
        self._lock = threading.Lock()  # held from a forward's pre-hook to its post-hook
        self._recovering = threading.Lock()
        self._refused = 0  # nested calls refused on the owning thread whose post-hook is pending
        self._bound = BoundTargets()  # targets of checkpointed forwards, for their recomputes
        self._marked = mark_shared_copy(model)  # see ``main_grad.mark_shared_copy``; undone by ``close``

    @property
    def alive_model(self) -> Optional[nn.Module]:
        """The language model, or ``None`` once it was garbage-collected."""
        return self._model_ref()

    @property
    def model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise bad_state("model", "the model these hooks were attached to", "a model that no longer exists")
        return model

    def install(self, model: nn.Module) -> list[Any]:
        options = self.options
        _mcore.check_call_conventions(model, options.detach_encoder)
        check_chain(model, options.draft_steps, options.draft_inputs)
        pre = model.register_forward_pre_hook(self.on_model_pre, with_kwargs=True)
        post = model.register_forward_hook(self.on_model_post, with_kwargs=True, always_call=True)
        done = model.register_forward_hook(self.on_model_done, with_kwargs=True, always_call=True)
        handles = [pre, post, done]
        self._last["model"] = done.id
        if model.post_process:
            handles.append(model.output_layer.register_forward_pre_hook(self.on_output_layer_first, prepend=True))
            self._last["output_first"] = handles[-1].id
            handles.append(model.output_layer.register_forward_pre_hook(self.on_output_layer_pre, with_kwargs=True))
            handles.append(model.output_layer.register_forward_hook(self.on_output_layer_post))
            handles.append(model.decoder.register_forward_hook(self.on_decoder_post))
            self._last["decoder"] = handles[-1].id
        if model.mtp_process:
            handles.append(model.mtp.register_forward_hook(self.on_mtp_block_post))
            self._last["block"] = handles[-1].id
            handles.append(model.mtp.register_forward_pre_hook(self.on_mtp_block_pre, with_kwargs=True))
            if options.detach_encoder or options.feeds_drafts:
                for layer in model.mtp.layers:
                    handles.append(layer.register_forward_pre_hook(self.on_mtp_layer_pre, with_kwargs=True))
            if self.depth > self.layers:  # the chain's extra steps call the last layer again
                last = model.mtp.layers[-1]
                handles.append(last.register_forward_pre_hook(self.on_last_layer_pre, with_kwargs=True, prepend=True))
                handles.append(last.register_forward_hook(self.on_last_layer_post))
        return handles

    def _keep_order(self, model: nn.Module) -> None:
        """Keep the post-hooks last and the window-closing pre-hook first, whatever users add later."""
        for name, hooks, last in (
            ("model", model._forward_hooks, True),
            ("decoder", getattr(model, "decoder", None) and model.decoder._forward_hooks, True),
            ("block", getattr(model, "mtp", None) and model.mtp._forward_hooks, True),
            ("output_first", getattr(model, "output_layer", None) and model.output_layer._forward_pre_hooks, False),
        ):
            hook_id = self._last.get(name)
            if hook_id is None or not hooks or hook_id not in hooks:
                continue
            edge = next(reversed(hooks)) if last else next(iter(hooks))
            if edge != hook_id:
                hooks.move_to_end(hook_id, last=last)

    # --------------------------------------------------------------------- the hooks
    def on_model_pre(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self._lock.acquire(blocking=False):
            self._lock_busy(model)
        self.forward = state = ForwardState(model, kwargs, threading.get_ident(), sys.exc_info()[1])
        self._keep_order(model)
        arguments = self._arguments
        args, labels = arguments.take(args, kwargs, "labels")
        args, loss_mask = arguments.take(args, kwargs, "loss_mask")
        grad = torch.is_grad_enabled()
        input_ids = arguments.get(args, kwargs, "input_ids")
        targets, bound, regions = self.targets_of_forward(labels, loss_mask, input_ids, grad)
        state.recompute = bound is not None and bound.trained
        if targets is not None:
            check_against_inputs(targets.labels, input_ids)
        train = targets is not None and grad and model.post_process
        if train and arguments.get(args, kwargs, "output_processor") is not None:
            # mcore 0.18+: the processor replaces the output layer call the MTP loss hangs on.
            raise bad_argument("output_processor", "None in a training micro-batch (mtp_hooks needs the output layer call)", "a processor")
        state.targets = targets if train else None
        state.packed_seq_params = arguments.get(args, kwargs, "packed_seq_params")
        if targets is not None and (train or regions.forward):
            state.loss_scale = targets.loss_scale if bound is not None else self._loss_scale(targets, args, kwargs)
        logprobs = self.options.output == "logprobs"
        vocab_size = getattr(model, "vocab_size", None)
        if vocab_size is not None and targets is not None and bound is None and (train or logprobs):
            check_label_range(targets.labels, targets.loss_mask, vocab_size, self.options.validate)
        if logprobs and model.post_process:
            if targets is None:
                raise bad_argument("labels", "labels for every forward with output='logprobs' (the main head scores them)", None)
            state.head_labels = targets.labels
            if targets is self.pending:
                targets.scored = True
        self.bind_for_recomputes(regions, targets, state.loss_scale, train)
        return args, kwargs

    def _loss_scale(self, targets: MicroBatch, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A training forward's MTP loss multiplier: the targets' times ``call_loss_scale``'s."""
        scale = targets.loss_scale
        if self.options.call_loss_scale is not None:
            from_call = check_loss_scale("call_loss_scale", self.options.call_loss_scale(self._arguments.named(args, kwargs)))
            if from_call is not None:
                scale = from_call if scale is None else scale * from_call
        return scale

    def _lock_busy(self, model: nn.Module) -> None:
        """The lock is held: refuse a nested or other-thread forward, or recover an abandoned one."""
        me = threading.get_ident()
        state = self.forward
        owner = None if state is None else state.thread
        if owner == me and forwards_on_stack(model, me, 2) > 1:
            self._refused += 1
            raise bad_state("model", "no forward of this model in flight when it is called", "a forward started inside another forward of it (nested forwards are not supported)")
        if owner is not None and owner != me and forwards_on_stack(model, owner, 1):
            raise other_thread("model", "a forward")
        self.recover_abandoned(inside_forward=True)
        if not self._lock.acquire(blocking=False):
            raise other_thread("model", "a forward")

    def _own_call(self, model: nn.Module, kwargs: dict[str, Any]) -> Optional[ForwardState]:
        """The state of the forward this post-hook call belongs to, or ``None`` for a call our
        pre-hook refused (another thread, nested) or never saw (an earlier pre-hook raised)."""
        state = self.forward
        if state is None or state.thread != threading.get_ident() or self._refused:
            return None
        if kwargs is not state.kwargs and forwards_on_stack(model, state.thread, 2) > 1:
            return None
        return state

    def on_model_post(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """In registration order: the model is stock for later hooks, which see what it returns."""
        state = self._own_call(model, kwargs)
        if state is None:
            return None
        state.close_window()
        return state.head_output if output is not None else None

    def on_model_done(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Kept last: counts the forward only if it and every hook before this one completed."""
        state = self._own_call(model, kwargs)
        if state is None:
            if self._refused and self.forward is not None and self.forward.thread == threading.get_ident():
                self._refused -= 1  # the post-hook of a nested call our pre-hook refused
            return None
        self.forward = None
        state.close_window()
        self._lock.release()
        if state.failed(output):
            return None  # the forward, or a hook before this one, raised: it counts for nothing
        if state.train and not state.attached:
            raise AssertionError(
                "mtp_hooks: a training micro-batch finished without MTP losses; the output layer never "
                "received the MTP block's output (a path that bypasses module hooks?)"
            )
        if state.train and not state.recompute:
            self._count(model, state)
        return None

    def _count(self, model: nn.Module, state: ForwardState) -> None:
        """Add a completed training forward's metrics."""
        self.loss_path = state.loss_path
        for entry in state.metrics:
            self.metrics.add(*entry)
            if model.training:  # stock mcore tracks only in training mode
                k, ce_sum, tokens, correct = entry[:4]
                _mcore.track_depth(k, self.depth, ce_sum, tokens, correct)

    # ------------------------------------------------- abandoned forwards and removal
    def recover_abandoned(self, inside_forward: bool = False) -> None:
        """Clean up after a forward that a non-``Exception`` interrupt abandoned (``interrupts``):
        if no forward of the model is on the owning thread's stack any more, restore what it
        changed, drop it and free the lock. A ``with micro_batch`` block dropped its targets."""
        if self.forward is None:
            return
        with self._recovering:
            state = self.forward
            if state is None:
                return
            calling = 1 if inside_forward and state.thread == threading.get_ident() else 0
            if state is None or forwards_on_stack(state.model, state.thread, calling + 1) > calling:
                return
            self.forward, self._refused = None, 0
            state.close_window()
            if self._lock.locked():
                self._lock.release()

    def close(self) -> None:
        """For ``remove``: refuse while a forward runs; restore and drop everything otherwise."""
        state = self.forward
        if state is not None and forwards_on_stack(state.model, state.thread, 1):
            raise bad_state("remove", "no forward of the model in flight", "remove() while a forward of the model is running")
        self.recover_abandoned()
        self.pending = None
        unmark_shared_copy(self._marked)
        self._marked = None

    # ------------------------------------------------------------------------ copies
    def _refuse_mid_forward(self, call: str) -> None:
        self.recover_abandoned()
        if self.forward is not None:
            raise bad_state(call, "no forward of the model in flight while it is copied", "a copy taken inside a forward")

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardHooks:
        """Bound to the model's copy (deepcopy's memo maps the model to it; pickling carries the model
        itself), with a fresh lock and no forward or targets in flight; refused mid-forward.
        ``RemovableHandle`` copies through ``__getstate__`` / ``__setstate__`` onto the copied dicts."""
        self._refuse_mid_forward("copy.deepcopy")
        model = self.alive_model
        copied_model = memo.get(id(model)) if model is not None else None
        if copied_model is None:
            raise bad_state(
                "copy.deepcopy",
                "a deep copy of the hooked model (its copy gets its own hooks), or attach() on a copy",
                "a deep copy of the hooks without their model",
            )
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name not in _PER_MODEL:
                new.__dict__[name] = copy.deepcopy(value, memo)
        originals = self._originals
        new._bind(copied_model, copy.deepcopy(originals.config, memo), originals.mtp_process)
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_mid_forward("pickle")
        model = self.alive_model
        if model is None:
            raise bad_state("pickle", "hooks whose model exists", "hooks whose model was garbage-collected")
        state = {name: value for name, value in self.__dict__.items() if name not in _PER_MODEL}
        originals = self._originals
        state["_copy_of"] = (model, originals.config, originals.mtp_process)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model, config, mtp_process = state.pop("_copy_of")
        self.__dict__.update(state)
        self._bind(model, config, mtp_process)
