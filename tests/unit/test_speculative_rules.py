"""The shared speculative-sampling loop (``mtp_hooks.testing.speculative``) under each verification rule.

Every rule is exact: the first token emitted is distributed as the target's ``p_1`` whatever the
draft, and draft 1 is accepted at the rule's expected acceptance (``mtp_hooks.ops.draft_rule``):
``sum_v min(p, q)`` for a sampled draft under ``"sampled"``, ``p(argmax q)`` under ``"argmax"``,
``sum_v p q`` under ``"match"``. Frequencies are checked within 5 standard errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtp_hooks.testing.speculative import Proposal, speculative_sampling, verify

ROWS, VOCAB = 40_000, 4
P1, Q1 = torch.tensor([0.5, 0.2, 0.2, 0.1]), torch.tensor([0.1, 0.6, 0.2, 0.1])
ALPHA = {
    "sampled": float(torch.minimum(P1, Q1).sum()),  # 0.5
    "argmax": float(P1[Q1.argmax()]),  # 0.2
    "match": float((P1 * Q1).sum()),  # 0.22
}


def within(share: torch.Tensor, probability: torch.Tensor, rows: int) -> bool:
    return bool(torch.all((share - probability).abs() < 5 * (probability * (1 - probability) / rows).sqrt()))


def two_drafts(rule: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``p``, ``q`` ``[ROWS, 2, V]`` and the drafts as the rule's drafter makes them (the argmax, else samples)."""
    p = torch.stack([P1, torch.full((VOCAB,), 0.25)]).expand(ROWS, 2, VOCAB).contiguous()
    q = torch.stack([Q1, torch.tensor([0.7, 0.1, 0.1, 0.1])]).expand(ROWS, 2, VOCAB).contiguous()
    drafts = q.argmax(-1) if rule == "argmax" else torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(ROWS, 2)
    return p, q, drafts


@pytest.mark.parametrize("rule", list(ALPHA))
def test_verify_emits_the_targets_distribution_and_accepts_at_the_rules_alpha(rule: str) -> None:
    gen = torch.Generator().manual_seed(1)
    p, q, drafts = two_drafts(rule, gen)
    ok, tokens, alpha = verify(p, q, drafts, torch.full((ROWS, VOCAB), 0.25), gen, rule)
    share = torch.bincount(tokens[:, 0], minlength=VOCAB).double() / ROWS
    assert within(share, P1.double(), ROWS), (rule, share, P1)
    expected = ALPHA[rule]
    assert abs(float(ok[:, 0].double().mean()) - expected) < 5 * math.sqrt(expected * (1 - expected) / ROWS), (rule, expected)
    assert not (ok[:, 1] & ~ok[:, 0]).any()  # a draft counts only after all before it were accepted
    # The exact acceptance reported: the rule's alpha of each drafted position (argmax: of the draft made).
    assert torch.allclose(alpha[:, 0], torch.full((ROWS,), expected, dtype=alpha.dtype)), rule


def test_the_argmax_rules_rejected_draft_is_never_emitted_in_its_place() -> None:
    """A rejected argmax draft is replaced by a draw from ``p`` without it (the residual of a one-hot proposal)."""
    gen = torch.Generator().manual_seed(2)
    p, q, drafts = two_drafts("argmax", gen)
    ok, tokens, _ = verify(p, q, drafts, torch.full((ROWS, VOCAB), 0.25), gen, "argmax")
    rejected = ~ok[:, 0]
    assert rejected.any() and not (tokens[rejected, 0] == drafts[rejected, 0]).any()


@pytest.mark.parametrize("rule", list(ALPHA))
def test_the_loop_counts_each_rows_steps_and_accepted_drafts(rule: str) -> None:
    """``speculative_sampling`` under each rule: per row, 1 + accepted tokens per step, every row
    stepping from the first step on until it is full, and the per-position counts add up."""
    rows, k, length = 64, 2, 12
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)), dim=-1)
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)

    def drafter(tokens: torch.Tensor, at: torch.Tensor, step: int) -> Proposal:
        qs = q.expand(tokens.shape[0], k, VOCAB)
        drafts = qs.argmax(-1) if rule == "argmax" else torch.multinomial(qs.flatten(0, 1), 1, generator=gen).view(-1, k)
        return Proposal(drafts, qs, p.expand(tokens.shape[0], k + 1, VOCAB))

    prompts = torch.zeros(rows, 2, dtype=torch.long)
    tokens, stats = speculative_sampling(drafter, prompts, length, k, gen, rule)
    emitted = (stats.row_steps + stats.row_accepted).tolist()
    assert all(length - k < 2 + n <= length + 1 for n in emitted), emitted  # each row filled past length - k
    assert stats.tokens == sum(emitted) and stats.steps == int(stats.row_steps.sum())
    assert stats.tried[0] == stats.steps and stats.accepted[0] + stats.accepted[1] == int(stats.row_accepted.sum())
    assert 0 < stats.accepted[0] < stats.tried[0], "the case should accept some first drafts, not all"
    assert tokens.shape == (rows, length + 1)
