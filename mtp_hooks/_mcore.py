"""Everything that depends on which megatron-core release is installed.

Decisions are made by feature detection (signatures and attributes), never by version strings.
Where stock mcore computes its own MTP loss, and how the hooks keep it off:

* 0.14 - 0.15: inline in ``GPTModel._postprocess``, gated by ``self.mtp_process`` read *after*
  the MTP block ran (crashes on ``labels=None``). The training window (``state``), opened by the
  block's forward hook, sets ``mtp_process = False``, so the gate reads False and the
  concatenated block output goes to the output layer unsplit.
* 0.16: inline as well, gated by ``config.mtp_num_layers``: the window's config view, which reads
  ``mtp_num_layers = None``, turns it off.
* 0.17 - 0.18: ``process_mtp_loss``, gated by ``config.mtp_num_layers`` (the view).
* 0.19: ``process_mtp_loss`` derives labels from ``input_ids`` when ``labels`` is None and would
  train MTP on every forward; the same view keeps it off. ``HybridModel`` (0.18+) gates on
  ``config.mtp_num_layers is not None and self.mtp_process``: both apply.

Both switches are applied on every version; each is a no-op where the gate it targets is absent.
``check_call_conventions`` checks at ``attach`` the keyword names the hooks rely on.
The normalisation of the MTP loss follows the installed version (``depth_coefficient``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import Tensor, nn

from mtp_hooks._quiet import megatron_notices_silenced

with megatron_notices_silenced():  # the first megatron-core import of most faces (export, integrations)
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as _mtp

from mtp_hooks.errors import MTPHooksError

MTPLossAutoScaler = _mtp.MTPLossAutoScaler
MTPLossLoggingHelper = _mtp.MTPLossLoggingHelper

_ROLL_PARAMETERS = frozenset(inspect.signature(_mtp.roll_tensor).parameters)
# 0.16.1+: ``roll_tensor(..., packed_seq_params=)`` rolls inside each packed (THD) sequence; before
# that the MTP layers themselves assert that no packed sequences come in.
ROLLS_PACKED_SEQUENCES: bool = "packed_seq_params" in _ROLL_PARAMETERS

# 0.17.1+ moved the MTP loss into ``process_mtp_loss``; with it came the ``clamp(min=1)`` divisor
# and the per-token rescaling by original / rolled token counts.
_PROCESS_MTP_LOSS = getattr(_mtp, "process_mtp_loss", None)
PER_TOKEN_LOSS_RESCALED: bool = _PROCESS_MTP_LOSS is not None

# 0.19.2+: ``process_mtp_loss(..., input_ids=)`` derives labels when it gets none.
DERIVES_LABELS_FROM_INPUT_IDS: bool = _PROCESS_MTP_LOSS is not None and "input_ids" in inspect.signature(
    _PROCESS_MTP_LOSS
).parameters


# 0.19.2+: the tracker also counts, per depth, the masked positions whose argmax is the label.
TRACKS_ACCEPTANCE_COUNTS: bool = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")


def track_depth(depth_index: int, depth: int, ce_sum: Tensor, tokens: Tensor, correct: Tensor) -> None:
    """Record one depth of a training forward in mcore's ``MTPLossLoggingHelper``, as stock does.

    The value is the depth's masked mean CE (0 for a depth without tokens, as 0.17.1+ stock; 0.14 -
    0.16 stock records 0/0 = NaN there), averaged by Megatron's ``track_mtp_metrics`` over the
    data-parallel x context-parallel group, the group stock gives. 0.19.2+ also records the
    correct and total counts of its acceptance metrics. No host sync.
    """
    loss = ce_sum.detach() * (tokens > 0) / tokens.clamp(min=1)
    _fit_tracker(depth)
    avg_group = None
    if parallel_state.model_parallel_is_initialized():
        avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if TRACKS_ACCEPTANCE_COUNTS:
        MTPLossLoggingHelper.save_metrics_to_tracker(
            loss, correct.detach().float(), tokens.detach().float(), depth_index, depth, avg_group=avg_group
        )
    else:
        MTPLossLoggingHelper.save_loss_to_tracker(loss, depth_index, depth, avg_group=avg_group)


class TrackerGrowth:
    """Undoes what a chain of more draft steps than the model's depths did to mcore's process-wide
    tracker (``_fit_tracker`` grows it): ``note`` before the chain first records, ``undo`` at
    ``remove`` cuts the per-depth tensors back to the length they had, or drops them where there
    was no tracker (stock then makes them at its own depth). What the chain's later steps recorded
    and nobody read yet goes with them."""

    def __init__(self) -> None:
        self._noted = False
        self._length: Optional[int] = None

    def note(self) -> None:
        if not self._noted:
            self._noted, self._length = True, _tracker_length()

    def undo(self) -> None:
        if not self._noted:
            return
        self._noted = False
        tracker = MTPLossLoggingHelper.tracker
        for key, value in list(tracker.items()):
            if isinstance(value, Tensor) and value.dim() == 1 and (
                self._length is None or value.shape[0] > self._length
            ):
                if self._length is None:
                    del tracker[key]
                else:
                    tracker[key] = value[: self._length].clone()


def _tracker_length() -> Optional[int]:
    lengths = [v.shape[0] for v in MTPLossLoggingHelper.tracker.values() if isinstance(v, Tensor) and v.dim() == 1]
    return max(lengths) if lengths else None


def _fit_tracker(depth: int) -> None:
    """Grow the tracker's per-depth tensors to ``depth`` entries (zeros added), for a chain of more
    draft steps than the depths a stock forward (or another model) recorded before."""
    tracker = MTPLossLoggingHelper.tracker
    for key, value in list(tracker.items()):
        if isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] < depth:
            tracker[key] = torch.cat([value, value.new_zeros(depth - value.shape[0])])


def check_call_conventions(model: nn.Module, layer_keywords: tuple[str, ...] = ()) -> None:
    """Refuse a release whose modules are called unlike the hooks expect, once at ``attach``.

    The hooks read and rewrite keyword arguments of three calls: the output layer's
    (``weight``, ``runtime_gather_output``, its input first), the MTP block's
    (``packed_seq_params``) and the MTP layers' ``layer_keywords`` (what an option rewrites there).
    A release that names them differently is refused here, not mid-forward.
    """
    expected: list[tuple[str, Any, tuple[str, ...]]] = []
    if getattr(model, "post_process", False):
        expected.append(("output layer", model.output_layer, ("weight", "runtime_gather_output")))
    if getattr(model, "mtp_process", False):
        expected.append(("MTP block", model.mtp, ("hidden_states", "packed_seq_params")))
        if layer_keywords:
            expected += [("MTP layer", layer, layer_keywords) for layer in model.mtp.layers]
    for what, module, names in expected:
        parameters = inspect.signature(type(module).forward).parameters
        missing = [name for name in names if name not in parameters]
        if missing:
            raise MTPHooksError(
                f"model: this megatron-core release calls the {what} differently\n"
                f"  expected: {type(module).__name__}.forward taking {', '.join(names)}\n"
                f"  received: a forward without {', '.join(missing)}; use a supported release (0.14 - 0.19)"
            )


def depth_coefficient(
    depth_scale: float, per_token: bool, original_tokens: Tensor, rolled_tokens: Tensor, rescale: Optional[bool] = None
) -> Any:
    """The factor stock mcore puts on one depth's ``sum(mask_k * CE_k)``.

    * not per-token (every version): ``depth_scale / tokens_k``. 0.14 - 0.16 divide unclamped (a
      depth without targets gives 0/0 = NaN there); 0.17.1+ clamp at 1, as done here everywhere.
    * ``calculate_per_token_loss`` on 0.14 - 0.16: ``depth_scale`` (the sum goes to
      ``finalize_model_grads``, which divides by the main loss's token count).
    * ``calculate_per_token_loss`` on 0.17.1+: ``depth_scale * original / clamp(tokens_k, 1)``,
      where ``original`` counts the unrolled mask, so a depth weighs like the main loss per token.

    ``rescale`` (the ``per_token_rescale`` option) picks one of the two per-token rules on any
    release; ``None`` follows the installed one.
    """
    return scale_depth_loss(None, depth_scale, per_token, original_tokens, rolled_tokens, rescale)


def scale_depth_loss(
    loss: Optional[Tensor], depth_scale: float, per_token: bool, original_tokens: Tensor, rolled_tokens: Tensor,
    rescale: Optional[bool] = None,
) -> Any:
    """``loss`` (one depth's masked per-token CE) scaled by ``depth_coefficient``'s rule with
    stock's own sequence of operations, so its gradient is stock's to the bit; ``loss=None``
    gives the coefficient itself."""
    if not per_token:
        return depth_scale / rolled_tokens.clamp(min=1) if loss is None else (
            depth_scale * loss / rolled_tokens.clamp(min=1)
        )
    if PER_TOKEN_LOSS_RESCALED if rescale is None else rescale:
        ratio = original_tokens / rolled_tokens.clamp(min=1)
        return depth_scale * ratio if loss is None else depth_scale * loss * ratio
    return depth_scale if loss is None else depth_scale * loss


# 0.16 - 0.17: ``MultiTokenPredictionLayer._checkpointed_forward(forward_func, *args, **kwargs)`` hands
# every argument to ``save_for_backward``, which refuses the ``PackedSeqParams`` of a packed (THD)
# batch under full activation recompute (TypeError); 0.18+ keep non-tensors out of the checkpoint.
_CHECKPOINTED = list(inspect.signature(_mtp.MultiTokenPredictionLayer._checkpointed_forward).parameters)
RECOMPUTE_SAVES_PACKED_SEQ_PARAMS: bool = ROLLS_PACKED_SEQUENCES and _CHECKPOINTED[1:2] == ["forward_func"]


def recompute_breaks_packed(config: Any) -> bool:
    """Whether stock MTP layers would crash on a packed batch under this config's full recompute."""
    return RECOMPUTE_SAVES_PACKED_SEQ_PARAMS and getattr(config, "recompute_granularity", None) == "full"


def config_detaches_heads(config: Any) -> bool:
    """``config.mtp_detach_heads`` (0.19+): stock MTP logits then use a detached output weight."""
    return bool(getattr(config, "mtp_detach_heads", False))


def unsupported_config(config: Any) -> Optional[str]:
    """Why the hooks cannot reproduce stock MTP on this config, or ``None``.

    ``use_mup`` (0.17.1+): stock scales MTP logits with the model's MuP output multiplier before
    its CE; the lean loss has no logits to scale.
    """
    if getattr(config, "use_mup", False):
        return "config.use_mup=True (MuP scales MTP logits before the loss); use a config without MuP"
    return None


def roll_left(
    tensor: torch.Tensor,
    cp_group: Optional[torch.distributed.ProcessGroup],
    packed_seq_params: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll ``tensor`` one step left along its last dim with mcore's ``roll_tensor``.

    CP boundary exchange and packed-sequence boundaries follow mcore. Returns (rolled, sum).
    """
    kwargs: dict[str, Any] = {}
    if "cp_group" in _ROLL_PARAMETERS:
        kwargs["cp_group"] = cp_group
    if packed_seq_params is not None:
        if "packed_seq_params" not in _ROLL_PARAMETERS:
            raise MTPHooksError(
                "packed_seq_params: packed sequences (THD) with MTP need megatron-core >= 0.16.1, whose roll_tensor "
                "respects sequence boundaries (earlier releases assert THD out for MTP); use unpacked [b, s] batches"
            )
        kwargs["packed_seq_params"] = packed_seq_params
    return _mtp.roll_tensor(tensor, shifts=-1, dims=-1, **kwargs)


def tp_group_of(layer: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The tensor-parallel group of an mcore parallel linear layer."""
    group = getattr(layer, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def cp_group_of(model: nn.Module, packed_seq_params: Any = None) -> Optional[torch.distributed.ProcessGroup]:
    """The context-parallel group a language model rolls its MTP targets with: the micro-batch's
    own (``packed_seq_params.cp_group``, dynamic context parallelism) when it has one, else the model's."""
    group = getattr(packed_seq_params, "cp_group", None)
    if group is not None:
        return group
    group = getattr(model, "cp_group", None)
    if group is None:
        pg_collection = getattr(model, "pg_collection", None)
        group = getattr(pg_collection, "cp", None)
    return group



# The transformer layer inside an MTP layer: ``transformer_layer`` up to 0.16.1, ``mtp_model_layer``
# from 0.17.1 (where it may also be a hybrid stack). Feature-detected on the layer instance.
MTP_LAYER_BODY_NAMES = ("mtp_model_layer", "transformer_layer")


def mtp_layer_body_name(layer: nn.Module) -> str:
    """The attribute under which ``layer`` (a ``MultiTokenPredictionLayer``) holds its transformer layer."""
    for name in MTP_LAYER_BODY_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise MTPHooksError(
        "model: an MTP layer without a transformer layer this release names\n"
        f"  expected: a MultiTokenPredictionLayer with one of {', '.join(MTP_LAYER_BODY_NAMES)}\n"
        f"  received: a {type(layer).__name__} without them"
    )


def expert_parallel_group_of(experts: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The expert-parallel group of an MoE experts module (``SequentialMLP``, ``TEGroupedMLP``): its own
    ``ep_group`` (0.14+), else mcore's global one."""
    group = getattr(experts, "ep_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_expert_model_parallel_group()
    return group


def expert_tp_group_of(linear: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The tensor-parallel group of an expert's linear layer: the expert-TP group, which mcore
    passes to every expert linear; mcore's global one where the layer does not hold it."""
    group = getattr(linear, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_expert_tensor_parallel_group()
    return group


def pipeline_group_of(model: nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The pipeline-parallel group of a language model (``pg_collection.pp`` where it has one)."""
    group = getattr(getattr(model, "pg_collection", None), "pp", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_pipeline_model_parallel_group()
    return group
