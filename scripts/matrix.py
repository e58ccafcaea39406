"""Run the whole test suite on every supported megatron-core release.

One virtualenv per Python holds torch and the test stack once; each megatron-core release is
installed on its own with ``pip install --no-deps --target .mcore/<version>`` from
``requirements/mcore-<version>.txt`` and put first on ``PYTHONPATH`` for its run, so it shadows
whatever megatron-core the base venv has.

* Python 3.11 (0.14.0, 0.15.3, 0.16.1): the project's default venv (``make venv``), whose own
  megatron-core 0.16.1 is shadowed. 0.14 and 0.15 declare ``numpy<2`` and get numpy 1.26 in
  their target folder.
* Python 3.12 (0.17.1, 0.18.2, 0.19.2, which declare Python >= 3.12): ``.venv-py312`` from
  ``requirements/matrix-py312.txt`` (PyPI's CUDA torch wheel, which runs on CPU and brings the
  ``triton`` that 0.18.2+ import). Without a Python 3.12 interpreter these releases cannot run.


Per release the log goes to ``matrix-out/<version>.log``; ``matrix-out/support_table.md`` gets
the pass / fail / skip counts. Exit status 1 if any release failed or any requested release could
not run; with ``--allow-skip`` a release that could not run is reported in the table and the exit
status only counts the releases that ran (so a green run cannot hide releases that never ran,
unless asked for explicitly).

The environments are built by ``scripts/overlays.py``.

Usage: ``python scripts/matrix.py [--versions 0.14.0,0.19.2] [--jobs 2] [--build-only] [--allow-skip] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlays import RELEASES, ROOT, Release, base_python311, describe_stack, ensure_mcore, ensure_venv, environment  # noqa: E402
from overlays import find_python312, log, parse_counts, requested_versions, split_pytest_args  # noqa: E402

OUT = ROOT / "matrix-out"


@dataclasses.dataclass
class Outcome:
    """What one release's run gave: its status, pytest's counts, the stack it imported and its time."""

    release: Release
    status: str  # "ok", "failed", "skipped"
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    reason: str = ""
    python: str = ""
    torch: str = ""
    mcore: str = ""
    seconds: float = 0.0


# The releases whose suite runs the parity matrix's whole default set (tests/parity/test_parity_matrix.py;
# 0.16.1 is `make test`'s); the others run its pairwise set, for CI's time (MTP_PARITY=pairwise).
FULL_PARITY_RELEASES = ("0.16.1",)
# What no release changes: the repository's own files, commands and benchmarks' plumbing (`make test` runs them).
RELEASE_INDEPENDENT = ("tests/repo",)
FAILURE_TAIL = 150  # lines of a failed release's log printed when releases run side by side


def run_release(release: Release, python: Path, pytest_args: list[str], stream: bool = True) -> Outcome:
    """The whole suite on one release: its log under ``matrix-out/``, its counts and versions. ``stream``: echo
    pytest's lines as they come (one release at a time); otherwise say when it starts and ends, and on a failure
    print the log's last lines."""
    target = ensure_mcore(python, release.version)
    env = environment(target)
    if release.version not in FULL_PARITY_RELEASES:
        env.setdefault("MTP_PARITY", "pairwise")
    if not stream:
        env.setdefault("OMP_NUM_THREADS", "1")  # releases side by side: a core each, not two threads fighting
    outcome = Outcome(release, "failed")
    outcome.python, outcome.torch, outcome.mcore = describe_stack(python, env)
    if outcome.mcore != release.version:
        raise RuntimeError(f"expected megatron-core {release.version} first on the path, imported {outcome.mcore}")
    OUT.mkdir(exist_ok=True)
    log_path = OUT / f"{release.version}.log"
    ignored = [f"--ignore={path}" for path in RELEASE_INDEPENDENT]
    command = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ignored, *pytest_args]
    log(f"megatron-core {release.version} (Python {outcome.python}, torch {outcome.torch}): {' '.join(command[1:])}")
    start = datetime.datetime.now()
    lines: list[str] = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        with log_path.open("w") as sink:
            for line in process.stdout:
                sink.write(line)
                lines.append(line)
                if stream and not line.startswith(("SKIPPED", "  ")):
                    sys.stdout.write(line)
        returncode = process.wait()
    outcome.seconds = (datetime.datetime.now() - start).total_seconds()
    outcome.counts = parse_counts("".join(lines))
    outcome.status = "ok" if returncode == 0 else "failed"
    if returncode not in (0, 1):
        outcome.reason = f"pytest exit status {returncode}"
    if not stream:
        log(f"megatron-core {release.version}: {outcome.status} in {outcome.seconds / 60:.1f} min, {lines[-1].strip() if lines else ''}")
        if outcome.status != "ok":
            shown = [line for line in lines if not line.startswith("SKIPPED")][-FAILURE_TAIL:]
            sys.stdout.write("".join(shown))
        sys.stdout.flush()
    return outcome


