"""Exact counters for one call: FLOPs, peak live tensor bytes, host syncs, host-to-device tensors.

They count what the call does, not how long it takes, so other work sharing the machine cannot change
them and one run per variant and shape is enough:

* ``flop_counter()``: ``torch.utils.flop_counter.FlopCounterMode`` with three formulas torch 2.13 lacks:
  the in-place ``addmm_`` / ``baddbmm_`` (2·m·n·k per product, as their out-of-place forms; a chunked
  weight-gradient accumulation is made of them) and the CPU attention kernels
  ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (torch's own SDPA formula: the full
  s × s products, a causal mask does not halve them, as for torch's GPU kernels).
* ``LiveBytes``: a dispatch mode that adds the bytes of every storage an op creates and subtracts them
  when the storage dies; its peak is what ``torch.cuda.max_memory_allocated`` would report above the
  memory live before the call, without the allocator's rounding, caching or fragmentation.
* ``HostSyncs``: a dispatch mode counting the ops that make the host wait for the device:
  ``_local_scalar_dense`` (``.item()``, ``bool()``, ``int()``), ``is_nonzero``, ``nonzero``, ``item``,
  ``equal`` (``torch.equal``) and copies from a device to the host. It sees the aten ops the Python
  code dispatches. It cannot see a sync made *inside* one op's kernel (e.g. a C++ kernel reading a device value into a host size, as
  ``masked_select`` or ``repeat_interleave`` without ``output_size`` do on CUDA), nor
  ``torch.cuda.synchronize()`` / stream or event waits (not aten ops): those it reports as 0.
* ``HostReads``: a function mode counting the Python calls that read tensor values on the host
  (``tolist``, ``item``, ``bool()``, ``int()``, ``float()``, ``numpy``): it sees the reads that
  ``HostSyncs`` cannot on CPU, where ``tolist`` dispatches no op (on a GPU it is a blocking copy).
* ``HostToDevice``: a dispatch mode counting tensors made from host data inside the call: ``lift_fresh``
  (``torch.tensor(python data)``, ``new_tensor``, ``as_tensor``), and ``_to_copy`` / ``copy_`` from a
  CPU tensor into a tensor on another device. On a GPU each is a host-to-device copy; on CPU the first
  is still counted (it is what would be copied on a GPU), the second cannot occur. Python numbers passed
  to an op as arguments (``x * 0.5``, ``torch.full``) are kernel arguments, and ``scalar_tensor`` makes
  a device scalar with a fill kernel (``empty().fill_(s)``; torch's CPU attention calls it for boolean
  masks): neither copies, neither is counted.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, Optional, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

T = TypeVar("T")

# Ops whose result the host must read back before it can go on (``equal`` returns a host bool).
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::item", "aten::equal"})
# Copies that make the host wait when they go from a device to the host.
_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_"})


aten = torch.ops.aten


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``addmm_`` / ``addmm``: one ``[m, k] @ [k, n]`` product, 2·m·n·k (the add is not counted, as torch)."""
    m, k = a_shape
    n = b_shape[1]
    return 2 * m * n * k


def _baddbmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    b, m, k = a_shape
    return 2 * b * m * b_shape[2] * k


def _sdpa_cpu_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward_flops(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten.addmm_: _addmm_flops,
    aten.baddbmm_: _baddbmm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` with ``EXTRA_FLOP_FORMULAS`` (in-place matmuls, CPU attention)."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)


def count_flops(fn: Callable[[], T]) -> tuple[int, T]:
    """(FLOPs of ``fn()``, its result), counted by ``flop_counter()`` (forward and any backward inside)."""
    with flop_counter() as counter:
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


class _ByOp:
    """Counts per op name (``by_op``) and their total (``count``); the base of the counting modes."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())


def _crosses_host(name: str, args: tuple, kwargs: Optional[dict], out: Any, direction: str) -> bool:
    """Whether a copy op moved data from a device to the host (``"to host"``) or the other way
    (``"to device"``); ``copy_``'s first argument is its destination, not a source."""
    sources = {t.device.type for t in _tensors((args[1:] if name == "aten::copy_" else args, kwargs))}
    targets = {t.device.type for t in _tensors(out)}
    host, devices = (targets, sources) if direction == "to host" else (sources, targets)
    return "cpu" in host and bool(devices - {"cpu", "meta"})


class _OpCounter(_ByOp, TorchDispatchMode):
    """Counts the ops named in ``OPS``, and the copies across the host boundary in ``DIRECTION``, by op."""

    OPS: frozenset[str]
    DIRECTION: str  # "to host" or "to device"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func._schema.name
        out = func(*args, **(kwargs or {}))
        if name in self.OPS:
            self.by_op[name] += 1
        elif name in _COPY_OPS and _crosses_host(name, args, kwargs, out, self.DIRECTION):
            self.by_op[f"{name} ({self.DIRECTION})"] += 1
        return out


class HostSyncs(_OpCounter):
    """Counts host syncs: ``_local_scalar_dense`` (``.item()``, ``bool()``), ``is_nonzero``,
    ``nonzero``, ``item``, ``equal``, and copies from a device to the host. ``by_op`` says which."""

    OPS = SYNC_OPS
    DIRECTION = "to host"


_READ_METHODS = {
    torch.Tensor.tolist: "tolist", torch.Tensor.item: "item", torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
}


class HostReads(_ByOp, TorchFunctionMode):
    """Counts Python-level reads of tensor values by the host (``_READ_METHODS``); ``by_op`` says which."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = _READ_METHODS.get(func)
        if name is not None:
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


# Ops that make a tensor out of host data.
_FROM_HOST_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})


class HostToDevice(_OpCounter):
    """Counts tensors made from host data (``lift_fresh``) and host-to-device
    copies (``_to_copy`` / ``copy_`` from a CPU tensor into another device's); ``by_op`` says which."""

    OPS = _FROM_HOST_OPS
    DIRECTION = "to device"
