"""The baseline RL users run today: verl 0.9.1's MTP patch, run the way verl's Megatron engine runs it.

verl is not a dependency of ``mtp_hooks``. The benchmark imports it from ``.verl/py311`` (verl 0.9.1
and the packages its import needs, installed with ``pip install --no-deps --target``, pins in
``requirements/verl.txt``; ``make verl-env``), appended to ``sys.path`` after this
environment's own packages so that torch and megatron-core stay the benchmarked ones. Without it the
variant is skipped and the report says why.

What verl does (``verl.utils.megatron_utils.patch_engine_mtp`` -> ``verl.models.mcore.mtp_patch``):
``GPTModel._postprocess`` is replaced on the instance; the MTP block and the MTP losses run whenever
labels are passed, and verl's engine passes labels to every forward, its ``no_grad`` old-policy and
reference log-prob passes included. On megatron-core 0.14 - 0.16 (no ``process_mtp_loss``) its legacy
loop calls the output layer through ``torch.func.functional_call`` with detached parameters (MTP never
trains the head) and tests ``num_tokens > 0`` on the host once per depth. It returns main-head logits.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pathlib
import sys
import types
from typing import Any, Optional

from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERL_PATH = ROOT / ".verl" / "py311"
VERL_VERSION = "0.9.1"


class Unavailable(Exception):
    """A baseline that cannot run here; the message says what is missing."""


def _import_patch() -> Any:
    if VERL_PATH.is_dir() and str(VERL_PATH) not in sys.path:
        sys.path.append(str(VERL_PATH))
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    try:
        import verl
        from verl.utils.megatron_utils import patch_engine_mtp
    except Exception as error:  # ImportError, or a dependency failing at import
        where = f"{VERL_PATH.relative_to(ROOT)} holds no importable verl" if VERL_PATH.is_dir() else f"{VERL_PATH.relative_to(ROOT)} does not exist"
        raise Unavailable(f"verl {VERL_VERSION} is not importable ({where}: {type(error).__name__}: {error}); "
                          "make verl-env installs it") from None
    if getattr(verl, "__version__", None) != VERL_VERSION:
        raise Unavailable(f"verl {VERL_VERSION} expected, {getattr(verl, '__version__', '?')} found")
    return patch_engine_mtp


def version() -> Optional[str]:
    """The importable verl's version, or ``None``."""
    try:
        _import_patch()
    except Unavailable:
        return None
    return VERL_VERSION


def patch(model: nn.Module, detach_encoder: bool = False) -> None:
    """``patch_engine_mtp(model, model_config)`` as verl's Megatron engine calls it.

    verl prints the whole module and logs a warning while patching; that output is swallowed here.
    """
    patch_engine_mtp = _import_patch()
    model_config = types.SimpleNamespace(mtp=types.SimpleNamespace(detach_encoder=detach_encoder))
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            patch_engine_mtp(model, model_config)
    finally:
        logging.disable(logging.NOTSET)
