"""Settings of the acceptance benchmark: task, model sizes and schedules per named mode.

Per task: ``quick`` (CI; minutes on 2 cores), ``full`` (the published run), ``smoke`` (the tests,
seconds); the code task also ``gpu``, which scales V, h and the layers up for one CUDA device, and
``chain`` (``chain-smoke``): an N = 1 model drafting k = 3 steps, with the chain-trained variants.
``benchmarks.acceptance --set field=value,...`` overrides any field (e.g. the gpu schedule at tiny
sizes on the CPU: ``--config gpu --set device=cpu,hidden=32,...``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from benchmarks import models
from benchmarks.configs import Config, Shape

WORD_VARIANTS = ("frozen", "ce", "distill", "tv")
CODE_VARIANTS = WORD_VARIANTS + ("accept",)
# The draft chain (``benchmarks.acceptance.chain``): plain = the N layers teacher-forced, ``+tf`` = k steps
# teacher-forced, ``+chain`` = k steps on their own sampled drafts.
CHAIN_VARIANTS = ("frozen", "ce", "ce+tf", "ce+chain", "accept", "accept+chain")
# Measured by vLLM (``--engine vllm``, ``benchmarks.acceptance.engine_run``): trained under the engine's rule and, for
# the chains, its schedule (``@per_step``: SGLang's, for contrast).
# ``+profile``: trained with the engine's profile (``mtp_hooks.profiles``) and decaying step weights; ``+profile_tf``: the
# same with steps 2..k fed the data's tokens (where a later draft counts, every earlier one equalled the target's token).
ENGINE_VARIANTS = ("frozen", "ce", "accept", "ce+chain", "accept+chain", "accept+chain@per_step", "accept+profile",
                   "accept+profile_tf")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Task, sizes and schedule of one run."""

    task: str = "words"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 32
    seq: int = 32  # rollout length, prompt included
    prompt: int = 2
    mtp: int = 2
    sft_seq: Optional[int] = None  # pretraining sequence length (None: seq)
    sft_batch: int = 32
    sft_min_steps: int = 300  # at initialisation both heads are near uniform, so acceptance starts high and dips first
    sft_max_steps: int = 1000
    sft_window: int = 50  # plateau check every this many steps
    sft_tolerance: float = 0.005  # words: window mean acceptance gain; code: relative held-out loss gain
    sft_lr: float = 3e-3
    held_out_windows: int = 64
    files: Optional[int] = None  # code: standard-library files to use (None: all)
    word_reward: str = "preferred"  # words: "preferred", or "grammatical" (times the rollout's grammatical share)
    word_letters: int = 0  # words: interior letters the words share (0: every token past the start tokens)
    word_interior: tuple[int, int] = (0, 2)  # words: least and most interior letters per spelling
    rl_steps: int = 40
    prompts: int = 8
    group: int = 8
    rl_lr: float = 1e-3
    mtp_lr: float = 3e-3
    eval_every: int = 5
    eval_rollouts: int = 64
    temperatures: tuple[float, ...] = (1.0,)
    variants: tuple[str, ...] = WORD_VARIANTS
    chain: int = 0  # draft steps k the chain variants train and every variant is evaluated with (0: the N layers)
    position_embedding: str = "learned_absolute"
    family: str = "gpt"  # the model: "gpt" (benchmarks.models) or "mimo" (Qwen2 with MTP layers, as vLLM runs it: --engine)
    device: str = "cpu"
    seed: int = 0

    @property
    def pretrain_seq(self) -> int:
        return self.sft_seq or self.seq


