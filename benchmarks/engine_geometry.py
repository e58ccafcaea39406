"""What ``draft_geometry="engine"`` costs in a training micro-batch, against the chain geometry and stock mcore.

    .venv/bin/python -m benchmarks.engine_geometry [--quick]

``make bench`` runs it at the configuration's base shape and publishes its table. The model is the base shape with
one MTP layer and rotary positions (the engine geometry needs both: one layer drafting every step, the rotary
outside the attention). Variants, each a training micro-batch (forward, main-head loss, backward):

* ``stock``: stock mcore, labels in, its one MTP depth's loss;
* ``hooks_k1``: ``attach(model)``, the same one step;
* ``chain_k3``: ``attach(model, draft_steps=3)``: steps 2..3 re-run the layer over the whole sequence (mcore's
  depth geometry);
* ``engine_k3``: ``draft_steps=3, draft_geometry="engine"``: steps 2..3's attention over step 1's cache, computed
  by the hooks in fp32 with ``[b, heads, s, s]`` scores per step.

Reported: FLOPs and peak live bytes (exact counts, ``shape_run.counted``), host syncs, and wall time from interleaved
rounds (median and range). The verdict is stated from the counts; wall time on a shared CPU is shown with its spread.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
from typing import Any, Callable, Optional

from torch import nn

import mtp_hooks
from benchmarks import models
from benchmarks.configs import CONFIGS, Config
from benchmarks.shape_run import counted, timed
from benchmarks.variants import main_loss, masked_mean

VARIANTS: dict[str, tuple[str, Optional[dict[str, Any]]]] = {
    "stock": ("stock mcore (N = 1)", None),
    "hooks_k1": ("mtp_hooks, one step", {}),
    "chain_k3": ("mtp_hooks, draft_steps=3, chain geometry", {"draft_steps": 3}),
    "engine_k3": ("mtp_hooks, draft_steps=3, engine geometry", {"draft_steps": 3, "draft_geometry": "engine"}),
}


def _step(model: nn.Module, options: Optional[dict[str, Any]], batch: models.Batch) -> tuple[Callable[[], None], Any]:
    """One training micro-batch of the variant, and the hooks (``None`` for stock)."""
    if options is None:

        def stock() -> None:
            per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
            masked_mean(per_token, batch.loss_mask).backward()

        return stock, None
    hooks = mtp_hooks.attach(model, **options)

    def hooked() -> None:
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            loss = main_loss(model(*batch.model_args), batch)
        loss.backward()

    return hooked, hooks


def measure(config: Config, log: Any = sys.stderr) -> dict[str, Any]:
    """Counts and timed rounds of every variant at the base shape (one MTP layer, rotary positions)."""
    rope = dataclasses.replace(config, position_embedding="rope")
    shape = dataclasses.replace(config.base, mtp=1)
    cuda = config.device != "cpu"
    steps: dict[str, Callable[[], None]] = {}
    kept: list[Any] = []
    out: dict[str, Any] = {"shape": dataclasses.asdict(shape), "variants": {}}
    for name, (label, options) in VARIANTS.items():
        model = models.build(rope, shape, 1)
        batch = models.make_batch(rope, shape)
        step, hooks = _step(model, options, batch)

        def tidy(model: nn.Module = model, hooks: Any = hooks) -> None:
            model.zero_grad(set_to_none=True)
            if hooks is not None:
                hooks.metrics(reset=True)

        for _ in range(config.warmup):
            step()
            tidy()
        counts = counted(step, cuda)
        tidy()
        out["variants"][name] = {"label": label, **{k: counts[k] for k in ("flops", "peak_bytes", "syncs")}, "train_s": []}
        steps[name] = lambda step=step, tidy=tidy: (step(), tidy())
        kept.append((model, hooks))
    names = list(steps)
    for round_index in range(config.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            out["variants"][name]["train_s"].append(timed(steps[name], cuda)[0])
    print(f"engine geometry at s = {shape.seq} done", file=log, flush=True)
    return out


def markdown(measured: dict[str, Any]) -> str:
    """The table: each variant's FLOPs, peak live memory and host syncs, with ratios to stock and to the chain."""
    shape, rows = measured["shape"], measured["variants"]
    stock, chain = rows["stock"], rows["chain_k3"]
    lines = [
        f"The engine geometry (`draft_geometry=\"engine\"`), training micro-batch at V = {shape['vocab']:,}, "
        f"s = {shape['seq']:,}, b = {shape['batch']}, hidden {shape['hidden']}, one MTP layer, rotary positions: "
        "exact FLOPs and peak live memory against stock mcore (its one step) and against the chain geometry (the same "
        "three steps, each over the whole sequence); wall time median (min-max) over interleaved rounds.",
        "",
        "| variant | GFLOP | × stock | × chain k = 3 | peak MiB | × stock | × chain k = 3 | host syncs | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows.values():
        times = row["train_s"]
        spread = f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})" if times else "–"
        lines.append(
            f"| {row['label']} | {row['flops'] / 1e9:.2f} | {row['flops'] / stock['flops']:.3f} | "
            f"{row['flops'] / chain['flops']:.3f} | {row['peak_bytes'] / 2**20:.1f} | "
            f"{row['peak_bytes'] / stock['peak_bytes']:.3f} | {row['peak_bytes'] / chain['peak_bytes']:.3f} | "
            f"{row['syncs']} | {spread} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="draft_geometry='engine' against the chain geometry and stock mcore")
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="= --config smoke")
    args = parser.parse_args(argv)
    config = CONFIGS["smoke" if args.quick else args.config]
    with contextlib.ExitStack() as stack:
        models.setup(config, stack)
        print(markdown(measure(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
