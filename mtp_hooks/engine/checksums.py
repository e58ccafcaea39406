"""Per-tensor checksums that tell whether two copies of a weight hold the same bits, computed on the
device where each copy lives: only the scalars cross to the host, never the tensors.

The checksum reads a tensor's bytes in its logical (row-major) order, whatever its strides, in chunks
of ``2**20`` bytes. A chunk's sum is ``sum_i byte_i * w_i`` with weights ``w_i = (i * K mod 2**20) + 1``
(K odd: distinct within a chunk), computed as a float64 dot product that is exact (every product and
partial sum is an integer below ``2**53``, whatever the summation order); the chunks are combined by
Horner's rule, ``total = 3 * total + chunk`` modulo the prime ``2**61 - 1``. A change of any single
byte always changes the checksum, and bytes moved elsewhere change it but by coincidence. Equal
tensors give equal checksums on any device. About 0.25 s per 100 MB on one CPU core.

Compare tensors in one dtype: cast the trainer's fp32 tensor to the engine's bf16 first
(``checksums(pairs, dtype=torch.bfloat16)``), the same rounding the engine's load applied.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Union

import torch
from torch import Tensor

__all__ = ["checksums", "tensor_checksum"]

_MODULUS = (1 << 61) - 1  # a Mersenne prime
_CHUNK_BYTES = 1 << 20  # products byte * weight < 2**28, a chunk's sum < 2**48: exact in float64
_MULTIPLIER = 0x9E3779B1  # odd: i -> i * K is a bijection modulo 2**20


def tensor_checksum(tensor: Tensor) -> Tensor:
    """The checksum of ``tensor``'s bytes: a 0-dim ``int64`` tensor on ``tensor``'s device.

    Nothing is read to the host: call ``.item()`` (or stack many and ``.tolist()``) when the value
    is needed. A non-contiguous tensor is first copied to a contiguous one on its own device.
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    if not flat.numel():
        return total
    data = flat.view(torch.uint8)
    size = min(_CHUNK_BYTES, data.numel())
    positions = torch.arange(size, dtype=torch.int64, device=tensor.device)
    weight = ((positions * _MULTIPLIER) % _CHUNK_BYTES + 1).to(torch.float64)
    for start in range(0, data.numel(), size):
        part = data[start : start + size].to(torch.float64)
        chunk = torch.dot(part, weight[: part.numel()]).to(torch.int64)
        total = (total * 3 + chunk) % _MODULUS
    return total


def checksums(
    pairs: Iterable[tuple[str, Tensor]], dtype: Union[None, torch.dtype, Mapping[str, torch.dtype]] = None
) -> dict[str, int]:
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
