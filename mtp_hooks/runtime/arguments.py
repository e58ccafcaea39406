"""Reading and rewriting arguments of a ``forward`` call as a with-kwargs pre-hook sees them.

Callers (Megatron-LM, verl, NeMo-RL) mix positional and keyword use of ``GPTModel.forward``, so
an argument is looked up by its position in the signature first and by name second, and is
written back into the slot it was found in.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import nn

# What a with-kwargs pre-hook returns: the call's new (args, kwargs), or None to leave it as it is.
HookResult = Optional[tuple[tuple[Any, ...], dict[str, Any]]]


class CallArguments:
    """Positions of ``forward``'s parameters for one module class."""

    def __init__(self, module: nn.Module) -> None:
        parameters = list(inspect.signature(type(module).forward).parameters)[1:]
        self._positions = {name: i for i, name in enumerate(parameters)}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        """The value of ``name`` in this call, or ``None`` if it was not passed."""
        position = self._positions.get(name)
        if position is not None and position < len(args):
            return args[position]
        return kwargs.get(name)

    def take(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[tuple[Any, ...], Any]:
        """Read ``name`` from the call and set it to ``None`` in the same slot (``kwargs`` in place).

        Returns the new positional arguments and the value that was there.
        """
        position = self._positions.get(name)
        if position is not None and position < len(args):
            value = args[position]
            return (*args[:position], None, *args[position + 1 :]), value
        value = kwargs.get(name)
        if name in kwargs:
            kwargs[name] = None
        return args, value

    def named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument of this call by parameter name (positional ones and keywords)."""
        names = sorted(self._positions, key=self._positions.__getitem__)
        return {**dict(zip(names, args)), **kwargs}