def skip_reasons(version: str) -> list[str]:
    """Distinct skip reasons of one release's run (from ``-rs``), with their counts."""
    path = OUT / f"{version}.log"
    if not path.exists():
        return []
    reasons: dict[str, int] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"SKIPPED \[(\d+)\] [^:]+:\d+: (.*)", line)
        if match:
            reasons[match.group(2)] = reasons.get(match.group(2), 0) + int(match.group(1))
    return [f"{count} x {reason}" for reason, count in sorted(reasons.items(), key=lambda item: -item[1])]


def write_table(outcomes: list[Outcome]) -> Path:
    """``matrix-out/support_table.md``: a row per release (counts, time), then each release's skip reasons."""
    today = datetime.date.today().isoformat()
    lines = [
        f"Support matrix, run {today} on CPU (`make matrix`; each row is the suite, `pytest -q`, but for "
        f"{', '.join(RELEASE_INDEPENDENT)}, which `make test` runs; the parity matrix pairwise but on 0.16.1).",
        "",
        "| megatron-core | Python | torch | result | passed | failed | skipped | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if o.status == "skipped":
            lines.append(f"| {o.release.version} | {o.release.python} | - | not run: {o.reason} | - | - | - | - |")
            continue
        failed = o.counts.get("failed", 0) + o.counts.get("error", 0)
        result = "pass" if o.status == "ok" else "FAIL" + (f" ({o.reason})" if o.reason else "")
        lines.append(
            f"| {o.mcore} | {o.python} | {o.torch} | {result} | {o.counts.get('passed', 0)} | {failed} "
            f"| {o.counts.get('skipped', 0)} | {o.seconds / 60:.1f} min |"
        )
    lines += ["", "Skip reasons per release:", ""]
    for o in outcomes:
        if o.status == "skipped":
            lines.append(f"- {o.release.version}: not run")
            continue
        reasons = skip_reasons(o.release.version)
        lines.append(f"- {o.release.version}: " + ("; ".join(reasons) if reasons else "none"))
    path = OUT / "support_table.md"
    OUT.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    argv, pytest_args = split_pytest_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", help="comma-separated megatron-core versions (default: all)")
    parser.add_argument("--python311", default=str(ROOT / ".venv" / "bin" / "python"), help="Python 3.11 of the base venv (make venv)")
    parser.add_argument("--python312", default=os.environ.get("PY312"), help="a Python 3.12 interpreter (default: python3.12 on PATH or pyenv's 3.12.1)")
    parser.add_argument("--build-only", action="store_true", help="build the environments, run no tests")
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="releases run side by side (each with one intra-op thread; its log under matrix-out/, the tail of a "
        "failed one printed); default 1, streamed",
    )
    parser.add_argument(
        "--allow-skip",
        action="store_true",
        help="exit 0 even if a requested release could not run (e.g. no Python 3.12); without it that is a failure",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected an int >= 1, received {args.jobs}")

    known = {release.version: release for release in RELEASES}
    wanted = requested_versions(parser, args.versions, list(known))
    python311 = base_python311(parser, args.python311)
    interpreter312 = find_python312(args.python312)
    python312: Optional[Path] = None

    outcomes: list[Outcome] = []
    runs: list[tuple[Release, Path]] = []
    for version in wanted:  # every environment first, one pip at a time
        release = known[version]
        if release.python == "3.12":
            if interpreter312 is None:
                reason = "no Python 3.12 interpreter (set PY312=/path/to/python3.12)"
                log(f"CANNOT RUN megatron-core {version}: {reason}")
                outcomes.append(Outcome(release, "skipped", reason=reason))
                continue
            if python312 is None:
                python312 = ensure_venv(ROOT / ".venv-py312", interpreter312, ROOT / "requirements" / "matrix-py312.txt")
            python = python312
        else:
            python = python311
        ensure_mcore(python, version)
        runs.append((release, python))
    if not args.build_only:
        if args.jobs == 1:
            outcomes += [run_release(release, python, pytest_args) for release, python in runs]
        else:
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                outcomes += list(pool.map(lambda run: run_release(*run, pytest_args, stream=False), runs))

    skipped = [o for o in outcomes if o.status == "skipped"]
    if not args.build_only:
        table = write_table(outcomes)
        print()
        print(table.read_text())
    if skipped:
        names = ", ".join(f"{o.release.version} ({o.reason})" for o in skipped)
        if not args.allow_skip:
            log(f"FAILED: requested releases that could not run: {names}. Provide what they need, "
                "drop them from --versions, or pass --allow-skip to accept running without them.")
            return 1
        log(f"not run (--allow-skip): {names}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
