"""Which targets a forward trains on: its ``with micro_batch`` block's, its call's ``labels=``, or,
for a ``torch.utils.checkpoint`` recompute, those its original forward bound (``recompute``).

A block's targets belong to the thread that opened it and to its one grad-enabled forward; a
grad-disabled forward inside it is inference and leaves them (an option may still read them there:
``MicroBatch.read``). A recompute never takes an open block's targets: it runs in backward, where
the block open on the thread (if any) is another micro-batch's. A block that ends with targets
nothing used or read warns once per ``MicroBatches`` (``disarm``).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Optional

from torch import Tensor

from mtp_hooks.checks import Validate, check_against_inputs, check_loss_scale, check_targets
from mtp_hooks.errors import bad_argument, bad_state, not_entered, other_thread, unused_targets
from mtp_hooks.runtime.arguments import CallArguments
from mtp_hooks.runtime.recompute import Bound, BoundTargets, Regions, enclosing_regions


@dataclasses.dataclass
class MicroBatch:
    """Targets of one training micro-batch, as the user gave them."""

    labels: Tensor
    loss_mask: Optional[Tensor]
    loss_scale: Any = None  # multiplier of this micro-batch's MTP loss (float or 0-d tensor), None = 1
    used: bool = False  # a training forward (or a checkpointed one, see ``recompute``) took them
    entered: bool = False  # ``with`` entered: the only way targets reach a forward
    seen: bool = False  # a grad-disabled forward of the model ran inside the block
    read: bool = False  # ... and an option's code read them there (``features``)
    thread: int = dataclasses.field(default_factory=threading.get_ident)  # the thread that armed it


class MicroBatches:
    """The targets of one model's ``micro_batch`` blocks and of its checkpointed forwards."""

    def __init__(self, validate: Validate, warned_unused: bool = False) -> None:
        self.validate = validate
        self.pending: Optional[MicroBatch] = None  # the open block's targets (of the thread that opened it)
        self._bound = BoundTargets()  # targets of checkpointed forwards, for their recomputes
        self.warned_unused = warned_unused  # ``disarm`` warns once (a copy of the hooks keeps it)

    def arm(
        self, labels: Tensor, loss_mask: Optional[Tensor], loss_scale: Any, recover: Callable[[], None]
    ) -> MicroBatch:
        """Make ``labels`` / ``loss_mask`` the targets of this thread's ``with micro_batch`` block,
        after ``recover`` dropped a forward an interrupt abandoned.

        Inside a checkpoint recompute the block is the replay of one whose forward bound its
        targets already: it arms nothing, so a block open around the backward is left alone."""
        if enclosing_regions().recompute is not None:
            return MicroBatch(labels, loss_mask, loss_scale, used=True, entered=True)
        recover()
        pending = self.pending
        if pending is not None and pending.thread != threading.get_ident():
            raise other_thread("micro_batch", "a micro_batch")
        if pending is not None and not pending.entered:
            self.pending = None
            raise not_entered()
        if pending is not None:
            raise bad_state("micro_batch", "no micro_batch already open on these hooks", "a nested micro_batch")
        check_targets(labels, loss_mask, self.validate)
        self.pending = MicroBatch(labels, loss_mask, check_loss_scale("loss_scale", loss_scale))
        return self.pending

    def disarm(self, targets: MicroBatch, completed: bool = True) -> None:
        """Drop ``targets`` if they are still the armed ones. A block that ``completed`` (no
        exception) with targets no forward used or read warns, once: its grad-disabled forward
        may be a deliberate inference pass, so it is not refused."""
        if self.pending is not targets:
            return
        self.pending = None
        if completed and not (targets.used or targets.read or self.warned_unused):
            self.warned_unused = True
            warnings.warn(unused_targets(targets.seen), UserWarning, stacklevel=3)

    def of_call(
        self, arguments: CallArguments, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool
    ) -> tuple[tuple[Any, ...], tuple[Optional[MicroBatch], Optional[Bound], Regions]]:
        """The model's call with ``labels`` / ``loss_mask`` taken out (so mcore returns logits; the
        new positional arguments, ``kwargs`` in place) and ``of_forward`` of them."""
        args, labels = arguments.take(args, kwargs, "labels")
        args, loss_mask = arguments.take(args, kwargs, "loss_mask")
        return args, self.of_forward(labels, loss_mask, arguments.get(args, kwargs, "input_ids"), grad)

    def of_forward(
        self, labels: Any, loss_mask: Any, input_ids: Any, grad: bool
    ) -> tuple[Optional[MicroBatch], Optional[Bound], Regions]:
        """A forward's targets, what a checkpoint recompute recalled (``None`` otherwise) and the
        checkpoint calls around it. ``use_reentrant=True`` runs the original forward without
        grad: it still takes its block's targets (and binds them for the recompute)."""
        regions = enclosing_regions()
        bound = None if regions.recompute is None else self._bound.recall(regions.recompute)
        if bound is not None:  # checked when the original forward took them
            return bound.targets, bound, regions
        reentrant = bool(regions.forward) and regions.forward[0].reentrant
        targets = self._of_call(labels, loss_mask, input_ids, grad or reentrant, regions.recompute is not None)
        return targets, None, regions

    def bind_for_recomputes(
        self, regions: Regions, targets: Optional[MicroBatch], loss_scale: Any, train: bool
    ) -> None:
        """Leave a checkpointed forward's targets, with its final loss scale, for its recomputes."""
        if regions.forward:
            kept = None
            if targets is not None:
                kept = MicroBatch(targets.labels, targets.loss_mask, loss_scale, used=True, entered=True)
            self._bound.bind(regions.forward, Bound(kept, train))

    def _of_call(
        self, labels: Any, loss_mask: Any, input_ids: Any, take: bool, recompute: bool
    ) -> Optional[MicroBatch]:
        """The call's ``labels=`` or this thread's open block's targets (``take``: the forward uses
        them up); a ``recompute`` that recalled nothing never takes a block's."""
        pending = self.pending
        if recompute or (pending is not None and pending.thread != threading.get_ident()):
            pending = None  # another thread's block, or one open around a backward: never this forward's
        if pending is not None and not pending.entered:
            self.pending = None
            raise not_entered()
        if labels is None and loss_mask is None:
            if pending is None:
                return None
            if take:  # a grad-disabled forward inside the block is inference: it leaves the targets
                if pending.used:
                    raise bad_state(
                        "model",
                        "one training forward per micro_batch",
                        "a second training forward inside the same micro_batch",
                    )
                pending.used = True
            pending.seen = True
            check_against_inputs(pending.labels, input_ids)  # a block's (the call's are checked below)
            return pending
        if pending is not None:
            raise bad_argument(
                "labels", "labels either in micro_batch(...) or as model(..., labels=...), not both", "both"
            )
        if labels is None:
            raise bad_argument("labels", "a [b, s] integer tensor when loss_mask is given", None)
        if isinstance(labels, Tensor) and labels.dim() == 2:
            check_against_inputs(labels, input_ids)
        check_targets(labels, loss_mask, self.validate)
        return MicroBatch(labels, loss_mask)
