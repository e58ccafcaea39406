"""The draft objectives of the lean MTP loss, one chunk of tokens at a time: statistics and logit gradients.

What each (objective, temperature, acceptance rule) trains is ``draft_rule``'s (``DraftRule.kind``);
this module holds their per-chunk math. ``z`` are the draft's untempered logits, ``q`` its softmax
at the temperature ``tau`` the loss takes (``DraftRule.q_temperature``: ``T``, or 1 for the CE kinds
and the argmax rule's surrogate), ``p = p_T`` the target's (``dq_u / dz_v = q_u (delta_uv - q_v) / tau``).
Per token, loss and gradient in ``z``:

* ``"ce"`` / ``"target_argmax_ce"``: ``-log q_1(y)`` for the label ``y`` (or the target's first
  argmax), ``q_1 - onehot(y)``;
* ``"distill"``: ``-sum_v p log q_T`` (the KL to ``p`` up to its entropy), ``(q_T - p) / T``;
* ``"tv"``: ``0.5 sum_v |q_T - p| = 1 - sum_v min(p, q_T)``, ``0.5 q (sign(q - p) - sum_u sign(q_u - p_u) q_u) / T``;
  bounded by ``2 alpha / T`` in l1, so it fades on the tokens the draft misses most;
* ``"min_overlap"``: ``-log alpha``, ``alpha = sum_v min(p, q_T)``; with ``m_v = d min(p_v, q_v) / d q_v``
  (1 where ``q < p``, 0 where ``q > p``, 1/2 at a tie): ``-q (m - sum_u m_u q_u) / (T alpha)``: tv's
  gradient divided by ``alpha``, so tokens with low acceptance keep pulling;
* ``"product_overlap"``: ``-log s``, ``s = sum_v p q``: ``q (1 - p / s) / tau``, i.e. ``q`` minus the
  posterior ``p q / s`` of the token both draw (no cancellation when ``s`` is small).

``alpha`` and ``s`` are clamped at the dtype's smallest normal (a loss of at most 87 in fp32, never
``inf``). Summed over depths at one position ``-log alpha`` is ``-log prod_k alpha_k``, the chained
acceptance the expected accepted length is made of (``metrics.MTPMetrics``). Every vocabulary sum
is all-reduced over ``group``; the functions take and return per-chunk tensors and know nothing
about chunking, hooks or models (``lean_loss`` runs the chunk loop, ``chunk_stats`` the softmaxes).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from mtp_hooks.ops.draft_rule import DraftRule
from mtp_hooks.ops.vocab_parallel import ProcessGroup, all_reduce


def tempered_exp_(shifted: Tensor, temperature: float, keep: bool = False) -> Tensor:
    """``exp(shifted / T)``; ``shifted`` (logits minus their row maximum) is divided in place, and
    overwritten by the exponentials unless ``keep``."""
    if temperature != 1.0:
        shifted.div_(temperature)
    return shifted.exp() if keep else shifted.exp_()


class Softmaxes(NamedTuple):
    """A chunk's local softmax columns against the target, as ``draft_statistics`` reads them."""

    p: Tensor  # the target's at T
    q: Optional[Tensor]  # the draft's at T (``DraftRule.tempered_draft``; the untempered one at T = 1)
    q_untempered: Optional[Tensor]  # the draft's at 1, for the argmax rule's surrogate
    draft_index: Tensor  # the draft's first argmax as an index into this shard ...
    draft_in_shard: Tensor  # ... and whether it falls in it
    log_q_shifted: Optional[Tensor] = None  # "distill": the draft's tempered logits minus their maximum ...
    log_sum: Optional[Tensor] = None  # ... and the log of their exponentials' sum (log q_T = shifted - log_sum)


class DraftStats(NamedTuple):
    """Per-token statistics of a chunk against the target, over the full vocabulary."""

    accept: Tensor  # alpha under the rule
    loss: Optional[Tensor]  # the objective per token; None for "ce" (its loss is the CE on the labels)
    aux: Optional[Tensor]  # what the gradient needs: "tv" sum_v sign(q - p) q, "min_overlap" sum_v m_v q
    overlap: Optional[Tensor]  # the sum under the -log: alpha ("min_overlap") or s ("product_overlap")


def _accepted_share(q: Tensor, p: Tensor) -> Tensor:
    """``m_v = d min(p_v, q_v) / d q_v``: 1 where ``q < p``, 0 where ``q > p``, 1/2 at a tie (tv's ``sign(0) = 0``)."""
    return torch.sub(p, q).sign_().add_(1.0).mul_(0.5)


def _clamped(alpha: Tensor) -> Tensor:
    return alpha.clamp(min=torch.finfo(alpha.dtype).tiny)


