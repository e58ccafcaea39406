"""Importing ``mtp_hooks`` or ``mtp_hooks.testing`` changes nothing in torch or megatron-core, and every
CPU shim of ``mtp_hooks.testing`` leaves them exactly as it found them when its context closes.

Checked in a fresh interpreter (this test session already holds the shims' effects): a snapshot of
every attribute of every loaded ``torch`` / ``megatron`` module (by identity), of ``torch.Tensor``,
``sys.modules``, torch's function-mode stack, the profile function and the process group, taken
before the import, after it, and after each context manager has been opened and closed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys, types, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed, torch.nn.functional
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import dot_product_attention, multi_latent_attention, multi_token_prediction
    from megatron.core.transformer.moe import moe_utils
    from torch.overrides import _get_current_function_mode_stack

    def snapshot():
        modules = {}
        for name, module in list(sys.modules.items()):
            if module is not None and name.split(".")[0] in ("torch", "megatron"):
                modules[name] = {k: id(v) for k, v in list(vars(module).items()) if k != "__warningregistry__"}
        return {
            "modules": modules,
            "tensor": {k: id(v) for k, v in vars(torch.Tensor).items()},
            "sys.modules": set(sys.modules),
            "modes": len(_get_current_function_mode_stack()),
            "profile": sys.getprofile(),
            "distributed": torch.distributed.is_initialized(),
        }

    def changes(before, after):
        found = []
        for name, attrs in before["modules"].items():
            now = vars(sys.modules[name]) if name in sys.modules else {}
            for key, ident in attrs.items():
                if key not in now:
                    found.append(f"{name}.{key} deleted")
                elif id(now[key]) != ident:
                    found.append(f"{name}.{key} replaced")
            for key, value in now.items():
                if key not in attrs and not isinstance(value, types.ModuleType) and key != "__warningregistry__":
                    found.append(f"{name}.{key} added")
        found += [f"torch.Tensor.{k} changed" for k in set(before["tensor"]) | set(vars(torch.Tensor)) if before["tensor"].get(k) != id(vars(torch.Tensor).get(k))]
        found += [f"sys.modules[{k!r}] removed" for k in before["sys.modules"] - set(sys.modules)]
        found += [f"{key}: {before[key]!r} -> {after[key]!r}" for key in ("modes", "profile", "distributed") if before[key] != after[key]]
        return found

    before = snapshot()
    import mtp_hooks
    import mtp_hooks.testing as testing
    after_import = snapshot()
    report = {"import": changes(before, after_import)}
    for name in ("cuda_current_device_is_cpu", "cuda_calls_on_cpu", "moe_mla_on_cpu", "fused_wgrad_kernel_on_cpu"):
        with getattr(testing, name)():
            pass
        report[name] = changes(after_import, snapshot())
    # A shim closed by an exception restores as well.
    try:
        with testing.moe_mla_on_cpu(), testing.fused_wgrad_kernel_on_cpu(), testing.cuda_current_device_is_cpu():
            raise KeyError("inside")
    except KeyError:
        pass
    report["raised"] = changes(after_import, snapshot())
    print(repr(report))
    """
)


def test_importing_mtp_hooks_testing_and_closing_each_shim_patches_nothing() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert report == {name: [] for name in report}, report
    assert len(report) == 6, report
