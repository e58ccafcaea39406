"""Benchmark configurations: one base shape, and sweeps that vary one of vocab, sequence length, N.

``cpu`` (the default) finishes in about two minutes on 2 cores; ``gpu`` is the realistic,
head-dominant shape (vocab 151,936, sequence 4,096, hidden 2,048, bf16) meant for one GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


# Variant name -> label, in report order. What each one runs: benchmarks/variants.py.
VARIANT_LABELS: dict[str, str] = {
    "stock": "stock mcore",
    "patched": "instance patch",
    "no_mtp": "no MTP layers",
    "hooks_dense": "mtp_hooks dense",
    "hooks_lean": "mtp_hooks lean",
}


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
    """A benchmark configuration: where it runs, precision, base shape, sweeps and repeats."""

    name: str
    device: str
    dtype: torch.dtype
    base: Shape
    vocab_sweep: tuple[int, ...]
    seq_sweep: tuple[int, ...]
    mtp_sweep: tuple[int, ...]
    repeats: int
    warmup: int
    rounds: int
    memory_repeats: int
    position_embedding: str
    chunk_size: Optional[int] = None  # lean loss chunk; None: the library's default

    def points(self) -> list[tuple[str, Shape]]:
        """(sweep name, shape) for every point; the base shape appears in every sweep."""
        out = []
        for value in self.vocab_sweep:
            out.append(("vocab", dataclasses.replace(self.base, vocab=value)))
        for value in self.seq_sweep:
            out.append(("seq", dataclasses.replace(self.base, seq=value)))
        for value in self.mtp_sweep:
            out.append(("mtp", dataclasses.replace(self.base, mtp=value)))
        return out

    def shapes(self) -> list[Shape]:
        """Distinct shapes to measure, base first."""
        seen: dict[Shape, None] = {self.base: None}
        for _, shape in self.points():
            seen.setdefault(shape, None)
        return list(seen)


CONFIGS: dict[str, Config] = {
    "cpu": Config(
        name="cpu",
        device="cpu",
        dtype=torch.float32,  # bf16 matmuls are emulated (tens of times slower) on CPUs without AMX
        base=Shape(vocab=16384, seq=256, mtp=2, hidden=128, layers=2, heads=4),
        vocab_sweep=(4096, 16384, 65536),
        seq_sweep=(128, 256, 512),
        mtp_sweep=(1, 2, 3),
        repeats=3,
        warmup=1,
        rounds=1,
        memory_repeats=1,
        position_embedding="learned_absolute",
    ),
    "gpu": Config(
        name="gpu",
        device="cuda",
        dtype=torch.bfloat16,
        base=Shape(vocab=151936, seq=4096, mtp=2, hidden=2048, layers=4, heads=16),
        vocab_sweep=(32768, 65536, 151936),
        seq_sweep=(1024, 2048, 4096),
        mtp_sweep=(1, 2, 3),
        repeats=5,
        warmup=2,
        rounds=1,  # one process per variant: about 5 minutes on one H200
        memory_repeats=1,
        position_embedding="rope",
    ),
    # A seconds-long configuration for checking the machinery end to end.
    "smoke": Config(
        name="smoke",
        device="cpu",
        dtype=torch.float32,
        base=Shape(vocab=2048, seq=64, mtp=2, hidden=64, layers=1, heads=4),
        vocab_sweep=(1024, 2048),
        seq_sweep=(64,),
        mtp_sweep=(1, 2),
        repeats=2,
        warmup=1,
        rounds=1,
        memory_repeats=1,
        position_embedding="learned_absolute",
    ),
}