def draft_statistics(rule: DraftRule, chunk: Softmaxes, group: ProcessGroup) -> DraftStats:
    """Acceptance under ``rule.accept_rule`` and the objective of a chunk (``T > 0``), in one all-reduce."""
    p, q = chunk.p, chunk.q
    columns: list[Tensor] = []
    if rule.accept_rule == "argmax":  # p_T at the draft's first argmax, on the shard holding it
        columns.append(p.gather(-1, chunk.draft_index.unsqueeze(-1)).squeeze(-1) * chunk.draft_in_shard)
    elif q is None:
        raise AssertionError(f"accept_rule {rule.accept_rule!r} needs the draft's tempered softmax")
    elif rule.accept_rule == "sampled":
        columns.append(torch.minimum(p, q).sum(dim=-1))
    else:
        columns.append((p * q).sum(dim=-1))
    kind = rule.kind
    if kind == "distill":
        if chunk.log_q_shifted is None or chunk.log_sum is None:
            raise AssertionError("objective 'distill' needs the draft's tempered log-softmax")
        columns.append((p * chunk.log_q_shifted).sum(dim=-1))
    elif kind in ("tv", "min_overlap"):
        if q is None:
            raise AssertionError(f"{kind} needs the draft's tempered softmax")
        if kind == "tv":
            sign = torch.sign(q - p)
            columns += [(sign * q).sum(dim=-1), (sign * (q - p)).sum(dim=-1)]
            del sign
        else:
            columns.append(_accepted_share(q, p).mul_(q).sum(dim=-1))  # alpha is the acceptance (column 0)
    elif kind == "product_overlap" and rule.accept_rule == "argmax":
        if chunk.q_untempered is None:
            raise AssertionError("the argmax rule's surrogate needs the draft's untempered softmax")
        columns.append((p * chunk.q_untempered).sum(dim=-1))
    sums = all_reduce(torch.stack(columns), group)
    alpha = sums[0]
    if kind == "distill":  # cross-entropy against p: log sum exp - sum p z
        assert chunk.log_sum is not None
        return DraftStats(alpha, chunk.log_sum - sums[1], None, None)
    if kind == "tv":  # 0.5 * sum |q - p|
        return DraftStats(alpha, 0.5 * sums[2], sums[1], None)
    if kind == "min_overlap":
        return DraftStats(alpha, -_clamped(alpha).log(), sums[1], alpha)
    if kind == "product_overlap":
        overlap = alpha if rule.accept_rule == "match" else sums[1]
        return DraftStats(alpha, -_clamped(overlap).log(), None, overlap)
    return DraftStats(alpha, None, None, None)


class GradInputs(NamedTuple):
    """What one chunk's (or vocabulary slice's) logit gradient is made of.

    ``q``: the draft's softmax on those columns at ``DraftRule.q_temperature`` or, for the CE kinds,
    its exponentials with ``q_scale`` (per token, ``1 / sum exp``) the factor that normalises them,
    folded into the one multiply by the token weights; ``p``: the target's tempered softmax;
    ``local`` / ``in_shard``: the CE kinds' target (the label, or the target's argmax) as an index
    into this shard; ``aux`` / ``overlap``: ``DraftStats``'.
    """

    q: Tensor
    p: Optional[Tensor]
    local: Tensor
    in_shard: Tensor
    aux: Optional[Tensor] = None
    overlap: Optional[Tensor] = None
    q_scale: Optional[Tensor] = None


def logit_grad(rule: DraftRule, inputs: GradInputs, token_weight: Optional[Tensor], first: int = 0) -> Tensor:
    """d(sum token_weight * loss)/d logits for vocabulary columns ``first ..``; written over ``inputs.q``.

    ``token_weight`` ``None``: every token weighs 1 (the unit-scale gradient of ``LeanMTPLoss``).
    The logits are the untempered ones: a tempered loss's gradient carries ``1 / q_temperature``.
    """
    q, p, kind = inputs.q, inputs.p, rule.kind
    if kind in ("ce", "target_argmax_ce"):  # softmax - onehot
        q_scale = inputs.q_scale
        factor = token_weight if q_scale is None else q_scale if token_weight is None else q_scale * token_weight
        grad = q if factor is None else q.mul_(factor.unsqueeze(-1))
        columns = grad.shape[-1]
        index = inputs.local - first
        inside = inputs.in_shard & (index >= 0) & (index < columns)
        step = inside.to(grad.dtype) if token_weight is None else token_weight * inside
        return grad.scatter_add_(-1, index.clamp(0, columns - 1).unsqueeze(-1), step.neg_().unsqueeze(-1))
    if p is None or inputs.q_scale is not None:
        raise AssertionError(f"{kind} takes the normalised softmax and the target's")
    rows: Optional[Tensor] = token_weight
    if kind == "distill":  # q - p
        grad = q.sub_(p)
    elif kind == "tv":  # 0.5 * q * (sign(q - p) - sum_v sign(q - p) q)
        if inputs.aux is None:
            raise AssertionError("tv needs sum_v sign(q - p) q")
        grad = torch.sign(q - p).sub_(inputs.aux.unsqueeze(-1)).mul_(q).mul_(0.5)
    elif kind == "min_overlap":  # -q * (m - sum_v m q) / alpha
        if inputs.aux is None or inputs.overlap is None:
            raise AssertionError("min_overlap needs sum_v m q and alpha")
        grad = q.mul_(_accepted_share(q, p).sub_(inputs.aux.unsqueeze(-1)))
        inverse = _clamped(inputs.overlap).reciprocal().neg_()
        rows = inverse if rows is None else inverse.mul_(rows)
    elif kind == "product_overlap":  # q * (1 - p / s)
        if inputs.overlap is None:
            raise AssertionError("product_overlap needs s = sum_v p q")
        grad = q.mul_(torch.div(p, _clamped(inputs.overlap).unsqueeze(-1)).neg_().add_(1.0))
    else:
        raise AssertionError(f"unknown loss kind {kind!r}")
    temperature = rule.q_temperature
    if temperature != 1.0:
        return grad.mul_(1.0 / temperature) if rows is None else grad.mul_((rows / temperature).unsqueeze(-1))
    return grad if rows is None else grad.mul_(rows.unsqueeze(-1))
