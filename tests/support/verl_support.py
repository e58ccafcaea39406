"""verl 0.9.1 for the integration tests: imported from the installed package, never copied.

``import_verl()`` returns verl's modules, or skips the calling test module with what is missing;
with ``MTP_HOOKS_REQUIRE_VERL=1`` (set by ``make test-verl``) a missing verl is an error instead,
so a CI run that lost its verl environment fails. Also here: verl's ``MtpConfig`` inside the
smallest model config that ``patch_engine_mtp`` / ``attach_engine_mtp`` read.
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest

VERL_VERSION = "0.9.1"


def import_verl() -> types.SimpleNamespace:
    """verl's MTP patch, its engine helpers and its configs, or a module-level skip."""
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    try:
        import verl
        from verl.models.mcore import mtp_patch
        from verl.utils import megatron_utils
        from verl.workers.config.model import MtpConfig
    except ImportError as error:
        if os.environ.get("MTP_HOOKS_REQUIRE_VERL"):
            raise RuntimeError(f"MTP_HOOKS_REQUIRE_VERL is set but verl cannot be imported: {error!r}") from error
        pytest.skip(f"verl is not importable ({error}); `make test-verl` installs verl {VERL_VERSION} in .verl/", allow_module_level=True)
    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(f"these tests pin verl {VERL_VERSION}, imported {verl.__version__} (requirements/verl.txt)")
    return types.SimpleNamespace(mtp_patch=mtp_patch, megatron_utils=megatron_utils, MtpConfig=MtpConfig)


def model_config(verl: types.SimpleNamespace, detach_encoder: bool) -> Any:
    """What ``patch_engine_mtp`` reads of verl's ``HFModelConfig``: its ``mtp`` (a real ``MtpConfig``)."""
    return types.SimpleNamespace(mtp=verl.MtpConfig(enable=True, enable_train=True, detach_encoder=detach_encoder))


def verl_function(module: str, name: str) -> Any:
    """verl's own top-level function ``name`` of ``module``, compiled from its installed source alone.

    For functions of modules whose imports this environment lacks (``verl.trainer.ppo.ray_trainer``
    imports ray's trainer stack and torchdata): the function's definition is taken from the
    installed file by ``ast`` and compiled unchanged, with the module's file name, against
    builtins only, so it must read no module global (a ``NameError`` says it does).
    """
    import ast
    import importlib.util

    import_verl()
    package, _, leaf = module.rpartition(".")
    spec = importlib.util.find_spec(package)
    path = os.path.join(os.path.dirname(spec.origin), leaf + ".py")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), filename=path)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if len(found) != 1:
        raise RuntimeError(f"{module}.{name}: {len(found)} top-level definitions in {path}, expected 1")
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return namespace[name]
