"""The draft objectives of the lean MTP loss, one chunk of tokens at a time: statistics and logit gradients.

The MTP heads are the rollout engine's speculative draft. For a draft token at temperature ``T``
the engine samples ``x ~ q_T = softmax(z_mtp / T)`` and accepts it with probability
``min(1, p_T(x) / q_T(x))``, ``p_T = softmax(z_main / T)`` being the main head (the target) at the
position that predicts the same token; the expected acceptance is ``alpha = sum_v min(p_T, q_T)``.
Both distributions are tempered because the engine tempers both: it verifies against the
rollout's sampling distribution and draws the draft token at the same ``T`` (a draft trained
against ``p_T`` but scored untempered would be trained for a sampler no engine runs). Per token:

* ``"ce"``: cross-entropy on the labels, untempered (the labels are data, not a distribution);
  ``T`` then only changes the acceptance reported (``alpha``; argmax agreement is the same at any T).
* ``"distill"``: ``-sum_v p_T log q_T`` (the KL to ``p_T`` up to its entropy); logit gradient
  ``(q_T - p_T) / T``.
* ``"tv"``: ``0.5 sum_v |q_T - p_T| = 1 - alpha``: maximises the mean acceptance. Its gradient
  is bounded by ``2 alpha / T`` (l1 over the vocabulary), so it fades on the tokens the draft
  misses most.
* ``"accept"``: ``-log alpha``, the log-probability that the draft token is accepted. Per token
  it has tv's optimum, and its gradient is tv's divided by ``alpha`` (l1 norm at most ``2 / T``),
  so tokens with low acceptance keep pulling; summed over depths at one position it is
  ``-log prod_k alpha_k``, the log of the chained acceptance the expected accepted length is
  made of (``metrics.MTPMetrics``). ``alpha`` is clamped at the dtype's smallest normal
  (a loss of at most 87 in fp32, never ``inf``).

Every vocabulary sum is all-reduced over ``tp_group``; the functions take and return per-chunk
tensors and know nothing about chunking, hooks or models (``lean_loss`` runs the chunk loop).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, Optional, get_args

import torch
from torch import Tensor

from mtp_hooks.errors import bad_argument, describe
from mtp_hooks.ops.vocab_parallel import ProcessGroup, all_reduce

Objective = Literal["ce", "distill", "tv", "accept"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)


def check_temperature(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real > 0, else an ``MTPHooksError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise bad_argument(name, "a finite float > 0", describe(value))
    return float(value)


def tempered_exp_(shifted: Tensor, temperature: float, keep: bool = False) -> Tensor:
    """``exp(shifted / T)``; ``shifted`` (logits minus their row maximum) is divided in place, and
    overwritten by the exponentials unless ``keep``."""
    if temperature != 1.0:
        shifted.div_(temperature)
    return shifted.exp() if keep else shifted.exp_()


class DraftStats(NamedTuple):
    """Per-token statistics of a chunk against the target, over the full vocabulary."""

    accept: Tensor  # alpha = sum_v min(p, q)
    loss: Optional[Tensor]  # the objective per token; None for "ce" (its loss is the CE on the labels)
    aux: Optional[Tensor]  # what the gradient needs: "tv" sum_v sign(q - p) q, "accept" sum_v m_v q (``_accepted_share``)


def _accepted_share(q: Tensor, p: Tensor) -> Tensor:
    """``m_v = d min(p_v, q_v) / d q_v``: 1 where ``q < p``, 0 where ``q > p``, 1/2 at a tie (tv's ``sign(0) = 0``)."""
    return torch.sub(p, q).sign_().add_(1.0).mul_(0.5)


def draft_statistics(objective: str, q: Tensor, p: Tensor, shifted: Tensor, log_sum: Tensor, group: ProcessGroup) -> DraftStats:
    """Acceptance and objective of a chunk: ``q`` and ``p`` are the local columns of the draft's and the
    target's (tempered) softmax, ``shifted`` (``"distill"`` only) the draft's tempered logits minus
    their maximum and ``log_sum`` the log of their exponentials' sum (``log q = shifted - log_sum``)."""
    extra = [torch.minimum(p, q).sum(dim=-1)]
    if objective == "distill":
        extra.append((p * shifted).sum(dim=-1))
    elif objective == "tv":
        sign = torch.sign(q - p)
        extra += [(sign * q).sum(dim=-1), (sign * (q - p)).sum(dim=-1)]
        del sign
    elif objective == "accept":
        extra.append(_accepted_share(q, p).mul_(q).sum(dim=-1))
    extra = all_reduce(torch.stack(extra), group)
    alpha = extra[0]
    if objective == "distill":  # cross-entropy against p: log sum exp - sum p z
        return DraftStats(alpha, log_sum - extra[1], None)
    if objective == "tv":  # 0.5 * sum |q - p|
        return DraftStats(alpha, 0.5 * extra[2], extra[1])
    if objective == "accept":
        return DraftStats(alpha, -_clamped(alpha).log(), extra[1])
    return DraftStats(alpha, None, None)


def _clamped(alpha: Tensor) -> Tensor:
    return alpha.clamp(min=torch.finfo(alpha.dtype).tiny)


def logit_grad(
    objective: str,
    q: Tensor,
    p: Optional[Tensor],
    aux: Optional[Tensor],
    local: Tensor,
    in_shard: Tensor,
    token_weight: Optional[Tensor],
    first: int = 0,
    q_scale: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    temperature: float = 1.0,
) -> Tensor:
    """d(sum token_weight * loss)/d logits for vocabulary columns ``first ..``; written over ``q``.

    ``q``: the MTP head's softmax on those columns (tempered but for ``"ce"``), or for ``"ce"`` its
    exponentials with ``q_scale`` (per token, ``1 / sum exp``) the factor that normalises them,
    folded into the one multiply by the token weights; ``p``: the target's tempered softmax;
    ``aux``: ``DraftStats.aux``; ``alpha``: per-token acceptance (``"accept"``); ``token_weight``
    ``None``: every token weighs 1 (the unit-scale gradient of ``LeanMTPLoss``). The logits are
    the untempered ones: a tempered objective's gradient carries ``1 / temperature``.
    """
    if objective == "ce":  # softmax - onehot
        factor = token_weight if q_scale is None else q_scale if token_weight is None else q_scale * token_weight
        grad = q if factor is None else q.mul_(factor.unsqueeze(-1))
        columns = grad.shape[-1]
        index = local - first
        inside = in_shard & (index >= 0) & (index < columns)
        step = inside.to(grad.dtype) if token_weight is None else token_weight * inside
        return grad.scatter_add_(-1, index.clamp(0, columns - 1).unsqueeze(-1), step.neg_().unsqueeze(-1))
    if p is None or q_scale is not None:
        raise AssertionError(f"objective {objective!r} takes the normalised softmax and the target's")
    rows: Optional[Tensor] = token_weight
    if objective == "distill":  # q - p
        grad = q.sub_(p)
    elif objective == "tv":  # 0.5 * q * (sign(q - p) - sum_v sign(q - p) q)
        if aux is None:
            raise AssertionError("objective 'tv' needs sum_v sign(q - p) q")
        grad = torch.sign(q - p).sub_(aux.unsqueeze(-1)).mul_(q).mul_(0.5)
    elif objective == "accept":  # -q * (m - sum_v m q) / alpha: no cancellation when alpha is small
        if aux is None or alpha is None:
            raise AssertionError("objective 'accept' needs sum_v m q and alpha")
        grad = q.mul_(_accepted_share(q, p).sub_(aux.unsqueeze(-1)))
        inverse = _clamped(alpha).reciprocal().neg_()
        rows = inverse if rows is None else inverse.mul_(rows)
    else:
        raise AssertionError(f"unknown objective {objective!r}")
    if temperature != 1.0:
        return grad.mul_(1.0 / temperature) if rows is None else grad.mul_((rows / temperature).unsqueeze(-1))
    return grad if rows is None else grad.mul_(rows.unsqueeze(-1))
