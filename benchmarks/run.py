"""Run the benchmark: every variant in its own process, medians, ratios, Markdown, JSON and a plot.

``python -m benchmarks`` (= ``python -m benchmarks.run --config cpu``) writes
``bench-out/<config>/results.{json,md}`` and ``bench-out/<config>/bench_<config>.png``.
``--publish`` also writes the results section of BENCHMARKS.md and ``docs/bench_<config>.png``
(and the README's results block, if the README has the ``<!-- bench:<config> -->`` markers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

from tqdm import tqdm

from benchmarks import report
from benchmarks.configs import CONFIGS, VARIANT_LABELS, Config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_variant(
    config: Config, variant: str, out: pathlib.Path, log: pathlib.Path, bar: tqdm, extra: list[str]
) -> dict[str, Any]:
    """``python -m benchmarks.run_one`` in a fresh process; progress lines advance the bar."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "benchmarks.run_one", "--config", config.name, "--variant", variant, "--out", str(out), *extra]
    bar.set_postfix_str(variant)
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("progress "):
                bar.update(1)
        code = process.wait()
    if code != 0:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"variant {variant} failed (exit {code}); log {log}:\n" + "\n".join(tail))
    with open(out) as result:
        return json.load(result)


def _replace_block(text: str, begin: str, end: str, body: str) -> Optional[str]:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda _: f"{begin}\n{body}{end}", text)


def publish(config: Config, markdown_text: str, png: pathlib.Path) -> list[pathlib.Path]:
    """Results into BENCHMARKS.md (between markers, or appended), the plot into docs/."""
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
    readme = ROOT / "README.md"
    if readme.exists():
        text = readme.read_text()
        updated = _replace_block(text, f"<!-- bench:{config.name} -->", f"<!-- /bench:{config.name} -->", body)
        if updated is not None:
            readme.write_text(updated)
            written.append(readme)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="mtp_hooks vs stock mcore: time and peak memory per micro-batch")
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    parser.add_argument("--variants", default=",".join(VARIANT_LABELS), help="comma-separated subset of " + ",".join(VARIANT_LABELS))
    parser.add_argument("--rounds", type=int, default=None, help="processes per variant (default: the config's)")
    parser.add_argument("--out", default=str(ROOT / "bench-out"), help="output folder (default: bench-out/)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per shape and process (default: the config's)")
    parser.add_argument("--chunk-size", type=int, default=None, help="lean loss tokens per chunk (default: the library's)")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle-hooks measurement")
    parser.add_argument("--publish", action="store_true", help="also write BENCHMARKS.md's results and docs/bench_<config>.png")
    args = parser.parse_args(argv)
    config = CONFIGS[args.config]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANT_LABELS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANT_LABELS)}")
    rounds = args.rounds or config.rounds
    config = dataclasses.replace(config, rounds=rounds)
    if args.repeats is not None:
        config = dataclasses.replace(config, repeats=args.repeats)
    if args.chunk_size is not None:
        config = dataclasses.replace(config, chunk_size=args.chunk_size)
    extra = [f"--repeats={config.repeats}"] + ([] if config.chunk_size is None else [f"--chunk-size={config.chunk_size}"])
    out_dir = pathlib.Path(args.out) / config.name
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shapes = len(config.shapes())
    jobs = [(r, variants[r % len(variants):] + variants[: r % len(variants)]) for r in range(rounds)]  # rotate order
    total = rounds * len(variants) * shapes * 2 + (0 if args.no_idle else 1)  # time and memory phases
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch, tqdm(total=total, unit="shape", desc=f"bench {config.name}") as bar:
        for round_index, order in jobs:
            for variant in order:
                out = pathlib.Path(scratch) / f"r{round_index}-{variant}.json"
                runs.append(_run_variant(config, variant, out, logs / f"{variant}.log", bar, extra))
        if not args.no_idle:
            runs.append(_run_variant(config, "idle", pathlib.Path(scratch) / "idle.json", logs / "idle.log", bar, extra))
    result = report.aggregate(config, runs)
    png = out_dir / f"bench_{config.name}.png"
    report.plot(config, result, str(png))
    markdown_text = report.markdown(config, result, plot_name=png.name)
    (out_dir / "results.md").write_text(markdown_text)
    with open(out_dir / "results.json", "w") as raw:
        json.dump({"summary": result, "runs": runs}, raw, indent=1)
    print(markdown_text)
    print(f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}, {png}")
    if args.publish:
        for path in publish(config, markdown_text, png):
            print(f"published {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
