"""The core of one forward, and the short window in which the model is not stock.

A forward changes the language model only inside one *window* of mcore's own post-processing:
from the end of the decoder (inference: ``mtp_process = False``, so the MTP block does not run)
or of the MTP block (training) to the output layer's first pre-hook on the main head's call,
where an output-layer pre-hook that the hooks keep first closes it. Two attributes change there,
written straight into the model's ``__dict__`` (what ``nn.Module.__setattr__`` does for plain
values): ``config`` becomes a ``proxies.config_view`` (``mtp_num_layers`` reads ``None``: stock's
own MTP loss stays off) and ``mtp_process`` becomes ``False``. Closing writes back the values
recorded at ``attach``. No user hook on the model's modules runs inside the window.

``Forward`` holds what every forward needs; each option keeps its own per-forward fields in its
``features`` module, and ``hooks.InFlight`` puts them together.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any, Optional

from torch import Tensor, nn

from mtp_hooks.runtime.micro_batch import MicroBatch


@dataclasses.dataclass
class Originals:
    """The attributes a window changes, as they were at ``attach`` (and the view to install)."""

    config: Any
    mtp_process: bool
    view: Any


@dataclasses.dataclass
class Forward:
    """The forward in flight; lives from the model's pre-hook to its post-hook."""

    model: nn.Module
    kwargs: dict[str, Any]  # the call's kwargs dict, to tell this call's post-hook from a nested one's
    thread: int
    exception: Optional[BaseException]  # ``sys.exc_info()[1]`` when the forward started
    targets: Optional[MicroBatch] = None  # set for a training forward only
    recompute: bool = False  # a checkpoint recompute of a forward that trained (and was counted) already
    window: Optional[Originals] = None  # set while the model is not stock
    main_pending: bool = False  # the window just closed: the next output-layer call is the main head's
    block_output: Optional[Tensor] = None  # the MTP block's output, matched by identity
    mtp_layer_calls: int = 0
    # Attributes of MTP layers swapped for the MTP block's run (module, name, original), restored
    # when the block returns or, if it raised, when the window closes.
    swaps: list[tuple[nn.Module, str, Any]] = dataclasses.field(default_factory=list)

    @property
    def train(self) -> bool:
        return self.targets is not None

    @property
    def here(self) -> bool:
        """Whether the calling thread is the one running this forward."""
        return self.thread == threading.get_ident()

    def open_window(self, originals: Originals) -> None:
        attributes = self.model.__dict__
        attributes["config"] = originals.view
        attributes["mtp_process"] = False
        self.window = originals

    def swap(self, module: nn.Module, name: str, value: Any) -> None:
        """Set a plain attribute of a submodule for the MTP block's run (``restore_swaps``)."""
        attributes = module.__dict__
        self.swaps.append((module, name, attributes[name]))
        attributes[name] = value

    def restore_swaps(self) -> None:
        while self.swaps:
            module, name, value = self.swaps.pop()
            module.__dict__[name] = value

    def close_window(self) -> bool:
        """Put back what the window changed (and any swap); ``True`` if the window was open."""
        self.restore_swaps()
        originals = self.window
        if originals is None:
            return False
        attributes = self.model.__dict__
        attributes["config"] = originals.config
        attributes["mtp_process"] = originals.mtp_process
        self.window = None
        return True

    def failed(self, output: Any) -> bool:
        """Whether the forward raised: no output, or torch calls the hook while handling an exception."""
        return output is None or sys.exc_info()[1] is not self.exception
