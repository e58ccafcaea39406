"""One benchmark variant in its own process: every shape of a config, written to a JSON file.

``python -m benchmarks.run_one --config cpu --variant hooks_lean --out result.json``

First every shape is timed: build the model, warm up (training and inference micro-batches),
then ``repeats`` timed training and inference micro-batches. Then every shape is built and
warmed up again for ``memory_repeats`` peak-memory probes of each, kept apart from the timed
runs because the probe changes how the allocator returns memory (see ``measure``).
Prints a ``progress`` line after each shape and phase, for the parent's progress bar.
``--variant idle`` measures the cost of idle hooks instead (see ``measure_idle``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import sys
import warnings
from typing import Any, Callable, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size).*")

import torch  # noqa: E402

import megatron.core  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.configs import CONFIGS, Config, Shape  # noqa: E402
from benchmarks.measure import Meter  # noqa: E402
from benchmarks.variants import VARIANTS, Variant  # noqa: E402

IDLE_SHAPE = Shape(vocab=256, seq=16, mtp=1, hidden=32, layers=1, heads=4)
IDLE_CALLS = 500


def environment(config: Config) -> dict[str, Any]:
    """Versions and machine, recorded with every result."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "mtp_hooks": mtp_hooks.__version__,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if config.device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def _mtp_losses(variant: Variant, state: Any) -> Optional[list[float]]:
    """Per-depth MTP loss (masked mean CE) of the last training micro-batch, where readable."""
    if variant.name == "stock":
        values = MTPLossLoggingHelper.tracker.get("values")
        out = None if values is None else [float(v) for v in values.tolist()]
        MTPLossLoggingHelper.tracker.clear()
        return out
    if isinstance(state, mtp_hooks.MTPHooks):
        metrics = state.metrics(reset=True)
        return [metrics[f"mtp_{k}/loss"] for k in range(1, state.depth + 1)]
    return None


def _prepared(
    config: Config, variant: Variant, shape: Shape, warmup: int
) -> tuple[Any, Callable[[], None], Callable[[], None], Optional[list[float]]]:
    """Model, training step, inference step, after ``warmup`` of each; MTP losses of the first step."""
    model = models.build(config, shape, shape.mtp if variant.with_mtp else None)
    state = variant.prepare(model, config)
    batch = models.make_batch(config, shape)

    def train() -> None:
        variant.train(model, batch, state)

    def infer() -> None:
        variant.infer(model, batch, state)

    losses = None
    for i in range(warmup):
        MTPLossLoggingHelper.tracker.clear()
        model.zero_grad(set_to_none=True)
        train()
        if i == 0 and variant.with_mtp:
            losses = _mtp_losses(variant, state)  # before the inference pass, which stock also logs
        infer()
    return model, train, infer, losses


def _release(meter: Meter) -> None:
    MTPLossLoggingHelper.tracker.clear()
    gc.collect()
    if meter.cuda:
        torch.cuda.empty_cache()


def time_shape(config: Config, variant: Variant, shape: Shape, meter: Meter) -> dict[str, Any]:
    """``repeats`` timed training and inference micro-batches of one variant at one shape."""
    model, train, infer, losses = _prepared(config, variant, shape, config.warmup)
    result: dict[str, Any] = {"shape": dataclasses.asdict(shape), "mtp_losses": losses, "train_s": [], "infer_s": []}
    for _ in range(config.repeats):
        model.zero_grad(set_to_none=True)  # outside the measured call: gradients are allocated inside it
        result["train_s"].append(meter.time(train))
        result["infer_s"].append(meter.time(infer))
    del model, train, infer
    _release(meter)
    return result


def probe_memory(config: Config, variant: Variant, shape: Shape, meter: Meter) -> dict[str, list[int]]:
    """Peak memory of ``memory_repeats`` training and inference micro-batches (after warm-up)."""
    model, train, infer, _ = _prepared(config, variant, shape, warmup=1)
    result: dict[str, list[int]] = {"train_mem": [], "train_mem_abs": [], "infer_mem": [], "infer_mem_abs": []}
    for _ in range(config.memory_repeats):
        model.zero_grad(set_to_none=True)
        growth, absolute = meter.peak_growth(train)
        result["train_mem"].append(growth)
        result["train_mem_abs"].append(absolute)
        growth, absolute = meter.peak_growth(infer)
        result["infer_mem"].append(growth)
        result["infer_mem_abs"].append(absolute)
    del model, train, infer
    _release(meter)
    return result


