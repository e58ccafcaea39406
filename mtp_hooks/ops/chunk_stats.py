"""The per-token statistics of one chunk of tokens over the full (vocab-parallel) vocabulary.

``lean_loss`` walks the tokens in chunks; each chunk's logits (and its teacher's) become one
``ChunkStats``: log-normalisers, the CE on the labels, the first argmax and, against a teacher,
the draft objective's statistics (``objectives``). Every vocabulary reduction runs over the group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from mtp_hooks.ops.objectives import draft_statistics, tempered_exp_
from mtp_hooks.ops.vocab_parallel import ProcessGroup, all_reduce, first_argmax_candidates


class ChunkStats:
    """Per-token statistics of one chunk of tokens over the full (vocab-parallel) vocabulary.

    Fills ``lse``, ``ce``, ``argmax`` (the full-vocabulary first argmax, or without a teacher
    this shard's candidate for it), ``loss`` and, with a teacher, ``lse_teacher``,
    ``draft_lse`` (the log-normalisers of ``p`` and of the draft's ``q`` in tempered logits),
    ``accept`` (``sum_v min(p, q)``), ``agree`` (same argmax) and ``aux``
    (``objectives.DraftStats``); ``q`` and ``p`` are the chunk's local softmax columns, written
    over ``logits`` and ``teacher_logits``, at ``temperature`` but for ``"ce"``'s ``q``
    (``objectives``). ``lse``, ``ce`` and ``argmax`` are untempered. Without a teacher ``q``
    holds the exponentials and ``q_scale`` the factor that normalises them (``logit_grad``
    applies it with the token weights: one pass over the chunk, not two).
    """

    def __init__(
        self,
        logits: Tensor,
        teacher_logits: Optional[Tensor],
        local: Tensor,
        in_shard: Tensor,
        objective: str,
        group: ProcessGroup,
        temperature: float = 1.0,
    ) -> None:
        values, index = logits.max(dim=-1)  # the first argmax counts, as stock 0.19's acceptance
        maxima = [values]
        if teacher_logits is not None:
            teacher_values, teacher_index = teacher_logits.max(dim=-1)
            maxima.append(teacher_values)
        maxima = all_reduce(torch.stack(maxima), group, dist.ReduceOp.MAX)
        row_max = maxima[0]
        # This shard's candidate for the first argmax (``first_argmax_candidates``): reduced with
        # MIN over the group here with a teacher, else once for all chunks by ``LeanMTPLoss``.
        self.argmax = first_argmax_candidates(values, index, row_max, group, logits.shape[-1])
        if teacher_logits is not None:
            teacher_argmax = first_argmax_candidates(teacher_values, teacher_index, maxima[1], group, logits.shape[-1])
            agree_index = all_reduce(torch.stack([self.argmax, teacher_argmax]), group, dist.ReduceOp.MIN)
            self.argmax = agree_index[0]
        shifted = logits.sub_(row_max.unsqueeze(-1))
        # The label's logit minus the row's maximum, 0 for a label outside every shard (a masked-in
        # -100 under validate="off"): mcore's vocab_parallel_cross_entropy, so the CE is stock's too.
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
        # At T != 1 the CE on the labels still needs the untempered sum of exponentials (a temporary
        # for the draft objectives; "ce" keeps them: its gradient is the untempered softmax).
        tempered = teacher_logits is not None and temperature != 1.0
        exp = shifted.exp() if objective == "distill" or tempered else shifted.exp_()
        sums = [picked, exp.sum(dim=-1)]
        if teacher_logits is not None:
            teacher_exp = tempered_exp_(teacher_logits.sub_(maxima[1].unsqueeze(-1)), temperature)
            sums.append(teacher_exp.sum(dim=-1))
        if tempered:  # the draft's exponentials at T, over ``shifted`` (kept, tempered, for "distill")
            exp = exp if objective == "ce" else None
            draft_exp = tempered_exp_(shifted, temperature, keep=objective == "distill")
            sums.append(draft_exp.sum(dim=-1))
        sums = all_reduce(torch.stack(sums), group)
        self.lse = row_max + sums[1].log()
        self.ce = sums[1].log() - sums[0]
        self.loss = self.ce
        self.p: Optional[Tensor] = None
        self.aux: Optional[Tensor] = None
        if teacher_logits is None:
            self.q, self.q_scale = exp, sums[1].reciprocal()
            return
        self.lse_teacher = maxima[1] / temperature + sums[2].log()
        self.p = p = teacher_exp.div_(sums[2].unsqueeze(-1))
        if tempered:
            log_sum = sums[3].log()
            q = draft_exp.div_(sums[3].unsqueeze(-1))
            self.draft_lse = row_max / temperature + log_sum
        else:
            log_sum = sums[1].log()
            q = exp.div_(sums[1].unsqueeze(-1))
            self.draft_lse = self.lse
        # The gradient's softmax: the draft's at T, or for "ce" the untempered one.
        self.q = exp.div_(sums[1].unsqueeze(-1)) if objective == "ce" and tempered else q
        self.q_scale = None
        stats = draft_statistics(objective, q, p, shifted, log_sum, group)
        self.accept, self.aux = stats.accept, stats.aux
        self.agree = torch.eq(*agree_index)
        if stats.loss is not None:
            self.loss = stats.loss

