"""``output="logprobs"``: the model returns the main head's log-probs of the labels (and entropy),
``TokenLogProbs`` of ``[b, s]`` tensors, computed in chunks without ``[b, s, V]`` logits.

Every forward then needs labels, training or not (``begin``). On the main head's call the labels
are scored (``score``) and mcore's own call still runs, on one position: its logits are dropped,
and it gets its (zero) gradient through the log-probs (``on_head_post``), so that call has its
backward like any head call. Under ``defer_embedding_wgrad_compute`` mcore's layer buffered the
call's input, and the pipeline's drain pairs every buffered input with a buffered gradient; it
cannot run on none, so removing the input instead would leave the drain nothing to pair. The zero
adds exactly nothing to any gradient. The model's post-hook returns ``Scoring.output``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor

from mtp_hooks.errors import bad_argument
from mtp_hooks.head import Head
from mtp_hooks.ops.logprobs import TokenLogProbs, lean_logprobs, with_zero_gradient_to
from mtp_hooks.options import Options
from mtp_hooks.runtime.micro_batch import MicroBatch


@dataclasses.dataclass
class Scoring:
    """Per forward: the labels the main head scores, its log-probs, and mcore's own head call's
    input until that call returns."""

    labels: Tensor
    output: Optional[TokenLogProbs] = None
    head_call: Optional[Tensor] = None


def begin(targets: Optional[MicroBatch], pending: Optional[MicroBatch]) -> Scoring:
    """The forward's scoring (model pre-hook): its targets' labels; a block's (``pending``) are
    marked read, so the block does not warn that they trained nothing."""
    if targets is None:
        raise bad_argument(
            "labels", "labels for every forward with output='logprobs' (the main head scores them)", None
        )
    if targets is pending:
        targets.read = True
    return Scoring(targets.labels)


def score(options: Options, scoring: Scoring, head: Head, hidden: Tensor) -> Tensor:
    """The main head's call: score the labels; mcore's own call goes on with one position."""
    if scoring.output is not None:
        return hidden
    scoring.output = head_logprobs(options, head, hidden, scoring.labels)
    scoring.head_call = hidden[:1]
    return scoring.head_call


def on_head_post(scoring: Scoring, hidden: Tensor, output: Any) -> None:
    """mcore's own main-head call returned: the log-probs carry a zero gradient back to its logits."""
    if scoring.head_call is None or hidden is not scoring.head_call:
        return
    scoring.head_call = None
    if scoring.output is not None:
        scoring.output = with_zero_gradient_to(scoring.output, output[0])


def head_logprobs(options: Options, head: Head, hidden: Tensor, labels: Tensor) -> TokenLogProbs:
    """The main head's log-probs of ``labels`` (and entropy), ``[b, s]``, from its input ``hidden``
    ``[s(/tp), b, h]``, without calling the output layer (so a head whose call does more is refused)."""
    head.require_reproducible(
        "output", "output='logprobs' computes the log-probs", "use output='logits' (the default) to keep it"
    )
    full = head.input(hidden)
    s, b = full.shape[0], full.shape[1]
    out = lean_logprobs(
        full.reshape(s * b, -1),
        head.weight,
        labels.t().reshape(-1),
        head.tp_group,
        head.chunk(s * b),
        options.temperature,
        options.entropy,
        main_grad_protocol=head.main_grad_protocol,
    )

    def as_bs(tensor: Tensor) -> Tensor:
        return tensor.view(s, b).t()

    return TokenLogProbs(as_bs(out.logprobs), None if out.entropy is None else as_bs(out.entropy))
