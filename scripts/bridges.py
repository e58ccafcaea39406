"""Run the bridge-built families (``tests/integrations/test_bridges.py``, and the MTP export against the bridge's
own, ``tests/integrations/test_export_bridges.py``) on every megatron-core release of the matrix.

The environments are the matrix's (``scripts/matrix.py``, built by ``scripts/overlays.py``): the base venv of each Python and
``.mcore/<version>`` first on ``PYTHONPATH``. On top of them, after the megatron-core folder, comes
an overlay of ``requirements/bridges.txt`` (mbridge 0.15.1, transformers 4.57.1 and what they
import) installed with ``pip install --no-deps --target .bridges/py311`` (or ``py312``).

Unlike ``make test`` this fails when a test skips: here a skip means mbridge or transformers is
missing, or a release cannot build a family, which is what the run is for. A requested release
that cannot run (no Python 3.12 interpreter) fails too, unless ``--allow-skip``.

``--suite megatron-bridge`` runs ``tests/integrations/test_megatron_bridge.py`` and
``tests/integrations/test_export_megatron_bridge.py`` instead: megatron-bridge 0.6.2
(Python 3.12 only) on megatron-core 0.19.2, with ``.bridges/py312-mb`` from
``requirements/bridges-megatron.txt`` (transformers 5.12.1).

Usage: ``python scripts/bridges.py [--suite mbridge|megatron-bridge] [--versions 0.14.0,0.19.2] [--build-only] [--allow-skip] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlays import RELEASES, ROOT, describe_stack, ensure_mcore, ensure_target, ensure_venv, find_python312, parse_counts  # noqa: E402
from overlays import base_python311, environment, requested_versions, split_pytest_args  # noqa: E402

OUT = ROOT / "matrix-out" / "bridges"


@dataclasses.dataclass(frozen=True)
class Suite:
    tests: tuple[str, ...]
    requirements: Path
    overlay: str  # folder under .bridges/, "{py}" the Python version without the dot
    versions: tuple[str, ...]  # default releases


SUITES = {
    # mbridge 0.15.1 + transformers 4.57.1: every matrix release
    "mbridge": Suite(("tests/integrations/test_bridges.py", "tests/integrations/test_export_bridges.py"), ROOT / "requirements" / "bridges.txt", "py{py}", tuple(r.version for r in RELEASES)),
    # megatron-bridge 0.6.2 + transformers 5.12.1: Python 3.12 only, run on the newest release
    "megatron-bridge": Suite(("tests/integrations/test_megatron_bridge.py", "tests/integrations/test_export_megatron_bridge.py"), ROOT / "requirements" / "bridges-megatron.txt", "py{py}-mb", ("0.19.2",)),
}


def log(message: str) -> None:
    print(f"[bridges] {message}", flush=True)


def overlay(suite: Suite, python: Path, python_version: str) -> Path:
    """``.bridges/<overlay>`` for that Python: the suite's requirements, installed ``--no-deps``."""
    return ensure_target(python, suite.requirements, ROOT / ".bridges" / suite.overlay.format(py=python_version.replace(".", "")))


def run_release(suite: Suite, version: str, python: Path, bridges: Path, pytest_args: list[str]) -> tuple[bool, str]:
    """Run the bridge tests on one release; ``(passed, summary line)``."""
    env = environment(ensure_mcore(python, version), bridges)
    _, _, mcore = describe_stack(python, env)
    if mcore != version:
        raise RuntimeError(f"expected megatron-core {version} first on the path, imported {mcore}")
    command = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *suite.tests, *pytest_args]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.monotonic() - start
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{Path(suite.tests[0]).stem}-{version}.log").write_text(result.stdout + result.stderr)
    counts = parse_counts(result.stdout)
    failed = counts.get("failed", 0) + counts.get("error", 0)
    ok = result.returncode == 0 and failed == 0 and counts.get("skipped", 0) == 0 and counts.get("passed", 0) > 0
    summary = f"{counts.get('passed', 0)} passed, {failed} failed, {counts.get('skipped', 0)} skipped in {seconds:.0f} s"
    skips = sorted({line.split(": ", 1)[-1] for line in result.stdout.splitlines() if line.startswith("SKIPPED")})
    if skips:
        summary += "; skipped because: " + "; ".join(skips)
    return ok, summary


def main(argv: Optional[list[str]] = None) -> int:
    argv, pytest_args = split_pytest_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="mbridge", help="which bridge (default mbridge)")
    parser.add_argument("--versions", help="comma-separated megatron-core versions (default: every release of the matrix; 0.19.2 for megatron-bridge)")
    parser.add_argument("--python311", default=str(ROOT / ".venv" / "bin" / "python"), help="Python 3.11 of the base venv (make venv)")
    parser.add_argument("--python312", default=os.environ.get("PY312"), help="a Python 3.12 interpreter for 0.17.1 - 0.19.2")
    parser.add_argument("--build-only", action="store_true", help="build the overlays (and megatron-core folders), run no tests")
    parser.add_argument("--jobs", type=int, default=2, help="releases run at the same time (default 2)")
    parser.add_argument("--allow-skip", action="store_true", help="exit 0 even if a requested release could not run")
    args = parser.parse_args(argv)

    suite = SUITES[args.suite]
    known = {release.version: release for release in RELEASES}
    wanted = requested_versions(parser, args.versions, list(suite.versions))
    python311 = base_python311(parser, args.python311)
    interpreter312 = find_python312(args.python312)

    rows: dict[str, tuple[str, str]] = {}
    runs: dict[str, tuple[Path, Path]] = {}
    not_run = False
    for version in wanted:
        release = known[version]
        if release.python == "3.12":
            if interpreter312 is None:
                log(f"CANNOT RUN megatron-core {version}: no Python 3.12 interpreter (set PY312=/path/to/python3.12)")
                rows[version] = (release.python, "not run: no Python 3.12 interpreter")
                not_run = True
                continue
            python = ensure_venv(ROOT / ".venv-py312", interpreter312, ROOT / "requirements" / "matrix-py312.txt")
        else:
            python = python311
        bridges = overlay(suite, python, release.python)
        ensure_mcore(python, version)
        runs[version] = (python, bridges)
    failed = False
    if not args.build_only:
        # The runs are mostly imports, one thread each: ``--jobs`` of them at a time.
        log(f"{' '.join(suite.tests)} on {', '.join(runs)} ({args.jobs} at a time)")
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {version: pool.submit(run_release, suite, version, python, bridges, pytest_args) for version, (python, bridges) in runs.items()}
            for version, future in futures.items():
                ok, summary = future.result()
                log(f"megatron-core {version}: " + ("pass: " if ok else "FAIL: ") + summary)
                rows[version] = (known[version].python, ("pass, " if ok else "FAIL, ") + summary)
                failed = failed or not ok
    rows = {version: rows[version] for version in wanted if version in rows}
    if rows:
        print(f"\n| megatron-core | Python | {' + '.join(suite.tests)} |\n|---|---|---|")
        for version, (python_version, result) in rows.items():
            print(f"| {version} | {python_version} | {result} |")
    if not_run and not args.allow_skip:
        log("FAILED: requested releases could not run; provide Python 3.12, drop them from --versions or pass --allow-skip")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
