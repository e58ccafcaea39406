"""What the draft is trained for and scored by: ``DraftRule(objective, draft_temperature, accept_rule)``.

The MTP heads are the rollout engine's speculative draft; ``p_T = softmax(z_main / T)`` is the
target (the main head at the position that predicts the same token), ``q_T = softmax(z_mtp / T)``
the draft, both at the rollout's temperature ``T`` (``T = 0``: greedy, ``p_0`` and ``q_0`` one-hot
at the first argmax). ``accept_rule`` is how the engine verifies a draft token; the expected
acceptance ``alpha`` of one draft token is

* ``"argmax"`` (vLLM, SGLang by default): the engine drafts the draft's first argmax and accepts it
  with probability ``p_T(argmax q)``: ``alpha = p_T(argmax z_mtp)``;
* ``"sampled"`` (rejection sampling of sampled drafts): ``x ~ q_T`` accepted with probability
  ``min(1, p_T(x) / q_T(x))``: ``alpha = sum_v min(p_T, q_T)``;
* ``"match"`` (exact match of independent samples: an exact-match verifier, as Megatron's engine, fed a
  sampled draft): ``alpha = sum_v p_T q_T``. An exact-match verifier fed the draft's argmax accepts
  ``p_T(argmax q)``: the argmax rule.

At ``T = 0`` all three are ``argmax p == argmax q`` (``mtp_k/agree``). The objective ``"accept"``
is ``-log alpha`` under the rule, except for ``"argmax"``: ``p_T(argmax q)`` is piecewise constant
in the draft's logits (zero gradient almost everywhere), so it trains the surrogate
``-log sum_v p_T(v) q_1(v)`` with the draft's untempered softmax ``q_1`` (the engine's argmax draft
does not depend on T): the log-probability that the draft's own sample matches the target's, whose
optimum ``q = onehot(argmax p_T)`` is argmax agreement, i.e. ``alpha``'s maximum; at ``T = 0`` it is
the draft's cross-entropy against the target's argmax. This module is the one place that knows
which loss and which temperatures each combination takes (``DraftRule.kind``, ``q_temperature``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

from mtp_hooks.errors import bad_argument, describe

Objective = Literal["ce", "distill", "tv", "accept"]
AcceptRule = Literal["argmax", "sampled", "match"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
ACCEPT_RULES: tuple[str, ...] = get_args(AcceptRule)

# The per-token loss each (objective, rule, T) trains (``DraftRule.kind``):
#   "ce"               cross-entropy on the labels, untempered
#   "target_argmax_ce" cross-entropy against the target's first argmax (``"accept"``, ``"argmax"``, T = 0)
#   "distill"          -sum_v p_T log q_T
#   "tv"               0.5 sum_v |q_T - p_T|
#   "min_overlap"      -log sum_v min(p_T, q_T)   (``"accept"``, ``"sampled"``)
#   "product_overlap"  -log sum_v p_T q          (``"accept"``: q = q_T under ``"match"``, q_1 under ``"argmax"``)
LossKind = Literal["ce", "target_argmax_ce", "distill", "tv", "min_overlap", "product_overlap"]


def check_temperature(name: str, value: Any, greedy: bool = False) -> float:
    """``value`` as a float if it is a finite real > 0 (>= 0 with ``greedy``), else an ``MTPHooksError``
    naming ``name``."""
    positive = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not positive or (value == 0 and not greedy):
        raise bad_argument(name, f"a finite float {'>=' if greedy else '>'} 0", describe(value))
    return float(value)


@dataclasses.dataclass(frozen=True)
class DraftRule:
    """The draft objective at the rollout's temperature under the engine's acceptance rule (the names of
    ``attach``'s options). Validated on construction: ``MTPHooksError`` names the first bad field, and
    refuses what ``T = 0`` leaves undefined (``"distill"``, ``"tv"``, and ``"accept"`` under
    ``"sampled"`` / ``"match"``: one-hot distributions give ``log 0`` or a loss without gradient)."""

    objective: Objective = "ce"
    draft_temperature: float = 1.0
    accept_rule: AcceptRule = "argmax"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise bad_argument("objective", f"one of {OBJECTIVES}", describe(self.objective))
        if self.accept_rule not in ACCEPT_RULES:
            raise bad_argument("accept_rule", f"one of {ACCEPT_RULES}", describe(self.accept_rule))
        object.__setattr__(
            self, "draft_temperature", check_temperature("draft_temperature", self.draft_temperature, greedy=True)
        )
        if self.greedy and self.objective in ("distill", "tv"):
            raise bad_argument(
                "draft_temperature",
                f"a float > 0 with objective={self.objective!r} (at T = 0 p and q are one-hot: "
                "the objective is undefined or has no gradient; objective='accept' with accept_rule='argmax' trains "
                "argmax agreement)",
                0.0,
            )
        if self.greedy and self.objective == "accept" and self.accept_rule != "argmax":
            raise bad_argument(
                "draft_temperature",
                f"a float > 0 with objective='accept' under accept_rule={self.accept_rule!r} "
                "(at T = 0 alpha is 0 or 1: -log alpha has no gradient; accept_rule='argmax' trains the draft's "
                "cross-entropy against the target's argmax)",
                0.0,
            )

    @property
    def greedy(self) -> bool:
        """``T = 0``: the engine drafts and verifies by argmax; acceptance is argmax agreement."""
        return self.draft_temperature == 0.0

    @property
    def needs_teacher(self) -> bool:
        """Whether the objective compares the draft with the target (all but ``"ce"``)."""
        return self.objective != "ce"

    @property
    def kind(self) -> LossKind:
        """The per-token loss trained (see ``LossKind``)."""
        if self.objective == "ce":
            return "ce"
        if self.objective == "distill":
            return "distill"
        if self.objective == "tv":
            return "tv"
        if self.accept_rule == "sampled":
            return "min_overlap"
        if self.accept_rule == "argmax" and self.greedy:
            return "target_argmax_ce"
        return "product_overlap"

    @property
    def q_temperature(self) -> float:
        """The temperature of the draft softmax the loss (and its logit gradient) takes: 1 for the CE
        kinds and the argmax rule's surrogate, ``T`` otherwise."""
        if self.kind in ("ce", "target_argmax_ce") or (self.kind == "product_overlap" and self.accept_rule == "argmax"):
            return 1.0
        return self.draft_temperature

    @property
    def target_in_gradient(self) -> bool:
        """Whether the logit gradient reads the target's softmax ``p_T`` (the CE kinds read an index)."""
        return self.kind not in ("ce", "target_argmax_ce")

    @property
    def tempered_draft(self) -> bool:
        """Whether a chunk needs the draft's softmax at ``T`` (the loss's, or the acceptance's under
        ``"sampled"`` / ``"match"``); never at ``T = 0``, where acceptance is agreement."""
        return not self.greedy and (self.objective in ("distill", "tv") or self.accept_rule != "argmax")
