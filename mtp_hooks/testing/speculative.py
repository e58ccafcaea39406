"""Speculative sampling as an engine runs it: k drafts per verification step, the target verifies them.

Draft j is verified while every draft before it was accepted, under the engine's rule (``Rule``,
the ``accept_rule`` of ``mtp_hooks.attach``):

* ``"sampled"``: a draft ``x ~ q`` accepted with probability ``min(1, p(x) / q(x))``, the first
  rejected one replaced by a draw from ``max(p - q, 0)`` (normalised);
* ``"argmax"`` (vLLM's and SGLang's default): the drafter's argmax, verified as a one-hot proposal:
  accepted with probability ``p(x)``, a rejected one replaced by a draw from ``p`` without ``x``;
* ``"match"``: a draft ``x ~ q``; the target draws ``y ~ p``, and ``x`` is accepted iff ``x = y``,
  else ``y`` is emitted.

When all k are accepted the target adds its own next token, so under each rule every emitted token
is distributed as the target's. Who drafts is the caller's: a ``Drafter`` gets the sequences so far
and returns the k drafts, the distributions they came from and the target's (a ``Proposal``). The
acceptance benchmark drafts with a hooked model's MTP depths or chain, the tests' engine with a
stock model's.

Tokens and random draws stay on the CPU, from one seeded generator (the drafter's draws first, then
the verification's). Full recompute per step, no cache: for tiny models.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Drafter", "Proposal", "Rule", "SpeculativeStats", "residual_sample", "speculative_sampling", "verify"]

Rule = Literal["sampled", "argmax", "match"]


@dataclasses.dataclass
class Proposal:
    """One verification step: ``drafts`` ``[r, k]``; ``q`` ``[r, k, V]``, the distribution each draft was
    drawn from; ``p`` ``[r, k + 1, V]``, the target's at each drafted position and after the last draft."""

    drafts: Tensor
    q: Tensor
    p: Tensor


