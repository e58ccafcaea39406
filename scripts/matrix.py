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

Usage: ``python scripts/matrix.py [--versions 0.14.0,0.19.2] [--build-only] [--allow-skip] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "matrix-out"
STAMP = ".requirements-sha256"


@dataclasses.dataclass(frozen=True)
class Release:
    version: str
    python: str  # "3.11" or "3.12"


RELEASES = (
    Release("0.14.0", "3.11"),
    Release("0.15.3", "3.11"),
    Release("0.16.1", "3.11"),
    Release("0.17.1", "3.12"),
    Release("0.18.2", "3.12"),
    Release("0.19.2", "3.12"),
)


@dataclasses.dataclass
class Outcome:
    release: Release
    status: str  # "ok", "failed", "skipped"
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    reason: str = ""
    python: str = ""
    torch: str = ""
    mcore: str = ""
    seconds: float = 0.0


def log(message: str) -> None:
    print(f"[matrix] {message}", flush=True)


def sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run(command: list[str], **kwargs: object) -> None:
    log("$ " + " ".join(command))
    subprocess.run(command, check=True, cwd=ROOT, **kwargs)  # type: ignore[call-overload]


def requested_versions(parser: argparse.ArgumentParser, versions: Optional[str], default: list[str]) -> list[str]:
    """The releases of a comma-separated ``--versions`` (``default`` without it); an unknown one is a usage error."""
    known = [release.version for release in RELEASES]
    wanted = versions.split(",") if versions else list(default)
    unknown = [version for version in wanted if version not in known]
    if unknown:
        parser.error(f"unknown versions {unknown}; known: {known}")
    return wanted


def base_python311(parser: argparse.ArgumentParser, path: str) -> Path:
    """``--python311`` as a path; a usage error where it does not exist."""
    python311 = Path(path)
    if not python311.exists():
        parser.error(f"{python311} does not exist: build the default venv first (make venv)")
    return python311


def find_python312(explicit: Optional[str]) -> Optional[str]:
    candidates = [explicit] if explicit else [shutil.which("python3.12"), "/root/.pyenv/versions/3.12.1/bin/python"]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == "True":
                return candidate
    return None


def ensure_venv(venv: Path, interpreter: str, requirements: Path) -> Path:
    """``venv`` with ``requirements`` installed (rebuilt when the requirements file changes)."""
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    wanted = sha256(requirements)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    log(f"building {venv.name} from {requirements.relative_to(ROOT)}{download_note(requirements)}")
    if venv.exists():
        shutil.rmtree(venv)
    run([interpreter, "-m", "venv", str(venv)])
    run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)])
    stamp.write_text(wanted)
    return python


# What building a base venv fetches, said before it is fetched (PyPI's Linux torch wheel for
# Python 3.12 is the CUDA build: it runs on CPU, but brings the nvidia-* wheels).
DOWNLOADS = {"matrix-py312.txt": "torch's CUDA build and its nvidia-* wheels: about 2.2 GB fetched, 4.9 GB on disk"}


def download_note(requirements: Path) -> str:
    """`` (what it fetches)`` for a base venv's build log line, or ``""``."""
    note = DOWNLOADS.get(requirements.name)
    return f" ({note})" if note else ""


def ensure_target(python: Path, requirements: Path, target: Path) -> Path:
    """``target`` holding exactly ``requirements`` (``pip install --no-deps --target``), rebuilt
    when the requirements file changes; meant to go first on ``PYTHONPATH`` over a base venv."""
    stamp = target / STAMP
    wanted = sha256(requirements)
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    log(f"installing {requirements.relative_to(ROOT)} into {target.relative_to(ROOT)}")
    if target.exists():
        shutil.rmtree(target)
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "-r", str(requirements)])
    stamp.write_text(wanted)
    return target


def ensure_mcore(python: Path, version: str) -> Path:
    """``.mcore/<version>`` holding that megatron-core (and its pinned extras), no other deps."""
    return ensure_target(python, ROOT / "requirements" / f"mcore-{version}.txt", ROOT / ".mcore" / version)


