"""The draft objectives and acceptances by their definitions, in plain torch: the dense references.

Test-only support for ``tests/unit/test_draft_objectives.py``, ``test_accept_rule.py``,
``tests/distributed/test_parallel_draft.py`` and the parity matrix's ``accept`` axis
(``parity_acceptance``). ``logits`` are the draft's (an MTP head's), ``teacher_logits`` the
target's (the main head's at the position that predicts the same token), over the full vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acceptance(logits: Tensor, teacher_logits: Tensor, temperature: float, accept_rule: str) -> Tensor:
    """Per token, the expected acceptance of the draft by the target at temperature T under the engine's
    rule: the first argmax's ``p_T`` (``"argmax"``), ``sum min(p_T, q_T)`` (``"sampled"``),
    ``sum p_T q_T`` (``"match"``); at T = 0 whether the first argmaxes agree."""
    if temperature == 0:
        return (logits.argmax(-1) == teacher_logits.argmax(-1)).to(logits.dtype)
    q, p = (logits / temperature).softmax(-1), (teacher_logits / temperature).softmax(-1)
    if accept_rule == "argmax":
        return p.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    return torch.minimum(p, q).sum(-1) if accept_rule == "sampled" else (p * q).sum(-1)


def per_token_objective(
    objective: str, logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0, accept_rule: str = "argmax"
) -> Tensor:
    """Each token's loss, by its definition: the CE on the labels (untempered); ``-sum p_T log q_T``;
    ``0.5 sum |q_T - p_T|``; ``"accept"``: ``-log alpha`` under ``"sampled"`` / ``"match"``, under
    ``"argmax"`` the surrogate ``-log sum p_T q_1`` (at T = 0 the CE against the target's argmax)."""
    if objective == "ce":
        return -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if objective == "accept" and accept_rule == "argmax":
        if temperature == 0:
            return -logits.log_softmax(-1).gather(-1, teacher_logits.argmax(-1, keepdim=True)).squeeze(-1)
        return -((teacher_logits / temperature).softmax(-1) * logits.softmax(-1)).sum(-1).log()
    if objective == "accept":
        return -acceptance(logits, teacher_logits, temperature, accept_rule).log()
    log_q = (logits / temperature).log_softmax(-1)
    p = (teacher_logits / temperature).softmax(-1)
    if objective == "distill":
        return -(p * log_q).sum(-1)
    return 0.5 * (log_q.exp() - p).abs().sum(-1)
