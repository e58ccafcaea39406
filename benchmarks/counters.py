"""Exact counters for one call: FLOPs, peak live tensor bytes, host syncs.

They count what the call does, not how long it takes, so other work sharing the machine cannot change
them and one run per variant and shape is enough:

* ``count_flops``: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention).
* ``LiveBytes``: a dispatch mode that adds the bytes of every storage an op creates and subtracts them
  when the storage dies; its peak is what ``torch.cuda.max_memory_allocated`` would report above the
  memory live before the call, without the allocator's rounding, caching or fragmentation.
* ``HostSyncs``: a dispatch mode counting the ops that make the host wait for the device.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, Optional, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

T = TypeVar("T")

# Ops whose result the host must read back before it can go on.
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::item"})
# Copies that make the host wait when they go from a device to the host.
_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_"})


def count_flops(fn: Callable[[], T]) -> tuple[int, T]:
    """(FLOPs of ``fn()``, its result), counted by ``FlopCounterMode`` (forward and any backward inside)."""
    with FlopCounterMode(display=False) as counter:
        result = fn()
    return counter.get_total_flops(), result


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    """A key for the tensor's storage while it lives; ``None`` for tensors without real storage."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, meta-less wrappers
        return None
    if storage.nbytes() == 0 or storage.device.type == "meta":
        return None
    return storage.data_ptr()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while the mode is active and still alive.

    An op output whose storage is not one of the op's inputs' storages and has not been seen before is
    a new allocation: its bytes are added and ``weakref.finalize`` on the storage subtracts them when
    it dies. Storages that existed before the mode (parameters, inputs, ``.grad`` being accumulated
    into) are never counted, also when an in-place op or a view returns them. ``peak`` is the highest
    running sum, ``live`` the current one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _released(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {key for key in map(_storage_key, _tensors((args, kwargs))) if key is not None}
        for tensor in _tensors(out):
            key = _storage_key(tensor)
            if key is None or key in inputs or key in self._seen:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._released, key, nbytes)
        return out


class HostSyncs(TorchDispatchMode):
    """Counts host syncs: ``_local_scalar_dense`` (``.item()``, ``bool()``), ``is_nonzero``,
    ``nonzero``, ``item``, and copies from a device to the host. ``by_op`` says which."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func._schema.name
        out = func(*args, **(kwargs or {}))
        if name in SYNC_OPS:
            self.by_op[name] += 1
        elif name in _COPY_OPS:
            sources = [t.device.type for t in _tensors((args, kwargs))]
            targets = [t.device.type for t in _tensors(out)]
            if any(d not in ("cpu", "meta") for d in sources) and "cpu" in targets:
                self.by_op[f"{name} (to host)"] += 1
        return out
