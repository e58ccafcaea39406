"""Run the benchmark: exact counts and interleaved wall time at every point, Markdown, JSON and a plot.

``python -m benchmarks`` (= ``python -m benchmarks.run --config cpu``) writes
``bench-out/<config>/results.{json,md}`` and ``bench-out/<config>/bench_<config>.png``;
``python -m benchmarks.run --config gpu`` does the same on one CUDA GPU.
``--publish`` also writes the config's results block of BENCHMARKS.md, ``docs/bench_<config>.png``,
the headline line between the README's ``<!-- bench:<config> -->`` markers and the trainer paragraph
between docs/api.md's ``<!-- trainer:<config> -->`` markers, where they are.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import sys
import time
import warnings
from typing import Any, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size).*")

from benchmarks import engine_geometry, headlines, loss_shapes, models, plot, tables, verdicts  # noqa: E402
from benchmarks.configs import CONFIGS, Config  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.shape_run import run_shape  # noqa: E402
from benchmarks.variants import VARIANTS  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def measure(config: Config, names: list[str], log: Any = sys.stderr, partial: Optional[pathlib.Path] = None) -> dict[str, Any]:
    """Every variant at every distinct shape of ``config``: the raw results ``verdicts.summarize`` reads.

    With ``partial``, the raw results so far are written there after every shape (``"complete": false``),
    so that a run cut short can still be reported with ``--from-json``.
    """
    points: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    shapes = config.shapes()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        models.setup(config, stack)
        env = environment(config)
        for index, shape in enumerate(shapes):
            base = shape == config.base
            here = names if base or config.sweep_variants is None else [n for n in names if n in config.sweep_variants]
            timed_names = here if base or config.sweep_timed is None else [n for n in here if n in config.sweep_timed]
            variants, refused_here = run_shape(config, shape, here, timed_names, time_inference=base)
            for name, why in refused_here.items():
                if name not in refused:
                    print(f"skipping {name}: {why}", file=log, flush=True)
                refused[name] = why
            points.append({"shape": dataclasses.asdict(shape), "key": shape.key, "variants": variants})
            print(f"[{index + 1}/{len(shapes)}] {shape.key} done at {time.perf_counter() - started:.0f} s", file=log, flush=True)
            if partial is not None:
                so_far = {"config": config.name, "env": {**env, "load_end": list(os.getloadavg())}, "variants": names,
                          "refused": refused, "points": points, "seconds": time.perf_counter() - started, "complete": False}
                partial.write_text(json.dumps({"raw": so_far}, indent=1))
        losses = []
        for vocab, tokens, hidden in config.loss_shapes:
            losses.append(loss_shapes.measure(vocab, tokens, hidden, config.rounds, log=log))
            print(f"loss alone V={vocab:,} tokens={tokens:,} done at {time.perf_counter() - started:.0f} s", file=log, flush=True)
        geometry = engine_geometry.measure(config, log)
        env["load_end"] = list(os.getloadavg())
    return {"config": config.name, "env": env, "variants": names, "refused": refused, "points": points,
            "loss_shapes": losses, "engine_geometry": geometry, "seconds": time.perf_counter() - started, "complete": True}


# Exact goals that hold at every shape; ``--check`` fails the run when one is missed. The memory goal
# is left out: its margin (0.9 of N logits, plus the fp32 accumulator) is meant for realistic vocabularies,
# and the smoke shapes, where the accumulator is most of the difference, do not judge it (``Config.memory_goal``).
CHECKED_GOALS = ("flops_ok", "detach_flops_ok", "inference_ok", "syncs_ok", "h2d_ok")


def failed_checks(result: dict[str, Any], skippable: tuple[str, ...] = ("verl",)) -> list[str]:
    """Every checked goal missed at any point, and every variant skipped that may not be."""
    failures = [f"{key}: {goal.replace('_ok', '')} missed" for key, point in result["points"].items()
                for goal in CHECKED_GOALS if point["goals"].get(goal) is False]
    failures += [f"variant {name} skipped: {why}" for name, why in result["refused"].items() if name not in skippable]
    for loss in result.get("loss_shapes", []):
        where = f"loss alone V{loss['vocab']}-T{loss['tokens']}"
        failures += [f"{where}: flops missed"] if not loss["flops_ok"] else []
        failures += [f"{where}: {name} host syncs / H2D missed" for name, row in loss["variants"].items() if row["counts_ok"] is False]
    return failures


def _replace_block(text: str, begin: str, end: str, body: str) -> Optional[str]:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda _: f"{begin}\n{body}{end}", text)


def publish(config: Config, markdown_text: str, png: pathlib.Path, headline: str, trainer_text: str = "") -> list[pathlib.Path]:
    """Results into BENCHMARKS.md (between markers, or appended), the plot into docs/; the README gets the
    headline line alone (its ``<!-- bench:<config> -->`` block) and docs/api.md the trainer paragraph."""
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    shutil.copyfile(png, docs / png.name)
    written = [docs / png.name]
    begin, end = f"<!-- results:{config.name} -->", f"<!-- /results:{config.name} -->"
    bench_md = ROOT / "BENCHMARKS.md"
    text = bench_md.read_text() if bench_md.exists() else "# Benchmarks\n"
    body = markdown_text.replace(f"]({png.name})", f"](docs/{png.name})")
    updated = _replace_block(text, begin, end, body)
    if updated is None:
        updated = text.rstrip("\n") + f"\n\n## Results: `{config.name}`\n\n{begin}\n{body}{end}\n"
    bench_md.write_text(updated)
    written.append(bench_md)
    blocks = [(ROOT / "README.md", f"<!-- bench:{config.name} -->", f"<!-- /bench:{config.name} -->", headline + "\n")]
    if trainer_text:
        blocks.append((docs / "api.md", f"<!-- trainer:{config.name} -->", f"<!-- /trainer:{config.name} -->", trainer_text))
    for path, begin, end, block in blocks:
        if path.exists():
            updated = _replace_block(path.read_text(), begin, end, block)
            if updated is not None:
                path.write_text(updated)
                written.append(path)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="mtp_hooks vs stock mcore: FLOPs, peak live memory, host syncs, time")
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="= --config smoke: every variant on tiny shapes, seconds (CI runs it)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default: the config's; at least 5)")
    parser.add_argument("--chunk-size", type=int, default=None, help="lean loss tokens per chunk (default: the library's)")
    parser.add_argument("--out", default=str(ROOT / "bench-out"), help="output folder (default: bench-out/)")
    parser.add_argument("--from-json", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: rebuild the tables and plot from a results.json this command wrote")
    parser.add_argument("--check", action="store_true",
                        help="exit 3 if an exact goal (FLOPs, detach_head FLOPs, inference = no-MTP, host syncs, H2D) is missed anywhere (--quick implies it)")
    parser.add_argument("--publish", action="store_true", help="also write BENCHMARKS.md's results, the README's headline line, docs/api.md's trainer paragraph and docs/bench_<config>.png")
    args = parser.parse_args(argv)
    config = CONFIGS["smoke" if args.quick else args.config]
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be >= 1, got {args.rounds}")
        config = dataclasses.replace(config, rounds=args.rounds)
    if args.chunk_size is not None:
        config = dataclasses.replace(config, chunk_size=args.chunk_size)
    out_dir = pathlib.Path(args.out) / config.name
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as saved:
            raw = json.load(saved)["raw"]
        if raw["config"] != config.name:
            parser.error(f"{args.from_json} holds config {raw['config']!r}, not {config.name!r}; pass --config {raw['config']}")
    else:
        raw = measure(config, names, partial=out_dir / "results.partial.json")
    result = verdicts.summarize(config, raw)
    result["loss_shapes"] = [loss_shapes.summarize(loss) for loss in raw.get("loss_shapes", [])]
    png = out_dir / f"bench_{config.name}.png"
    plot.save(config, result, str(png))
    markdown_text = tables.markdown(config, result, plot_name=png.name)
    if result["loss_shapes"]:
        markdown_text += "\n" + loss_shapes.markdown(result["loss_shapes"])
    if raw.get("engine_geometry"):
        markdown_text += "\n" + engine_geometry.markdown(raw["engine_geometry"])
    (out_dir / "results.md").write_text(markdown_text)
    with open(out_dir / "results.json", "w") as out:
        json.dump({"summary": result, "raw": raw}, out, indent=1)
    print(markdown_text)
    print(f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}, {png} in {raw['seconds']:.0f} s")
    if args.publish:
        for path in publish(config, markdown_text, png, headlines.headline(config, result), headlines.trainer_summary(config, result)):
            print(f"published {path.relative_to(ROOT)}")
    if args.check or args.quick:
        failures = failed_checks(result)
        for failure in failures:
            print(f"CHECK FAILED: {failure}", file=sys.stderr)
        if failures:
            return 3
        print("checks passed: " + ", ".join(g.replace("_ok", "") for g in CHECKED_GOALS) + " at every point")
    return 0


if __name__ == "__main__":
    sys.exit(main())
