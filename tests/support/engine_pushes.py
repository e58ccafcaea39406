"""Other ways into an engine's draft than ``VLLMSync.push``: what tests show it catches or avoids.

Test-only support for ``tests/engine``. Each function runs inside vLLM's worker through
``LLM.collective_rpc`` (they travel by module and name), on the draft model:

* ``load_without_processing``: the draft's ``load_weights`` alone, as a push that forgets vLLM's
  post-load processing does (the parameters change, MLA's derived ``W_UK`` / ``W_UV`` do not);
* ``reload_as_vllm_does``: vLLM's own layerwise reload (its draft weight-update sessions) without
  the push's repair of the weights vLLM's CPU AMX MLA backend releases;
* ``parameter_checksum`` / ``add_to_parameter``: read or change one engine parameter in place.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from mtp_hooks.engine.checksums import tensor_checksum
from mtp_hooks.engine.vllm_worker import restore_released_mla_weights, engine_model


def load_without_processing(worker: Any, pairs: Sequence[tuple[str, Tensor]]) -> None:
    model, _ = engine_model(worker, "draft")
    with torch.no_grad():
        restore_released_mla_weights(model, [name for name, _ in pairs])  # (CPU AMX MLA) a weight to load into
        model.load_weights(iter(pairs))


def reload_as_vllm_does(worker: Any, pairs: Sequence[tuple[str, Tensor]]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model, model_config = engine_model(worker, "draft")
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(iter(pairs))
        finalize_layerwise_reload(model, model_config)


def mla_backend(worker: Any) -> Optional[str]:
    """The class name of the draft's MLA attention implementation (``None``: no MLA)."""
    model, _ = engine_model(worker, "draft")
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and "MLA" in type(impl).__name__:
            return type(impl).__name__
    return None


def parameter_checksum(worker: Any, parameter: str) -> Optional[int]:
    """The checksum of the draft's ``parameter`` now (``None`` when it holds nothing)."""
    model, _ = engine_model(worker, "draft")
    tensor = dict(model.named_parameters())[parameter]
    return int(tensor_checksum(tensor).item()) if tensor.numel() else None


def add_to_parameter(worker: Any, parameter: str, value: float) -> None:
    """Add ``value`` to the first element of the draft's ``parameter``, in place."""
    model, _ = engine_model(worker, "draft")
    with torch.no_grad():
        dict(model.named_parameters())[parameter].view(-1)[0] += value
