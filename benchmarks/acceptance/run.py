"""The acceptance benchmark's command line: ``python -m benchmarks.acceptance`` (the package docstring says what it runs)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import benchmarks.acceptance  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.acceptance import report  # noqa: E402
from benchmarks.acceptance.experiment import CACHE, TASKS, run_task  # noqa: E402
from benchmarks.acceptance.settings import SETTINGS, Setting, config, controlled, overrides  # noqa: E402

SEEDS = (0, 1, 2)
DEFAULT_OUT = Path("bench-out/acceptance")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(benchmarks.acceptance.__doc__ or "").split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), help="code (the default): the standard library's source; words (the default of "
                        "--engine): the synthetic language")
    parser.add_argument("--quick", action="store_true", help="the short schedule (3 seeds in minutes on 2 cores)")
    parser.add_argument("--config", "--setting", dest="setting", help="named schedule: quick, full (default), smoke; code also gpu (one CUDA device), chain (k = 3 drafts from N = 1), chain-smoke")
    parser.add_argument("--set", default="", metavar="FIELD=VALUE,...", help="override sizes or schedule, e.g. hidden=32,layers=1,device=cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: bench-out/acceptance (--engine: bench-out/acceptance-engine)")
    parser.add_argument("--cache", type=Path, default=CACHE, help="tokenizer, token streams and pretrained models (code task)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (small matmuls: 1 is fastest on a shared CPU)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: 0,1,2; --engine --quick: 0; at least 1)")
    parser.add_argument("--engine", choices=["vllm"], help="measure the drafts with vLLM at the rollouts' T and at T = 0 (make acceptance-engine; "
                        "runs in .vllm): a MiMo-shaped model, variants trained for the engine, k = 1..3 (engine_run.py)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="join the acceptance.json of runs over separate seeds into --out, run nothing")
    args = parser.parse_args(argv)
    if args.merge:
        result = report.merge_seeds([json.loads((directory / "acceptance.json").read_text()) for directory in args.merge])
        report.write_outputs(result, args.out)
        print(report.markdown(result))
        return 0
    args.task = args.task or ("words" if args.engine else "code")
    name = args.setting or ({True: "engine-quick", False: "engine"} if args.engine else {True: "quick", False: "full"})[args.quick]
    if name not in SETTINGS[args.task]:
        parser.error(f"--config {name!r}: the {args.task} task has {', '.join(sorted(SETTINGS[args.task]))}")
    try:
        setting = dataclasses.replace(SETTINGS[args.task][name], **overrides(args.set))
    except ValueError as error:
        parser.error(str(error))
    default_seeds = (0,) if args.engine and args.quick else SEEDS
    seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip()) if args.seeds is not None else default_seeds
    if not seeds:
        parser.error("--seeds needs at least one seed")
    controlled(setting, args.threads)
    started = time.perf_counter()
    if args.engine:
        return _engine(setting, seeds, args, name, started)
    with contextlib.ExitStack() as stack:
        models.setup(config(setting), stack)
        result = run_task(setting, seeds, cache=args.cache)
    result["wall_seconds"] = time.perf_counter() - started
    result["mode"] = name  # the named setting (quick, full, chain, ...): the plots' titles say it
    report.write_outputs(result, args.out)
    print(report.markdown(result))
    print(f"written: {args.out}/acceptance.json, acceptance.md and the plots")
    return 0


def _engine(setting: Setting, seeds: tuple[int, ...], args: argparse.Namespace, name: str, started: float) -> int:
    """``--engine vllm``: the run measured by vLLM (``engine_run``), its record and verdict (``engine_report``)."""
    from benchmarks.acceptance import engine_report
    from benchmarks.acceptance.engine_run import run_engine

    out = args.out if args.out != DEFAULT_OUT else Path("bench-out/acceptance-engine")
    with contextlib.ExitStack() as stack:
        models.setup(config(setting), stack)
        result = run_engine(setting, seeds, cache=args.cache)
    result["wall_seconds"] = time.perf_counter() - started
    result["mode"] = name
    engine_report.write_outputs(result, out)
    print(engine_report.markdown(result))
    print(f"written: {out}/acceptance.json, acceptance.md and acceptance-engine.png ({result['wall_seconds']:.0f} s)")
    if not engine_report.sound(engine_report.verdict(result)):
        print("the measurement does not hold: speculative output differs from the plain one, or the k = 1 prediction is off (acceptance.md)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
