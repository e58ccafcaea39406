"""The hooks on the language model's submodules: where a forward opens and closes its window.

* decoder forward hook (kept last among the decoder's hooks): an inference forward opens the
  window (``state``) with ``mtp_process = False``, so the MTP block does not run;
* MTP block pre-hook: packed batches get the padded layout; MTP layer pre-hooks
  (``detach_encoder``): a ``DetachedEmbedding`` and detached trunk hidden states;
* MTP block forward hook (kept last): remembers the block's output and opens the training window
  (stock's own MTP loss off, ``_mcore``);
* output-layer pre-hook kept first: closes the window before any user hook runs; the main
  output-layer pre-hook computes the MTP losses (``heads``) on the call that carries the block's
  output, matched by identity, so a user's own call of the output layer (a logit lens) is stock's;
  the output-layer forward hook: with ``output="logprobs"`` it gives mcore's own main-head call its
  gradient; under ``defer_embedding_wgrad_compute`` it ends the main head's undeferred call (``deferral``).

Every hook acts only on the thread whose forward is in flight (``ForwardState.thread``) and on the
model that forward runs (``ForwardState.model``), never on a stored reference.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from torch import Tensor, nn

import torch

from mtp_hooks import _mcore
from mtp_hooks.features import chain, deferral
from mtp_hooks.features import mtp_loss as heads
from mtp_hooks.runtime.interrupts import forwards_on_stack
from mtp_hooks.ops.logprobs import with_zero_gradient_to
from mtp_hooks.options import Options
from mtp_hooks.head import Head
from mtp_hooks.runtime.proxies import DetachedEmbedding, config_view, is_config_view
from mtp_hooks.runtime.forward import ForwardState, Originals
from mtp_hooks.targets import packed_layout

HookResult = Optional[tuple[tuple[Any, ...], dict[str, Any]]]


class SubmoduleHooks:
    """Mixin of ``ForwardHooks``: the hooks on the decoder, the MTP block and layers, the output layer."""

    options: Options
    depth: int  # draft steps trained
    layers: int  # the model's MTP layers
    forward: Optional[ForwardState]
    _originals: Originals
    recover_abandoned: Callable[..., None]  # ``ForwardHooks``: drops a forward an interrupt abandoned

    def on_decoder_post(self, decoder: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self.forward
        if state is None or state.train or state.thread != threading.get_ident():
            return None
        model = state.model
        if model.mtp_process:
            tied = getattr(model, "share_embeddings_and_output_weights", False)
            weight = model.shared_embedding_or_output_weight() if tied else None
            state.open_window(self._current_originals(model), mtp_process_off=True)
            if tied and model.shared_embedding_or_output_weight() is not weight:
                # A later pipeline stage with tied embeddings keeps a copy of the word embeddings
                # for MTP and serves it as the output weight only while ``mtp_process`` is set;
                # without it mcore would hand its untrained ``output_layer.weight`` to the head.
                state.output_weight = weight
        return None

    def on_mtp_block_post(self, block: nn.Module, args: tuple[Any, ...], output: Any) -> Optional[Tensor]:
        state = self.forward
        if state is None or not state.train or state.thread != threading.get_ident():
            return None
        extended = None
        if self.depth > self.layers:  # the chain's steps past the N layers (``chain``), before the swaps end
            if state.last_layer_call is None:
                raise AssertionError("mtp_hooks: the MTP block returned without a call of its last layer")
            kwargs, last = state.last_layer_call
            extended = torch.cat([output, *chain.extra_steps(block.layers[-1], kwargs, last, self.depth - self.layers)])
        state.restore_swaps()
        state.block_output = output if extended is None else extended
        state.open_window(self._current_originals(state.model), mtp_process_off=True)
        return extended

    def on_last_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The chain: the block's own arguments of its last MTP layer's call, before any hook rewrites them."""
        state = self.forward
        if state is not None and state.train and state.thread == threading.get_ident():
            state.last_layer_call = (dict(kwargs), None)
        return None

    def on_last_layer_post(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self.forward
        if state is not None and state.train and state.thread == threading.get_ident() and state.last_layer_call is not None:
            state.last_layer_call = (state.last_layer_call[0], output)
        return None

    def _current_originals(self, model: nn.Module) -> Originals:
        """The attach-time originals; a config the user replaced since (not a view) is adopted."""
        config = model.__dict__.get("config")
        originals = self._originals
        if config is not originals.config and not is_config_view(config):
            originals = self._originals = Originals(config, originals.mtp_process, config_view(config, self._view_live))
        return originals

    def _view_live(self) -> bool:
        """Whether the config view should read ``mtp_num_layers = None`` now: only on the thread of
        a forward that is still running. A read after an interrupt abandoned it restores stock."""
        state = self.forward
        if state is None or state.window is None or state.thread != threading.get_ident():
            return False
        if forwards_on_stack(state.model, state.thread, 1):
            return True
        self.recover_abandoned()
        return False

    def on_output_layer_first(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        state = self.forward
        if state is not None and state.thread == threading.get_ident() and state.close_window():
            state.main_pending = True
        return None

    def on_output_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        state = self.forward
        if state is None or state.in_own_head_call or state.thread != threading.get_ident():
            return None
        hidden = args[0]
        if state.train:
            if state.attached or hidden is not state.block_output:
                return None  # someone else's call of the output layer (a logit lens): stock's
        elif not state.main_pending:
            return None
        state.main_pending = False
        if state.output_weight is not None:  # inference forward, see ``on_decoder_post``
            kwargs["weight"] = state.output_weight
        weight = kwargs.get("weight")
        if weight is None:
            weight = layer.weight
        if not state.train and state.head_labels is None:
            return (args, kwargs) if state.output_weight is not None else None
        head = Head.of(layer, weight, self.options.chunk_size, lambda chunk, head_weight: self._own_head_call(layer, state, chunk, head_weight))
        if state.train:
            assert state.targets is not None
            model = state.model
            detach = self.options.detach_head or _mcore.config_detaches_heads(model.config)
            batch = heads.MTPBatch(state.targets.labels, state.targets.loss_mask, self.depth, state.packed_seq_params, state.packed_layout)
            loss_scale = self.options.mtp_loss_scale(model.config)
            if state.loss_scale is not None:  # this micro-batch's multiplier
                loss_scale = loss_scale * state.loss_scale
            hidden, state.metrics, state.loss_path = heads.attach_mtp_losses(
                self.options, model, head.detached() if detach else head, hidden, batch, loss_scale
            )
            state.attached = True
            if state.head_labels is None and deferral.defers(layer):
                # The main head's call on the MTP stage, where mcore's drain targets the wrong weight
                # (``deferral``): undeferred, with an empty pair left in the buffers on its return.
                state.swap(layer, "config", deferral.undeferred(layer.__dict__["config"]))
                state.undeferred_call = hidden
        if state.head_labels is not None and state.head_output is None:
            state.head_output = heads.head_logprobs(self.options, head, hidden, state.head_labels)
            # mcore's own head call still runs, on one position; its logits are dropped, and it gets
            # its (zero) gradient through the log-probs (``on_output_layer_post``).
            hidden = state.head_call = hidden[:1]
        return (hidden, *args[1:]), kwargs

    def on_output_layer_post(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The main head's undeferred call (``deferral``) returned: its real config back, an empty pair
        in mcore's buffers. ``output="logprobs"``: the log-probs carry a zero gradient back to the logits of mcore's own
        main-head call (``logprobs.with_zero_gradient_to``), so that call gets its backward like any
        head call. Under ``defer_embedding_wgrad_compute`` mcore's layer buffered the call's input, and
        the pipeline's drain (``drain_embedding_wgrad_compute``) pairs every buffered input with a
        buffered gradient; it cannot run on none, so removing the input instead would leave the
        log-probs with lean MTP nothing to drain. The zero adds exactly nothing to any gradient."""
        state = self.forward
        if state is None or state.thread != threading.get_ident() or not args:
            return None
        if state.undeferred_call is not None and args[0] is state.undeferred_call:
            state.undeferred_call = None
            state.restore_swaps()
            deferral.leave_empty_pair(layer, layer.__dict__["config"], args[0], output[0])
            return None
        if state.head_call is None or args[0] is not state.head_call:
            return None
        state.head_call = None
        if state.head_output is not None:
            state.head_output = with_zero_gradient_to(state.head_output, output[0])
        return None

    @staticmethod
    def _own_head_call(layer: nn.Module, state: ForwardState, hidden: Tensor, weight: Tensor) -> Tensor:
        """The output layer called for one MTP depth (dense path). Under ``defer_embedding_wgrad_compute``
        the call sees its config with that flag off, so its weight gradient is made in its own backward
        and mcore's buffers keep one head call per micro-batch, the main head's: the drain pairs the
        buffered inputs and gradients in order, while a micro-batch's head calls reach backward in the
        reverse order (stock's deferred MTP heads get the main head's gradient paired with their input)."""
        config = layer.__dict__.get("config")
        undeferred = bool(getattr(config, "defer_embedding_wgrad_compute", False))
        state.in_own_head_call = True
        if undeferred:
            layer.__dict__["config"] = deferral.undeferred(config)
        try:
            logits, _bias = layer(hidden, weight=weight, runtime_gather_output=False)
        finally:
            state.in_own_head_call = False
            if undeferred:
                layer.__dict__["config"] = config
        return logits

    def on_mtp_block_pre(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        """Give the MTP layers the padded layout of a packed batch, so their shifted input ids stay
        within each sequence (mcore rolls them by ``cu_seqlens_q``; see ``targets.packed_layout``)."""
        packed = kwargs.get("packed_seq_params")
        state = self.forward
        if state is None or packed is None or state.thread != threading.get_ident():
            return None
        if state.train and block.training and _mcore.recompute_breaks_packed(block.config):
            # Stock 0.16 - 0.17 recompute would hand the PackedSeqParams to save_for_backward
            # (TypeError): the MTP layers run without recompute for this block call (same gradients).
            for layer in block.layers:
                state.swap(layer, "config", config_view(layer.config, lambda: True, "recompute_granularity"))
        state.packed_layout = layout = packed_layout(packed)  # once per forward: the targets roll by it too
        if layout is packed:
            return None
        kwargs["packed_seq_params"] = layout
        return args, kwargs

    def on_mtp_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        state = self.forward
        if state is None or not state.train or state.thread != threading.get_ident():
            return None
        options = self.options
        if options.feeds_drafts and state.mtp_layer_calls > 0 and kwargs.get("embedding") is not None:
            # Step j >= 2 of the chain: the previous step's own draft, from the hidden state it hands on.
            if state.draft_head is None:
                state.draft_head = chain.draft_head(state.model, options.chunk_size)
            temperature = options.draft_temperature if options.draft_inputs == "sample" else None
            kwargs["embedding"] = chain.DraftEmbedding(kwargs["embedding"], chain.step_drafts(state.draft_head, kwargs["hidden_states"], temperature))
        if options.detach_encoder:
            self._detach_layer_inputs(layer, state, kwargs)
        state.mtp_layer_calls += 1
        return args, kwargs

    def _detach_layer_inputs(self, layer: nn.Module, state: ForwardState, kwargs: dict[str, Any]) -> None:
        """``detach_encoder``: a detached embedding, detached trunk hidden states (every depth's input
        with ``detach_between_depths``), and a dynamic-CP micro-batch's own CP group for the rolls."""
        if kwargs.get("embedding") is not None:
            kwargs["embedding"] = DetachedEmbedding(kwargs["embedding"])
        dynamic_cp = getattr(kwargs.get("packed_seq_params"), "cp_group", None)
        if dynamic_cp is not None and "cp_group" in layer.__dict__ and layer.__dict__["cp_group"] is not dynamic_cp:
            # The micro-batch's own CP group for the shifted input ids (dynamic context parallelism),
            # as verl's detached embedding path uses; restored when the MTP block returns.
            state.swap(layer, "cp_group", dynamic_cp)
        if state.mtp_layer_calls == 0 or self.options.detach_between_depths:
            # Depth 0: the trunk's hidden states (the block's own chunk 0, the main head's input,
            # stays attached). Later depths, with detach_between_depths: the previous depth's output.
            # requires_grad keeps full activation recompute working on a detached input.
            kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_(True)
