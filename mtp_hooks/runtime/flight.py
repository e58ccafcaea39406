"""At most one forward of a model in flight, on one thread: the lock, the forward it guards, and the
recovery of a forward that an interrupt abandoned (``interrupts``).

The model's pre-hook starts a forward (``start``): it takes the lock or, if the lock is held,
refuses a nested forward or one from another thread, or recovers an abandoned one first. Every
submodule hook asks ``here`` for the forward of its own thread (one guard for all of them); the
model's post-hooks ask ``own_post`` for the forward their call belongs to and ``finish`` it.
"""

from __future__ import annotations

import threading
from typing import Generic, Optional, TypeVar

from torch import nn

from mtp_hooks.errors import bad_state, other_thread
from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.interrupts import forwards_on_stack

F = TypeVar("F", bound=Forward)


class Flight(Generic[F]):
    """The forward in flight of one model (``current``), guarded by a lock held from its pre-hook to its post-hook."""

    def __init__(self) -> None:
        self.current: Optional[F] = None
        self._lock = threading.Lock()
        self._recovering = threading.Lock()
        self._refused = 0  # nested calls refused on the owning thread whose post-hook is pending

    def start(self, model: nn.Module, forward: F) -> None:
        """Make ``forward`` the one in flight, or raise ``MTPHooksStateError`` (nested, other thread)."""
        if not self._lock.acquire(blocking=False):
            self._busy(model)
        self.current = forward

    def here(self) -> Optional[F]:
        """The forward in flight if it runs on the calling thread (the guard of every submodule hook)."""
        forward = self.current
        return forward if forward is not None and forward.here else None

    def own_post(self, model: nn.Module, kwargs: dict) -> Optional[F]:
        """The forward this post-hook call of ``model`` belongs to, or ``None`` for a call the
        pre-hook refused (another thread, nested) or never saw (an earlier pre-hook raised)."""
        forward = self.current
        if forward is None or not forward.here or self._refused:
            return None
        if kwargs is not forward.kwargs and forwards_on_stack(model, forward.thread, 2) > 1:
            return None
        return forward

    def refused_post(self) -> None:
        """The post-hook of a call that ``own_post`` disowned: one nested call's refusal is done."""
        if self._refused and self.current is not None and self.current.here:
            self._refused -= 1

    def finish(self, forward: F) -> None:
        """``forward`` returned (or raised): restore the model and free the lock."""
        self.current = None
        forward.close_window()
        self._lock.release()

    def window_live(self) -> bool:
        """Whether the config view should read ``mtp_num_layers = None`` now: only on the thread of
        a forward that is still running. A read after an interrupt abandoned it restores stock."""
        forward = self.current
        if forward is None or forward.window is None or not forward.here:
            return False
        if forwards_on_stack(forward.model, forward.thread, 1):
            return True
        self.recover_abandoned()
        return False

    def running(self) -> bool:
        """Whether a forward of the model is on its thread's stack (for ``remove`` and copies)."""
        forward = self.current
        return forward is not None and bool(forwards_on_stack(forward.model, forward.thread, 1))

    def recover_abandoned(self, inside_forward: bool = False) -> None:
        """Clean up after a forward that a non-``Exception`` interrupt abandoned: if no forward of
        the model is on the owning thread's stack any more, restore what it changed, drop it and
        free the lock. A ``with micro_batch`` block dropped its targets."""
        if self.current is None:
            return
        with self._recovering:
            forward = self.current
            if forward is None:
                return
            calling = 1 if inside_forward and forward.here else 0
            if forwards_on_stack(forward.model, forward.thread, calling + 1) > calling:
                return
            self.current, self._refused = None, 0
            forward.close_window()
            if self._lock.locked():
                self._lock.release()

    def _busy(self, model: nn.Module) -> None:
        """The lock is held: refuse a nested or other-thread forward, or recover an abandoned one."""
        me = threading.get_ident()
        owner = None if self.current is None else self.current.thread
        if owner == me and forwards_on_stack(model, me, 2) > 1:
            self._refused += 1
            raise bad_state(
                "model",
                "no forward of this model in flight when it is called",
                "a forward started inside another forward of it (nested forwards are not supported)",
            )
        if owner is not None and owner != me and forwards_on_stack(model, owner, 1):
            raise other_thread("model", "a forward")
        self.recover_abandoned(inside_forward=True)
        if not self._lock.acquire(blocking=False):
            raise other_thread("model", "a forward")
