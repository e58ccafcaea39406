"""What a push wrote into the engine, and the comparison that proves (or refutes) that the engine's
draft is the trainer's. No engine import here: the records are plain data.

A push records, for every tensor it pushed, each write the engine's own loader made of it: the
engine parameter it went into (vLLM stacks ``q``/``k``/``v``, ``gate``/``up``, experts, DeepSeek's
``q_a``/``kv_a`` into one parameter), the view inside it, the dtype, and two checksums computed by
the engine on its own device: right after the write (``loaded``) and after the engine derived its
runtime weights (``live``; ``None`` where its kernels repacked the weight and released the
parameter, as vLLM's CPU linear layers do).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch

from mtp_hooks.errors import StaleDraftError

__all__ = ["Ledger", "Write", "compare"]


@dataclasses.dataclass(frozen=True)
class Write:
    """One write of a pushed tensor into an engine parameter, as the engine's loader made it."""

    name: str  # the pushed (HF) name
    parameter: str  # the engine parameter's qualified name in the engine's model ("" if not found)
    parameter_shape: tuple[int, ...]  # its shape when written (the load format)
    offset: int  # the view's storage offset from the parameter's
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # the engine's dtype, e.g. "torch.bfloat16"
    loaded: int  # checksum of the view right after the write
    live: Optional[int] = None  # checksum of the same view after the engine's processing; None: released

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as the ``torch.dtype`` it names."""
        found = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise AssertionError(f"a write recorded with dtype {self.dtype!r}")
        return found


Ledger = Mapping[str, Sequence[Write]]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _stale(name: str, expected: str, received: str, reason: str, write: Optional[Write] = None) -> StaleDraftError:
    naming = ""
    if write is not None and write.parameter:
        naming = (
            f"\n  names: the trainer's {name} is held by the engine's {write.parameter}: the engine names its own "
            "parameters: it numbers the MTP layers by its own scheme (after the target's decoder layers, or from the "
            "checkpoint's MTP index plus an offset), and stacks q/k/v, gate/up and experts into one parameter; "
            "the pushed name is the checkpoint's)"
        )
    return StaleDraftError(
        f"{name}: the engine's draft is not the trainer's\n"
        f"  expected: {expected}\n  received: {received}\n  {reason}{naming}"
    )


def compare(
    trainer: Mapping[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    ledger: Ledger,
    live: Mapping[tuple[str, int], Optional[int]],
) -> int:
    """Raise ``StaleDraftError`` for the first of the trainer's tensors the engine does not hold.

    Args:
        trainer: the trainer's checksums, each computed in the dtype of the tensor's write.
        shapes: the trainer's shapes.
        ledger: the last push's writes, by name.
        live: the engine's checksums now, by ``(name, index of the write)``; ``None`` where the
            parameter no longer holds the data (released after processing).

    Returns:
        The number of tensors checked.
    """
    for name, checksum in trainer.items():
        writes = ledger.get(name)
        trained = f"checksum {checksum} (the trainer's tensor, shape {tuple(shapes[name])})"
        if not writes:
            raise _stale(
                name,
                trained,
                "nothing: no push since the engine started carried this name",
                "push the trainer's weights (VLLMSync.push) before the check, under the names it checks",
            )
        for index, write in enumerate(writes):
            where = f"the engine's {write.parameter or 'parameter'} view {write.shape} ({write.dtype})"
            if _numel(write.shape) != _numel(shapes[name]):
                raise _stale(
                    name, trained, f"{where}: another size", "the trainer's tensor changed shape since the push", write
                )
            if write.loaded != checksum:
                raise _stale(
                    name,
                    trained,
                    f"checksum {write.loaded} ({where}, as the last push wrote it)",
                    "the trainer's tensor changed since the last push: "
                    "an optimizer step without a push, or a push of other weights",
                    write,
                )
            now = live.get((name, index))
            if write.live is not None and now != write.live:
                raise _stale(
                    name,
                    f"checksum {write.live} ({where}, as it was after the last push)",
                    f"checksum {now} (the same view now)" if now is not None else "nothing (the parameter is gone)",
                    "the engine's tensor changed since the push (overwritten, or dropped as by a sleep / offload)",
                    write,
                )
    return len(trainer)
