"""Tied embeddings on a later pipeline stage: the word-embedding copy that serves the MTP layers and heads.

On the stage with the output layer and the MTP layers (PP > 1, tied heads), mcore keeps a copy of
the word embeddings, and ``shared_embedding_or_output_weight()`` returns it only while
``mtp_process`` is set; otherwise it returns ``output_layer.weight``, which that stage never trains.
Two things follow, both for that stage alone:

* an inference forward opens the window at the decoder (``mtp_process = False``) before mcore reads
  the head's weight, so mcore would hand its main head the untrained ``output_layer.weight``. The
  weight mcore serves is read before the window opens (``served``); if the window hides it, it is
  kept (``Served.weight``, ``keep``) and handed to the main head's call (``serve``);
* under mcore's ``main_grad`` protocol the MTP layers' share of the copy's gradient is lost unless
  the copy is marked ``zero_out_wgrad`` while the hooks are attached (``mark``, ``Mark``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor, nn


@dataclasses.dataclass
class Served:
    """Per inference forward: the tied copy its window hid from the main head, if any."""

    weight: Optional[Tensor] = None


def served(model: nn.Module) -> Optional[Tensor]:
    """The weight mcore serves a tied main head now (before the window opens); ``None`` if untied."""
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    return model.shared_embedding_or_output_weight() if tied else None


def keep(state: Served, model: nn.Module, weight: Optional[Tensor]) -> None:
    """The window is open: keep ``weight`` (``served`` before it opened) if mcore now serves another."""
    if weight is not None and model.shared_embedding_or_output_weight() is not weight:
        state.weight = weight


def serve(state: Served, kwargs: dict[str, Any]) -> bool:
    """The main head's call: the kept copy as its ``weight``. Returns whether there was one."""
    if state.weight is None:
        return False
    kwargs["weight"] = state.weight
    return True


@dataclasses.dataclass
class Mark:
    """The copy ``mark`` flagged at ``attach`` (``None``: nothing was flagged), unflagged by ``undo``.

    A copy of the hooks (``deepcopy``, ``pickle``) holds no mark: it flagged nothing, so its
    ``remove`` leaves the copied weight as it came with the copy.
    """

    weight: Optional[Tensor] = None

    @classmethod
    def of(cls, model: nn.Module) -> Mark:
        return cls(mark(model))

    def undo(self) -> None:
        if self.weight is not None and getattr(self.weight, "zero_out_wgrad", False):
            del self.weight.zero_out_wgrad
        self.weight = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Mark:
        return Mark()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Mark, ())


def mark(model: nn.Module) -> Optional[Tensor]:
    """Mark a later pipeline stage's tied word-embedding copy ``zero_out_wgrad``; return it if marked here.

    On that stage (tied heads, the MTP layers there, PP > 1) one weight serves both the output layer
    and the MTP layers' embedding lookups. Under the ``main_grad`` protocol the output layer adds its
    share to ``main_grad`` and returns an uninitialised placeholder, autograd sums the lookups' share
    onto it, and DDP drops the sum (``grad_added_to_main_grad``): the lookups' share is lost (stock
    mcore too). ``zero_out_wgrad`` is mcore's own flag for a weight two layers use on one stage (it
    sets it at PP = 1 only): the placeholder is zeros, so DDP adds ``.grad``, which is then exactly
    the lookups' share. Nothing is computed anew, and a stage without fusion is unchanged (the flag
    is read only under the protocol).
    """
    if not (getattr(model, "share_embeddings_and_output_weights", False) and model.post_process and model.mtp_process):
        return None
    weight = model.embedding.word_embeddings.weight
    if getattr(weight, "zero_out_wgrad", False):
        return None  # PP = 1: mcore set it
    weight.zero_out_wgrad = True
    return weight
