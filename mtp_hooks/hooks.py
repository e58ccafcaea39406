"""Attach MTP training to an mcore language model with torch hooks and wrapt proxies.

No class or instance method is replaced. Per forward of the language model:

* a forward pre-hook takes ``labels`` / ``loss_mask`` out of the call (or from the open
  ``micro_batch``), so mcore returns logits, and installs a ``ConfigView`` on the model so mcore's
  own MTP loss stays off. For an inference micro-batch it also sets ``mtp_process = False``, so
  the MTP block does not run at all;
* a forward hook on the MTP block switches off the stock MTP loss of releases whose post-processing
  gates it on ``mtp_process`` after the block ran (see ``_mcore``);
* a forward pre-hook on ``output_layer`` receives the MTP block's concatenated output
  ``[(1+N)s, b, h]``, computes each depth's loss on its chunk, attaches the losses to chunk 0 with
  mcore's ``MTPLossAutoScaler`` and hands chunk 0 on, so the main logits are mcore's own;
* with ``detach_encoder``, a pre-hook on each MTP layer swaps its ``embedding`` for a
  ``DetachedEmbedding`` proxy and detaches the depth-0 trunk hidden states;
* an ``always_call`` forward hook restores every swapped attribute, also when forward raises.

Parallel layouts (mcore's own groups and rolls; nothing to configure):

* TP / SP: returned logits stay vocab-parallel ``[b, s, V/tp]`` (full ``V`` with
  ``runtime_gather_output=True``); the MTP head's CE, argmax acceptance and metrics reduce over
  the TP group, and with sequence parallelism the head input is gathered along the sequence
  first, as ``ColumnParallelLinear`` does.
* CP: ``labels`` / ``loss_mask`` are the rank's part of mcore's load-balanced split and MTP
  targets roll across CP ranks (``mtp_targets``). As in stock mcore 0.16.1, each depth is
  normalised by the masked-token count of *this* CP rank, not of the whole sequence; with
  ``config.calculate_per_token_loss`` nothing is normalised per rank, so the CP ranks' losses
  and gradients add up to the whole sequence's.
* Packed THD (``packed_seq_params``): targets stay inside each sequence. When
  ``cu_seqlens_q_padded`` differs from ``cu_seqlens_q``, a pre-hook on the MTP block hands it
  the padded layout as ``cu_seqlens_q`` (``targets.packed_layout``), because mcore shifts the
  MTP layers' input ids by ``cu_seqlens_q`` and would otherwise shift across sequences.
* Pipeline (and virtual pipeline): attach to every model chunk; labels are only read on the
  chunk with the output layer, which must also hold the MTP layers (mcore's default placement).
  On a later stage with tied embeddings, an inference forward keeps the word-embedding copy as
  the output weight although ``mtp_process`` is off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
import weakref
from typing import Any, Iterator, Literal, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.logprobs import TokenLogProbs, lean_logprobs
from mtp_hooks.loss import OBJECTIVES, argmax_matches, lean_mtp_loss
from mtp_hooks.metrics import MTPMetrics
from mtp_hooks.proxies import ConfigView, DetachedEmbedding
from mtp_hooks.targets import align_with_depths, mtp_targets, packed_layout

LossImpl = Literal["lean", "dense"]
Objective = Literal["ce", "distill", "tv"]
Output = Literal["logits", "logprobs"]
_STATE_KEY = "_mtp_hooks"
_LOGITS_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass
class _MicroBatch:
    """Targets of one training micro-batch, as the user gave them."""

    labels: Tensor
    loss_mask: Optional[Tensor]
    used: bool = False
    thread: int = dataclasses.field(default_factory=threading.get_ident)  # the thread that opened it


@dataclasses.dataclass
class _Forward:
    """State of the forward in flight; lives from the model's pre-hook to its post-hook."""

    targets: Optional[_MicroBatch]
    packed_seq_params: Any
    restore: list[tuple[nn.Module, str, Any]]
    mtp_layer_calls: int = 0
    attached: bool = False
    in_own_head_call: bool = False
    # Metrics of this forward, added to the running sums only once the forward has completed.
    metrics: list[tuple[int, Tensor, Tensor, Tensor]] = dataclasses.field(default_factory=list)
    # Set when switching ``mtp_process`` off changed ``shared_embedding_or_output_weight()``.
    output_weight: Optional[Tensor] = None
    # ``output="logprobs"``: the labels the main head is scored on, and what the forward returns.
    head_labels: Optional[Tensor] = None
    head_output: Optional[TokenLogProbs] = None

    @property
    def train(self) -> bool:
        return self.targets is not None


