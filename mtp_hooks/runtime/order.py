"""Hooks kept at an edge of their module's hook dict, whatever users register later.

torch runs a module's hooks in the order of its hook dict, and ``prepend=True`` places a hook only
when it is registered. Some of the hooks must stay last (the model's counting post-hook, the
decoder's and the MTP block's window-opening post-hooks) or first (the output layer's
window-closing pre-hook), so ``HookOrder.restore`` moves them back to their edge at the start of
every forward. Kept by hook id and looked up on the model that forward runs, so a copy of the
model (whose hook dicts keep the ids) is kept in order too.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle


class HookOrder:
    """The hooks to keep first or last, each by (submodule name, hook dict, hook id, last)."""

    def __init__(self) -> None:
        self._kept: list[tuple[str, str, int, bool]] = []

    def keep(
        self, handle: RemovableHandle, submodule: str = "", *, pre: bool = False, last: bool = True
    ) -> RemovableHandle:
        """Keep ``handle``'s hook last (or first) among the forward (``pre``: pre-) hooks of the
        model's ``submodule`` (``""``: the model itself). Returns ``handle``."""
        self._kept.append((submodule, "_forward_pre_hooks" if pre else "_forward_hooks", handle.id, last))
        return handle

    def restore(self, model: nn.Module) -> None:
        """Move every kept hook of ``model`` that users pushed off its edge back there."""
        for submodule, attribute, hook_id, last in self._kept:
            module = getattr(model, submodule, None) if submodule else model
            hooks = None if module is None else getattr(module, attribute)
            if not hooks or hook_id not in hooks:
                continue
            edge = next(reversed(hooks)) if last else next(iter(hooks))
            if edge != hook_id:
                hooks.move_to_end(hook_id, last=last)
