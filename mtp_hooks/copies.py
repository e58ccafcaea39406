"""Copies of a hooked model: ``copy.deepcopy`` and ``pickle`` give the copy its own hooks.

torch's hook dicts hold bound methods of ``ForwardHooks``, and ``RemovableHandle`` copies through
``__getstate__`` / ``__setstate__`` onto the copied dicts, so a deep copy of the model copies the
hooks object with it. Here that copy is rebound to the copied model (deepcopy's memo maps the
original model to its copy; pickling carries the model itself) with a fresh lock and no forward
or targets in flight. Copying while a forward runs is refused.
"""

from __future__ import annotations

import copy
from typing import Any

from mtp_hooks.errors import bad_state

_PER_MODEL = ("pending", "forward", "_model_ref", "_originals", "_lock", "_recovering", "_refused", "_bound", "_marked")


class CopyableHooks:
    """Mixin of ``ForwardHooks``: how it is deep-copied and pickled (module docstring)."""

    def _refuse_mid_forward(self, call: str) -> None:
        self.recover_abandoned()  # type: ignore[attr-defined]
        if self.forward is not None:  # type: ignore[attr-defined]
            raise bad_state(call, "no forward of the model in flight while it is copied", "a copy taken inside a forward")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._refuse_mid_forward("copy.deepcopy")
        model = self.alive_model  # type: ignore[attr-defined]
        copied_model = memo.get(id(model)) if model is not None else None
        if copied_model is None:
            raise bad_state(
                "copy.deepcopy",
                "a deep copy of the hooked model (its copy gets its own hooks), or attach() on a copy",
                "a deep copy of the hooks without their model",
            )
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name not in _PER_MODEL:
                new.__dict__[name] = copy.deepcopy(value, memo)
        originals = self._originals  # type: ignore[attr-defined]
        new._bind(copied_model, copy.deepcopy(originals.config, memo), originals.mtp_process)  # type: ignore[attr-defined]
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_mid_forward("pickle")
        model = self.alive_model  # type: ignore[attr-defined]
        if model is None:
            raise bad_state("pickle", "hooks whose model exists", "hooks whose model was garbage-collected")
        state = {name: value for name, value in self.__dict__.items() if name not in _PER_MODEL}
        originals = self._originals  # type: ignore[attr-defined]
        state["_copy_of"] = (model, originals.config, originals.mtp_process)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model, config, mtp_process = state.pop("_copy_of")
        self.__dict__.update(state)
        self._bind(model, config, mtp_process)  # type: ignore[attr-defined]
