"""The parity matrix's ``accept`` axis: the hooked twin's acceptance metrics against a dense reference
built from stock's own logits.

Test-only support for ``parity``. A value other than ``"off"`` attaches the hooked twin with
``agreement_metrics=True`` under an acceptance rule and draft temperature (``ACCEPT``); stock's
output-layer calls of the same forward (its N, or the chain's k, MTP heads, then the main head) are
captured and ``stock_acceptance`` computes, from them alone, what ``hooks.metrics()`` must report:
per depth k the masked means of argmax agreement and of the acceptance of depth k's draft at t by
the main head at t + k (``draft_references.acceptance``, full vocabulary: the TP shards gathered,
with CP the whole sequence gathered and this rank's positions kept), and ``mtp/accept_len``, the
per-position chain. The dense loss path keeps stock's CE and measures no acceptance, so the axis
never meets it (``FORBIDDEN_ACCEPT``: the covering sets leave those combinations out).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from mtp_hooks.testing import context_parallel_positions
from tests.support.draft_references import acceptance
from tests.support.stock_references import gather_vocab

# value -> (accept_rule, draft_temperature); "greedy": T = 0, where every rule is argmax agreement.
ACCEPT: dict[str, Optional[tuple[str, float]]] = {
    "off": None,
    "argmax": ("argmax", 0.7),
    "sampled": ("sampled", 1.3),
    "match": ("match", 0.7),
    "greedy": ("argmax", 0.0),
}
FORBIDDEN_ACCEPT = frozenset((("loss_impl", "dense"), ("accept", value)) for value in ACCEPT if value != "off")
KEYS = ("agree", "accept")


def accept_options(value: str) -> dict[str, Any]:
    """The ``attach`` options of the axis value."""
    rule = ACCEPT[value]
    return {} if rule is None else {"agreement_metrics": True, "accept_rule": rule[0], "draft_temperature": rule[1]}


def accept_reference(value: str) -> str:
    """The reference, in words (for the failure messages)."""
    rule = ACCEPT[value]
    assert rule is not None
    return (
        f"acceptance metrics under accept_rule={rule[0]!r} at T = {rule[1]} from stock's own MTP and main logits "
        "(full vocabulary, whole sequence), depth k at t against the main head at t + k"
    )


def _whole_sequence(tensor: Tensor, dim: int) -> tuple[Tensor, Optional[Tensor]]:
    """``tensor`` with its sequence dimension ``dim`` gathered over the CP group in sequence order, and
    this rank's positions in it (``None`` without CP)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return tensor, None
    group = parallel_state.get_context_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    seq = tensor.shape[dim] * size
    full = tensor.new_empty(tensor.shape[:dim] + (seq,) + tensor.shape[dim + 1 :])
    for rank, part in enumerate(parts):
        full.index_copy_(dim, context_parallel_positions(seq, rank, size), part)
    return full, context_parallel_positions(seq, parallel_state.get_context_parallel_rank(), size)


def stock_acceptance(value: str, mtp_logits: Tensor, main_logits: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """``hooks.metrics()``' acceptance entries for one micro-batch, from stock's logits: ``mtp_logits``
    ``[k, s, b, V/tp]`` (depths 1..k), ``main_logits`` ``[s, b, V/tp]``, ``loss_mask`` ``[b, s]`` (this
    CP rank's shares). Depth k's target at t is the mask at t + k (0 past the sequence's end)."""
    rule = ACCEPT[value]
    assert rule is not None
    mtp, local = _whole_sequence(gather_vocab(mtp_logits).double(), 1)
    main, _ = _whole_sequence(gather_vocab(main_logits).double(), 0)
    mask, _ = _whole_sequence(loss_mask.t().double(), 0)  # [s, b]
    seq, depth = main.shape[0], mtp.shape[0]
    out: dict[str, float] = {}
    chain_alpha, chain_mask, length = torch.ones_like(mask), torch.ones_like(mask), 0.0
    for k in range(1, depth + 1):
        alpha, agree, mask_k = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)
        alpha[: seq - k] = acceptance(mtp[k - 1, : seq - k], main[k:], rule[1], rule[0])
        agree[: seq - k] = (mtp[k - 1, : seq - k].argmax(-1) == main[k:].argmax(-1)).double()
        mask_k[: seq - k] = mask[k:]
        chain_alpha, chain_mask = chain_alpha * alpha, chain_mask * mask_k
        if local is not None:  # this CP rank's positions
            alpha, agree, mask_k = alpha[local], agree[local], mask_k[local]
        kept_chain_alpha, kept_chain_mask = (chain_alpha, chain_mask) if local is None else (chain_alpha[local], chain_mask[local])
        tokens = float(mask_k.sum())
        assert tokens > 0 and float(kept_chain_mask.sum()) > 0, "the matrix's batches give every depth a target"
        out[f"mtp_{k}/agree"] = float((agree * mask_k).sum()) / tokens
        out[f"mtp_{k}/accept"] = float((alpha * mask_k).sum()) / tokens
        length += float((kept_chain_alpha * kept_chain_mask).sum() / kept_chain_mask.sum())
    out["mtp/accept_len"] = length
    return out


def hooked_acceptance(metrics: dict[str, float]) -> dict[str, float]:
    """The acceptance entries of ``hooks.metrics()``."""
    return {key: value for key, value in metrics.items() if key.split("/")[-1] in KEYS or key == "mtp/accept_len"}