def environment(*targets: Path) -> dict[str, str]:
    """The environment with ``targets`` (first shadows last) and the repository first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, targets), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTHONHOME", None)
    return env


def describe_stack(python: Path, env: dict[str, str]) -> tuple[str, str, str]:
    code = (
        "import platform, importlib.metadata as m, torch; "
        "print(platform.python_version(), torch.__version__, m.version('megatron-core'), sep='|')"
    )
    probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if probe.returncode != 0:
        raise RuntimeError(f"cannot import the stack:\n{probe.stderr[-2000:]}")
    python_version, torch_version, mcore_version = probe.stdout.strip().splitlines()[-1].split("|")
    return python_version, torch_version, mcore_version


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def parse_counts(text: str) -> dict[str, int]:
    """Counts from pytest's closing summary line."""
    for line in reversed(text.splitlines()):
        found = _COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            counts: dict[str, int] = {}
            for number, kind in found:
                kind = "error" if kind.startswith("error") else kind
                counts[kind] = counts.get(kind, 0) + int(number)
            return counts
    return {}


# The releases whose suite runs the parity matrix's whole default set (tests/parity/test_parity_matrix.py;
# 0.16.1 is `make test`'s); the others run its pairwise set, for CI's time (MTP_PARITY=pairwise).
FULL_PARITY_RELEASES = ("0.16.1", "0.19.2")


def run_release(release: Release, python: Path, pytest_args: list[str]) -> Outcome:
    target = ensure_mcore(python, release.version)
    env = environment(target)
    if release.version not in FULL_PARITY_RELEASES:
        env.setdefault("MTP_PARITY", "pairwise")
    outcome = Outcome(release, "failed")
    outcome.python, outcome.torch, outcome.mcore = describe_stack(python, env)
    if outcome.mcore != release.version:
        raise RuntimeError(f"expected megatron-core {release.version} first on the path, imported {outcome.mcore}")
    OUT.mkdir(exist_ok=True)
    log_path = OUT / f"{release.version}.log"
    command = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args]
    log(f"megatron-core {release.version} (Python {outcome.python}, torch {outcome.torch}): {' '.join(command[1:])}")
    start = datetime.datetime.now()
    lines: list[str] = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        with log_path.open("w") as sink:
            for line in process.stdout:
                sink.write(line)
                lines.append(line)
                if not line.startswith(("SKIPPED", "  ")):
                    sys.stdout.write(line)
        returncode = process.wait()
    outcome.seconds = (datetime.datetime.now() - start).total_seconds()
    outcome.counts = parse_counts("".join(lines))
    outcome.status = "ok" if returncode == 0 else "failed"
    if returncode not in (0, 1):
        outcome.reason = f"pytest exit status {returncode}"
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
    today = datetime.date.today().isoformat()
    lines = [
        f"Support matrix, run {today} on CPU (`make matrix`; each row is the whole suite, `pytest -q`).",
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


def split_pytest_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The script's own arguments and those after ``--`` (for pytest)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def main(argv: Optional[list[str]] = None) -> int:
    argv, pytest_args = split_pytest_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", help="comma-separated megatron-core versions (default: all)")
    parser.add_argument("--python311", default=str(ROOT / ".venv" / "bin" / "python"), help="Python 3.11 of the base venv (make venv)")
    parser.add_argument("--python312", default=os.environ.get("PY312"), help="a Python 3.12 interpreter (default: python3.12 on PATH or pyenv's 3.12.1)")
    parser.add_argument("--build-only", action="store_true", help="build the environments, run no tests")
    parser.add_argument(
        "--allow-skip",
        action="store_true",
        help="exit 0 even if a requested release could not run (e.g. no Python 3.12); without it that is a failure",
    )
    args = parser.parse_args(argv)

    known = {release.version: release for release in RELEASES}
    wanted = requested_versions(parser, args.versions, list(known))
    python311 = base_python311(parser, args.python311)
    interpreter312 = find_python312(args.python312)
    python312: Optional[Path] = None

    outcomes: list[Outcome] = []
    for version in wanted:
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
        if args.build_only:
            ensure_mcore(python, version)
            continue
        outcomes.append(run_release(release, python, pytest_args))

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
