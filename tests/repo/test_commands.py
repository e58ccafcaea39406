"""The README's commands that are not the test suite run and give the right verdict: ``make demo``
(``python -m benchmarks.demo``) and a quiet ``import mtp_hooks``.

Each runs in its own interpreter, as a new user runs it (the demo starts its own process group);
the repository root goes first on ``PYTHONPATH``, the rest of it is kept, and this session's
process-group rendezvous variables are not passed on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTHONWARNINGS", None)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the demo's own process group
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_demo_matches_stock_and_exits_zero() -> None:
    result = run_python("-m", "benchmarks.demo")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    assert "same as stock within fp32 rounding" in result.stdout, result.stdout
    assert "DIFFERENT" not in result.stdout, result.stdout


# The megatron-core modules mtp_hooks imports, with only the notices mtp_hooks silences filtered:
# whatever else a release prints while importing them (0.15.3: a unified-memory warning and an
# end-of-life notice; 0.17+ with torch's CUDA build: torch's CUDA_HOME notice) is that release's, and mtp_hooks adds nothing to it.
_MEGATRON_ALONE = (
    "import warnings; "
    "warnings.filterwarnings('ignore', message=r'(Transformer Engine and Apex are|Apex is|absl\\.logging is) not installed', category=UserWarning); "
    "import megatron.core.parallel_state, megatron.core.transformer.multi_token_prediction, "
    "megatron.core.tensor_parallel.mappings, megatron.core.models.common.language_module.language_module"
)


def test_import_prints_no_megatron_notices() -> None:
    result = run_python("-c", "from mtp_hooks import attach")  # the first use of a lazy name imports megatron-core
    assert result.returncode == 0, result.stderr
    assert "not installed" not in result.stderr, result.stderr
    megatron_alone = run_python("-c", _MEGATRON_ALONE)
    assert megatron_alone.returncode == 0, megatron_alone.stderr
    assert _without_log_prefixes(result.stderr) == _without_log_prefixes(megatron_alone.stderr), result.stderr
    assert _without_log_prefixes(result.stdout) == _without_log_prefixes(megatron_alone.stdout), result.stdout


def _without_log_prefixes(text: str) -> str:
    """``text`` without the time and process id that torch's C++ log lines start with."""
    return re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", text.strip(), flags=re.M)


def test_import_leaves_warnings_raised_later_visible() -> None:
    code = "import warnings; from mtp_hooks import attach; warnings.warn('Apex is not installed (raised by the user)'); print('done')"
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "raised by the user" in result.stderr, result.stderr
