#!/usr/bin/env bash
# The README's install commands, as written, in a fresh virtualenv (CI runs this from .ci/run):
#   1. torch first, for the platform (here: the CPU build CI tests, torch==2.13.0);
#   2. pip install -e ".[test]" -c requirements/py311.txt (the constraints keep CI's exact stack).
# Then checks that pip kept that torch (no CUDA wheels pulled in), that the stack is the pinned one
# (the [test] extra's packages included), and that mtp_hooks imports from this checkout. About a
# minute with pip's cache warm.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[test]" -c requirements/py311.txt
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import re
import tomllib

import mtp_hooks  # first: it imports megatron-core quietly
import torch

import megatron.core

pins = {}
for line in pathlib.Path("requirements/py311.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==")
        pins[name.lower()] = version
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
wanted = [re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in project["dependencies"] + project["optional-dependencies"]["test"]]
got = {name: md.version(name) for name in wanted if name in pins}  # [test]'s pinned packages too: the suite's needs
assert {"torch", "megatron-core", "wrapt", "pytest", "tokenizers"} <= got.keys(), sorted(got)
wrong = {name: (version, pins[name]) for name, version in got.items() if version.split("+")[0] != pins[name]}
assert not wrong, f"installed (got, pinned) differ: {wrong}"
cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
assert not cuda, f"CUDA wheels were pulled in: {cuda}"
assert pathlib.Path(mtp_hooks.__file__).resolve().is_relative_to(pathlib.Path.cwd().resolve()), mtp_hooks.__file__
print(f"install ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, mtp_hooks {mtp_hooks.__version__} from {mtp_hooks.__file__}")
PY
