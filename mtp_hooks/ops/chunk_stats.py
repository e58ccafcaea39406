"""The per-token statistics of one chunk of tokens over the full (vocab-parallel) vocabulary.

``lean_loss`` walks the tokens in chunks; each chunk's logits (and its teacher's) become one
``ChunkStats``: log-normalisers, the CE on the labels, the first argmax and, against a teacher,
the draft rule's statistics (``objectives``). Every vocabulary reduction runs over the group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from mtp_hooks.ops.draft_rule import DraftRule
from mtp_hooks.ops.objectives import GradInputs, Softmaxes, draft_statistics, tempered_exp_
from mtp_hooks.ops.vocab_parallel import ProcessGroup, all_reduce, first_argmax_candidates, group_max, shard_targets


class ChunkStats:
    """Per-token statistics of one chunk of tokens over the full (vocab-parallel) vocabulary.

    Fills ``lse``, ``ce``, ``argmax`` (the full-vocabulary first argmax, or without a teacher this
    shard's candidate for it), ``loss``, ``grad`` (``objectives.GradInputs``: the softmax columns,
    written over ``logits`` and ``teacher_logits``, that the logit gradient takes) and, with a
    teacher, ``target_argmax``, ``agree`` (same first argmax), ``accept`` (alpha under the rule;
    ``agree`` at T = 0), ``lse_teacher`` and ``grad_lse`` (the log-normalisers of ``p`` and of the
    gradient's ``q`` in tempered logits, which a backward recompute needs). ``lse``, ``ce`` and
    ``argmax`` are untempered. Where the gradient is a CE (``"ce"``, or ``"accept"`` at T = 0 under
    the argmax rule) ``grad.q`` holds the exponentials and ``grad.q_scale`` the factor that
    normalises them (``logit_grad`` applies it with the token weights: one pass over the chunk).
    """

    def __init__(
        self,
        logits: Tensor,
        teacher_logits: Optional[Tensor],
        local: Tensor,
        in_shard: Tensor,
        rule: DraftRule,
        group: ProcessGroup,
    ) -> None:
        shard, temperature = logits.shape[-1], rule.draft_temperature
        self.lse_teacher: Optional[Tensor] = None
        values, index = logits.max(dim=-1)  # the first argmax counts, as stock 0.19's acceptance
        row_maxima = [values]
        if teacher_logits is not None:
            teacher_values, teacher_index = teacher_logits.max(dim=-1)
            row_maxima.append(teacher_values)
        maxima = group_max(torch.stack(row_maxima), group)  # a NaN row: +inf, so its argmax is a real id (NaN losses)
        row_max = maxima[0]
        # This shard's candidate for the first argmax (``first_argmax_candidates``): reduced with
        # MIN over the group here with a teacher, else once for all chunks by ``LeanMTPLoss``.
        self.argmax = first_argmax_candidates(values, index, row_max, group, shard)
        if teacher_logits is not None:
            teacher_argmax = first_argmax_candidates(teacher_values, teacher_index, maxima[1], group, shard)
            both = all_reduce(torch.stack([self.argmax, teacher_argmax]), group, dist.ReduceOp.MIN)
            self.argmax, self.target_argmax = both[0], both[1]
            self.agree = torch.eq(both[0], both[1])
        shifted = logits.sub_(row_max.unsqueeze(-1))
        # The label's logit minus the row's maximum, 0 for a label outside every shard (a masked-in
        # -100 under validate="off"): mcore's vocab_parallel_cross_entropy, so the CE is stock's too.
        columns = [shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard]
        if rule.kind == "target_argmax_ce":  # the gradient's CE targets the teacher's argmax
            local, in_shard = shard_targets(self.target_argmax, shard, group)
            columns.append(shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard)
        picked = len(columns) - 1
        # The draft's softmax at T next to the untempered one (the CE's, and the gradient's where
        # ``q_temperature`` is 1) takes a second temporary; "distill" keeps its tempered logits.
        tempered = teacher_logits is not None and rule.tempered_draft and temperature != 1.0
        distill = rule.kind == "distill"
        exp = shifted.exp() if distill or tempered else shifted.exp_()
        columns.append(exp.sum(dim=-1))
        sampled = teacher_logits is not None and not rule.greedy
        if sampled:
            assert teacher_logits is not None
            teacher_exp = tempered_exp_(teacher_logits.sub_(maxima[1].unsqueeze(-1)), temperature)
            columns.append(teacher_exp.sum(dim=-1))
        untempered: Optional[Tensor] = exp
        del exp
        if tempered:
            untempered = untempered if rule.q_temperature == 1.0 else None  # freed before the tempered one is made
            draft_exp = tempered_exp_(shifted, temperature, keep=distill)
            columns.append(draft_exp.sum(dim=-1))
        sums = all_reduce(torch.stack(columns), group)
        log_sum = sums[picked + 1].log()
        self.lse = row_max + log_sum
        self.ce = log_sum - sums[0]
        self.loss = self.ce
        if teacher_logits is None or rule.greedy:
            if teacher_logits is not None:
                self.accept = self.agree.to(self.lse.dtype)
                if rule.kind == "target_argmax_ce":
                    self.loss = log_sum - sums[1]
            self.grad_lse = self.lse
            assert untempered is not None  # only a tempered draft frees it, and that needs a teacher and T > 0
            self.grad = GradInputs(untempered, None, local, in_shard, q_scale=sums[picked + 1].reciprocal())
            return
        self.lse_teacher = maxima[1] / temperature + sums[picked + 2].log()
        p = teacher_exp.div_(sums[picked + 2].unsqueeze(-1))
        q_untempered = None if untempered is None else untempered.div_(sums[picked + 1].unsqueeze(-1))
        q, tempered_log_sum = q_untempered, log_sum
        if tempered:
            tempered_log_sum = sums[picked + 3].log()
            q = draft_exp.div_(sums[picked + 3].unsqueeze(-1))
        draft_index, draft_in_shard = shard_targets(self.argmax, shard, group)
        softmaxes = Softmaxes(
            p, q if rule.tempered_draft or temperature == 1.0 else None, q_untempered, draft_index, draft_in_shard
        )
        if distill:
            softmaxes = softmaxes._replace(log_q_shifted=shifted, log_sum=tempered_log_sum)
        stats = draft_statistics(rule, softmaxes, group)
        self.accept = stats.accept
        if stats.loss is not None:
            self.loss = stats.loss
        # The gradient's softmax: the draft's at T, or (the CE, the argmax rule's surrogate) the untempered one.
        untempered_grad = rule.q_temperature == 1.0
        grad_q = q_untempered if untempered_grad else q
        assert grad_q is not None
        self.grad_lse = self.lse if untempered_grad else row_max / temperature + tempered_log_sum
        self.grad = GradInputs(grad_q, p, local, in_shard, stats.aux, stats.overlap)
