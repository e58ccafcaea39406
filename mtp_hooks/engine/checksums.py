"""Per-tensor checksums that tell whether two copies of a weight hold the same bits, computed on the
device where each copy lives: only the scalars cross to the host, never the tensors.

The checksum reads a tensor's bytes in its logical (row-major) order, whatever its strides, and sums
``byte_i * w_i`` modulo the Mersenne prime ``2**61 - 1`` with position weights ``w_i`` in
``[1, 2**31 - 1]``. A change of any single byte always changes it (``delta * w_i`` is never a
multiple of the prime); bytes moved to other places change it unless by a coincidence of about one
in ``2**31``. Unlike a float sum it is exact: equal tensors give equal checksums on any device and
for any chunking.

Compare tensors in one dtype: cast the trainer's fp32 tensor to the engine's bf16 first
(``checksums(pairs, dtype=torch.bfloat16)``), the same rounding the engine's load applied.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

__all__ = ["checksums", "tensor_checksum"]

_MODULUS = (1 << 61) - 1  # the running total, a Mersenne prime
_WEIGHT_MODULUS = (1 << 31) - 1  # position weights, a Mersenne prime too
_MULTIPLIER = 48_271
_CHUNK_BYTES = 1 << 22  # 4 MiB of bytes at a time: int64 temporaries of 32 MiB at most


def tensor_checksum(tensor: Tensor, *, chunk_bytes: int = _CHUNK_BYTES) -> Tensor:
    """The checksum of ``tensor``'s bytes: a 0-dim ``int64`` tensor on ``tensor``'s device.

    Nothing is read to the host: call ``.item()`` (or stack many and ``.tolist()``) when the value
    is needed. A non-contiguous tensor is first copied to a contiguous one on its own device.
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, data.numel(), chunk_bytes):
        part = data[start : start + chunk_bytes].to(torch.int64)
        position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=tensor.device)
        weight = position % _WEIGHT_MODULUS * _MULTIPLIER % _WEIGHT_MODULUS + 1  # in [1, 2**31 - 1]
        # each product < 2**39, a chunk's sum < 2**61: no int64 overflow
        total = (total + (part * weight).sum()) % _MODULUS
    return total


def checksums(pairs: Iterable[tuple[str, Tensor]], dtype: Union[None, torch.dtype, Mapping[str, torch.dtype]] = None) -> dict[str, int]:
    """``{name: checksum}`` of ``(name, tensor)`` pairs, each cast to ``dtype`` first (one for all, or
    one per name; ``None``: as they are).

    Each checksum is computed on its tensor's device (a cast makes a temporary copy there, one
    tensor at a time); the values reach the host together, in one read per device.
    """
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    order: list[str] = []
    for name, tensor in pairs:
        wanted = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        cast = tensor.detach() if wanted is None or tensor.dtype == wanted else tensor.detach().to(wanted)
        by_device.setdefault(cast.device, []).append((name, tensor_checksum(cast)))
        order.append(name)
    found: dict[str, int] = {}
    for computed in by_device.values():
        found.update(zip([name for name, _ in computed], torch.stack([value for _, value in computed]).tolist()))
    return {name: found[name] for name in order}
