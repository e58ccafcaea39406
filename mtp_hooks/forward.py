"""The per-forward state machine: the hooks that open a forward, swap what it needs, and restore.

In the order a forward meets them:

1. model forward pre-hook (``on_model_pre``): takes ``labels`` / ``loss_mask`` out of the call (or
   the armed ``micro_batch`` targets), so mcore returns logits; decides training or inference;
   installs a ``ConfigView`` (``mtp_num_layers`` reads ``None``: mcore's own MTP loss stays off);
   for inference also sets ``mtp_process = False`` so the MTP block does not run.
2. MTP block pre-hook (``on_mtp_block_pre``): hands packed batches the padded layout (and runs
   the MTP layers without recompute where stock recompute cannot take a packed batch).
3. MTP layer pre-hooks (``on_mtp_layer_pre``, with ``detach_encoder``): a ``DetachedEmbedding``
   proxy for ``embedding`` and detached depth-0 trunk hidden states (every depth's input hidden
   states with ``detach_between_depths``).
4. MTP block forward hook (``on_mtp_block_post``): turns off the stock MTP loss of releases that
   gate it on ``mtp_process`` after the block ran (``_mcore``).
5. output layer pre-hook (``on_output_layer_pre``): the MTP losses and the log-prob output
   (``heads``); chunk 0 goes on to mcore's own main head.
6. model forward hook, ``always_call`` (``on_model_post``): restores every swapped attribute, also
   when forward raised, and counts the forward's metrics only if it completed.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mtp_hooks import _mcore, heads
from mtp_hooks.arguments import CallArguments
from mtp_hooks.checks import check_against_inputs, check_label_range, check_targets
from mtp_hooks.errors import MTPHooksError, bad_argument
from mtp_hooks.interrupts import forwards_on_stack
from mtp_hooks.logprobs import TokenLogProbs
from mtp_hooks.metrics import MTPMetrics
from mtp_hooks.options import Options
from mtp_hooks.proxies import ConfigView, DetachedEmbedding, NoRecomputeConfig
from mtp_hooks.targets import packed_layout

HookResult = Optional[tuple[tuple[Any, ...], dict[str, Any]]]


@dataclasses.dataclass
class MicroBatch:
    """Targets of one training micro-batch, as the user gave them."""

    labels: Tensor
    loss_mask: Optional[Tensor]
    loss_scale: Any = None  # a multiplier of this micro-batch's MTP loss (float or 0-d tensor), None = 1
    used: bool = False
    scoped: bool = False  # armed by ``with micro_batch(...)``: stays until the block ends
    thread: int = dataclasses.field(default_factory=threading.get_ident)  # the thread that armed it


@dataclasses.dataclass
class ForwardState:
    """State of the forward in flight; lives from the model's pre-hook to its post-hook."""

    targets: Optional[MicroBatch]
    packed_seq_params: Any
    restore: list[tuple[nn.Module, str, Any]]
    mtp_layer_calls: int = 0
    attached: bool = False
    loss_path: Optional[str] = None  # how the MTP losses were computed (``MTPHooks.loss_path``)
    in_own_head_call: bool = False
    loss_scale: Any = None  # this forward's MTP loss multiplier: micro_batch(loss_scale=) x call_loss_scale
    # Metrics of this forward, added to the running sums only once the forward has completed.
    metrics: list[heads.DepthSums] = dataclasses.field(default_factory=list)
    # Set when switching ``mtp_process`` off changed ``shared_embedding_or_output_weight()``.
    output_weight: Optional[Tensor] = None
    # ``output="logprobs"``: the labels the main head is scored on, and what the forward returns.
    head_labels: Optional[Tensor] = None
    head_output: Optional[TokenLogProbs] = None

    @property
    def train(self) -> bool:
        return self.targets is not None

    def restore_all(self) -> None:
        for module, name, value in reversed(self.restore):
            setattr(module, name, value)
        self.restore.clear()