_CODE = Setting(
    task="code", hidden=128, layers=4, heads=4, vocab=4096, seq=36, prompt=12, sft_seq=48, sft_batch=16,
    sft_min_steps=100, sft_max_steps=120, sft_window=40, sft_tolerance=0.01, sft_lr=2e-3, files=120,
    rl_steps=8, prompts=4, group=4, rl_lr=1e-3, eval_every=8, eval_rollouts=8, temperatures=(1.0, 0.7),
    variants=CODE_VARIANTS, position_embedding="rope",
)
SETTINGS: dict[str, dict[str, Setting]] = {
    "words": {
        "quick": Setting(sft_min_steps=200, sft_max_steps=400, rl_steps=20, eval_every=5, eval_rollouts=128),
        "full": Setting(sft_max_steps=2500, rl_steps=150, eval_every=10, eval_rollouts=256),
        "smoke": Setting(hidden=32, layers=1, seq=12, sft_batch=8, sft_min_steps=0, sft_max_steps=6, sft_window=3, rl_steps=2, prompts=2, group=4, eval_every=1, eval_rollouts=4),
    },
    "code": {
        "quick": _CODE,
        # Measured (2026-12-01): 101 min wall per seed (pretraining and both temperatures) with the three seeds as
        # separate processes side by side on 2 cores (--seeds N, then --merge).
        "full": dataclasses.replace(_CODE, vocab=8192, seq=48, prompt=16, sft_seq=96, sft_min_steps=300, sft_max_steps=800,
                                    sft_window=100, files=None, rl_steps=24, prompts=4, group=4, eval_every=8, eval_rollouts=32),
        "gpu": dataclasses.replace(_CODE, vocab=32768, hidden=512, layers=8, heads=8, seq=160, prompt=32, sft_seq=512, sft_batch=32,
                                   sft_min_steps=1000, sft_max_steps=10000, sft_window=200, sft_lr=1e-3, held_out_windows=256, files=None,
                                   rl_steps=100, prompts=16, group=8, eval_every=20, eval_rollouts=128, device="cuda"),
        "smoke": dataclasses.replace(_CODE, vocab=1024, hidden=32, layers=1, seq=14, prompt=8, sft_seq=16, sft_batch=4, sft_min_steps=0,
                                     sft_max_steps=4, sft_window=2, held_out_windows=4, files=40, rl_steps=2, prompts=2, group=2,
                                     eval_every=1, eval_rollouts=3),
    },
}
# One temperature, the quick RL schedule, more evaluation rollouts (steps 2..3 are tried only after
# step 1 is accepted): about 4 min per seed on one core.
SETTINGS["code"]["chain"] = dataclasses.replace(_CODE, mtp=1, chain=3, temperatures=(1.0,), variants=CHAIN_VARIANTS, eval_rollouts=32)
# --engine vllm: a MiMo-shaped model (Qwen2 + 2 MTP layers) that vLLM runs with method="mtp"; the chains train k = 3 steps,
# and the engine drafts k = 1..3 greedily. One rollout temperature (1.0); rl_lr 3e-4: at 1e-3 the quick run's greedy
# continuations had collapsed to ". . . ." by step 8 (measured), and the engine evaluates greedy continuations.
# engine-quick: one seed, about 1.5 min on 2 cores with its pretraining (docs/development.md); engine: 3 seeds.
SETTINGS["code"]["engine-quick"] = dataclasses.replace(_CODE, family="mimo", chain=3, temperatures=(1.0,), variants=ENGINE_VARIANTS, rl_lr=3e-4)
SETTINGS["code"]["engine"] = dataclasses.replace(SETTINGS["code"]["engine-quick"], seq=48, sft_min_steps=300, sft_max_steps=600, sft_window=100,
                                                 rl_steps=24, eval_every=8, eval_rollouts=32)
# The engine test's (tests/engine/test_engine_acceptance_bench.py): seconds of training, four engine starts.
SETTINGS["code"]["engine-smoke"] = dataclasses.replace(SETTINGS["code"]["smoke"], family="mimo", hidden=64, chain=3, temperatures=(1.0,),
                                                       variants=("frozen", "ce", "accept+chain"), seq=20, eval_rollouts=4)
# --engine vllm on the word task (the default of --engine): a confident policy, as a rollout engine drafts for. Inside
# a word the next token is certain and at a boundary the bigram's top successor has about 0.6 of the mass, so at
# T = 1 a perfect draft is accepted about 0.8 of the time at position 1 (the code task's small model: 0.05-0.19).
# The engine measures at the rollouts' T (temperatures[0]) with T = 0 beside it; rl_lr 3e-4 (``--set rl_lr=0.001``:
# a policy that moves far), mtp_lr 1e-3 (at 3e-4 every trained variant gained less at rl_lr 1e-3, BENCHMARKS.md).
WORD_ENGINE_VARIANTS = ("frozen", "ce", "accept", "accept+chain", "accept+profile", "accept+profile_tf")
_WORD_ENGINE = Setting(family="mimo", hidden=64, layers=2, vocab=64, seq=32, prompt=2, mtp=2, chain=3, sft_min_steps=300,
                       sft_max_steps=1500, rl_lr=3e-4, mtp_lr=1e-3, temperatures=(1.0,), variants=WORD_ENGINE_VARIANTS,
                       word_reward="grammatical", word_letters=4, word_interior=(2, 4))
SETTINGS["words"]["engine-quick"] = dataclasses.replace(_WORD_ENGINE, rl_steps=12, eval_every=6, eval_rollouts=96)
SETTINGS["words"]["engine"] = dataclasses.replace(_WORD_ENGINE, rl_steps=40, eval_every=10, eval_rollouts=128)
SETTINGS["words"]["engine-smoke"] = dataclasses.replace(_WORD_ENGINE, sft_min_steps=60, sft_max_steps=60, sft_window=20, sft_batch=16, seq=14,
                                                        rl_steps=2, prompts=2, group=4, eval_every=1, eval_rollouts=4,
                                                        variants=("frozen", "ce", "accept+profile"))
