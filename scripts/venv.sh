#!/usr/bin/env bash
# make venv: the README's pip path in $1 (default .venv), unless $1 already holds that stack.
#   1. pip install torch==$TORCH_VERSION --extra-index-url $TORCH_INDEX   (the CPU build by default)
#   2. pip install -e ".[test]" -c requirements/py311.txt                 (CI's exact stack)
# A virtualenv made by hand with the README's commands passes scripts/check_stack.py and is kept:
# the stamp make writes after this script is then the only change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
check=(scripts/check_stack.py)
case "$TORCH_INDEX" in */cpu|*/cpu/) ;; *) check+=(--allow-cuda) ;; esac   # another index: a CUDA build is the point
if [ -x "$venv/bin/python" ] && "$venv/bin/python" "${check[@]}" --quiet 2>/dev/null; then
    echo "$venv already holds the pinned stack: kept"
    exit 0
fi
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# shellcheck disable=SC2046  # torch_index.py prints the index option, or nothing where the index is out of reach
"${pip[@]}" "torch==$TORCH_VERSION" $("$PYTHON" scripts/torch_index.py "$TORCH_INDEX")
"${pip[@]}" -e ".[test]" -c requirements/py311.txt
"$venv/bin/python" "${check[@]}"
