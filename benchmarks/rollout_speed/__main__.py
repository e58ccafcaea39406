"""``python -m benchmarks.rollout_speed``: what a trained draft saves in rollout time (``make rollout-speed``).

Runs in ``.vllm`` with Intel OpenMP preloaded (``make rollout-speed``); ``--config gpu`` in a CUDA vLLM
(``ENGINE_CONFIG=gpu``). ``--quick``: one seed, fewer RL steps and prompts, 3 rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from datetime import date
from pathlib import Path
from typing import Optional


from benchmarks import models
from benchmarks.acceptance.experiment import CACHE
from benchmarks.acceptance.engine_run import engine_versions
from benchmarks.acceptance.report import versions
from benchmarks.acceptance.settings import SETTINGS, build_model, config, controlled, overrides
from benchmarks.environment import load_average, machine
from benchmarks.rollout_speed import report
from benchmarks.rollout_speed.run import run


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="what a trained draft saves in rollout time, measured by vLLM")
    parser.add_argument("--quick", action="store_true", help="setting speed-quick (one seed, 12 RL steps, 16 prompts) and 3 rounds")
    parser.add_argument("--config", choices=["cpu", "gpu"], default="cpu", help="gpu: train on CUDA, vLLM's CUDA engine (ENGINE_CONFIG=gpu)")
    parser.add_argument("--setting", help="a named setting of the word task (default: speed, --quick: speed-quick; speed-smoke for tests)")
    parser.add_argument("--set", default="", metavar="FIELD=VALUE,...", help="override the setting's fields, e.g. rl_steps=4")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; --quick: 0)")
    parser.add_argument("--rounds", type=int, help="timed rounds per variant (default 5; --quick: 3)")
    parser.add_argument("--batch", type=int, default=1, help="requests the engine runs at once (max_num_seqs; default 1)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (training and the CPU engine)")
    parser.add_argument("--cache", type=Path, default=CACHE, help="pretrained models (shared with the acceptance benchmark)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/rollout-speed"))
    args = parser.parse_args(argv)
    name = args.setting or ("speed-quick" if args.quick else "speed")
    if name not in SETTINGS["words"]:
        parser.error(f"--setting {name!r}: the word task has {', '.join(sorted(SETTINGS['words']))}")
    try:
        setting = dataclasses.replace(SETTINGS["words"][name], **overrides(args.set))
    except ValueError as error:
        parser.error(str(error))
    if args.config == "gpu":
        setting = dataclasses.replace(setting, device="cuda")
    seeds = tuple(int(x) for x in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if x.strip())
    rounds = args.rounds or (3 if args.quick else 5)
    if not seeds or rounds < 1 or args.batch < 1:
        parser.error("--seeds needs a seed, --rounds and --batch at least 1")
    controlled(setting, args.threads)
    started = time.perf_counter()
    meta = {"machine": machine(), "date": date.today().isoformat(), "load_before": load_average(), "mode": name}
    with contextlib.ExitStack() as stack:
        models.setup(config(setting), stack)
        meta["params_main"] = sum(p.numel() for n, p in build_model(setting).named_parameters() if not n.startswith("mtp."))
        result = run(setting, seeds, args.cache, rounds, args.batch, args.config)
    meta.update(load_after=load_average(), seconds=time.perf_counter() - started, versions=versions() | engine_versions())
    result["meta"] = meta
    report.write_outputs(result, args.out)
    print(report.markdown(result))
    print(f"written: {args.out}/rollout_speed.json, rollout_speed.md and rollout_speed.png ({meta['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
