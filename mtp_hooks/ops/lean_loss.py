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
  ``"accept"``, optionally at a sampling temperature (their per-chunk math is ``objectives``'); with a
  teacher it also reports argmax agreement and expected speculative acceptance. The head
  weight's gradient, when the weight needs one, takes one of two paths (``weight_grad``):

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

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtp_hooks.errors import bad_argument
from mtp_hooks.ops.chunk_stats import ChunkStats
from mtp_hooks.ops.main_grad import HeadWeightGrad
from mtp_hooks.ops.objectives import OBJECTIVES, check_temperature, logit_grad
from mtp_hooks.ops.vocab_parallel import ProcessGroup, accumulation_dtype, all_reduce, shard_targets
from mtp_hooks.ops.weight_grad import WEIGHT_GRAD_MODES, add_weight_grad_
from mtp_hooks.ops.workspace import Workspace

_MIN_WEIGHT_SLICES = 4  # the weight gradient's recompute never holds more than 1/4 of the logits


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
    the MTP head predicts too (its logits use ``weight`` detached). ``objective``: ``"ce"`` (CE
    on the labels), ``"distill"`` (CE against the teacher's softmax p), ``"tv"`` (total
    variation ``0.5 sum |q - p|`` = 1 - expected speculative acceptance) or ``"accept"``
    (``-log sum min(p, q)``); all but ``"ce"`` need a teacher (``objectives``). ``temperature``:
    p and q are ``softmax(logits / temperature)`` for the teacher objectives and the acceptance,
    as a speculative sampler at that temperature draws and verifies; the CE on the labels stays
    untempered. Outputs: the scalar objective, per-token CE on the labels and correct flags and,
    with a teacher, per-token argmax agreement and expected acceptance ``sum min(p, q)``.

    The hidden-state gradient is computed during forward (the objective's upstream gradient is
    a scalar), with the token weights folded in where the head's dtype can hold them (fp32,
    bf16: rounded where stock rounds its logit gradient) and at unit weight for fp16. Backward
    multiplies it by the upstream gradient (and fp16's token weights) in fp32 and rounds once,
    so a loss scaler's 2^16 .. 2^32, a schedule's 1/7 or a coefficient of 1e-6 never meets half
    precision before it is applied; stock's dense path scales its fp32 CE gradient before
    casting it, too. ``weight_grad`` says how the head weight's gradient is made:
    ``"recompute"`` recomputes logits in backward, one vocabulary slice at a time; ``"fused"``
    accumulates it during forward into one ``[V/tp, H]`` buffer (fp32 for half, bf16 and fp32
    inputs; fp16's token weights normalised by their largest, so its GEMM operands stay in
    range), which backward scales by the upstream gradient. With ``main_grad_protocol``
    (``head.follows_main_grad_protocol``) backward adds the weight gradient to
    ``weight.main_grad`` and returns mcore's placeholder, as mcore's output layer does. With the
    weight detached neither does any weight-gradient work. Tokens are independent, so the caller
    may pass several depths' tokens at once (each carrying its own coefficient in
    ``token_weight``) and split the per-token outputs; fused, the depths then share one
    accumulator. Every chunk's logits are written into one buffer (``workspace``), and a chunk's
    other temporaries are freed before the next chunk is computed.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        token_weight: Tensor,
        teacher: Optional[Tensor],
        tp_group: ProcessGroup,
        chunk_size: int,
        objective: str,
        weight_grad: str = "recompute",
        main_grad_protocol: bool = False,
        temperature: float = 1.0,
    ) -> tuple[Tensor, ...]:
        tokens = hidden.shape[0]
        acc_dtype = accumulation_dtype(hidden.dtype)
        local, in_shard = shard_targets(labels, weight.shape[0], tp_group)
        token_weight = token_weight.to(acc_dtype)
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fused = need_weight_grad and weight_grad == "fused"
        acc = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if fused else None
        teacher_weight = weight.detach()
        new = lambda dtype: torch.zeros(tokens, dtype=dtype, device=hidden.device)  # noqa: E731
        lse, ce, loss = new(acc_dtype), new(acc_dtype), new(acc_dtype)
        lse_teacher, draft_lse, aux, accept = new(acc_dtype), new(acc_dtype), new(acc_dtype), new(acc_dtype)
        argmax, agree = new(torch.long), new(torch.bool)
        # The hidden-state gradient made in forward carries the token weights where the head's dtype
        # can hold them (rounded where stock rounds its logit gradient); fp16 cannot hold
        # ``coef * softmax`` (2.4e-5 * 1e-5 is below its smallest normal), so there it is made at
        # unit weight and backward applies the weights in fp32.
        fold = hidden.dtype != torch.float16
        # fp16's fused accumulator takes its unit-weight gradient times the token weights relative to
        # the largest (the GEMM operands stay at unit scale); backward multiplies by that largest.
        norm = token_weight.abs().amax().clamp(min=torch.finfo(acc_dtype).tiny) if fused and tokens and not fold else None
        relative = None if norm is None else token_weight / norm
        hidden_grad = torch.empty_like(hidden) if need_hidden_grad else None
        logits_space = Workspace(acc_dtype, hidden.device)
        teacher_space = Workspace(acc_dtype, hidden.device)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, tokens))
            logits = logits_space.product(hidden[rows], weight)
            teacher_logits = None if teacher is None else teacher_space.product(teacher[rows], teacher_weight)
            chunk = ChunkStats(logits, teacher_logits, local[rows], in_shard[rows], objective, tp_group, temperature)
            del logits, teacher_logits
            lse[rows], ce[rows], argmax[rows], loss[rows] = chunk.lse, chunk.ce, chunk.argmax, chunk.loss
            if teacher is not None:
                lse_teacher[rows], accept[rows], agree[rows] = chunk.lse_teacher, chunk.accept, chunk.agree
                draft_lse[rows] = chunk.draft_lse
                if chunk.aux is not None:
                    aux[rows] = chunk.aux
            if hidden_grad is not None or acc is not None:
                weights = token_weight[rows] if fold else None
                grad = logit_grad(
                    objective, chunk.q, chunk.p, chunk.aux, local[rows], in_shard[rows], weights,
                    q_scale=chunk.q_scale, alpha=chunk.accept if teacher is not None else None, temperature=temperature,
                )
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
        ctx.chunk_size, ctx.tp_group, ctx.objective, ctx.temperature = chunk_size, tp_group, objective, temperature
        ctx.recompute = need_weight_grad and not fused
        ctx.hidden_dtype, ctx.fold = hidden.dtype, fold
        ctx.weight_grad = HeadWeightGrad(weight, main_grad_protocol, hidden.dtype) if need_weight_grad else None
        if ctx.recompute:
            ctx.save_for_backward(
                hidden_grad,
                hidden,
                weight,
                teacher if objective != "ce" else None,
                local,
                in_shard,
                token_weight,
                lse if objective == "ce" else draft_lse,  # the normaliser of the gradient's softmax
                lse_teacher,
                aux,
                accept,
            )
        else:
            ctx.save_for_backward(hidden_grad, None if fold else token_weight, acc, norm)
        ctx.mark_non_differentiable(ce, correct, agree, accept)
        return result, ce, correct, agree, accept

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        nones = (None,) * 9
        if not ctx.recompute:
            hidden_grad, token_weight, acc, norm = ctx.saved_tensors
            upstream = grad_objective.to(accumulation_dtype(ctx.hidden_dtype))  # never rounded to the head's dtype
            d_hidden = None if hidden_grad is None else _scale_rows(hidden_grad, token_weight, upstream, ctx.fold)
            d_weight = None
            if acc is not None:
                ctx.weight_grad.add_scaled_(acc, norm * upstream if norm is not None else upstream)
                d_weight = ctx.weight_grad.result()
            return d_hidden, d_weight, *nones
        hidden_grad, hidden, weight, teacher, local, in_shard, token_weight, lse, lse_teacher, aux, accept = ctx.saved_tensors
        temperature = 1.0 if ctx.objective == "ce" else ctx.temperature
        upstream = grad_objective.to(lse.dtype)
        scaled = token_weight * upstream
        d_hidden = None if hidden_grad is None else _scale_rows(hidden_grad, token_weight, upstream, ctx.fold)
        # Vocabulary slices with as many logits as a forward chunk, and at most a quarter of the
        # shard (backward runs while the model's activation gradients are live); each slice
        # gives its own rows of dW (``main_grad.HeadWeightGrad``).
        tokens, shard = hidden.shape[0], weight.shape[0]
        columns = min(-(-ctx.chunk_size * shard // max(tokens, 1)), -(-shard // _MIN_WEIGHT_SLICES))
        q_space, p_space = Workspace(lse.dtype, hidden.device), Workspace(lse.dtype, hidden.device)
        for first in range(0, shard, columns):
            cols = slice(first, min(first + columns, shard))
            q = _tempered(q_space.product(hidden, weight[cols]), temperature).sub_(lse.unsqueeze(-1)).exp_()
            p = None
            if teacher is not None:
                p = _tempered(p_space.product(teacher, weight[cols]), temperature).sub_(lse_teacher.unsqueeze(-1)).exp_()
            grad = logit_grad(ctx.objective, q, p, aux, local, in_shard, scaled, first, alpha=accept, temperature=temperature)
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
    tp_group: ProcessGroup,
    chunk_size: int,
    objective: str = "ce",
    teacher: Optional[Tensor] = None,
    weight_grad: str = "recompute",
    main_grad_protocol: bool = False,
    temperature: float = 1.0,
) -> HeadLoss:
    """Functional form of ``LeanMTPLoss`` (see there); ``agree`` / ``accept`` are ``None`` without a teacher.

    ``weight_grad``: ``"recompute"`` (default) or ``"fused"``; see ``choose_weight_grad`` for
    which keeps less memory. ``main_grad_protocol``: add the weight gradient to
    ``weight.main_grad`` as mcore's output layer does (``main_grad``). To share the fused accumulator over MTP depths, pass their tokens
    concatenated (``hidden``, ``labels``, ``token_weight`` with each depth's coefficient, and
    ``teacher``) and split the per-token outputs back by depth.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective != "ce" and teacher is None:
        raise ValueError(f"objective {objective!r} needs a teacher")
    if weight_grad not in WEIGHT_GRAD_MODES:
        raise bad_argument("weight_grad", f"one of {WEIGHT_GRAD_MODES}", repr(weight_grad))
    temperature = check_temperature("temperature", temperature)
    result, ce, correct, agree, accept = LeanMTPLoss.apply(
        hidden, weight, labels, token_weight, teacher, tp_group, chunk_size, objective, weight_grad, main_grad_protocol,
        temperature,
    )
    if teacher is None:
        return HeadLoss(result, ce, correct, None, None)
    return HeadLoss(result, ce, correct, agree, accept)