# (sequences ``[r, width]`` so far, ``at`` ``[r]``: where each row's first draft goes, the step's index) -> Proposal.
# Draft j goes at ``at + j``; ``p[:, j]`` is the target's distribution of that token, read at ``at - 1 + j``.
Drafter = Callable[[Tensor, Tensor, int], Proposal]


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of a run. Per draft position j: drafts tried (all before it accepted), accepted, and the
    summed exact acceptance probability of those tried under the rule (``verify``); verification
    steps and tokens emitted; per row (request): verification steps and accepted drafts."""

    tried: list[int]
    accepted: list[int]
    expected: list[float]
    row_steps: Tensor
    row_accepted: Tensor
    steps: int = 0
    tokens: int = 0

    @classmethod
    def empty(cls, rows: int, k: int) -> "SpeculativeStats":
        zeros = torch.zeros(rows, dtype=torch.long)
        return cls([0] * k, [0] * k, [0.0] * k, zeros, zeros.clone())

    def add(self, active: Tensor, ok: Tensor, overlap: Tensor) -> None:
        """Count one verification step of the ``active`` rows (``verify``'s ``ok`` and ``overlap``)."""
        tried = torch.cat([active[:, None], active[:, None] & ok[:, :-1]], dim=1)
        for j in range(len(self.tried)):
            self.tried[j] += int(tried[:, j].sum())
            self.accepted[j] += int((tried[:, j] & ok[:, j]).sum())
            self.expected[j] += float(overlap[:, j][tried[:, j]].sum())
        accepted = ok.sum(1)
        self.steps += int(active.sum())
        self.tokens += int((1 + accepted)[active].sum())
        self.row_steps += active.long()
        self.row_accepted += torch.where(active, accepted, 0)

    def summary(self) -> dict[str, Any]:
        """Per draft position the realised acceptance and the expected one at the drafts tried; tokens per step."""
        return {
            "realised_accept": [a / t if t else math.nan for a, t in zip(self.accepted, self.tried)],
            "expected_at_tried": [e / t if t else math.nan for e, t in zip(self.expected, self.tried)],
            "tried": list(self.tried),
            "realised_tokens_per_step": self.tokens / self.steps if self.steps else math.nan,
            "steps": self.steps,
        }


def residual_sample(p: Tensor, q: Tensor, gen: torch.Generator) -> Tensor:
    """A draw per row from ``max(p - q, 0)`` normalised (from ``p`` where that is empty)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
    return torch.multinomial(residual, 1, generator=gen).squeeze(-1)


def verify(
    p: Tensor, q: Tensor, drafts: Tensor, bonus: Tensor, gen: torch.Generator, rule: Rule = "sampled"
) -> tuple[Tensor, Tensor, Tensor]:
    """The target's verification of k drafts per row under ``rule``: ``p``, ``q`` ``[r, k, V]`` (target and
    draft at each drafted position; ``q`` unread under ``"argmax"``), ``drafts`` ``[r, k]``, ``bonus``
    ``[r, V]`` (the target after all k).

    Returns ``ok`` ``[r, k]`` (draft j accepted, all before it too), the tokens ``[r, k + 1]`` to append
    (the first ``1 + ok.sum(1)`` of each row count) and the exact acceptance probability ``[r, k]``:
    ``sum_v min(p, q)`` (sampled), ``p(x)`` (argmax) or ``sum_v p q`` (match).
    """
    rows, k = drafts.shape
    idx = torch.arange(rows)
    if rule == "argmax":  # a deterministic draft: the proposal is one-hot at it
        q = F.one_hot(drafts, p.shape[-1]).to(p.dtype)
    if rule == "match":  # the target's own draws decide, and replace the first draft they differ from
        fixes = torch.stack([torch.multinomial(p[:, j], 1, generator=gen).squeeze(-1) for j in range(k)], dim=1)
        ok = torch.cumprod((fixes == drafts).long(), dim=1).bool()
        alpha = (p * q).sum(-1)
    else:
        u = torch.rand(rows, k, generator=gen)
        ratio = torch.stack([(p[idx, j, drafts[:, j]] / q[idx, j, drafts[:, j]]).clamp(max=1) for j in range(k)], dim=1)
        ok = torch.cumprod((u < ratio).long(), dim=1).bool()
        fixes = torch.stack([residual_sample(p[:, j], q[:, j], gen) for j in range(k)], dim=1)
        alpha = torch.minimum(p, q).sum(-1)
    extra = torch.multinomial(bonus, 1, generator=gen).squeeze(-1)
    accepted = ok.sum(1)
    tokens = torch.cat([drafts, torch.zeros(rows, 1, dtype=drafts.dtype)], dim=1)
    tokens[idx, accepted] = torch.where(accepted == k, extra, fixes[idx, accepted.clamp(max=k - 1)])
    return ok, tokens, alpha


def speculative_sampling(
    drafter: Drafter, prompts: Tensor, length: int, k: int, gen: torch.Generator, rule: Rule = "sampled"
) -> tuple[Tensor, SpeculativeStats]:
    """Continue ``prompts`` ``[r, P]`` (the last token the target's) with ``drafter``'s k drafts per
    verification step, verified under ``rule``, while a row has room for k drafts and the target's
    token within ``length`` tokens; returns the sequences ``[r, length + 1]`` (zeros past each row's
    end) and the counts. A row steps from the first step on until it is full (``row_steps``)."""
    rows, start = prompts.shape
    buffer = torch.zeros(rows, length + 1, dtype=torch.long)
    buffer[:, :start] = prompts
    n = torch.full((rows,), start)
    stats = SpeculativeStats.empty(rows, k)
    idx = torch.arange(rows)
    step = 0
    while bool((active := n <= length - k).any()):
        at = torch.where(active, n, start)  # finished rows: any in-range position, results unused
        proposal = drafter(buffer, at, step)
        ok, tokens, overlap = verify(proposal.p[:, :k], proposal.q, proposal.drafts, proposal.p[:, k], gen, rule)
        stats.add(active, ok, overlap)
        new = 1 + ok.sum(1)
        for r in idx[active].tolist():
            s, count = int(n[r]), int(new[r])
            buffer[r, s : s + count] = tokens[r, :count]
            n[r] = s + count
        step += 1
    return buffer, stats
