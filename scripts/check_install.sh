#!/usr/bin/env bash
# The README's pip path, as written, in a fresh virtualenv (CI runs this from .ci/run):
#   1. pip install torch==2.13.0 --extra-index-url $TORCH_INDEX (the CPU build CI tests);
#   2. pip install -e ".[test]" -c requirements/py311.txt (the constraints keep CI's exact stack).
# Then scripts/check_stack.py: pip kept that torch (no CUDA wheels pulled in), the stack is the pinned
# one (the [test] extra's packages included), and mtp_hooks imports from this checkout. About a minute
# with pip's cache warm.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# shellcheck disable=SC2046  # torch_index.py prints the index option, or nothing where the index is out of reach
"${pip[@]}" torch==2.13.0 $("$PYTHON" scripts/torch_index.py "$TORCH_INDEX")
"${pip[@]}" -e ".[test]" -c requirements/py311.txt
"$venv/bin/python" scripts/check_stack.py
