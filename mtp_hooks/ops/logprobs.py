"""Main-head log-probabilities of the labels (and entropy) without ``[tokens, V]`` logits.

For RL losses that only need ``log p(label)`` and the entropy per token. Forward walks the tokens
in chunks and keeps only the per-token log-sum-exp (and entropy); backward recomputes the logits
one vocabulary slice at a time, each slice giving its own rows of the weight gradient. Each
chunk's (slice's) temporaries are freed before the next one is computed. The weight's gradient
follows mcore's ``main_grad`` protocol where asked (``main_grad.HeadWeightGrad``), as the MTP loss's does.
Vocab-parallel: every reduction over the vocabulary runs over ``tp_group``. Knows nothing about
hooks; ``mtp_hooks.attach(..., output="logprobs")`` wires it to the model's final hidden states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Union, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtp_hooks.ops.main_grad import HeadWeightGrad
from mtp_hooks.ops.vocab_parallel import ProcessGroup, accumulation_dtype, all_reduce, shard_targets
from mtp_hooks.ops.workspace import Workspace


@dataclasses.dataclass(frozen=True, eq=False)
class TokenLogProbs:
    """What the model returns with ``output="logprobs"``: ``[b, s]`` tensors (entropy ``None`` unless asked).

    Not a tuple, so that wrappers converting outputs tuple element by tuple element return it as
    it is: mcore's ``Float16Module`` upcasts the last stage's outputs with ``float16_to_fp32``,
    whose ``conversion_helper`` rebuilds every tuple (a NamedTuple too) as a plain one, and leaves
    other objects to a conversion that touches half-precision tensors only (these are fp32).
    Reads like the ``(logprobs, entropy)`` pair all the same: ``logprobs, entropy = out``,
    ``out[0]``, ``out[1]``, ``len(out) == 2``.
    """

    logprobs: Tensor
    entropy: Optional[Tensor]

    def _pair(self) -> tuple[Tensor, Optional[Tensor]]:
        return (self.logprobs, self.entropy)

    def __iter__(self) -> Iterator[Optional[Tensor]]:
        return iter(self._pair())

    def __len__(self) -> int:
        return 2

    @overload
    def __getitem__(self, index: int) -> Optional[Tensor]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Optional[Tensor], ...]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[Optional[Tensor], tuple[Optional[Tensor], ...]]:
        return self._pair()[index]


def _chunk_logits(space: Workspace, hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = space.product(hidden, weight)
    return logits if temperature == 1.0 else logits.div_(temperature)


class LeanLogProbs(torch.autograd.Function):
    """Per-token ``log softmax(hidden @ weight.T / temperature)[label]`` and entropy, chunked.

    Inputs: ``hidden`` ``[T, H]`` (gathered / copied into the TP region by the caller), ``weight``
    ``[V/tp, H]``, ``labels`` ``[T]``. Outputs: log-probs ``[T]`` and entropy ``[T]`` (zeros when
    ``with_entropy`` is false), in fp32 (fp64 for fp64 inputs). With ``main_grad_protocol``
    (``head.follows_main_grad_protocol``) backward adds the weight gradient to
    ``weight.main_grad`` and returns mcore's placeholder, as mcore's output layer does.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        tp_group: ProcessGroup,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
        main_grad_protocol: bool = False,
    ) -> tuple[Tensor, Tensor]:
        tokens = hidden.shape[0]
        dtype = accumulation_dtype(hidden.dtype)
        local, in_shard = shard_targets(labels, weight.shape[0], tp_group)
        lse = torch.empty(tokens, dtype=dtype, device=hidden.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        # With entropy a chunk holds two logits-sized temporaries (the logits and their exponentials):
        # half as many tokens, so the chunk's memory stays that of one chunk of logits.
        step = max(1, chunk_size // 2) if with_entropy else chunk_size
        logits_space, exp_space = Workspace(dtype, hidden.device), Workspace(dtype, hidden.device)
        for start in range(0, tokens, step):
            rows = slice(start, min(start + step, tokens))
            logits = _chunk_logits(logits_space, hidden[rows], weight, temperature)
            row_max = all_reduce(logits.amax(dim=-1), tp_group, dist.ReduceOp.MAX)
            target = logits.gather(-1, local[rows].unsqueeze(-1)).squeeze(-1) * in_shard[rows]
            shifted = logits.sub_(row_max.unsqueeze(-1))
            exp = torch.exp(shifted, out=exp_space.matrix(*shifted.shape)) if with_entropy else shifted.exp_()
            sums = [target, exp.sum(dim=-1)]
            if with_entropy:
                sums.append(exp.mul_(shifted).sum(dim=-1))
            reduced = all_reduce(torch.stack(sums), tp_group)
            lse[rows] = row_max + reduced[1].log()
            logprobs[rows] = reduced[0] - lse[rows]
            if with_entropy:
                # H = log Z - E_q[z - max], with Z the partition function of the shifted logits.
                entropy[rows] = reduced[1].log() - reduced[2] / reduced[1]
            del logits, shifted, exp, sums, reduced  # one chunk's temporaries alive at a time
        ctx.chunk_size, ctx.tp_group, ctx.temperature = chunk_size, tp_group, temperature
        ctx.weight_grad = HeadWeightGrad(weight, main_grad_protocol, hidden.dtype) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(hidden, weight, local, in_shard, lse, entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor, grad_entropy: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, local, in_shard, lse, entropy = ctx.saved_tensors
        need_hidden, weight_grad = ctx.needs_input_grad[0], ctx.weight_grad
        dtype = lse.dtype
        tokens, shard = hidden.shape[0], weight.shape[0]
        d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
        grad_logprobs = grad_logprobs.to(dtype).unsqueeze(-1)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(dtype).unsqueeze(-1)
        # Vocabulary slices with two slice-sized temporaries (log q and q) holding as many logits as
        # one forward chunk: each gives its own rows of dW (``HeadWeightGrad``) and adds its part of dh.
        columns = max(1, min(shard, -(-ctx.chunk_size * shard // max(2 * tokens, 1))))
        log_q_space, q_space = Workspace(dtype, hidden.device), Workspace(dtype, hidden.device)
        for first in range(0, shard, columns):
            cols = slice(first, min(first + columns, shard))
            log_q = _chunk_logits(log_q_space, hidden, weight[cols], ctx.temperature).sub_(lse.unsqueeze(-1))
            q = torch.exp(log_q, out=q_space.matrix(*log_q.shape))
            # d log q[label] / dz = onehot - q ;  d H / dz = -q * (log q + H)
            if grad_entropy is not None:
                grad = log_q.add_(entropy.unsqueeze(-1)).mul_(grad_entropy).add_(grad_logprobs).mul_(q).neg_()
            else:
                grad = q.mul_(grad_logprobs).neg_()
            index = local - first
            inside = in_shard & (index >= 0) & (index < grad.shape[-1])
            grad.scatter_add_(
                -1, index.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), grad_logprobs * inside.unsqueeze(-1)
            )
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if d_hidden is not None:
                rounded = log_q_space.rounded(grad, weight.dtype)
                torch.addmm(d_hidden, rounded.to(dtype), weight[cols].to(dtype), out=d_hidden)
                del rounded
            if weight_grad is not None:
                weight_grad.add_rows_(cols, grad, hidden, log_q_space)
            del log_q, q, grad  # one slice's temporaries alive at a time
        if d_hidden is not None:
            d_hidden = d_hidden.to(hidden.dtype)
        d_weight = None if weight_grad is None else weight_grad.result()
        return d_hidden, d_weight, None, None, None, None, None, None


def lean_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    tp_group: ProcessGroup,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    main_grad_protocol: bool = False,
) -> TokenLogProbs:
    """Functional form of ``LeanLogProbs``; entropy is ``None`` unless ``with_entropy``."""
    logprobs, entropy = LeanLogProbs.apply(
        hidden, weight, labels, tp_group, chunk_size, temperature, with_entropy, main_grad_protocol
    )
    return TokenLogProbs(logprobs, entropy if with_entropy else None)


class _ZeroGradientTo(torch.autograd.Function):
    """Copies of ``outputs``; backward passes their gradients on and hands ``sink`` zeros."""

    @staticmethod
    def forward(ctx: Any, sink: Tensor, *outputs: Tensor) -> tuple[Tensor, ...]:
        ctx.sink = (sink.shape, sink.dtype, sink.device)
        return tuple(output.clone() for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:
        shape, dtype, device = ctx.sink
        return (torch.zeros(shape, dtype=dtype, device=device), *grads)


def with_zero_gradient_to(out: TokenLogProbs, sink: Tensor) -> TokenLogProbs:
    """``out`` (same values) whose backward also hands ``sink`` an exactly zero gradient, so the
    graph that made ``sink`` runs its backward whenever the log-probs' does; ``out`` itself where
    ``sink`` has no graph."""
    if not sink.requires_grad:
        return out
    tensors = (out.logprobs,) if out.entropy is None else (out.logprobs, out.entropy)
    copies = _ZeroGradientTo.apply(sink, *tensors)
    return TokenLogProbs(copies[0], None if out.entropy is None else copies[1])
