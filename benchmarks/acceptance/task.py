"""The acceptance benchmark's task protocol, its synthetic word task, and the policy-gradient pieces.

A task (``Task``) is what the benchmark needs to know of the text: pretraining batches, held-out
prompts, a reward on generated tokens and a few named policy measures. ``WordTask`` (here) and
``benchmarks.acceptance.code_task.CodeTask`` (the standard library's own code) implement it.

The language is a small word grammar with real next-token structure: every word has a fixed
spelling (a start token that names the word, then 0-2 interior letters, so inside a word the next
token is certain) and words follow each other by a seeded bigram over a few successors (so at a
word boundary the next token is a genuine choice). The reward prefers some words; a policy that
learns it moves probability mass at word boundaries, which is what a frozen draft cannot follow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

BOS = 0


@dataclasses.dataclass(frozen=True)
class WordLanguage:
    """Words, their spellings, the word bigram and the rewarded words; all drawn from ``seed``."""

    spellings: tuple[tuple[int, ...], ...]  # word w -> its tokens; the first one is 1 + w
    successors: Tensor  # [W, W] bigram probabilities, ``branching`` non-zero per row
    preferred: frozenset[int]  # rewarded words
    vocab: int

    @classmethod
    def build(cls, vocab: int = 32, words: int = 12, branching: int = 3, preferred: int = 4, seed: int = 0,
              letters: int = 0, interior: tuple[int, int] = (0, 2)) -> "WordLanguage":
        """``letters``: how many interior letters the words share (0: every token after the start tokens); with few,
        the next letter depends on the word, not on the letter before it. ``interior``: the least and most interior
        letters of a spelling."""
        if vocab < words + 3:
            raise ValueError(f"vocab: expected at least words + 3 = {words + 3} tokens, got {vocab}")
        if not 0 <= letters <= vocab - 1 - words:
            raise ValueError(f"letters: expected 0..{vocab - 1 - words} (vocab - 1 - words), got {letters}")
        gen = torch.Generator().manual_seed(seed)
        pool = torch.arange(1 + words, vocab if letters == 0 else 1 + words + letters)
        spellings = []
        for w in range(words):
            length = int(torch.randint(interior[0], interior[1] + 1, (1,), generator=gen))
            spelled = pool[torch.randint(0, len(pool), (length,), generator=gen)].tolist()
            spellings.append((1 + w, *spelled))
        successors = torch.zeros(words, words)
        for w in range(words):
            nxt = torch.randperm(words, generator=gen)[:branching]
            successors[w, nxt] = _dirichlet(branching, gen)
        chosen = torch.randperm(words, generator=gen)[:preferred].tolist()
        return cls(tuple(spellings), successors, frozenset(chosen), vocab)

    @property
    def words(self) -> int:
        return len(self.spellings)

    def sample(self, count: int, length: int, gen: torch.Generator) -> Tensor:
        """``[count, length]`` token sequences: BOS, then words from the bigram (first word uniform)."""
        rows = []
        for _ in range(count):
            tokens = [BOS]
            word = int(torch.randint(0, self.words, (1,), generator=gen))
            while len(tokens) < length:
                tokens.extend(self.spellings[word])
                word = int(torch.multinomial(self.successors[word], 1, generator=gen))
            rows.append(tokens[:length])
        return torch.tensor(rows)

    def reward(self, tokens: Tensor, prompt: int) -> Tensor:
        """Per sequence: share of the generated word starts that start a preferred word (0 if none)."""
        generated = tokens[:, prompt:]
        starts = (generated >= 1) & (generated <= self.words)
        preferred = torch.zeros(self.vocab, dtype=torch.bool)
        preferred[[1 + w for w in self.preferred]] = True
        hits = (preferred[generated] & starts).sum(1).float()
        return hits / starts.sum(1).clamp(min=1).float()


    def grammatical_share(self, tokens: Tensor, prompt: int) -> float:
        """Share of generated tokens the grammar allows after what precedes them (spelling inside a
        word, a bigram successor at a word boundary); how far a policy has left the language."""
        return float(self.grammatical_rows(tokens, prompt).mean())

    def grammatical_rows(self, tokens: Tensor, prompt: int) -> Tensor:
        """``grammatical_share`` per sequence, ``[b]``."""
        shares = []
        for row in tokens.tolist():
            allowed = 0
            state: tuple[int, int] | None = None  # (word, index of the last token in its spelling)
            for position, token in enumerate(row):
                if position >= prompt:
                    allowed += int(token in self._next_tokens(state))
                state = self._advance(state, token)
            shares.append(allowed / max(len(row) - prompt, 1))
        return torch.tensor(shares)

    def _next_tokens(self, state: "tuple[int, int] | None") -> set[int]:
        if state is None:  # after BOS or an ungrammatical interior letter: any word may start
            return set(range(1, self.words + 1))
        word, index = state
        if index + 1 < len(self.spellings[word]):
            return {self.spellings[word][index + 1]}
        return {1 + w for w in torch.nonzero(self.successors[word]).flatten().tolist()}

    def _advance(self, state: "tuple[int, int] | None", token: int) -> "tuple[int, int] | None":
        if 1 <= token <= self.words:
            return (token - 1, 0)
        if state is not None and state[1] + 1 < len(self.spellings[state[0]]) and self.spellings[state[0]][state[1] + 1] == token:
            return (state[0], state[1] + 1)
        return None


def _dirichlet(size: int, gen: torch.Generator) -> Tensor:
    """A Dirichlet(1, ..., 1) draw from a seeded generator (normalised exponentials)."""
    draws = -torch.log(torch.rand(size, generator=gen).clamp(min=1e-12))
    return draws / draws.sum()


Logits = Callable[[Tensor], Tensor]  # [b, s] token ids -> [b, s, V] main-head logits


@torch.no_grad()
def sample_rollouts(logits_of: Logits, prompts: Tensor, length: int, gen: torch.Generator, temperature: float = 1.0) -> Tensor:
    """Autoregressive sampling from the main head (full recompute per token; tiny models only).

    ``logits_of`` takes CPU token ids and may run the model anywhere; the logits of the last
    position come back to the CPU. The draws come from ``gen`` alone, so two models with identical main parameters sample
    identical rollouts whatever their MTP layers hold.
    """
    tokens = prompts
    while tokens.shape[1] < length:
        last = logits_of(tokens)[:, -1].float().cpu() / temperature
        nxt = torch.multinomial(F.softmax(last, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def group_advantages(rewards: Tensor, group: int) -> Tensor:
    """GRPO advantages: rewards standardised within each group of rollouts of one prompt."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def next_token_targets(tokens: Tensor, prompt: int) -> tuple[Tensor, Tensor]:
    """Next-token labels and the mask of generated targets (the prompt's tokens are not trained)."""
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.zeros_like(tokens, dtype=torch.float32)
    mask[:, prompt - 1 : -1] = 1.0
    labels[:, -1] = 0
    return labels, mask


