"""The built wheel ships ``mtp_hooks.testing``: installed non-editable into a throwaway ``--target``,
it builds and trains the Qwen-style and DeepSeek-style models from a process that cannot see this
checkout.

The wheel is built (``pip wheel --no-deps --no-build-isolation``, offline with this interpreter's
setuptools) from a copy of the files the build reads, so the checkout gets no ``build/`` or
``*.egg-info``. The child runs with ``-S`` (no site-packages ``.pth`` files, so no editable install
of any checkout) and a ``PYTHONPATH`` of the target plus the folders that hold torch, megatron-core
and wrapt; it fails if ``mtp_hooks`` comes from anywhere but the target.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_FILES = ("pyproject.toml", "README.md", "LICENSE")

CHILD = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import os
    target, root, megatron_file = sys.argv[1:4]
    assert not any(p and os.path.realpath(p) == root for p in sys.path), sys.path
    import megatron.core
    assert megatron.core.__file__ == megatron_file, (megatron.core.__file__, megatron_file)
    import mtp_hooks
    from mtp_hooks import testing
    assert mtp_hooks.__file__.startswith(target) and testing.__file__.startswith(target), (mtp_hooks.__file__, testing.__file__)

    testing.init_parallel()
    with testing.cuda_current_device_is_cpu(), testing.moe_mla_on_cpu():
        shapes = [testing.TinyQwen()] + ([testing.TinyDeepSeek()] if testing.deepseek_missing() is None else [])
        for shape in shapes:
            twins = testing.build_twins(shape, seed=3)
            batch = testing.make_batch(64, seq=8, seed=1)
            testing.stock_train_step(twins.stock, batch)
            stock = testing.stock_mtp_losses()
            testing.hooked_train_step(twins.hooked, twins.hooks, batch)
            metrics = twins.hooks.metrics()  # read once: metrics() starts a new window
            hooked = [metrics[f"mtp_{k}/loss"] for k in (1, 2)]
            assert len(stock) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(hooked, stock)), (stock, hooked)
            testing.assert_same_grads(twins.hooked, twins.stock)
            print("trained", type(shape).__name__)
    print("missing", testing.deepseek_missing())
    """
)


def _setuptools_missing() -> str | None:
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed in this interpreter (the offline wheel build needs it)"
    if int(setuptools.__version__.split(".")[0]) < 77:
        return f"setuptools {setuptools.__version__} < 77 (pyproject.toml's build requirement)"
    return None


def _path_entry(module_file: str, depth: int) -> str:
    return str(Path(module_file).resolve().parents[depth])


@pytest.mark.skipif(_setuptools_missing() is not None, reason=str(_setuptools_missing()))
def test_installed_wheel_builds_and_trains_both_model_families_without_the_checkout(tmp_path: Path) -> None:
    import megatron.core
    import torch
    import wrapt

    source = tmp_path / "src"
    source.mkdir()
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "mtp_hooks", source / "mtp_hooks", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True, timeout=120)
    (wheel,) = wheels.glob("mtp_hooks-*.whl")

    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mtp_hooks" / "testing").rglob("*.py")}
    assert expected and expected <= shipped, sorted(expected - shipped)
    assert "mtp_hooks/py.typed" in shipped

    target = tmp_path / "target"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], check=True, timeout=120)
    assert not any(target.glob("*.pth")) and (target / "mtp_hooks" / "testing" / "__init__.py").is_file()

    # torch/__init__.py, wrapt/__init__.py: the folder above the package; megatron/core/__init__.py: two above
    # (megatron-core's first: a release on PYTHONPATH wins over one in site-packages, as here)
    dependencies = list(dict.fromkeys([_path_entry(megatron.core.__file__, 2), _path_entry(torch.__file__, 1), _path_entry(wrapt.__file__, 1)]))
    assert str(ROOT.resolve()) not in dependencies, dependencies
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")  # this session's group holds its port
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k not in rendezvous}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *dependencies])
    empty = tmp_path / "cwd"
    empty.mkdir()
    result = subprocess.run(
        [sys.executable, "-S", "-c", CHILD, str(target), str(ROOT.resolve()), megatron.core.__file__],
        cwd=empty, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "trained TinyQwen" in result.stdout, result.stdout
    if "missing None" in result.stdout:
        assert "trained TinyDeepSeek" in result.stdout, result.stdout