def _validate_targets(labels: Any, loss_mask: Any) -> _MicroBatch:
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise bad_argument("labels", "a [b, s] integer tensor", describe(labels))
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise bad_argument("labels", "an integer dtype (token ids)", describe(labels))
    if loss_mask is not None:
        if not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape:
            raise bad_argument("loss_mask", f"None or a tensor shaped like labels {tuple(labels.shape)}", describe(loss_mask))
        if loss_mask.dtype != torch.bool and not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
            raise bad_argument("loss_mask", "values in {0, 1}", f"{describe(loss_mask)} with other values")
    return _MicroBatch(labels, loss_mask)


def _check_label_range(targets: _MicroBatch, vocab_size: int) -> None:
    """Refuse a label outside ``[0, vocab_size)`` where the mask counts it (one device sync):
    mcore's CE would silently treat it as a zero logit."""
    labels = targets.labels
    outside = (labels < 0) | (labels >= vocab_size)
    if targets.loss_mask is not None:
        outside &= targets.loss_mask != 0
    if bool(outside.any()):
        raise bad_argument("labels", f"token ids in [0, {vocab_size}) where loss_mask is 1", "ids outside the vocabulary")


def _find_language_model(model: nn.Module) -> nn.Module:
    """The mcore language model inside ``model`` (itself, ``.module`` chains, ``.language_model``)."""
    current: Any = model
    for _ in range(16):
        if isinstance(current, LanguageModule) and hasattr(current, "mtp_process"):
            return current
        current = getattr(current, "module", None) or getattr(current, "language_model", None)
        if current is None:
            break
    raise bad_argument(
        "model",
        "an mcore GPTModel, a wrapper exposing one as .module (DDP, Float16Module), or a model with .language_model",
        type(model).__name__,
    )


