"""The trained draft in a rollout engine: live weight sync into vLLM, and the stale-draft alarm.

``mtp_hooks.export.mtp_hf_weights(model, layout)`` gives the MTP layers as ``(hf_name, tensor)``
pairs; this package puts them into a running vLLM engine and proves they arrived:

* ``VLLMSync(llm).push(pairs)``: the engine's own loader and post-load processing (MLA's derived
  ``W_UK`` / ``W_UV``, CPU GEMM packing) on its draft model, or ``model="target"``;
* ``VLLMSync(llm).check(pairs)``: per-tensor checksums on each side, each on its tensor's device;
  ``StaleDraftError`` names the first tensor the engine does not hold;
* ``start_vllm`` / ``generate_greedy`` / ``generate_sampled`` / ``stop_vllm``: an in-process engine with MTP
  speculative decoding and the acceptance it measures (T = 0, or T > 0 with per-request seeds);
* ``spec_sampling_fix_needed()`` / ``vllm_cpu_spec_sampling_fix()``: vLLM's CPU build below 0.34 verifies
  drafts at T > 0 with uninitialised temperatures; ``start_vllm``, ``VLLMSync`` and ``generate_sampled``
  apply the fix themselves there, and the context manager does for an engine the library never saw;
* ``tensor_checksum`` / ``checksums``: the checksum both sides use.

Importing this package imports neither vLLM nor megatron-core, and none of its ``vllm_*`` modules: the
names below resolve on first use (PEP 562 ``__getattr__``), so a vLLM worker that unpickles the push loads
``vllm_worker`` and the engine modules it imports only. ``vllm`` itself is imported by the calls that need it.
``checksums`` and ``tensor_checksum`` are bound at once (torch only): the function ``checksums`` shares its
module's name, and binding it here keeps ``mtp_hooks.engine.checksums`` the function whichever import comes
first (the import system binds a submodule to its package's attribute when it first loads it).
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from mtp_hooks.engine.checksums import checksums, tensor_checksum
from mtp_hooks.errors import StaleDraftError

if _TYPE_CHECKING:  # what the lazy names are, for type checkers
    from mtp_hooks.engine.ledger import Write
    from mtp_hooks.engine.vllm_cpu_fix import spec_sampling_fix_needed, vllm_cpu_spec_sampling_fix
    from mtp_hooks.engine.vllm_engine import (
        CONFIGS,
        EngineAcceptance,
        SpecDecodeCounts,
        engine_environment,
        generate_greedy,
        generate_sampled,
        spec_decode_counts,
        start_vllm,
        stop_vllm,
    )
    from mtp_hooks.engine.vllm_sync import PushReport, VLLMSync

# The lazy names, by the module that defines them.
_MODULES = {
    "mtp_hooks.engine.ledger": ("Write",),
    "mtp_hooks.engine.vllm_cpu_fix": ("spec_sampling_fix_needed", "vllm_cpu_spec_sampling_fix"),
    "mtp_hooks.engine.vllm_engine": tuple(
        "CONFIGS EngineAcceptance SpecDecodeCounts engine_environment generate_greedy generate_sampled "
        "spec_decode_counts start_vllm stop_vllm".split()
    ),
    "mtp_hooks.engine.vllm_sync": ("PushReport", "VLLMSync"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "CONFIGS",
    "EngineAcceptance",
    "PushReport",
    "SpecDecodeCounts",
    "StaleDraftError",
    "VLLMSync",
    "Write",
    "checksums",
    "engine_environment",
    "generate_greedy",
    "generate_sampled",
    "spec_decode_counts",
    "spec_sampling_fix_needed",
    "start_vllm",
    "stop_vllm",
    "tensor_checksum",
    "vllm_cpu_spec_sampling_fix",
]


def __getattr__(name: str) -> _Any:
    """A lazy name's object, imported and bound here on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
