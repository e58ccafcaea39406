"""Every variant at one shape: exact counts once, then wall time in interleaved rounds.

All variants' models are built for the shape (same seed, so the same weights) and kept side by side,
so that the timed rounds can alternate between them: round r runs each timed variant once, in an
order rotated by r, so that slow phases of a shared machine hit every variant alike. Per variant:

1. ``warmup`` untimed training and inference micro-batches;
2. one counted training and one counted inference micro-batch: FLOPs (``flop_counter``), host
   syncs (``HostSyncs``), host-to-device tensors (``HostToDevice``) and peak live bytes above what was live before the call (``LiveBytes`` on
   CPU; ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` on CUDA);
3. ``rounds`` timed training (and, where asked, inference) micro-batches, interleaved: wall and
   process CPU time of each, and the 1-minute load average after it.

Gradients are set to ``None`` before each training micro-batch, outside counted and timed regions,
so the gradients a micro-batch creates are part of its peak, as in a real first micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

import mtp_hooks
from benchmarks import models
from benchmarks.configs import Config, Shape
from benchmarks.counters import HostSyncs, HostToDevice, LiveBytes, flop_counter
from benchmarks.variants import VARIANTS, TrainerState, Variant, loss_path
from benchmarks.verl_baseline import Unavailable


@dataclasses.dataclass
class Prepared:
    """One variant's model, its state from ``prepare`` and the micro-batch it runs."""

    variant: Variant
    model: nn.Module
    state: Any
    batch: models.Batch

    def train(self) -> None:
        self.variant.train(self.model, self.batch, self.state)

    def infer(self) -> None:
        self.variant.infer(self.model, self.batch, self.state)

    def tidy(self) -> None:
        """Between micro-batches, never inside a measured one: drop gradients and logged losses."""
        self.model.zero_grad(set_to_none=True)
        MTPLossLoggingHelper.tracker.clear()
        hooks = self.state.hooks if isinstance(self.state, TrainerState) else self.state
        if isinstance(hooks, mtp_hooks.MTPHooks):
            hooks.metrics(reset=True)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], cuda: bool) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call, device work included (synchronised before and
    after on CUDA only). Process CPU time counts this process's threads only, so other processes on a
    shared machine change it less than the wall time (they still take cores, caches and memory bandwidth)."""
    _sync(cuda)
    cpu_start, start = time.process_time(), time.perf_counter()
    fn()
    _sync(cuda)
    return time.perf_counter() - start, time.process_time() - cpu_start


def counted(fn: Callable[[], None], cuda: bool) -> dict[str, Any]:
    """FLOPs, peak live bytes above the bytes live before, host syncs and host-to-device tensors of one call."""
    gc.collect()
    _sync(cuda)
    live = contextlib.nullcontext() if cuda else LiveBytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with live, HostSyncs() as syncs, HostToDevice() as h2d, flop_counter() as flops:
        fn()
    if cuda:
        _sync(cuda)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        assert isinstance(live, LiveBytes)
        peak = live.peak
    return {"flops": flops.get_total_flops(), "peak_bytes": peak, "syncs": syncs.count, "syncs_by_op": dict(syncs.by_op),
            "h2d": h2d.count, "h2d_by_op": dict(h2d.by_op)}


def prepare(config: Config, shape: Shape, names: list[str]) -> tuple[dict[str, Prepared], dict[str, str]]:
    """Model and state per variant; variants whose options the installed library refuses, with why."""
    prepared: dict[str, Prepared] = {}
    refused: dict[str, str] = {}
    for name in names:
        variant = VARIANTS[name]
        model = models.build(config, shape, shape.mtp if variant.with_mtp else None)
        try:
            state = variant.prepare(model, config)
        except mtp_hooks.MTPHooksError as error:
            refused[name] = "the installed mtp_hooks refuses it: " + " ".join(str(error).split())
            continue
        except Unavailable as error:
            refused[name] = str(error)
            continue
        prepared[name] = Prepared(variant, model, state, models.make_batch(config, shape))
    return prepared, refused


def run_shape(
    config: Config, shape: Shape, names: list[str], timed_names: list[str], time_inference: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Counts and round timings of every variant in ``names`` at ``shape``, and the refused ones.

    The shape's models are gone when this returns (the caching allocator's reserve is emptied on CUDA).
    """
    prepared, refused = prepare(config, shape, names)
    out = _measure(config, prepared, timed_names, time_inference)
    del prepared
    gc.collect()
    if config.device != "cpu":
        torch.cuda.empty_cache()
    return out, refused


def _measure(
    config: Config, prepared: dict[str, Prepared], timed_names: list[str], time_inference: bool
) -> dict[str, dict[str, Any]]:
    cuda = config.device != "cpu"
    out: dict[str, dict[str, Any]] = {}
    for name, p in prepared.items():
        for _ in range(config.warmup):
            p.tidy()
            p.train()
            p.infer()
        p.tidy()
        train = counted(p.train, cuda)
        path: Optional[str] = loss_path(p.state)
        p.tidy()
        infer = counted(p.infer, cuda)
        p.tidy()
        out[name] = {"label": p.variant.label, "loss_path": path, "train": train, "infer": infer,
                     "train_s": [], "infer_s": [], "train_cpu_s": [], "infer_cpu_s": [], "load": []}
    order = [name for name in prepared if name in timed_names]
    for round_index in range(config.rounds if order else 0):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            p = prepared[name]
            p.tidy()
            wall, cpu = timed(p.train, cuda)
            out[name]["train_s"].append(wall)
            out[name]["train_cpu_s"].append(cpu)
            if time_inference:
                wall, cpu = timed(p.infer, cuda)
                out[name]["infer_s"].append(wall)
                out[name]["infer_cpu_s"].append(cpu)
            out[name]["load"].append(os.getloadavg()[0])
    for p in prepared.values():
        p.tidy()
    return out
