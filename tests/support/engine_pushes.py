"""Other ways into an engine's draft than ``VLLMSync.push``: what tests show it catches or avoids.

Test-only support for ``tests/engine``. Each function runs inside vLLM's worker through
``LLM.collective_rpc`` (they travel by module and name), on the draft model:

* ``load_without_processing``: the draft's ``load_weights`` alone, as a push that forgets vLLM's
  post-load processing does (the parameters change, MLA's derived ``W_UK`` / ``W_UV`` do not);
* ``reload_as_vllm_does``: vLLM's own layerwise reload (its draft weight-update sessions) without
  the push's repair of the weights vLLM's CPU AMX MLA backend releases;
* ``parameter_checksum`` / ``add_to_parameter``: read or change one engine parameter in place;
* ``fail_next_load_after_first_tensor``: a load that stops midway, as a crash inside vLLM would;
* ``derived_views_of_kv_b_proj``: whether the generic derivation's tensors are views of ``kv_b_proj``;
* ``derived_mismatches``: the draft's MLA-derived tensors that are not what a given ``kv_b_proj`` gives.
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


def derived_mismatches(worker: Any, pairs: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Every MLA layer of the draft proven against the one ``kv_b_proj.weight`` among ``pairs`` (in bf16)."""
    from mtp_hooks.engine.derived import is_mla, prove_mla

    model, _ = engine_model(worker, "draft")
    kv_b_proj = next(t for name, t in pairs if name.endswith("kv_b_proj.weight")).to(torch.bfloat16)
    return [f"{m.layer}.{m.tensor}" for name, module in model.named_modules() if is_mla(module) for m in prove_mla(name, module, kv_b_proj)]


def derived_views_of_kv_b_proj(worker: Any) -> list[bool]:
    """Per MLA layer of the draft: whether its generic ``W_UK_T`` / ``W_UV`` share ``kv_b_proj.weight``'s storage."""
    from mtp_hooks.engine.derived import is_mla

    model, _ = engine_model(worker, "draft")
    found = []
    for module in model.modules():
        if is_mla(module) and isinstance(getattr(module, "W_UK_T", None), Tensor):
            storage = module.kv_b_proj.weight.untyped_storage().data_ptr()
            found.append(all(t.untyped_storage().data_ptr() == storage for t in (module.W_UK_T, module.W_UV)))
    return found


def fail_next_load_after_first_tensor(worker: Any) -> None:
    """Fault injection: the draft's next ``load_weights`` loads its first tensor, then raises (once)."""
    model, _ = engine_model(worker, "draft")
    own = model.load_weights

    def failing(weights: Any) -> Any:
        pairs = list(weights)
        if pairs and pairs[0][1].is_meta:  # the push's rehearsal: let it through
            return own(iter(pairs))
        del model.load_weights  # the model's own method again
        own(iter(pairs[:1]))
        raise RuntimeError("injected: the load stopped after its first tensor")

    model.load_weights = failing


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
