"""The test environments as overlays: one base virtualenv per Python, package folders layered over it.

Each megatron-core release (``requirements/mcore-<version>.txt``) and each extra stack (the bridges' and
verl's requirements) is installed with ``pip install --no-deps --target <folder>`` and put first on
``PYTHONPATH`` for a run, so it shadows what the base venv has while the base venv stays as it is:

* Python 3.11: the project's default venv (``make venv``);
* Python 3.12: ``.venv-py312`` from ``requirements/matrix-py312.txt`` (PyPI's CUDA torch wheel, which runs
  on CPU and brings the ``triton`` that megatron-core 0.18.2+ imports).


A folder or venv is rebuilt when its requirements file changes (a sha256 stamp). ``scripts/matrix.py``,
``scripts/bridges.py`` and ``scripts/verl_env.py`` build their runs from these pieces.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import torch_index  # scripts/ is on the path: this module is imported by, or run as, a script there

ROOT = Path(__file__).resolve().parent.parent
STAMP = ".requirements-sha256"


@dataclasses.dataclass(frozen=True)
class Release:
    """A megatron-core release of the matrix and the Python it runs on."""

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


def log(message: str) -> None:
    """One progress line, flushed (the runs' own output interleaves with it)."""
    print(f"[matrix] {message}", flush=True)


def sha256(*paths: Path) -> str:
    """The digest of the files' bytes: the stamp that says a venv or folder is up to date."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run(command: list[str], **kwargs: object) -> None:
    """Run ``command`` in the repository, logged first; a non-zero exit raises."""
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
    """A Python 3.12 interpreter: ``explicit``, else ``python3.12`` on PATH or pyenv's 3.12.1; ``None`` if none runs."""
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
    # torch first, from TORCH_INDEX where it answers (the CPU wheel index unless the Makefile is told otherwise);
    # the rest from pip's own index alone (an index out of reach would cost pip its retries for every package)
    torch_pins = re.findall(r"^torch==\S+", requirements.read_text(), re.M)
    if torch_pins:
        index = torch_index.main_args(os.environ.get("TORCH_INDEX", torch_index.DEFAULT))
        run([str(python), "-m", "pip", "install", "-q", *index, *torch_pins])
    run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)])
    stamp.write_text(wanted)
    return python


# What building a base venv fetches, said before it is fetched (PyPI's Linux torch wheel for
# Python 3.12 is the CUDA build: it runs on CPU, but brings the nvidia-* wheels).
DOWNLOADS = {
    "matrix-py312.txt": "torch from TORCH_INDEX, or where that index is out of reach PyPI's CUDA build and its "
    "nvidia-* wheels: about 2.2 GB fetched, 4.9 GB on disk"
}


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
    """The Python, torch and megatron-core versions ``python`` imports under ``env``."""
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


def split_pytest_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The script's own arguments and those after ``--`` (for pytest)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]
