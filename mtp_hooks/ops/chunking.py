"""How many tokens a lean kernel takes per chunk: its memory policy."""

from __future__ import annotations

import math

_LOGITS_CHUNK_BYTES = 256 * 2**20


def auto_chunk_size(vocab_shard: int, tokens: int) -> int:
    """Tokens per lean chunk, from a memory budget: the largest power of two whose fp32 logits
    ``[chunk, V/tp]`` fit in 256 MiB (at least 16 tokens), and no more than the tokens there are.

    Only one chunk's temporaries are alive at a time, so the budget bounds the loss's working
    memory whatever the sequence length; fewer, larger GEMMs keep lean's time at stock's.
    """
    budget = _LOGITS_CHUNK_BYTES // (4 * max(vocab_shard, 1))
    chunk = max(16, 2 ** int(math.log2(max(budget, 1))))
    return min(chunk, max(tokens, 1))