class ForwardHooks:
    """The hooks of one language model and the state they share between and within forwards."""

    def __init__(self, model: nn.Module, options: Options) -> None:
        self.options = options
        self.depth: int = model.config.mtp_num_layers
        self.metrics = MTPMetrics(self.depth)
        self.pending: Optional[MicroBatch] = None
        self.forward: Optional[ForwardState] = None
        self.loss_path: Optional[str] = None  # of the last completed training forward
        self._model_ref = weakref.ref(model)
        self._arguments = CallArguments(model)
        self._calls = 0
        self._thread: Optional[int] = None  # the thread whose forward is in flight while _calls > 0

    @property
    def alive_model(self) -> Optional[nn.Module]:
        """The language model, or ``None`` once it was garbage-collected."""
        return self._model_ref()

    @property
    def model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise MTPHooksError("the model these hooks were attached to no longer exists")
        return model

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        handles = [
            model.register_forward_pre_hook(self.on_model_pre, with_kwargs=True),
            model.register_forward_hook(self.on_model_post, with_kwargs=True, always_call=True),
        ]
        if model.post_process:
            handles.append(model.output_layer.register_forward_pre_hook(self.on_output_layer_pre, with_kwargs=True))
        if model.mtp_process:
            handles.append(model.mtp.register_forward_hook(self.on_mtp_block_post))
            handles.append(model.mtp.register_forward_pre_hook(self.on_mtp_block_pre, with_kwargs=True))
            if self.options.detach_encoder:
                for layer in model.mtp.layers:
                    handles.append(layer.register_forward_pre_hook(self.on_mtp_layer_pre, with_kwargs=True))
        return handles

    # ------------------------------------------------------------ micro-batch targets
    def arm(self, labels: Tensor, loss_mask: Optional[Tensor], loss_scale: Any = None) -> MicroBatch:
        """Make ``labels`` / ``loss_mask`` the targets of this thread's next forward."""
        self.recover_interrupted()
        pending = self.pending
        if pending is not None and pending.thread != threading.get_ident():
            raise other_thread("micro_batch", "a micro_batch")
        if pending is not None and pending.scoped:
            raise bad_argument("micro_batch", "no micro_batch already open on these hooks", "a nested micro_batch")
        if pending is not None and not pending.used:
            raise bad_argument(
                "micro_batch",
                "a forward between two micro_batch(...) calls (each call arms the next forward)",
                "a second micro_batch(...) while the targets of the first were not used by any forward",
            )
        check_targets(labels, loss_mask, self.options.validate)
        self.pending = MicroBatch(labels, loss_mask, check_loss_scale("loss_scale", loss_scale))
        return self.pending

    def disarm(self, targets: MicroBatch) -> None:
        """Drop ``targets`` if they are still the armed ones."""
        if self.pending is targets:
            self.pending = None

    def _targets_for_call(self, labels: Any, loss_mask: Any) -> Optional[MicroBatch]:
        pending = self.pending
        if pending is not None and pending.thread != threading.get_ident():
            raise other_thread("model", "a forward")
        if labels is None and loss_mask is None:
            if pending is None:
                return None
            if pending.used:
                raise bad_argument("micro_batch", "one forward per micro_batch", "a second forward inside the same micro_batch")
            pending.used = True
            if not pending.scoped:
                self.pending = None  # armed by a plain call: consumed by this forward
            return pending
        if pending is not None:
            raise bad_argument("labels", "labels either in micro_batch(...) or as model(..., labels=...), not both", "both")
        if labels is None:
            raise bad_argument("labels", "a [b, s] integer tensor when loss_mask is given", None)
        check_targets(labels, loss_mask, self.options.validate)
        return MicroBatch(labels, loss_mask)

    # --------------------------------------------------------------------- the hooks
    def on_model_pre(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.recover_interrupted(inside_forward=True)
        if self._calls > 0 and self._thread != threading.get_ident():
            raise other_thread("model", "a forward")
        self._calls += 1
        self._thread = threading.get_ident()
        if self._calls > 1:
            raise MTPHooksError("model: a forward of this model started inside another forward of it; nested forwards are not supported")
        arguments = self._arguments
        args, labels = arguments.take(args, kwargs, "labels")
        args, loss_mask = arguments.take(args, kwargs, "loss_mask")
        targets = self._targets_for_call(labels, loss_mask)
        if targets is not None:
            check_against_inputs(targets.labels, arguments.get(args, kwargs, "input_ids"))
        train = targets is not None and torch.is_grad_enabled() and model.post_process
        if train and arguments.get(args, kwargs, "output_processor") is not None:
            # mcore 0.18+: the processor replaces the output layer call the MTP loss hangs on.
            raise bad_argument("output_processor", "None in a training micro-batch (mtp_hooks needs the output layer call)", "a processor")
        state = ForwardState(
            targets=targets if train else None,
            packed_seq_params=arguments.get(args, kwargs, "packed_seq_params"),
            restore=[(model, "config", model.config)],
        )
        logprobs = self.options.output == "logprobs"
        vocab_size = getattr(model, "vocab_size", None)
        if vocab_size is not None and targets is not None and (state.train or logprobs):
            check_label_range(targets.labels, targets.loss_mask, vocab_size, self.options.validate)
        if logprobs and model.post_process:
            if targets is None:
                raise bad_argument("labels", "labels for every forward with output='logprobs' (the main head scores them)", None)
            state.head_labels = targets.labels
        if train:
            state.loss_scale = self._loss_scale(state.targets, args, kwargs)
        if not train and model.mtp_process:
            self._skip_mtp_block(model, state)
        model.config = ConfigView(model.config)
        self.forward = state
        return args, kwargs

    def _loss_scale(self, targets: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The MTP loss multiplier of a training forward: the targets' times ``call_loss_scale``'s."""
        scale = targets.loss_scale
        if self.options.call_loss_scale is not None:
            from_call = check_loss_scale("call_loss_scale", self.options.call_loss_scale(self._arguments.named(args, kwargs)))
            if from_call is not None:
                scale = from_call if scale is None else scale * from_call
        return scale

    @staticmethod
    def _skip_mtp_block(model: nn.Module, state: ForwardState) -> None:
        tied = model.post_process and getattr(model, "share_embeddings_and_output_weights", False)
        weight = model.shared_embedding_or_output_weight() if tied else None
        state.restore.append((model, "mtp_process", model.mtp_process))
        model.mtp_process = False
        if tied and model.shared_embedding_or_output_weight() is not weight:
            # A later pipeline stage with tied embeddings keeps a copy of the word embeddings
            # for MTP and serves it as the output weight only while ``mtp_process`` is set;
            # without it mcore would hand its untrained ``output_layer.weight`` to the head.
            state.output_weight = weight

    def on_model_post(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self._calls == 0 or self._thread != threading.get_ident():
            return None  # this call's pre-hook never ran: refused above, or an earlier pre-hook raised
        self._calls -= 1
        if self._calls > 0:
            return None
        state, self.forward = self.forward, None
        if state is None:
            return None
        state.restore_all()
        if output is not None and state.train and not state.attached:
            raise AssertionError(
                "mtp_hooks: a training micro-batch finished without MTP losses; the output layer never "
                "received the MTP block's output (a path that bypasses module hooks?)"
            )
        if output is None:  # forward raised, and its micro-batch counts for nothing
            return None
        if state.loss_path is not None:
            self.loss_path = state.loss_path
        for entry in state.metrics:
            self.metrics.add(*entry)
            if model.training:  # stock mcore tracks only in training mode
                k, ce_sum, tokens, correct = entry[:4]
                _mcore.track_depth(k, self.depth, ce_sum, tokens, correct)
        return state.head_output

    def on_output_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        state = self.forward
        if state is None or state.in_own_head_call:
            return None
        if state.output_weight is not None:  # inference forward, see ``_skip_mtp_block``
            kwargs["weight"] = state.output_weight
        weight = kwargs.get("weight")
        if weight is None:
            weight = layer.weight
        hidden = args[0]
        if state.train and not state.attached:
            assert state.targets is not None
            model = self.model
            detach = self.options.detach_head or _mcore.config_detaches_heads(model.config)
            hidden, state.metrics, state.loss_path = heads.attach_mtp_losses(
                self.options,
                model,
                layer,
                hidden,
                self.depth,
                weight.detach() if detach else weight,
                state.targets.labels,
                state.targets.loss_mask,
                state.packed_seq_params,
                lambda chunk, head_weight: self._own_head_call(layer, state, chunk, head_weight),
                state.loss_scale,
            )
            state.attached = True
        elif state.head_labels is None:
            return (args, kwargs) if state.output_weight is not None else None
        if state.head_labels is not None and state.head_output is None:
            state.head_output = heads.head_logprobs(self.options, layer, hidden, weight, state.head_labels)
            hidden = hidden[:1]  # mcore's own head call still runs, on one position; its logits are dropped
        return (hidden, *args[1:]), kwargs

    @staticmethod
    def _own_head_call(layer: nn.Module, state: ForwardState, hidden: Tensor, weight: Tensor) -> Tensor:
        state.in_own_head_call = True
        try:
            logits, _bias = layer(hidden, weight=weight, runtime_gather_output=False)
        finally:
            state.in_own_head_call = False
        return logits

    def on_mtp_block_pre(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        """Give the MTP layers the padded layout of a packed batch, so their shifted input ids stay
        within each sequence (mcore rolls them by ``cu_seqlens_q``; see ``targets.packed_layout``)."""
        packed = kwargs.get("packed_seq_params")
        if self.forward is None or packed is None:
            return None
        if self.forward.train and block.training and _mcore.recompute_breaks_packed(block.config):
            # Stock recompute would hand the PackedSeqParams to save_for_backward (TypeError):
            # these MTP layers run without recompute for this forward (same gradients).
            for layer in block.layers:
                self.forward.restore.append((layer, "config", layer.config))
                layer.config = NoRecomputeConfig(layer.config)
        layout = packed_layout(packed)
        if layout is packed:
            return None
        kwargs["packed_seq_params"] = layout
        return args, kwargs

    def on_mtp_block_post(self, block: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self.forward
        if state is not None and state.train:
            _mcore.stock_mtp_loss_off_after_block(self.model, state.restore)
        return None

    def on_mtp_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        state = self.forward
        if state is None or not state.train:
            return None
        if "embedding" in kwargs and kwargs["embedding"] is not None:
            kwargs["embedding"] = DetachedEmbedding(kwargs["embedding"])
        dynamic_cp = getattr(kwargs.get("packed_seq_params"), "cp_group", None)
        if dynamic_cp is not None and getattr(layer, "cp_group", dynamic_cp) is not dynamic_cp:
            # The micro-batch's own CP group for the shifted input ids (dynamic context parallelism).
            state.restore.append((layer, "cp_group", layer.cp_group))
            layer.cp_group = dynamic_cp
        if state.mtp_layer_calls == 0 or self.options.detach_between_depths:
            # Depth 0: the trunk's hidden states (the block's own chunk 0, the main head's input,
            # stays attached). Later depths, with detach_between_depths: the previous depth's output.
            # requires_grad keeps full activation recompute working on a detached input.
            kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_(True)
        state.mtp_layer_calls += 1
        return args, kwargs

    # ------------------------------------------------- interrupted forwards and removal
    def recover_interrupted(self, inside_forward: bool = False) -> None:
        """Clean up after a forward that a non-``Exception`` interrupt abandoned (``interrupts``).

        Only when a forward is counted as in flight: then, if no forward of the model is on the
        owning thread's stack any more (besides the one calling, ``inside_forward``), restore
        what it swapped, drop its metrics, and free the nesting counter. Its targets are gone
        already: a ``with micro_batch`` block drops them on any exit, a plain call's targets are
        consumed when the forward starts.
        """
        if self._calls == 0 or self._thread is None:
            return
        model = self.alive_model
        if model is None:
            return
        calling = 1 if inside_forward and self._thread == threading.get_ident() else 0
        if forwards_on_stack(model, self._thread) > calling:
            return  # still running: a genuine nested call, or another thread's forward
        state, self.forward = self.forward, None
        if state is not None:
            state.restore_all()
        self._calls, self._thread = 0, None

    def close(self) -> None:
        """Restore whatever a forward in flight swapped and drop armed targets (for ``remove``)."""
        if self.forward is not None:
            self.forward.restore_all()
            self.forward = None
        self.pending = None


def check_loss_scale(name: str, value: Any) -> Any:
    """``value`` if it is a valid MTP loss multiplier (``None``, a float >= 0, a 0-d floating tensor)."""
    if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise bad_argument(name, "None, a float >= 0 or a 0-d floating tensor (a multiplier of the micro-batch's MTP loss)", repr(value))


def other_thread(name: str, what: str) -> MTPHooksError:
    return bad_argument(
        name,
        "one thread at a time on these hooks (attach one model per thread, or serialise the calls)",
        f"{what} from thread {threading.get_ident()} while another thread has a micro_batch open or a forward in flight",
    )
