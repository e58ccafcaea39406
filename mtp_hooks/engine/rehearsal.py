"""A push rehearsed on the meta device: what the engine's loader would write, decided before it writes.

vLLM's loader maps each HF name to its parameter imperatively (stacked ``qkv`` / ``gate_up``, experts,
renamed MTP layers) and checks shapes as it copies. To refuse a bad push before anything changes,
``rehearse`` runs the model's own ``load_weights`` once with every layer in load format on the meta
device (the metadata vLLM recorded at load time, as its layerwise reload uses) and the pushed tensors
moved to meta: the loaders map, narrow and copy exactly as in the real load, but no byte reaches the
engine. It reports which pushed names reached a parameter, how many elements of each load-format
parameter were covered, and the loader's own error, if any. The layers' live tensors are put back,
exactly, on exit (also when the loader raises).

Parameters vLLM derives after loading (MLA's ``W_UK_T`` / ``W_UV``, packed GEMM weights) are not in
the load format, so they are never counted as missing: ``mtp_hooks.engine.derived`` proves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Rehearsal", "refusal", "rehearse"]


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What the loader would do with a push (names are the engine's, relative to the pushed model)."""

    taken: frozenset[str]  # pushed names whose tensor reached a parameter's loader
    covered: dict[str, int]  # load-format parameter -> elements the push would write
    sizes: dict[str, int]  # load-format parameter -> elements it holds (padding excluded)
    error: Optional[BaseException]  # what the loader raised, if it refused

    def untouched(self, exclude: Callable[[str], bool]) -> list[str]:
        """Load-format parameters the push would not fill whole, but those ``exclude`` names."""
        return sorted(n for n, size in self.sizes.items() if self.covered.get(n, 0) < size and not exclude(n))


class _CopyCounter(TorchDispatchMode):
    """Counts the elements each ``copy_`` writes, refusing a copy that would broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        if func is torch.ops.aten.copy_.default:
            if args[0].numel() != args[1].numel():
                raise AssertionError(
                    f"copy of a tensor of shape {tuple(args[1].shape)} into one of shape {tuple(args[0].shape)}"
                )
            self.count += args[0].numel()
        return func(*args, **(kwargs or {}))


def _original_loader(tensor: Tensor) -> Callable[..., Any]:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(tensor, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":  # a finished reload's wrapper
        loader = loader.__wrapped__
    return loader


@contextlib.contextmanager
def _load_format_on_meta(model: nn.Module) -> Iterator[dict[int, str]]:
    """Every layer of ``model`` in load format on meta; yields ``id(parameter) -> qualified name``."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS, to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any], set[str], dict[str, Any]]] = []
    names: dict[int, str] = {}
    metas: dict[int, Tensor] = {}  # one meta tensor per live one: a tensor two layers share stays shared

    def meta(live: Tensor) -> Tensor:
        return metas.setdefault(id(live), to_meta_tensor(live))

    try:
        for prefix, layer in model.named_modules():
            if type(layer).__name__ in SKIP_MODULES:
                continue
            params, buffers = get_layerwise_info(layer).restore_metadata
            plain = {n: layer.__dict__[n] for n in (*params, *buffers) if n in layer.__dict__}
            saved.append(
                (layer, dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set), plain)
            )
            new_params = {n: restore_layer_refs(p, layer) for n, p in params.items()}
            new_params.update({n: meta(p) for n, p in layer._parameters.items() if n in SKIP_TENSORS and p is not None})
            new_buffers = {n: restore_layer_refs(b, layer) for n, b in buffers.items()}
            new_buffers.update({n: meta(b) for n, b in layer._buffers.items() if n in SKIP_TENSORS and b is not None})
            for n in plain:
                del layer.__dict__[n]
            layer._parameters.clear()
            layer._parameters.update(new_params)
            layer._buffers.clear()
            layer._buffers.update(new_buffers)
            names.update({id(p): f"{prefix}.{n}" if prefix else n for n, p in new_params.items() if id(p) not in names})
        yield names
    finally:
        for layer, params, buffers, non_persistent, plain in saved:
            layer._parameters.clear()
            layer._parameters.update(params)
            layer._buffers.clear()
            layer._buffers.update(buffers)
            layer._non_persistent_buffers_set.clear()
            layer._non_persistent_buffers_set.update(non_persistent)
            layer.__dict__.update(plain)


def rehearse(model: nn.Module, pairs: Sequence[tuple[str, Tensor]]) -> Rehearsal:
    """Run ``model.load_weights`` on ``pairs`` with the model and the tensors on meta; nothing is written."""
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    sources = {}
    meta_pairs = []
    for name, tensor in pairs:
        meta = tensor.to("meta")
        sources[id(meta)] = name
        meta_pairs.append((name, meta))
    taken: set[str] = set()
    covered: dict[str, int] = {}
    error: Optional[BaseException] = None
    with _load_format_on_meta(model) as names, torch.no_grad():
        parameters = {id(p): p for p in model.parameters()}
        sizes = {names[i]: get_tensor_load_numel(p) for i, p in parameters.items() if i in names}
        loaders = {i: p.__dict__.get("weight_loader") for i, p in parameters.items()}

        def recording(parameter: Tensor, original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)  # its signature too: vLLM's callers read it to decide how to call
            def load(*args: Any, **kwargs: Any) -> Any:
                for loaded in (*args, *kwargs.values()):  # loaders differ in signature: any pushed tensor counts
                    if isinstance(loaded, Tensor) and loaded is not parameter:
                        base = loaded._base if loaded._base is not None else loaded
                        source = sources.get(id(loaded), sources.get(id(base)))
                        if source is not None:
                            taken.add(source)
                with _CopyCounter() as counter:
                    result = original(*args, **kwargs)
                name = names.get(id(parameter), "")
                covered[name] = min(covered.get(name, 0) + counter.count, sizes.get(name, counter.count))
                return result

            return load

        try:
            for i, p in parameters.items():
                p.weight_loader = recording(p, _original_loader(p))
            model.load_weights(iter(meta_pairs))
        except Exception as raised:  # the loader's own refusal: reported, never half-applied
            error = raised
        finally:
            for i, p in parameters.items():
                if loaders[i] is None:
                    p.__dict__.pop("weight_loader", None)
                else:
                    p.weight_loader = loaders[i]
    return Rehearsal(frozenset(taken), covered, sizes, error)


def refusal(model: nn.Module, role: str, pairs: Sequence[tuple[str, Tensor]], shared: set[str]) -> str:
    """Why the engine's loader would not take ``pairs`` whole ("" if it would), decided on meta."""
    rehearsal = rehearse(model, pairs)
    if rehearsal.error is not None:
        return f"the engine's loader refused the push: {type(rehearsal.error).__name__}: {str(rehearsal.error)[:400]}"
    not_taken = [name for name, _ in pairs if name not in rehearsal.taken]
    untouched = rehearsal.untouched(lambda name: name in shared)
    if not_taken or untouched:
        return (
            f"{len(not_taken)} pushed names its loader does not take {not_taken[:8]}, "
            f"{len(untouched)} {role} parameters the push would leave unwritten {untouched[:8]}"
        )
    return ""
