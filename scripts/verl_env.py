"""verl 0.9.1 next to the test stacks, and the verl integration tests on megatron-core 0.16.1 and 0.19.2.

verl and the packages its imports need (``requirements/verl.txt``, exact pins) are installed
with ``pip install --no-deps --target .verl/py311`` (and ``.verl/py312``) and put on
``PYTHONPATH`` over a base venv, which stays as it is (the layering of ``scripts/overlays.py``,
whose functions this reuses, as ``scripts/matrix.py`` does):

* megatron-core 0.16.1: ``.venv`` (``make venv``) with ``.verl/py311`` on the path;
* megatron-core 0.19.2: ``.venv-py312`` with ``.mcore/0.19.2`` first, then ``.verl/py312``.

``PYTHONPATH=.verl/py311 .venv/bin/python`` imports verl on the default stack. The tests run
with ``MTP_HOOKS_REQUIRE_VERL=1``, which turns their "verl is not importable" skip into a
failure, and ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl loads no entry-point plugins).

``--py311-only`` builds (and tests) the default stack alone: no ``.venv-py312``, whose torch is
the CUDA build (about 2.2 GB fetched, 4.9 GB on disk), so a CPU box gets verl for ``make bench``
without it (``make verl-env-py311``).

Usage: ``python scripts/verl_env.py [--build-only] [--py311-only] [--python312 PATH] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overlays  # noqa: E402

ROOT = overlays.ROOT
REQUIREMENTS = ROOT / "requirements" / "verl.txt"
TESTS = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "integrations").glob("test_verl*.py"))


def ensure_verl(python: Path, tag: str) -> Path:
    """``.verl/<tag>`` holding ``requirements/verl.txt`` (rebuilt when it changes)."""
    return overlays.ensure_target(python, REQUIREMENTS, ROOT / ".verl" / tag)


def stacks(python311: Path, interpreter312: Optional[str]) -> list[tuple[str, Path, list[Path]]]:
    """(megatron-core version, python, PYTHONPATH folders first to last) of each stack, built."""
    out = [("0.16.1", python311, [ensure_verl(python311, "py311")])]
    if interpreter312 is not None:
        python312 = overlays.ensure_venv(ROOT / ".venv-py312", interpreter312, ROOT / "requirements" / "matrix-py312.txt")
        mcore = overlays.ensure_mcore(python312, "0.19.2")
        out.append(("0.19.2", python312, [mcore, ensure_verl(python312, "py312")]))
    return out


def run_tests(version: str, python: Path, path: list[Path], pytest_args: list[str]) -> int:
    env = overlays.environment(*path)
    env["MTP_HOOKS_REQUIRE_VERL"] = "1"
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    _python, torch, mcore = overlays.describe_stack(python, env)
    if mcore != version:
        raise RuntimeError(f"expected megatron-core {version} first on the path, imported {mcore}")
    command = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *(pytest_args or TESTS)]
    overlays.log(f"verl on megatron-core {version} (torch {torch}): {' '.join(command[1:])}")
    start = time.monotonic()
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    overlays.log(f"megatron-core {version}: exit status {code} in {time.monotonic() - start:.0f} s")
    return code


def main(argv: Optional[list[str]] = None) -> int:
    argv, pytest_args = overlays.split_pytest_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python311", default=str(ROOT / ".venv" / "bin" / "python"), help="Python 3.11 of the base venv (make venv)")
    parser.add_argument("--python312", default=os.environ.get("PY312"), help="a Python 3.12 interpreter (default: python3.12 on PATH or pyenv's 3.12.1)")
    parser.add_argument("--build-only", action="store_true", help="build .verl/py311 and .verl/py312, run no tests")
    parser.add_argument("--py311-only", action="store_true", help="only the megatron-core 0.16.1 stack (.verl/py311): no Python 3.12 venv")
    args = parser.parse_args(argv)

    python311 = Path(args.python311)
    if not python311.exists():
        parser.error(f"{python311} does not exist: build the default venv first (make venv)")
    interpreter312 = None if args.py311_only else overlays.find_python312(args.python312)
    built = stacks(python311, interpreter312)
    if interpreter312 is None and not args.py311_only:
        overlays.log("FAILED: no Python 3.12 interpreter for megatron-core 0.19.2 (set PY312=/path/to/python3.12)")
        return 1
    if args.build_only:
        return 0
    if not (pytest_args or TESTS):
        overlays.log("FAILED: no tests/integrations/test_verl*.py to run")
        return 1
    codes = [run_tests(version, python, path, pytest_args) for version, python, path in built]
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