def _auto_chunk_size(vocab_shard: int, tokens: int) -> int:
    """Tokens per lean chunk: a power of two keeping one chunk's fp32 logits near 256 MiB and at
    most about an eighth of all the logits (at least 16 tokens)."""
    budget = _LOGITS_CHUNK_BYTES // (4 * max(vocab_shard, 1))
    cap = 2 ** math.ceil(math.log2(max(-(-tokens // 8), 1)))
    return max(16, min(2 ** int(math.log2(max(budget, 1))), cap))


class MTPHooks:
    """Handle and state of ``mtp_hooks`` on one language model. Create it with ``attach``.

    Use ``micro_batch`` to give the labels of a training micro-batch, ``metrics`` to read the
    per-depth MTP loss and acceptance, and ``remove`` (or ``with``) to restore stock mcore.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        detach_encoder: bool,
        detach_head: bool,
        loss_scale: Optional[float],
        loss_impl: LossImpl,
        chunk_size: Optional[int],
        objective: Objective = "ce",
        agreement_metrics: bool = False,
        output: Output = "logits",
        entropy: bool = False,
        temperature: float = 1.0,
    ) -> None:
        self._model_ref = weakref.ref(model)
        self.objective = objective
        self.agreement_metrics = agreement_metrics or objective != "ce"
        self.output = output
        self.entropy = entropy
        self.temperature = temperature
        self.detach_encoder = detach_encoder
        self.detach_head = detach_head
        self.loss_impl = loss_impl
        self.chunk_size = chunk_size
        self._loss_scale = loss_scale
        self.depth: int = model.config.mtp_num_layers
        self._metrics = MTPMetrics(self.depth)
        self._pending: Optional[_MicroBatch] = None
        self._forward: Optional[_Forward] = None
        self._calls = 0
        self._thread: Optional[int] = None  # the thread whose forward is in flight while _calls > 0
        self._handles: list[RemovableHandle] = []
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]
        self._positions = {name: i for i, name in enumerate(parameters)}

    # ----------------------------------------------------------------- public API
    @property
    def model(self) -> nn.Module:
        """The language model the hooks sit on."""
        model = self._model_ref()
        if model is None:
            raise MTPHooksError("the model these hooks were attached to no longer exists")
        return model

    @property
    def loss_scale(self) -> float:
        """Total MTP loss weight (split evenly over depths), as used by the next forward."""
        scale = self._loss_scale
        return self.model.config.mtp_loss_scaling_factor if scale is None else scale

    @contextlib.contextmanager
    def micro_batch(self, labels: Tensor, loss_mask: Optional[Tensor] = None) -> Iterator["MTPHooks"]:
        """Make the next forward a training micro-batch with these ``[b, s]`` targets.

        ``labels`` are next-token labels (as for the main head), ``loss_mask`` is aligned with
        them. The forward trains MTP only if gradients are enabled; otherwise it is an inference
        micro-batch. One forward per ``micro_batch``: a second forward inside it raises.
        On exit (also by exception) the targets are dropped.

        One thread at a time: while a micro_batch is open or a forward is in flight, a
        ``micro_batch`` or forward from another thread raises ``MTPHooksError`` (the hooks swap
        attributes of the shared model for the length of a forward).
        """
        if self._pending is not None and self._pending.thread != threading.get_ident():
            raise _other_thread("micro_batch", "a micro_batch")
        if self._pending is not None:
            raise bad_argument("micro_batch", "no micro_batch already open on these hooks", "a nested micro_batch")
        self._pending = _validate_targets(labels, loss_mask)
        try:
            yield self
        finally:
            self._pending = None

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Per-depth ``mtp_k/loss`` (masked mean CE), ``mtp_k/acc`` (share of masked positions whose
        argmax is the label) and ``mtp_k/tokens``, over the training forwards completed since the
        last reset (a forward that raised counts for nothing). Local to this rank (identical
        across TP ranks). Empty if nothing was trained."""
        return self._metrics.read(reset)

    def remove(self) -> None:
        """Remove every hook and restore every swapped attribute. Calling it twice is harmless."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._forward is not None:
            self._restore(self._forward)
            self._forward = None
        self._pending = None
        model = self._model_ref()
        if model is not None and model.__dict__.get(_STATE_KEY) is self:
            del model.__dict__[_STATE_KEY]

    def __enter__(self) -> "MTPHooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ---------------------------------------------------------------- installation
    def _install(self, model: nn.Module) -> None:
        self._handles.append(model.register_forward_pre_hook(self._on_model_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._on_model_post, with_kwargs=True, always_call=True))
        if model.post_process:
            self._handles.append(model.output_layer.register_forward_pre_hook(self._on_output_layer_pre, with_kwargs=True))
        if model.mtp_process:
            self._handles.append(model.mtp.register_forward_hook(self._on_mtp_block_post))
            self._handles.append(model.mtp.register_forward_pre_hook(self._on_mtp_block_pre, with_kwargs=True))
        if self.detach_encoder and model.mtp_process:
            for layer in model.mtp.layers:
                self._handles.append(layer.register_forward_pre_hook(self._on_mtp_layer_pre, with_kwargs=True))

    # ------------------------------------------------------------------- the hooks
    def _on_model_pre(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._calls > 0 and self._thread != threading.get_ident():
            raise _other_thread("model", "a forward")
        self._calls += 1
        self._thread = threading.get_ident()
        if self._calls > 1:
            raise MTPHooksError("model: a forward of this model started inside another forward of it; nested forwards are not supported")
        args, labels = self._take_argument(args, kwargs, "labels")
        args, loss_mask = self._take_argument(args, kwargs, "loss_mask")
        targets = self._targets_for_call(labels, loss_mask)
        input_ids = self._argument(args, kwargs, "input_ids")
        if targets is not None and isinstance(input_ids, Tensor) and targets.labels.shape != input_ids.shape:
            raise bad_argument("labels", f"shape of input_ids {tuple(input_ids.shape)}", describe(targets.labels))
        train = targets is not None and torch.is_grad_enabled() and model.post_process
        if train and self._argument(args, kwargs, "output_processor") is not None:
            # mcore 0.18+: the processor replaces the output layer call the MTP loss hangs on.
            raise bad_argument("output_processor", "None in a training micro-batch (mtp_hooks needs the output layer call)", "a processor")
        state = _Forward(
            targets=targets if train else None,
            packed_seq_params=self._argument(args, kwargs, "packed_seq_params"),
            restore=[(model, "config", model.config)],
        )
        vocab_size = getattr(model, "vocab_size", None)
        if vocab_size is not None and (state.train or (self.output == "logprobs" and targets is not None)):
            _check_label_range(targets, vocab_size)
        if self.output == "logprobs" and model.post_process:
            if targets is None:
                raise bad_argument("labels", "labels for every forward with output='logprobs' (the main head scores them)", None)
            state.head_labels = targets.labels
        if not train and model.mtp_process:
            tied = model.post_process and getattr(model, "share_embeddings_and_output_weights", False)
            weight = model.shared_embedding_or_output_weight() if tied else None
            state.restore.append((model, "mtp_process", model.mtp_process))
            model.mtp_process = False
            if tied and model.shared_embedding_or_output_weight() is not weight:
                # A later pipeline stage with tied embeddings keeps a copy of the word embeddings
                # for MTP and serves it as the output weight only while ``mtp_process`` is set;
                # without it mcore would hand its untrained ``output_layer.weight`` to the head.
                state.output_weight = weight
        model.config = ConfigView(model.config)
        self._forward = state
        return args, kwargs

    def _on_model_post(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._calls == 0 or self._thread != threading.get_ident():
            return None  # this call's pre-hook never ran: refused above, or an earlier pre-hook raised
        self._calls -= 1
        if self._calls > 0:
            return None
        state, self._forward = self._forward, None
        if state is None:
            return None
        self._restore(state)
        if output is not None and state.train and not state.attached:
            raise AssertionError(
                "mtp_hooks: a training micro-batch finished without MTP losses; the output layer never "
                "received the MTP block's output (a path that bypasses module hooks?)"
            )
        if output is None:  # forward raised, and its micro-batch counts for nothing
            return None
        for entry in state.metrics:
            self._metrics.add(*entry)
        return state.head_output

    def _on_output_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
        state = self._forward
        if state is None or state.in_own_head_call:
            return None
        if state.output_weight is not None:  # inference forward, see ``_on_model_pre``
            kwargs["weight"] = state.output_weight
        weight = kwargs.get("weight")
        if weight is None:
            weight = layer.weight
        hidden = args[0]
        if state.train and not state.attached:
            chunks = torch.chunk(hidden, 1 + self.depth, dim=0)
            if len(chunks) != 1 + self.depth or chunks[-1].shape != chunks[0].shape:
                raise AssertionError(
                    f"mtp_hooks: output layer input {tuple(hidden.shape)} does not split into 1 + {self.depth} equal chunks"
                )
            detach = self.detach_head or _mcore.config_detaches_heads(self.model.config)
            hidden = self._attach_mtp_losses(layer, chunks, weight.detach() if detach else weight, state)
            state.attached = True
        elif state.head_labels is None:
            return (args, kwargs) if state.output_weight is not None else None
        if state.head_labels is not None and state.head_output is None:
            state.head_output = self._head_logprobs(layer, hidden, weight, state.head_labels)
            hidden = hidden[:1]  # mcore's own head call still runs, on one position; its logits are dropped
        return (hidden, *args[1:]), kwargs

    def _on_mtp_block_pre(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Give the MTP layers the padded layout of a packed batch, so their shifted input ids stay
        within each sequence (mcore rolls them by ``cu_seqlens_q``; see ``targets.packed_layout``)."""
        packed = kwargs.get("packed_seq_params")
        if self._forward is None or packed is None:
            return None
        layout = packed_layout(packed)
        if layout is packed:
            return None
        kwargs["packed_seq_params"] = layout
        return args, kwargs

    def _on_mtp_block_post(self, block: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self._forward
        if state is not None and state.train:
            _mcore.stock_mtp_loss_off_after_block(self.model, state.restore)
        return None

    def _on_mtp_layer_pre(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
        state = self._forward
        if state is None or not state.train:
            return None
        if "embedding" in kwargs and kwargs["embedding"] is not None:
            kwargs["embedding"] = DetachedEmbedding(kwargs["embedding"])
        if state.mtp_layer_calls == 0:
            # Depth 0 only: the block's own chunk 0 (the main head's input) stays attached.
            kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_(True)
        state.mtp_layer_calls += 1
        return args, kwargs

    # ---------------------------------------------------------------- loss wiring
    def _attach_mtp_losses(self, layer: nn.Module, chunks: tuple[Tensor, ...], weight: Tensor, state: _Forward) -> Tensor:
        model = self.model
        assert state.targets is not None
        depth_scale = self.loss_scale / self.depth
        per_token = bool(getattr(model.config, "calculate_per_token_loss", False))
        targets = mtp_targets(
            state.targets.labels,
            state.targets.loss_mask,
            self.depth,
            packed_seq_params=state.packed_seq_params,
            cp_group=_mcore.cp_group_of(model),
        )
        loss_mask = state.targets.loss_mask
        original_tokens = state.targets.labels.new_tensor(state.targets.labels.numel()) if loss_mask is None else loss_mask.sum()
        teachers: list[Optional[Tensor]] = [None] * self.depth
        if self.agreement_metrics:
            teachers = list(self._main_head_inputs(layer, chunks[0], state))
        main = chunks[0]
        for k, (chunk, (labels_k, mask_k), teacher) in enumerate(zip(chunks[1:], targets, teachers)):
            tokens = mask_k.sum()
            coef = _mcore.depth_coefficient(depth_scale, per_token, original_tokens, tokens)
            objective, *sums = self._depth_loss(layer, chunk, weight, labels_k, mask_k, coef, state, teacher)
            main = _mcore.MTPLossAutoScaler.apply(main, objective)
            state.metrics.append((k, sums[0], tokens, *sums[1:]))
        return main

    def _main_head_inputs(self, layer: nn.Module, main: Tensor, state: _Forward) -> list[Tensor]:
        """Per depth k, the main head's (detached, SP-gathered) input at position t + k, for the
        draft objectives and agreement metrics (``targets.align_with_depths``)."""
        with torch.no_grad():
            if getattr(layer, "sequence_parallel", False):
                main = gather_from_sequence_parallel_region(main, group=_mcore.tp_group_of(layer))
            return align_with_depths(
                main, self.depth, packed_seq_params=state.packed_seq_params, cp_group=_mcore.cp_group_of(self.model)
            )

    def _head_logprobs(self, layer: nn.Module, hidden: Tensor, weight: Tensor, labels: Tensor) -> TokenLogProbs:
        """``output="logprobs"``: the main head's log-probs of ``labels`` (and entropy), ``[b, s]``."""
        tp_group = _mcore.tp_group_of(layer)
        full = self._head_input(layer, hidden, tp_group)
        s, b = full.shape[0], full.shape[1]
        out = lean_logprobs(
            full.reshape(s * b, -1),
            weight,
            labels.t().reshape(-1),
            tp_group,
            self.chunk_size or _auto_chunk_size(weight.shape[0], s * b),
            self.temperature,
            self.entropy,
        )
        as_bs = lambda t: t.view(s, b).t()  # noqa: E731
        return TokenLogProbs(as_bs(out.logprobs), None if out.entropy is None else as_bs(out.entropy))

    def _depth_loss(
        self,
        layer: nn.Module,
        chunk: Tensor,
        weight: Tensor,
        labels: Tensor,
        mask: Tensor,
        coef: Any,
        state: _Forward,
        teacher: Optional[Tensor] = None,
    ) -> tuple[Tensor, ...]:
        """(objective carrying grad, detached masked CE sum, masked correct count[, masked argmax
        agreements, masked expected acceptance with a ``teacher``]) of one depth."""
        tp_group = _mcore.tp_group_of(layer)
        labels_sb, mask_sb = labels.t(), mask.t()  # [s, b], like the hidden states
        if self.loss_impl == "dense":
            state.in_own_head_call = True
            try:
                logits, _bias = layer(chunk, weight=weight, runtime_gather_output=False)
            finally:
                state.in_own_head_call = False
            correct = argmax_matches(logits, labels_sb, tp_group)  # before mcore's CE, which may write into logits
            ce = self.model.compute_language_model_loss(labels, logits).t()
            objective = (ce * mask_sb).sum() * coef
            return objective, (ce.detach() * mask_sb).sum(), (correct * mask_sb).sum()
        hidden = self._head_input(layer, chunk, tp_group)
        chunk_size = self.chunk_size or _auto_chunk_size(weight.shape[0], hidden.shape[0] * hidden.shape[1])
        mask_flat = mask_sb.reshape(-1)
        out = lean_mtp_loss(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels_sb.reshape(-1),
            mask_flat * coef,
            tp_group,
            chunk_size,
            self.objective,
            None if teacher is None else teacher.reshape(-1, teacher.shape[-1]),
        )
        sums = [out.objective, (out.ce * mask_flat).sum(), (out.correct * mask_flat).sum()]
        if out.agree is not None and out.accept is not None:
            sums += [(out.agree * mask_flat).sum(), (out.accept * mask_flat).sum()]
        return tuple(sums)

    @staticmethod
    def _head_input(layer: nn.Module, hidden: Tensor, tp_group: Any) -> Tensor:
        """What ``ColumnParallelLinear`` multiplies: SP-gathered or copied into the TP region."""
        if getattr(layer, "sequence_parallel", False):
            return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
        if _mcore.group_size(tp_group) > 1:
            return copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        return hidden

    # --------------------------------------------------------------- call plumbing
    def _targets_for_call(self, labels: Any, loss_mask: Any) -> Optional[_MicroBatch]:
        pending = self._pending
        if pending is not None and pending.thread != threading.get_ident():
            raise _other_thread("model", "a forward")
        if labels is None and loss_mask is None:
            if pending is None:
                return None
            if pending.used:
                raise bad_argument(
                    "micro_batch", "one forward per micro_batch", "a second forward inside the same micro_batch"
                )
            pending.used = True
            return pending
        if pending is not None:
            raise bad_argument(
                "labels", "labels either in micro_batch(...) or as model(..., labels=...), not both", "both"
            )
        if labels is None:
            raise bad_argument("labels", "a [b, s] integer tensor when loss_mask is given", None)
        return _validate_targets(labels, loss_mask)

    def _argument(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        position = self._positions.get(name)
        if position is not None and position < len(args):
            return args[position]
        return kwargs.get(name)

    def _take_argument(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[tuple[Any, ...], Any]:
        """Read ``name`` from the call and set it to ``None`` in the same slot."""
        position = self._positions.get(name)
        if position is not None and position < len(args):
            value = args[position]
            return (*args[:position], None, *args[position + 1 :]), value
        value = kwargs.get(name)
        if name in kwargs:
            kwargs[name] = None
        return args, value

    @staticmethod
    def _restore(state: _Forward) -> None:
        for module, name, value in reversed(state.restore):
            setattr(module, name, value)
        state.restore.clear()


def _other_thread(name: str, what: str) -> MTPHooksError:
    return bad_argument(
        name,
        "one thread at a time on these hooks (attach one model per thread, or serialise the calls)",
        f"{what} from thread {threading.get_ident()} while another thread has a micro_batch open or a forward in flight",
    )


def attach(
    model: nn.Module,
    *,
    detach_encoder: bool = False,
    detach_head: bool = False,
    loss_scale: Optional[float] = None,
    loss_impl: LossImpl = "lean",
    chunk_size: Optional[int] = None,
    objective: Objective = "ce",
    agreement_metrics: bool = False,
    output: Output = "logits",
    entropy: bool = False,
    temperature: float = 1.0,
) -> MTPHooks:
    """Make an mcore model with MTP layers return main-head logits while its MTP layers train.

    Hooks and proxies only: no method of any class or instance is replaced, and ``remove()``
    leaves the model exactly as stock.

    Args:
        model: a ``GPTModel``, a wrapper exposing it as ``.module`` (DDP, Float16Module), or a
            model whose ``.language_model`` is one. Its config must have ``mtp_num_layers``.
        detach_encoder: MTP layers get detached next-token embeddings and detached trunk hidden
            states, so the MTP loss sends no gradient into the decoder or the embedding.
        detach_head: MTP logits use a detached output weight (tied or untied).
        loss_scale: total MTP loss weight, split evenly over depths; ``None`` reads
            ``config.mtp_loss_scaling_factor`` at every forward.
        loss_impl: ``"lean"`` (default) never keeps MTP logits for backward; ``"dense"``
            computes them with the output layer, as stock mcore does.
        chunk_size: tokens per chunk of the lean loss and log-probs; ``None`` keeps a chunk's
            fp32 logits under about 256 MiB and an eighth of all the logits.
        objective: what the MTP heads learn (lean only). ``"ce"``: stock cross-entropy on the
            labels. ``"distill"``: cross-entropy against the main head's detached distribution at
            the position predicting the same token. ``"tv"``: total variation to that
            distribution, i.e. 1 - expected speculative-sampling acceptance.
        agreement_metrics: also report per depth ``mtp_k/agree`` (MTP argmax equals the main
            head's at the matching position) and ``mtp_k/accept`` (``sum_v min(p_main, q_mtp)``);
            costs one more head matmul per depth in forward (lean only; implied by
            ``"distill"`` / ``"tv"``).
        output: ``"logits"`` (mcore's own ``[b, s, V/tp]``) or ``"logprobs"``: a
            ``TokenLogProbs(logprobs, entropy)`` of ``[b, s]`` tensors, the main head's
            log-probabilities of the labels computed in chunks without ``[b, s, V]`` logits;
            every forward then needs labels (training or not).
        entropy: with ``output="logprobs"``, also return the per-token entropy.
        temperature: with ``output="logprobs"``, divide the main head's logits by it.

    Returns:
        An ``MTPHooks`` handle (also a context manager that removes the hooks on exit).

    Raises:
        MTPHooksError: for a model without MTP layers, a second attach, or bad arguments.

    Example::

        hooks = mtp_hooks.attach(model, detach_encoder=True)
        with hooks.micro_batch(labels=labels, loss_mask=loss_mask):
            logits = model(input_ids, position_ids, attention_mask)   # [b, s, V/tp]

    If a forward raises, every swapped attribute is restored by an ``always_call`` hook, the
    targets of that forward are dropped and its metrics are not counted.

    One thread at a time per model: a ``micro_batch`` or forward from a second thread while one
    is open or in flight raises ``MTPHooksError``. Separate models may run in separate threads.
    """
    language_model = _find_language_model(model)
    config = language_model.config
    if not getattr(config, "mtp_num_layers", None):
        raise bad_argument("model", "a model with MTP layers (config.mtp_num_layers >= 1)", f"mtp_num_layers={config.mtp_num_layers!r}")
    unsupported = _mcore.unsupported_config(config)
    if unsupported is not None:
        raise MTPHooksError(f"model: mtp_hooks cannot reproduce stock MTP with {unsupported}")
    if _STATE_KEY in language_model.__dict__:
        raise bad_argument(
            "model",
            "a model without mtp_hooks attached (remove() the first hooks before attaching again)",
            f"a {type(language_model).__name__} with mtp_hooks already attached",
        )
    if bool(language_model.post_process) != bool(language_model.mtp_process):
        # A custom pipeline_model_parallel_layout can put the MTP layers on an earlier stage
        # ("mtp_standalone"): their output then travels to the output layer's stage over p2p.
        raise MTPHooksError(
            "model: the MTP layers sit on another pipeline stage than the output layer (custom pipeline layout); "
            "mtp_hooks needs them on the same stage, the last one (the default without a layout)"
        )
    for name, value in (("detach_encoder", detach_encoder), ("detach_head", detach_head)):
        if not isinstance(value, bool):
            raise bad_argument(name, "a bool", describe(value))
    if loss_scale is None and config.mtp_loss_scaling_factor is None:
        raise bad_argument("loss_scale", "a float, since config.mtp_loss_scaling_factor is None", None)
    if loss_scale is not None and (isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale >= 0):
        raise bad_argument("loss_scale", "None or a float >= 0", describe(loss_scale))
    if loss_impl not in ("lean", "dense"):
        raise bad_argument("loss_impl", "'lean' or 'dense'", describe(loss_impl))
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise bad_argument("chunk_size", "None or an int >= 1", describe(chunk_size))
    if objective not in OBJECTIVES:
        raise bad_argument("objective", f"one of {OBJECTIVES}", describe(objective))
    for name, value in (("agreement_metrics", agreement_metrics), ("entropy", entropy)):
        if not isinstance(value, bool):
            raise bad_argument(name, "a bool", describe(value))
    if loss_impl == "dense" and (objective != "ce" or agreement_metrics):
        raise bad_argument(
            "loss_impl", "'lean' for objective 'distill' / 'tv' and for agreement_metrics (dense keeps stock's CE)", "'dense'"
        )
    if output not in ("logits", "logprobs"):
        raise bad_argument("output", "'logits' or 'logprobs'", describe(output))
    if entropy and output != "logprobs":
        raise bad_argument("entropy", "False unless output='logprobs'", True)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise bad_argument("temperature", "a float > 0", describe(temperature))
    if temperature != 1.0 and output != "logprobs":
        raise bad_argument("temperature", "1.0 unless output='logprobs' (logits are mcore's own)", describe(temperature))
    if language_model.post_process and getattr(language_model.output_layer, "bias", None) is not None:
        raise MTPHooksError("model: the output layer has a bias; mtp_hooks supports bias-free output layers (GPTModel's default)")
    hooks = MTPHooks(
        language_model,
        detach_encoder=detach_encoder,
        detach_head=detach_head,
        loss_scale=None if loss_scale is None else float(loss_scale),
        loss_impl=loss_impl,
        chunk_size=chunk_size,
        objective=objective,
        agreement_metrics=agreement_metrics,
        output=output,
        entropy=entropy,
        temperature=float(temperature),
    )
    hooks._install(language_model)
    language_model.__dict__[_STATE_KEY] = hooks
    return hooks


@contextlib.contextmanager
def attached(model: nn.Module, **options: Any) -> Iterator[MTPHooks]:
    """``attach`` for the length of a ``with`` block; the hooks are removed on exit."""
    hooks = attach(model, **options)
    try:
        yield hooks
    finally:
        hooks.remove()


def hooks_of(model: nn.Module) -> Optional[MTPHooks]:
    """The ``MTPHooks`` attached to ``model`` (or the language model inside it), or ``None``."""
    return _find_language_model(model).__dict__.get(_STATE_KEY)
