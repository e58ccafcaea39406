"""Train Multi-Token Prediction layers of Megatron-Core models inside RL loops, with hooks.

``attach(model)`` makes a GPTModel with MTP layers return main-head logits while its MTP
layers keep training on the same micro-batch; ``remove()`` restores stock mcore exactly.

Importing ``mtp_hooks`` imports neither torch nor megatron-core: the names below resolve on first use
(PEP 562 ``__getattr__``), so ``mtp_hooks.engine`` (a vLLM worker's side) loads without them. The first
use of ``attach``, ``MTPHooks``, ... imports ``megatron.core`` (about 3 s on a 2-core CPU, most of it
torch's dynamo / inductor and ``torch.distributed.tensor``, which megatron-core loads; ``mtp_hooks`` itself
takes milliseconds). megatron-core's import-time notices that Transformer Engine, Apex or absl are not
installed are silenced for the length of that import only (``_quiet``); every other warning is left alone.
The exception types (``mtp_hooks.errors``) import nothing and are bound at once.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from mtp_hooks.errors import MTPHooksError, MTPHooksStateError, StaleDraftError

if _TYPE_CHECKING:  # what the lazy names are, for type checkers
    from mtp_hooks.api import attach, attached, hooks_of
    from mtp_hooks.handle import MTPHooks
    from mtp_hooks.ops.logprobs import TokenLogProbs
    from mtp_hooks.targets import mtp_targets

# Each lazy name and the module that defines it.
_LAZY = {
    "attach": "mtp_hooks.api",
    "attached": "mtp_hooks.api",
    "hooks_of": "mtp_hooks.api",
    "MTPHooks": "mtp_hooks.handle",
    "TokenLogProbs": "mtp_hooks.ops.logprobs",
    "mtp_targets": "mtp_hooks.targets",
}

__all__ = [
    "MTPHooks", "MTPHooksError", "MTPHooksStateError", "StaleDraftError", "TokenLogProbs",
    "attach", "attached", "hooks_of", "mtp_targets",
]
__version__ = "0.3.0"


def __getattr__(name: str) -> _Any:
    """A lazy name's object, imported (megatron-core's notices silenced) and bound here on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mtp_hooks._quiet import megatron_notices_silenced

    with megatron_notices_silenced():
        value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
