"""Targets of checkpointed forwards, bound to the ``torch.utils.checkpoint`` call they ran in.

``torch.utils.checkpoint`` runs a forward again during backward (the *recompute*), when the
``micro_batch`` block that gave its targets has long closed and another micro-batch's may be
open. So the targets are bound to the checkpoint call itself, never to a tensor the user may
reuse or rebuild: each call has one object that lives exactly as long as its recompute can
happen, and that object is on the stack both when the forward runs and when it is recomputed:

* ``use_reentrant=False``: the call's ``_CheckpointFrame``, the ``new_frame`` of the suspended
  ``_checkpoint_without_reentrant_generator`` that ``checkpoint`` holds in forward, and the
  ``frame`` of ``_checkpoint_hook``'s unpack hook, which runs the recompute in backward;
* ``use_reentrant=True``: the autograd context ``ctx`` of ``CheckpointFunction``, the same object
  in its ``forward`` (which runs the function without grad) and its ``backward`` (the recompute).

The forwards of one model inside one call are bound in order and recalled in the same order by
each recompute run (a backward graph task). Frames are read only on the calling thread, and none
is kept. Binding holds the targets weakly keyed by that object: they go when the graph does.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import weakref
from types import CodeType
from typing import Any, NamedTuple, Optional

import torch
import torch.utils.checkpoint as _checkpoint



def _code(function: Any) -> Optional[CodeType]:
    return getattr(inspect.unwrap(function), "__code__", None) if function is not None else None


def _nested_code(outer: Optional[CodeType], name: str) -> Optional[CodeType]:
    consts = () if outer is None else outer.co_consts
    return next((c for c in consts if isinstance(c, CodeType) and c.co_name == name), None)


_function = getattr(_checkpoint, "CheckpointFunction", None)
_NON_REENTRANT_FORWARD = _code(getattr(_checkpoint, "checkpoint", None))
_NON_REENTRANT_GENERATOR = _code(getattr(_checkpoint, "_checkpoint_without_reentrant_generator", None))
_NON_REENTRANT_RECOMPUTE = _nested_code(
    _code(getattr(getattr(_checkpoint, "_checkpoint_hook", None), "__init__", None)), "unpack_hook"
)
_REENTRANT_FORWARD = _code(getattr(_function, "forward", None))
_REENTRANT_RECOMPUTE = _code(getattr(_function, "backward", None))
# Whether the installed torch lays its checkpoint out as read here (pinned by a test). If not, no
# region is found: a recompute then takes only its call's ``labels=``, and one whose targets came
# from a block fails loudly in torch (CheckpointError: tensors saved differ), never silently.
SUPPORTED: bool = None not in (
    _NON_REENTRANT_FORWARD, _NON_REENTRANT_GENERATOR, _NON_REENTRANT_RECOMPUTE, _REENTRANT_FORWARD, _REENTRANT_RECOMPUTE
)


@dataclasses.dataclass(frozen=True)
class Region:
    """One ``torch.utils.checkpoint`` call: its own object, its flavour, and for a recompute the
    backward run (graph task, or checkpoint's group id) recomputing it."""

    key: Any
    reentrant: bool
    run: Any = None


class Regions(NamedTuple):
    """The checkpoint calls around a forward: those it runs the original forward of, innermost
    first, up to the innermost recompute it is part of (``None`` outside any recompute)."""

    forward: list[Region]
    recompute: Optional[Region]


def enclosing_regions() -> Regions:
    """Read the calling thread's stack for ``torch.utils.checkpoint`` calls (module docstring)."""
    forward: list[Region] = []
    frame = sys._getframe(1) if SUPPORTED else None
    while frame is not None:
        code = frame.f_code
        if code is _REENTRANT_FORWARD:
            forward.append(Region(frame.f_locals["ctx"], True))
        elif code is _REENTRANT_RECOMPUTE:
            return Regions(forward, Region(frame.f_locals["ctx"], True, torch._C._current_graph_task_id()))
        elif code is _NON_REENTRANT_RECOMPUTE:
            local = frame.f_locals
            return Regions(forward, Region(local["frame"], False, local.get("gid")))
        elif code is _NON_REENTRANT_FORWARD:
            gen = frame.f_locals.get("gen")
            if (
                gen is not None
                and getattr(gen, "gi_code", None) is _NON_REENTRANT_GENERATOR
                and gen.gi_frame is not None
            ):
                new_frame = gen.gi_frame.f_locals.get("new_frame")
                if new_frame is not None:
                    forward.append(Region(new_frame, False))
        frame = frame.f_back
    return Regions(forward, None)


class Bound(NamedTuple):
    """What a checkpointed forward left for its recomputes: its targets (``micro_batch.MicroBatch``;
    ``None``: it had none) and whether it trained (then it was counted, and its recomputes are not)."""

    targets: Any
    trained: bool


@dataclasses.dataclass
class _Record:
    forwards: list[Bound] = dataclasses.field(default_factory=list)
    recalled: dict[Any, int] = dataclasses.field(default_factory=dict)  # per recompute run: forwards recalled


class BoundTargets:
    """The targets of one model's checkpointed forwards, by checkpoint call (module docstring)."""

    def __init__(self) -> None:
        self._records: "weakref.WeakKeyDictionary[Any, _Record]" = weakref.WeakKeyDictionary()

    def bind(self, regions: list[Region], bound: Bound) -> None:
        """Record the next forward of the model inside each of ``regions``."""
        for region in regions:
            record = self._records.get(region.key)
            if record is None:
                record = self._records[region.key] = _Record()
            record.forwards.append(bound)

    def recall(self, region: Region) -> Optional[Bound]:
        """What the original of this recomputed forward bound (``None``: it bound nothing)."""
        record = self._records.get(region.key)
        if record is None:
            return None
        index = record.recalled.get(region.run, 0)
        record.recalled[region.run] = index + 1
        return record.forwards[index] if index < len(record.forwards) else None