def policy_gradient_loss(logits: Tensor, labels: Tensor, mask: Tensor, advantages: Tensor) -> Tensor:
    """On-policy GRPO loss (one update per batch, so the ratio is 1): ``-mean(A * log p(token))``."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return -(advantages[:, None] * logp * mask).sum() / mask.sum()


class Task(Protocol):
    """What the benchmark needs of a text: built per seed by ``build(setting, seed, cache)``.

    ``policy_metrics`` names the per-rollout measures ``describe`` returns (besides the reward);
    ``pretrain_batch`` draws ``[count, length]`` training sequences; ``held_out`` is a fixed
    ``[n, length]`` batch for the pretraining's stopping rule (``None``: stop on the draft's
    acceptance instead); ``prompts`` draws ``[count, setting.prompt]`` prompts of the ``"rl"`` or
    ``"eval"`` split.
    """

    name: str
    policy_metrics: tuple[str, ...]

    def pretrain_batch(self, count: int, length: int, gen: torch.Generator) -> Tensor: ...

    def held_out(self) -> Optional[Tensor]: ...

    def prompts(self, count: int, split: str, gen: torch.Generator) -> Tensor: ...

    def reward(self, tokens: Tensor, prompt: int) -> Tensor: ...

    def describe(self, tokens: Tensor, prompt: int) -> dict[str, float]: ...

    def examples(self, tokens: Tensor) -> list[Any]: ...

    def info(self) -> dict[str, Any]: ...

    def cache_key(self) -> Optional[str]: ...


WORD_PROMPT = 2  # BOS and the first word's start token


WORD_REWARDS = ("preferred", "grammatical")


@dataclasses.dataclass
class WordTask:
    """The synthetic word language as a ``Task``: prompts are BOS and a first word's start token. ``reward``:
    ``"preferred"``, the language's (the share of preferred words), or ``"grammatical"``, that times the rollout's
    grammatical share, so a policy that moves far keeps to the language instead of repeating a preferred word's
    start token."""

    language: WordLanguage
    name: str = "words"
    policy_metrics: tuple[str, ...] = ("grammatical_share",)
    reward_kind: str = "preferred"

    @classmethod
    def build(cls, setting: Any, seed: int, cache: Any = None) -> "WordTask":
        kind = getattr(setting, "word_reward", "preferred")
        if kind not in WORD_REWARDS:
            raise ValueError(f"word_reward: expected one of {WORD_REWARDS}, received {kind!r}")
        language = WordLanguage.build(vocab=setting.vocab, seed=seed, letters=getattr(setting, "word_letters", 0),
                                      interior=getattr(setting, "word_interior", (0, 2)))
        return cls(language, reward_kind=kind)

    def pretrain_batch(self, count: int, length: int, gen: torch.Generator) -> Tensor:
        return self.language.sample(count, length, gen)

    def held_out(self) -> Optional[Tensor]:
        return None

    def prompts(self, count: int, split: str, gen: torch.Generator) -> Tensor:
        return self.language.sample(count, WORD_PROMPT, gen)

    def reward(self, tokens: Tensor, prompt: int) -> Tensor:
        preferred = self.language.reward(tokens, prompt)
        return preferred if self.reward_kind == "preferred" else preferred * self.language.grammatical_rows(tokens, prompt)

    def describe(self, tokens: Tensor, prompt: int) -> dict[str, float]:
        return {"grammatical_share": self.language.grammatical_share(tokens, prompt)}

    def examples(self, tokens: Tensor) -> list[Any]:
        return tokens.tolist()

    def info(self) -> dict[str, Any]:
        lang = self.language
        return {"words": lang.words, "preferred": sorted(lang.preferred), "spellings": [list(s) for s in lang.spellings]}

    def cache_key(self) -> Optional[str]:
        # The language is drawn from the seed (in the cache key too) and these sizes.
        lang = self.language
        lengths = sorted({len(s) for s in lang.spellings})
        letters = len({t for s in lang.spellings for t in s[1:]})
        return f"words-v{lang.vocab}-w{lang.words}-len{lengths[0]}to{lengths[-1]}-l{letters}"
