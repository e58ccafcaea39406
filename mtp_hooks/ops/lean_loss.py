"""Vocab-parallel losses for the MTP heads, dense and lean.

Knows nothing about hooks or models: hidden states, head weight, labels, token weights and the
tensor-parallel group go in; a scalar objective ``sum(token_weight * loss)`` plus detached
per-token statistics come out. Logits shards are ``[tokens, V/tp]``; every reduction over the
vocabulary (max, sum of exponentials, target logit, argmax) runs over ``tp_group``.

* ``argmax_matches`` (from ``vocab_parallel``) scores logits that the caller computed (dense path;
  the CE itself is mcore's).
* ``LeanMTPLoss`` never keeps logits for backward: it walks the tokens in chunks (``chunk_stats``) and computes the
  hidden-state gradient during forward (the objective's upstream gradient is a scalar, so it is
  known up to that factor). Objectives: ``"ce"`` on the labels, and, against the main head's
  distribution at the matching position (the teacher), ``"distill"``, ``"tv"`` and
  ``"accept"``, at the rollout's temperature under the engine's acceptance rule (``DraftRule``,
  ``draft_rule``; their per-chunk math is ``objectives``'); with a teacher it also reports argmax
  agreement and expected speculative acceptance under the rule. How it runs is a ``KernelSpec``.
  The head weight's gradient, when the weight needs one, takes one of two paths (``weight_grad``):

  - ``"recompute"`` keeps nothing but the hidden states (and teacher inputs) for backward and
    recomputes the logits there one vocabulary slice at a time; each slice yields its own rows
    of the weight gradient with one matmul over all tokens, rounded once as in the dense path.
    One head matmul more than stock (4 for ``"ce"``: logits, hidden gradient, recomputed
    logits, weight gradient).
  - ``"fused"`` adds each chunk's ``logit_grad.T @ hidden`` to one ``[V/tp, H]`` accumulator
    (fp32 for half, bf16 and fp32 inputs) during forward and only scales it by the upstream
    gradient in backward: stock's matmul count (3 for ``"ce"``), but the accumulator lives from
    forward to backward. All MTP depths can share it by passing their tokens in one call.

  ``weight_grad.choose_weight_grad`` picks the path that keeps less alive: ``"fused"`` unless its
  accumulator (``V/tp * H`` fp32) outweighs the fp32 MTP logits stock keeps
  (``tokens * V/tp``), i.e. unless ``H > tokens`` summed over the depths of the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtp_hooks.errors import bad_argument, describe
from mtp_hooks.ops.chunk_stats import ChunkStats
from mtp_hooks.ops.draft_rule import DraftRule
from mtp_hooks.ops.main_grad import HeadWeightGrad
from mtp_hooks.ops.objectives import GradInputs, logit_grad
from mtp_hooks.ops.vocab_parallel import ProcessGroup, accumulation_dtype, all_reduce, shard_targets
from mtp_hooks.ops.weight_grad import WEIGHT_GRAD_MODES, add_weight_grad_
from mtp_hooks.ops.workspace import Workspace

_MIN_WEIGHT_SLICES = 4  # the weight gradient's recompute never holds more than 1/4 of the logits


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """How a lean kernel runs, whatever it computes: the vocabulary's tensor-parallel group
    (``None``: one rank), tokens per chunk, the head weight's gradient path (``"recompute"`` or
    ``"fused"``, ``weight_grad.choose_weight_grad``) and whether that gradient follows mcore's
    ``main_grad`` protocol (``main_grad``: added to ``weight.main_grad`` as mcore's output layer does)."""

    tp_group: ProcessGroup
    chunk_size: int
    weight_grad: str = "recompute"
    main_grad_protocol: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise bad_argument("chunk_size", "an int >= 1", describe(self.chunk_size))
        if self.weight_grad not in WEIGHT_GRAD_MODES:
            raise bad_argument("weight_grad", f"one of {WEIGHT_GRAD_MODES}", repr(self.weight_grad))


class HeadLoss(NamedTuple):
    """Outputs of ``lean_mtp_loss``; all but ``objective`` are detached ``[T]`` tensors."""

    objective: Tensor
    ce: Tensor
    correct: Tensor
    agree: Optional[Tensor]
    accept: Optional[Tensor]


class LeanMTPLoss(torch.autograd.Function):
    """``sum(token_weight * loss(hidden @ weight.T))`` without keeping logits for backward.

    Inputs: ``hidden`` ``[T, H]`` (already gathered / copied into the TP region by the caller),
    ``weight`` ``[V/tp, H]``, ``labels`` ``[T]``, ``token_weight`` ``[T]`` (0 where masked) and,
    optionally, ``teacher`` ``[T, H]``: the main head's input at the position whose next token
    the MTP head predicts too (its logits use ``weight`` detached); ``spec``: ``KernelSpec``;
    ``rule``: ``DraftRule``, the objective at the rollout's temperature under the engine's
    acceptance rule (``draft_rule``; all objectives but ``"ce"`` need a teacher). The CE on the
    labels stays untempered. Outputs: the scalar objective, per-token CE on the labels and
    correct flags and, with a teacher, per-token argmax agreement and expected acceptance under
    the rule.

    The hidden-state gradient is computed during forward (the objective's upstream gradient is
    a scalar), with the token weights folded in where the head's dtype can hold them (fp32,
    bf16: rounded where stock rounds its logit gradient) and at unit weight for fp16. Backward
    multiplies it by the upstream gradient (and fp16's token weights) in fp32 and rounds once,
    so a loss scaler's 2^16 .. 2^32, a schedule's 1/7 or a coefficient of 1e-6 never meets half
    precision before it is applied; stock's dense path scales its fp32 CE gradient before
    casting it, too. ``spec.weight_grad`` says how the head weight's gradient is made:
    ``"recompute"`` recomputes logits in backward, one vocabulary slice at a time; ``"fused"``
    accumulates it during forward into one ``[V/tp, H]`` buffer (fp32 for half, bf16 and fp32
    inputs; fp16's token weights normalised by their largest, so its GEMM operands stay in
    range), which backward scales by the upstream gradient. With ``spec.main_grad_protocol``
    backward adds the weight gradient to ``weight.main_grad`` and returns mcore's placeholder.
    With the weight detached neither does any weight-gradient work. Tokens are independent, so
    the caller may pass several depths' tokens at once (each carrying its own coefficient in
    ``token_weight``) and split the per-token outputs; fused, the depths then share one
    accumulator. Every chunk's logits are written into one buffer (``workspace``), and a chunk's
    other temporaries are freed before the next chunk is computed.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        token_weight: Tensor,
        teacher: Optional[Tensor],
        spec: KernelSpec,
        rule: DraftRule,
    ) -> tuple[Tensor, ...]:
        tokens, tp_group = hidden.shape[0], spec.tp_group
        acc_dtype = accumulation_dtype(hidden.dtype)
        local, in_shard = shard_targets(labels, weight.shape[0], tp_group)
        token_weight = token_weight.to(acc_dtype)
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fused = need_weight_grad and spec.weight_grad == "fused"
        acc = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if fused else None
        teacher_weight = weight.detach()
        new = lambda dtype: torch.zeros(tokens, dtype=dtype, device=hidden.device)  # noqa: E731
        lse, ce, loss, grad_lse, lse_teacher = (
            new(acc_dtype), new(acc_dtype), new(acc_dtype), new(acc_dtype), new(acc_dtype)
        )
        aux, overlap, accept = new(acc_dtype), new(acc_dtype), new(acc_dtype)
        argmax, target_argmax, agree = new(torch.long), new(torch.long), new(torch.bool)
        # The hidden-state gradient made in forward carries the token weights where the head's dtype
        # can hold them (rounded where stock rounds its logit gradient); fp16 cannot hold
        # ``coef * softmax`` (2.4e-5 * 1e-5 is below its smallest normal), so there it is made at
        # unit weight and backward applies the weights in fp32.
        fold = hidden.dtype != torch.float16
        # fp16's fused accumulator takes its unit-weight gradient times the token weights relative to
        # the largest (the GEMM operands stay at unit scale); backward multiplies by that largest.
        norm = (
            token_weight.abs().amax().clamp(min=torch.finfo(acc_dtype).tiny) if fused and tokens and not fold else None
        )
        relative = None if norm is None else token_weight / norm
        hidden_grad = torch.empty_like(hidden) if need_hidden_grad else None
        logits_space = Workspace(acc_dtype, hidden.device)
        teacher_space = Workspace(acc_dtype, hidden.device)
        for start in range(0, tokens, spec.chunk_size):
            rows = slice(start, min(start + spec.chunk_size, tokens))
            logits = logits_space.product(hidden[rows], weight)
            teacher_logits = None if teacher is None else teacher_space.product(teacher[rows], teacher_weight)
            chunk = ChunkStats(logits, teacher_logits, local[rows], in_shard[rows], rule, tp_group)
            del logits, teacher_logits
            lse[rows], ce[rows], argmax[rows], loss[rows], grad_lse[rows] = (
                chunk.lse, chunk.ce, chunk.argmax, chunk.loss, chunk.grad_lse
            )
            if teacher is not None:
                accept[rows], agree[rows], target_argmax[rows] = chunk.accept, chunk.agree, chunk.target_argmax
                for saved, value in (
                    (lse_teacher, chunk.lse_teacher), (aux, chunk.grad.aux), (overlap, chunk.grad.overlap)
                ):
                    if value is not None:
                        saved[rows] = value
            if hidden_grad is not None or acc is not None:
                grad = logit_grad(rule, chunk.grad, token_weight[rows] if fold else None)
                rounded = logits_space.rounded(grad, weight.dtype)
                if hidden_grad is not None:
                    torch.mm(rounded, weight, out=hidden_grad[rows])
                if acc is not None and relative is not None:  # fp16
                    grad = grad.mul_(relative[rows].unsqueeze(-1))
                    rounded = logits_space.rounded(grad, weight.dtype)
                if acc is not None:
                    add_weight_grad_(acc, grad, rounded, hidden[rows])
                del grad, rounded
            del chunk  # one chunk's temporaries alive at a time
        if teacher is None:  # the chunks' candidates, reduced in one collective
            argmax = all_reduce(argmax, tp_group, dist.ReduceOp.MIN)
        correct = argmax == labels  # stock 0.19's acceptance count: the first argmax is the label
        result = (loss * token_weight).sum()
        ctx.spec, ctx.rule = spec, rule
        ctx.recompute = need_weight_grad and not fused
        ctx.hidden_dtype, ctx.fold = hidden.dtype, fold
        ctx.weight_grad = HeadWeightGrad(weight, spec.main_grad_protocol, hidden.dtype) if need_weight_grad else None
        if ctx.recompute:
            if rule.kind == "target_argmax_ce":  # the gradient's CE targets the teacher's argmax (T = 0)
                local, in_shard = shard_targets(target_argmax, weight.shape[0], tp_group)
            target = teacher if rule.target_in_gradient else None
            ctx.save_for_backward(
                hidden_grad, hidden, weight, target, local, in_shard, token_weight, grad_lse, lse_teacher, aux, overlap
            )
        else:
            ctx.save_for_backward(hidden_grad, None if fold else token_weight, acc, norm)
        ctx.mark_non_differentiable(ce, correct, agree, accept)
        return result, ce, correct, agree, accept

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        nones = (None,) * 5
        if not ctx.recompute:
            hidden_grad, token_weight, acc, norm = ctx.saved_tensors
            upstream = grad_objective.to(accumulation_dtype(ctx.hidden_dtype))  # never rounded to the head's dtype
            d_hidden = None if hidden_grad is None else _scale_rows(hidden_grad, token_weight, upstream, ctx.fold)
            d_weight = None
            if acc is not None:
                ctx.weight_grad.add_scaled_(acc, norm * upstream if norm is not None else upstream)
                d_weight = ctx.weight_grad.result()
            return d_hidden, d_weight, *nones
        (
            hidden_grad, hidden, weight, teacher, local, in_shard, token_weight, grad_lse, lse_teacher, aux, overlap
        ) = ctx.saved_tensors
        rule: DraftRule = ctx.rule
        upstream = grad_objective.to(grad_lse.dtype)
        scaled = token_weight * upstream
        d_hidden = None if hidden_grad is None else _scale_rows(hidden_grad, token_weight, upstream, ctx.fold)
        # Vocabulary slices with as many logits as a forward chunk, and at most a quarter of the
        # shard (backward runs while the model's activation gradients are live); each slice
        # gives its own rows of dW (``main_grad.HeadWeightGrad``).
        tokens, shard = hidden.shape[0], weight.shape[0]
        columns = min(-(-ctx.spec.chunk_size * shard // max(tokens, 1)), -(-shard // _MIN_WEIGHT_SLICES))
        q_space, p_space = Workspace(grad_lse.dtype, hidden.device), Workspace(grad_lse.dtype, hidden.device)
        for first in range(0, shard, columns):
            cols = slice(first, min(first + columns, shard))
            # The draft's softmax at the loss's temperature (and the target's at T) on these columns.
            q = _tempered(q_space.product(hidden, weight[cols]), rule.q_temperature).sub_(grad_lse.unsqueeze(-1)).exp_()
            p = None
            if teacher is not None:
                p = _tempered(p_space.product(teacher, weight[cols]), rule.draft_temperature).sub_(
                    lse_teacher.unsqueeze(-1)
                ).exp_()
            grad = logit_grad(rule, GradInputs(q, p, local, in_shard, aux, overlap), scaled, first)
            del q, p
            ctx.weight_grad.add_rows_(cols, grad, hidden, q_space)
            del grad
        return d_hidden, ctx.weight_grad.result(), *nones


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    return logits if temperature == 1.0 else logits.div_(temperature)


def _scale_rows(hidden_grad: Tensor, token_weight: Optional[Tensor], upstream: Tensor, folded: bool) -> Tensor:
    """``hidden_grad * upstream`` (times ``token_weight`` per row unless ``folded`` in forward),
    multiplied in fp32 (fp64) and rounded once to ``hidden_grad``'s dtype."""
    if folded or token_weight is None:
        rows = upstream.expand(hidden_grad.shape[0])  # a [T] operand: the product is computed in fp32
    else:
        rows = token_weight * upstream
    return torch.mul(hidden_grad, rows.unsqueeze(-1), out=torch.empty_like(hidden_grad))


def lean_mtp_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_weight: Tensor,
    spec: KernelSpec,
    rule: DraftRule = DraftRule(),
    teacher: Optional[Tensor] = None,
) -> HeadLoss:
    """Functional form of ``LeanMTPLoss`` (see there); ``agree`` / ``accept`` are ``None`` without a teacher.

    ``spec.weight_grad``: ``"recompute"`` or ``"fused"``; see ``choose_weight_grad`` for which
    keeps less memory. To share the fused accumulator over MTP depths, pass their tokens
    concatenated (``hidden``, ``labels``, ``token_weight`` with each depth's coefficient, and
    ``teacher``) and split the per-token outputs back by depth.

    Example::

        out = lean_mtp_loss(hidden, weight, labels, mask / mask.sum(), KernelSpec(tp_group, 1024),
                            DraftRule("accept", draft_temperature=0.7), teacher=main_hidden)
    """
    if not isinstance(spec, KernelSpec):
        raise bad_argument("spec", "a KernelSpec", describe(spec))
    if not isinstance(rule, DraftRule):
        raise bad_argument("rule", "a DraftRule", describe(rule))
    if rule.needs_teacher and teacher is None:
        raise bad_argument(
            "teacher", f"the main head's input: objective {rule.objective!r} compares the draft with it", None
        )
    result, ce, correct, agree, accept = LeanMTPLoss.apply(hidden, weight, labels, token_weight, teacher, spec, rule)
    if teacher is None:
        return HeadLoss(result, ce, correct, None, None)
    return HeadLoss(result, ce, correct, agree, accept)