# make rollout-speed (benchmarks.rollout_speed): the word task on a target where speculation can pay in wall time on
# this CPU, 512 x 8 (31.5 M main parameters: one request's decode step is dominated by reading the weights, and
# verifying 4 tokens costs about 1.5 of its steps; BENCHMARKS.md, "Where speculation can pay"), with one MTP layer
# drafting k = 3, pretrained at lr 1e-3 (3e-3 is the small model's). A short GRPO run in which the policy learns
# (rl_lr 3e-4: the reward rises from about 0.7 to 0.97 in 8 steps; at 1e-3 it collapsed to 0.04 by step 8, measured),
# the draft frozen or trained with vLLM's profile at the README's MTP rate (mtp_lr 3e-4; at 1e-3 seed 0's trained draft
# ended below frozen, 291 verification steps against 277, measured). speed-quick: one seed.
SPEED_VARIANTS = ("frozen", "accept+profile")
_SPEED = dataclasses.replace(_WORD_ENGINE, hidden=512, layers=8, mtp=1, sft_min_steps=150, sft_max_steps=400, sft_window=50, sft_lr=1e-3,
                             rl_steps=24, prompts=4, group=8, rl_lr=3e-4, mtp_lr=3e-4, eval_every=4, eval_rollouts=32, variants=SPEED_VARIANTS)
SETTINGS["words"]["speed"] = _SPEED
SETTINGS["words"]["speed-quick"] = dataclasses.replace(_SPEED, rl_steps=12, eval_rollouts=16)
SETTINGS["words"]["speed-smoke"] = dataclasses.replace(_SPEED, hidden=64, layers=2, sft_min_steps=20, sft_max_steps=20, sft_window=10, sft_batch=8,
                                                       rl_steps=1, prompts=2, group=2, eval_rollouts=2)
SETTINGS["code"]["chain-smoke"] = dataclasses.replace(SETTINGS["code"]["smoke"], mtp=1, chain=3, temperatures=(1.0,), variants=CHAIN_VARIANTS)


def controlled(setting: Setting, threads: int) -> None:
    """``threads`` intra-op threads and, off the CPU, deterministic kernels: the controlled experiment needs
    bit-identical main updates in every variant."""
    torch.set_num_threads(threads)
    if setting.device != "cpu":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def config(setting: Setting) -> Config:
    shape = shape_of(setting)
    return Config(
        name="acceptance", device=setting.device, dtype=torch.float32, base=shape, vocab_sweep=(), seq_sweep=(), mtp_sweep=(),
        rounds=1, warmup=0, position_embedding=setting.position_embedding,
    )


def build_model(setting: Setting, seed: int = 1234) -> Any:
    """A fresh model of ``setting`` (fp32, untied head): ``benchmarks.models``' GPT, or for ``family="mimo"``
    the Qwen2-style one of ``mtp_hooks.testing.engine_models`` (RMSNorm, SwiGLU, RoPE, GQA, QKV bias)."""
    if setting.family == "mimo":
        from mtp_hooks.testing.engine_models import shape

        model = shape("mimo", setting.mtp, hidden_size=setting.hidden, num_layers=setting.layers, vocab_size=setting.vocab).build(seed)
        return model if setting.device == "cpu" else model.to(setting.device)
    if setting.family != "gpt":
        raise ValueError(f"family: expected 'gpt' or 'mimo', received {setting.family!r}")
    return models.build(config(setting), shape_of(setting), setting.mtp, seed=seed)


def shape_of(setting: Setting) -> Shape:
    # Room for the speculative loop's two draft tokens past the rollout length.
    return Shape(vocab=setting.vocab, seq=max(setting.seq + 2, setting.pretrain_seq), mtp=setting.mtp,
                 hidden=setting.hidden, layers=setting.layers, heads=setting.heads)




def overrides(text: str) -> dict[str, Any]:
    """``hidden=32,layers=1`` -> typed values for ``Setting``'s fields."""
    types = {f.name: f.type for f in dataclasses.fields(Setting)}
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in types:
            raise ValueError(f"--set: unknown field {name!r}; fields: {', '.join(types)}")
        kind = str(types[name])
        if kind == "Optional[int]":
            out[name] = None if value == "None" else int(value)
        elif kind in ("int", "float"):
            out[name] = int(value) if kind == "int" else float(value)
        elif kind == "str":
            out[name] = value
        elif kind == "tuple[float, ...]":  # temperatures=1.0/0.7
            out[name] = tuple(float(part) for part in value.split("/"))
        else:
            raise ValueError(f"--set: field {name!r} ({kind}) cannot be set from the command line")
    return out
