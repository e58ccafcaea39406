"""vLLM's rollouts timed: the same sampled prompts without speculation and with each draft, and where a step's time goes.

Two engines in this process: one without speculation, one drafting k tokens with the MTP layer (started last: an
in-process engine's metrics are the last one's). Both start from the pretrained checkpoint; the spec engine first
generates the timing prompts once with the pretrained weights (the frozen draft's acceptance before RL), then both
take the RL run's main weights and the spec engine each draft's MTP layer in turn (``VLLMSync.push`` + ``check``,
outside the timed calls). In each round every variant generates the same prompts, prompt i seeded ``seed + i``, the
same number of tokens (``ignore_eos``), in an order that rotates from round to round; then one more run per variant
with forward timers on the engine's target and draft models (``StepTimers``) says where a step's time goes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.acceptance.engine_measure import push_checked, write_checkpoint
from mtp_hooks.engine import VLLMSync, generate_sampled, start_vllm, stop_vllm
from mtp_hooks.engine.vllm_worker import engine_model

PLAIN = "no speculation"


@dataclasses.dataclass
class StepTimers:
    """Seconds and calls of the forwards of an engine's target model and draft model, by forward hooks.

    On CUDA each forward is bracketed by ``torch.cuda.synchronize()``: the profiled run is slower than the timed
    rounds, which are never profiled."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    handles: list[Any] = dataclasses.field(default_factory=list)

    def watch(self, role: str, model: nn.Module) -> None:
        self.seconds[role], self.calls[role] = 0.0, 0
        started: list[float] = []
        cuda = any(p.is_cuda for p in model.parameters())

        def before(module: nn.Module, args: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            started.append(time.perf_counter())

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.seconds[role] += time.perf_counter() - started.pop()
            self.calls[role] += 1

        self.handles += [model.register_forward_pre_hook(before), model.register_forward_hook(after)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _watch_worker(worker: Any, speculative: bool) -> StepTimers:
    timers = StepTimers()
    timers.watch("target", engine_model(worker, "target")[0])
    if speculative:
        timers.watch("draft", engine_model(worker, "draft")[0])
    return timers


@dataclasses.dataclass
class Timing:
    """How one variant generated: the wall seconds of every timed round, vLLM's counts, and the profiled run's."""

    rounds: list[float]
    drafts_per_round: list[int]  # verification steps of each timed run (0 without speculation; the same seeds, the same count)
    drafts: int  # of the last round
    accepted: int
    accepted_per_position: list[int]
    target_forwards: int  # in the profiled run
    target_seconds: float
    draft_forwards: int
    draft_seconds: float
    profiled_seconds: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every variant generates and how the engines run: ``tokens`` per prompt at ``temperature``, prompt i
    seeded ``seed + i``; ``k`` drafted tokens; ``rounds`` timed rounds; ``batch`` requests at once (max_num_seqs)."""

    tokens: int
    temperature: float
    seed: int
    k: int
    rounds: int
    batch: int
    vocab: int
    config: str = "cpu"


def time_rollouts(folder: Path, pretrained: nn.Module, final: nn.Module, drafts: dict[str, dict[str, Any]], prompts: list[list[int]],
                  plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant (``PLAIN`` and each of ``drafts``, name -> the trained model's state) timed as the module says;
    ``pretrained`` and ``final`` are models holding the pretrained and the RL run's weights (``final``'s MTP layer is
    loaded with each draft in turn)."""
    tokens, temperature, seed, k, rounds = plan.tokens, plan.temperature, plan.seed, plan.k, plan.rounds
    write_checkpoint(folder, pretrained, plan.vocab)
    engine = dict(config=plan.config, dtype="float32", max_num_seqs=plan.batch)
    plain = start_vllm(str(folder), 0, **engine)
    spec = None
    try:
        spec = start_vllm(str(folder), k, **engine)
        before = generate_sampled(spec, prompts, tokens, temperature, seed)
        log(f"  before RL, frozen draft: acceptance per position {', '.join(f'{a:.3f}' for a in before.per_position)}")
        syncs = {PLAIN: VLLMSync(plain), "spec": VLLMSync(spec)}
        for sync in syncs.values():
            push_checked(sync, final, main=True)
        names = [PLAIN, *drafts]

        def engine_for(name: str) -> Any:
            """The engine that generates for ``name``, holding its draft."""
            if name == PLAIN:
                return plain
            final.load_state_dict(drafts[name])
            push_checked(syncs["spec"], final, main=False)
            return spec

        for name in names:  # warm-up
            generate_sampled(engine_for(name), prompts, tokens, temperature, seed)
        walls: dict[str, list[float]] = {name: [] for name in names}
        counts: dict[str, list[Any]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no variant always first
                out = generate_sampled(engine_for(name), prompts, tokens, temperature, seed)
                walls[name].append(out.seconds)
                counts[name].append(out.counts)
            log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{name} {walls[name][-1]:.2f} s" for name in names))
        timings = {}
        for name in names:
            llm = engine_for(name)
            timers: StepTimers = llm.collective_rpc(_watch_worker, args=(name != PLAIN,))[0]
            try:
                out = generate_sampled(llm, prompts, tokens, temperature, seed)
            finally:
                timers.remove()
            last = counts[name][-1]
            timings[name] = Timing(walls[name], [each.drafts for each in counts[name]], last.drafts, last.accepted,
                                   list(last.accepted_per_position), timers.calls["target"], timers.seconds["target"],
                                   timers.calls.get("draft", 0), timers.seconds.get("draft", 0.0), out.seconds)
    finally:
        if spec is not None:
            stop_vllm(spec)
        stop_vllm(plain)
    return {"before_rl_per_position": list(before.per_position), "before_rl_accept_len": before.mean_length,
            "variants": {name: dataclasses.asdict(t) for name, t in timings.items()}}


def summary(variant: dict[str, Any], plain: dict[str, Any], tokens_total: int) -> dict[str, Any]:
    """What explains a variant's time against the plain engine's, per step: the wall median and range, tokens per
    second, accepted tokens per target forward, the step's parts from the profiled run, and the speedup they predict
    (tokens per step x the plain step / the speculative step) next to the one measured (the medians' ratio)."""
    wall = statistics.median(variant["rounds"])
    plain_wall = statistics.median(plain["rounds"])
    steps = variant["target_forwards"]
    plain_step = plain["profiled_seconds"] / plain["target_forwards"]
    step = variant["profiled_seconds"] / steps
    per_forward = tokens_total / steps  # generated tokens per target forward (prefill steps included)
    out = {
        "wall_s": wall, "wall_range": [min(variant["rounds"]), max(variant["rounds"])],
        "tokens_per_s": tokens_total / wall,
        "tokens_per_target_forward": per_forward,
        "accept_len": 1 + variant["accepted"] / variant["drafts"] if variant["drafts"] else 1.0,
        "accept_per_position": [a / variant["drafts"] for a in variant["accepted_per_position"]] if variant["drafts"] else [],
        "step_s": step,
        "target_forward_s": variant["target_seconds"] / steps,  # one token without speculation; k + 1 verified with it
        "draft_s": variant["draft_seconds"] / steps,  # the drafter's k forwards per step
        "other_s": step - (variant["target_seconds"] + variant["draft_seconds"]) / steps,
        "speedup_measured": plain_wall / wall,
        "speedup_predicted": per_forward * plain_step / step,
    }
    if variant["draft_forwards"]:
        out["draft_forwards_per_step"] = variant["draft_forwards"] / steps
    return out
