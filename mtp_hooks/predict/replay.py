"""The acceptance an engine measures, predicted by the trainer on the engine's own tokens.

vLLM drafts k tokens per verification step and, at T = 0, keeps draft j while drafts 1..j all equal
the target's argmax; its per-position rate is (steps whose drafts 1..j were kept) / steps. At T > 0 it drafts
the argmax too and keeps draft j with probability p_T(draft j); a rejected draft is replaced by a token drawn
from p_T without the draft's own, so on the engine's sampled tokens draft j was kept exactly where they equal
it, and the same replay holds (given the k tokens the same requests draw past the end). The
trainer predicts it without an engine in the loop: ``draft_hits`` (``hits``) says, at every position,
whether each draft step's token equals the engine's there; ``replay`` then walks the engine's
verification steps over those indicators: from the first generated token, each step drafts after
the last token, keeps the leading drafts that hit, and moves on by one plus them.
``predict_engine_acceptance`` does both. Prompts of equal length.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor, nn

from mtp_hooks.predict.hits import draft_hits

if TYPE_CHECKING:
    from mtp_hooks import MTPHooks
    from mtp_hooks.profiles import EngineProfile

__all__ = ["Replay", "engine_sequences", "predict_engine_acceptance", "replay"]


@dataclasses.dataclass(frozen=True)
class Replay:
    """Predicted counts of an engine run: verification steps (``drafts``), and per draft position
    how many steps kept it (``accepted_per_position``), as vLLM's counters count them."""

    drafts: int
    accepted_per_position: tuple[int, ...]
    # Share of the generated tokens the trainer's main head also picks (its argmax after the token before):
    # below 1, the trainer's target is not the engine's, and neither are the hidden states the drafts start from.
    target_agreement: float = float("nan")

    @property
    def per_position(self) -> tuple[float, ...]:
        return tuple(a / self.drafts for a in self.accepted_per_position) if self.drafts else ()

    @property
    def mean_length(self) -> float:
        return 1 + sum(self.accepted_per_position) / self.drafts if self.drafts else float("nan")


def replay(hits: Tensor, prompt: int, max_tokens: int, target_agreement: float = float("nan")) -> Replay:
    """The engine's verification steps over ``hits`` (``draft_hits``): per row the prefill
    gives the first token; while fewer than ``max_tokens`` are out, one step drafts k after the last
    token, keeps the leading hits and emits them plus the target's token."""
    k, rows, width = hits.shape
    drafts, accepted = 0, [0] * k
    for row in range(rows):
        last, produced = prompt, 1  # index of the last token out, tokens out
        while produced < max_tokens:
            drafts += 1
            kept = 0
            while kept < k and last - 1 < width and bool(hits[kept, row, last - 1]):
                accepted[kept] += 1
                kept += 1
            last, produced = last + 1 + kept, produced + 1 + kept
    return Replay(drafts, tuple(accepted), target_agreement)


def predict_engine_acceptance(
    model: nn.Module, hooks: MTPHooks, prompts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]],
    max_tokens: int, mtp_input: str = "decoder_output", geometry: str = "chain",
    engine: Optional[EngineProfile] = None,
) -> Replay:
    """The per-position acceptance an engine drafting ``hooks.options.draft_steps`` argmax tokens measures
    when it generates ``max_tokens`` tokens per prompt, at T = 0 or sampling. ``token_ids``: the engine's generated
    tokens, at least ``max_tokens`` per prompt and ideally k more (at T = 0 the greedy continuation past the end,
    e.g. from a plain run; sampling, the same seeded requests run k tokens longer), so the last steps' drafts have
    tokens to be compared with. ``mtp_input`` and
    ``geometry``: ``draft_hits``' (``"pre_final_norm"`` for vLLM's MiMo drafter, ``"engine"`` for vLLM's
    proposer's steps 2..k). ``engine``: an ``mtp_hooks.profiles`` profile, which sets both and ``draft_hits``'
    ``recycle`` (what step j + 1 reads of step j) and ``draft_hits``' ``start_embedding`` (``"zeroed"``: vLLM's
    drafters zero MTP layer 1's token embedding at position 0; without a profile, ``"kept"``), and must be the one
    ``hooks`` were attached with."""
    recycle, start_embedding = "normed", "kept"
    if engine is not None:
        if (mtp_input, geometry) != ("decoder_output", "chain"):
            raise ValueError("engine: the profile sets mtp_input and geometry; pass either, not both")
        mtp_input, geometry, recycle = engine.mtp_input, engine.geometry, engine.recycle
        start_embedding = engine.start_embedding
        wanted = {k: v for k, v in engine.attach_options().items() if k != "draft_geometry"}  # training's own
        trained = {name: getattr(hooks.options, name) for name in wanted}
        if trained != wanted:
            raise ValueError(f"engine: hooks attached with {trained}, not as {engine.name} drafts: {wanted}")
    sequences, prompt = engine_sequences(prompts, token_ids, max_tokens)
    hits, agreement = draft_hits(model, hooks, sequences, prompt, mtp_input, geometry, recycle, start_embedding)
    return replay(hits, prompt, max_tokens, agreement)


def engine_sequences(
    prompts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]], max_tokens: int
) -> tuple[Tensor, int]:
    """``[b, P + n]``: the prompts followed by the engine's tokens (n: the fewest any prompt has, at least
    ``max_tokens``), and the prompts' one length P: ``draft_hits``' input."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts: expected one length, received {sorted(lengths)}")
    width = min(len(t) for t in token_ids)
    if width < max_tokens:
        raise ValueError(f"token_ids: expected at least max_tokens={max_tokens} per prompt, received {width}")
    rows = [list(p) + list(t[:width]) for p, t in zip(prompts, token_ids)]
    return torch.tensor(rows, dtype=torch.long), lengths.pop()
