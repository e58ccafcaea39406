"""The package faces load lazily: ``mtp_hooks`` and ``mtp_hooks.engine`` import no megatron-core (a vLLM worker that
unpickles the push needs none of it), their names resolve on first use, and the faces that do import megatron-core
print none of its "not installed" notices.

Imports are measured in fresh interpreters, as a user or a vLLM worker runs them (the repository root first on
``PYTHONPATH``); the times are printed (``pytest -s``) and recorded in ``docs/engine.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mtp_hooks
import mtp_hooks.engine
from mtp_hooks import errors

ROOT = Path(__file__).resolve().parents[2]

# Runs ``code`` timed, then reports what it loaded.
_PROBE = """
import json, sys, time
start = time.perf_counter()
{code}
seconds = time.perf_counter() - start
modules = sorted(m for m in sys.modules if m.split('.')[0] in ('mtp_hooks', 'megatron', 'vllm', 'torch'))
print(json.dumps({{"seconds": seconds, "modules": modules}}))
"""


def _run(code: str) -> tuple[dict[str, Any], str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTHONWARNINGS", None)
    probe = _PROBE.format(code=code)
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize(
    "code",
    ["import mtp_hooks.engine", "from mtp_hooks.engine import VLLMSync", "import mtp_hooks.engine.ledger", "import mtp_hooks"],
)
def test_engine_and_the_package_import_without_megatron(code: str) -> None:
    loaded, _ = _run(code)
    modules = loaded["modules"]
    print(f"{code}: {loaded['seconds']:.2f} s")
    assert not [m for m in modules if m.split(".")[0] in ("megatron", "vllm")], modules
    if code != "from mtp_hooks.engine import VLLMSync":  # the package faces load none of the engine's vllm_* modules
        assert not [m for m in modules if m.startswith("mtp_hooks.engine.vllm_")], modules
    if code == "import mtp_hooks":
        assert modules == ["mtp_hooks", "mtp_hooks.errors"], modules  # not even torch


@pytest.mark.parametrize("code", ["import mtp_hooks.export", "import mtp_hooks.predict"])
def test_faces_that_import_megatron_print_none_of_its_notices(code: str) -> None:
    loaded, stderr = _run(code)
    assert "megatron.core" in loaded["modules"]
    assert "not installed" not in stderr, stderr


def test_the_package_names_resolve_on_first_use() -> None:
    assert set(mtp_hooks.__all__) <= set(dir(mtp_hooks)) and set(mtp_hooks.engine.__all__) <= set(dir(mtp_hooks.engine))
    from mtp_hooks import StaleDraftError, attach
    from mtp_hooks.api import attach as defined

    assert attach is defined and StaleDraftError is errors.StaleDraftError is mtp_hooks.engine.StaleDraftError
    assert all(getattr(mtp_hooks, name) is not None for name in mtp_hooks.__all__)
    assert all(getattr(mtp_hooks.engine, name) is not None for name in mtp_hooks.engine.__all__)
    assert callable(mtp_hooks.engine.checksums)  # the function, not its module of the same name
    for face in (mtp_hooks, mtp_hooks.engine):
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            face.no_such_name  # noqa: B018