def measure_idle(config: Config, meter: Meter) -> dict[str, Any]:
    """Cost of hooks that are attached but idle, on a tiny model where it is not lost in compute.

    Inference forwards of an MTP model with ``mtp_hooks`` attached (the hooks switch the MTP
    block off, install the config view, restore) against the same model built without MTP layers
    and without hooks: ``IDLE_CALLS`` forwards each, interleaved. The per-forward cost is the
    difference of the *fastest* forwards (interference from other processes only ever adds time,
    so the minimum is the cost without it); medians are recorded too. The report divides the
    cost by the benchmark shape's no-MTP forward.
    """
    hooked = models.build(config, IDLE_SHAPE, IDLE_SHAPE.mtp)
    plain = models.build(config, IDLE_SHAPE, None)
    hooks = mtp_hooks.attach(hooked)
    batch = models.make_batch(config, IDLE_SHAPE)
    samples: dict[str, list[float]] = {"hooked": [], "plain": []}
    with torch.no_grad():
        for _ in range(10):
            hooked(*batch.model_args)
            plain(*batch.model_args)
        for _ in range(IDLE_CALLS):
            samples["hooked"].append(meter.time(lambda: hooked(*batch.model_args)))
            samples["plain"].append(meter.time(lambda: plain(*batch.model_args)))
    hooks.remove()
    out: dict[str, Any] = {"shape": dataclasses.asdict(IDLE_SHAPE), "calls": IDLE_CALLS}
    for name, values in samples.items():
        out[f"{name}_min_s"] = min(values)
        out[f"{name}_median_s"] = statistics.median(values)
    out["idle_s"] = out["hooked_min_s"] - out["plain_min_s"]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    parser.add_argument("--variant", required=True, choices=[*VARIANTS, "idle"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=None, help="comma-separated shape keys to run (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per shape (default: the config's)")
    parser.add_argument("--chunk-size", type=int, default=None, help="lean loss tokens per chunk (default: the config's)")
    args = parser.parse_args(argv)
    config = CONFIGS[args.config]
    if args.repeats is not None:
        config = dataclasses.replace(config, repeats=args.repeats)
    if args.chunk_size is not None:
        config = dataclasses.replace(config, chunk_size=args.chunk_size)
    meter = Meter(config.device)
    output: dict[str, Any] = {"config": config.name, "variant": args.variant}
    with contextlib.ExitStack() as stack:
        models.setup(config, stack)
        output["env"] = environment(config)
        if args.variant == "idle":
            output["idle"] = measure_idle(config, meter)
            print("progress idle", flush=True)
        else:
            variant = VARIANTS[args.variant]
            wanted = None if args.shapes is None else set(args.shapes.split(","))
            shapes = [shape for shape in config.shapes() if wanted is None or shape.key in wanted]
            # Without MTP layers, N does not change the model: measure each (V, s) once.
            model_of = (lambda shape: (shape.vocab, shape.seq)) if not variant.with_mtp else (lambda shape: shape)
            measured: dict[Any, dict[str, Any]] = {}
            for shape in shapes:  # timed runs first, with the allocator as users have it
                if model_of(shape) not in measured:
                    measured[model_of(shape)] = time_shape(config, variant, shape, meter)
                print(f"progress time {shape.key}", flush=True)
            meter.exact_cpu_memory()
            probed: dict[Any, dict[str, list[int]]] = {}
            for shape in shapes:
                if model_of(shape) not in probed:
                    probed[model_of(shape)] = probe_memory(config, variant, shape, meter)
                print(f"progress memory {shape.key}", flush=True)
            points = [
                {**measured[model_of(shape)], **probed[model_of(shape)], "shape": dataclasses.asdict(shape)}
                for shape in shapes
            ]
            output["points"] = points
    with open(args.out, "w") as out:
        json.dump(output, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
