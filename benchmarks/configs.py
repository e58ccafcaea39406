"""Benchmark configurations: one base shape, and sweeps that vary one of vocab, sequence length, N.

``cpu`` (the default): base V = 32,000, s = 512, h = 32, N = 2, fp32, with sweeps up to the vocabularies
of real models (129,280: DeepSeek-V3; 151,936: Qwen2.5) and s = 4,096, b = 1, a "realistic" sweep with
both large at once (V = 129,280, s = 1,024 and 2,048), and the loss alone at realistic shapes; h and the
layer count are small so that stock's fp32 logits fit a shared machine's memory and the run takes
minutes, not hours.
``gpu`` is the realistic, head-dominant shape (vocab 151,936, sequence 4,096, hidden 2,048, bf16) for one
GPU. ``smoke`` (``--quick``) is seconds long: every variant, the machinery end to end, tiny shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model and micro-batch shape. ``mtp`` is N, the number of MTP layers."""

    vocab: int
    seq: int
    mtp: int
    hidden: int
    layers: int
    heads: int
    batch: int = 1

    @property
    def key(self) -> str:
        return f"V{self.vocab}-s{self.seq}-N{self.mtp}"

    def logits_bytes(self, tp: int = 1) -> int:
        """fp32 logits of one head over the micro-batch: ``s * b * V/tp * 4`` bytes."""
        return self.seq * self.batch * (self.vocab // tp) * 4


@dataclasses.dataclass(frozen=True)
class Config:
    """A benchmark configuration: where it runs, precision, base shape, sweeps and timing rounds.

    Exact counts (FLOPs, peak live bytes, host syncs) are taken once per variant at every point.
    Wall time comes from ``rounds`` interleaved rounds (every variant once per round, in a rotated
    order) after ``warmup`` untimed micro-batches: all variants at the base shape, and at the other
    sweep points the variants in ``sweep_timed`` (``None``: all).
    """

    name: str
    device: str
    dtype: torch.dtype
    base: Shape
    vocab_sweep: tuple[int, ...]
    seq_sweep: tuple[int, ...]
    mtp_sweep: tuple[int, ...]
    rounds: int
    warmup: int
    position_embedding: str
    sweep_timed: Optional[tuple[str, ...]] = ("stock", "hooks_lean")
    chunk_size: Optional[int] = None  # lean loss chunk; None: the library's default
    # Variants measured away from the base shape (None: all); the others only at the base shape.
    sweep_variants: Optional[tuple[str, ...]] = None
    # The "realistic" sweep: sequence lengths at a real model's vocabulary (both large at once).
    realistic_vocab: Optional[int] = None
    realistic_seq_sweep: tuple[int, ...] = ()
    # The loss alone (``benchmarks.loss_shapes``) at (vocab, tokens, hidden), with the fused path
    # under mcore's gradient-accumulation protocol; empty: not run.
    loss_shapes: tuple[tuple[int, int, int], ...] = ()
    # Whether the memory goal is judged: its margin (0.9 of N logits, plus the fp32 accumulator) is meant for
    # real vocabularies; at tiny ones the V/tp x h tensors backward creates anyway set the peak, not the logits.
    memory_goal: bool = True

    def points(self) -> list[tuple[str, Shape]]:
        """(sweep name, shape) for every point; the base shape appears in every sweep."""
        out = []
        for value in self.vocab_sweep:
            out.append(("vocab", dataclasses.replace(self.base, vocab=value)))
        for value in self.seq_sweep:
            out.append(("seq", dataclasses.replace(self.base, seq=value)))
        for value in self.mtp_sweep:
            out.append(("mtp", dataclasses.replace(self.base, mtp=value)))
        for value in self.realistic_seq_sweep:
            assert self.realistic_vocab is not None, "a realistic sweep needs realistic_vocab"
            out.append(("realistic", dataclasses.replace(self.base, vocab=self.realistic_vocab, seq=value)))
        return out

    def shapes(self) -> list[Shape]:
        """Distinct shapes to measure: base first, then the most expensive (largest T · V) first, so that a
        run cut short (its ``results.json`` is written after every shape) holds the realistic shapes."""
        seen: dict[Shape, None] = {}
        for _, shape in self.points():
            if shape != self.base:
                seen.setdefault(shape, None)
        rest = sorted(seen, key=lambda s: (s.seq * s.batch * s.vocab * (s.mtp + 1)), reverse=True)
        return [self.base, *rest]


# The sweeps, as the tables and the plot name them: title, the symbol of the varied dimension, the Shape field.
SWEEP_TITLES = {"vocab": "vocabulary size V", "seq": "sequence length s", "mtp": "MTP depth N",
                "realistic": "sequence length s at a real vocabulary"}
SWEEP_SYMBOLS = {"vocab": "V", "seq": "s", "mtp": "N", "realistic": "s"}
SWEEP_ATTRIBUTES = {"vocab": "vocab", "seq": "seq", "mtp": "mtp", "realistic": "seq"}  # the Shape field each varies


def sweep_title(config: Config, sweep: str) -> str:
    """What ``sweep`` varies, in words (the realistic sweep names its vocabulary)."""
    if sweep == "realistic":
        return f"sequence length s at V = {config.realistic_vocab:,}"
    return SWEEP_TITLES[sweep]


def sweeps(config: Config) -> list[str]:
    """The sweeps ``config`` has points in, in ``SWEEP_TITLES`` order."""
    present = {name for name, _ in config.points()}
    return [sweep for sweep in SWEEP_TITLES if sweep in present]


CONFIGS: dict[str, Config] = {
    "cpu": Config(
        name="cpu",
        device="cpu",
        dtype=torch.float32,  # bf16 matmuls are emulated (tens of times slower) on CPUs without AMX
        base=Shape(vocab=32000, seq=512, mtp=2, hidden=32, layers=2, heads=4),
        vocab_sweep=(8000, 32000, 129280, 151936),
        seq_sweep=(128, 512, 2048, 4096),
        mtp_sweep=(1, 2, 3),
        rounds=5,
        warmup=1,
        position_embedding="learned_absolute",
        sweep_variants=("stock", "verl", "no_mtp", "hooks_lean", "hooks_lean_detach_head", "trainer_logits", "trainer_logprobs"),
        realistic_vocab=129280,
        realistic_seq_sweep=(1024, 2048),
        loss_shapes=((129280, 1024, 128), (151936, 2048, 128)),
    ),
    "gpu": Config(
        name="gpu",
        device="cuda",
        dtype=torch.bfloat16,
        base=Shape(vocab=151936, seq=4096, mtp=2, hidden=2048, layers=4, heads=16),
        vocab_sweep=(32768, 65536, 151936),
        seq_sweep=(1024, 2048, 4096),
        mtp_sweep=(1, 2, 3),
        rounds=7,
        warmup=2,
        position_embedding="rope",
        sweep_timed=None,
    ),
    # A seconds-long configuration for checking the machinery end to end.
    "smoke": Config(
        name="smoke",
        device="cpu",
        dtype=torch.float32,
        base=Shape(vocab=2048, seq=64, mtp=2, hidden=64, layers=1, heads=4),
        vocab_sweep=(1024, 2048),
        seq_sweep=(32, 64),
        mtp_sweep=(1, 2),
        rounds=5,
        warmup=1,
        position_embedding="learned_absolute",
        loss_shapes=((2048, 64, 64),),
        memory_goal=False,
    ),
}
