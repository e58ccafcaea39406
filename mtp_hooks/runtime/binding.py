"""What ties the hooks to one model, and what a copy of a hooked model rebinds.

``ModelBinding`` holds everything that belongs to one model rather than to the options: a weak
reference to it, the attributes a window changes as they were at ``attach`` (``Originals``, with
the config view to install), the ``micro_batch`` targets and the forward in flight. A ``deepcopy``
of the hooked model copies the hooks object, and this binding rebinds to the copied model
(deepcopy's memo maps the model to its copy; pickling carries the model itself) with a fresh lock
and nothing in flight; both are refused mid-forward. Everything else the hooks hold copies as plain
data.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Optional

from torch import Tensor, nn

from mtp_hooks.checks import Validate
from mtp_hooks.errors import bad_state
from mtp_hooks.runtime.flight import Flight
from mtp_hooks.runtime.forward import Forward, Originals
from mtp_hooks.runtime.micro_batch import MicroBatch, MicroBatches
from mtp_hooks.runtime.proxies import config_view, is_config_view


class ModelBinding:
    """The hooks' state that belongs to one model (module docstring)."""

    def __init__(
        self, model: nn.Module, config: Any, mtp_process: bool, validate: Validate, warned_unused: bool = False
    ) -> None:
        self._bind(model, config, mtp_process, validate, warned_unused)

    def _bind(self, model: nn.Module, config: Any, mtp_process: bool, validate: Validate, warned_unused: bool) -> None:
        self.micro_batches = MicroBatches(validate, warned_unused)
        self.flight: Flight[Any] = Flight()
        self._model_ref = weakref.ref(model)
        self._originals = Originals(config, mtp_process, config_view(config, self.flight.window_live))

    @property
    def alive_model(self) -> Optional[nn.Module]:
        """The language model, or ``None`` once it was garbage-collected."""
        return self._model_ref()

    @property
    def model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise bad_state("model", "the model these hooks were attached to", "a model that no longer exists")
        return model

    def originals(self, model: nn.Module) -> Originals:
        """The attach-time originals; a config the user replaced since (not a view) is adopted."""
        config = model.__dict__.get("config")
        originals = self._originals
        if config is not originals.config and not is_config_view(config):
            view = config_view(config, self.flight.window_live)
            originals = self._originals = Originals(config, originals.mtp_process, view)
        return originals

    def open_window(self, forward: Forward) -> None:
        forward.open_window(self.originals(forward.model))

    def arm(self, labels: Tensor, loss_mask: Optional[Tensor], loss_scale: Any) -> MicroBatch:
        """A ``micro_batch`` block's targets (``MicroBatches.arm``), once a forward an interrupt
        abandoned is dropped."""
        return self.micro_batches.arm(labels, loss_mask, loss_scale, self.flight.recover_abandoned)

    def close(self) -> None:
        """For ``remove``: refuse while a forward runs; restore and drop everything otherwise."""
        if self.flight.running():
            raise bad_state(
                "remove", "no forward of the model in flight", "remove() while a forward of the model is running"
            )
        self.flight.recover_abandoned()
        self.micro_batches.pending = None

    # ------------------------------------------------------------------ copies
    def _refuse_mid_forward(self, call: str) -> None:
        self.flight.recover_abandoned()
        if self.flight.current is not None:
            raise bad_state(
                call, "no forward of the model in flight while it is copied", "a copy taken inside a forward"
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelBinding:
        self._refuse_mid_forward("copy.deepcopy")
        model = self.alive_model
        copied_model = memo.get(id(model)) if model is not None else None
        if copied_model is None:
            raise bad_state(
                "copy.deepcopy",
                "a deep copy of the hooked model (its copy gets its own hooks), or attach() on a copy",
                "a deep copy of the hooks without their model",
            )
        originals = self._originals
        return ModelBinding(
            copied_model, copy.deepcopy(originals.config, memo), originals.mtp_process,
            self.micro_batches.validate, self.micro_batches.warned_unused,
        )

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_mid_forward("pickle")
        model = self.alive_model
        if model is None:
            raise bad_state("pickle", "hooks whose model exists", "hooks whose model was garbage-collected")
        originals = self._originals
        micro_batches = self.micro_batches
        copy_of = (model, originals.config, originals.mtp_process, micro_batches.validate, micro_batches.warned_unused)
        return {"copy_of": copy_of}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._bind(*state["copy_of"])
