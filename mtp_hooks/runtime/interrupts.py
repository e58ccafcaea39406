"""Telling a forward that is still running from one that an interrupt abandoned.

torch runs ``always_call`` forward hooks when a forward raises an ``Exception``, but not for other
``BaseException``s (``KeyboardInterrupt``, ``SystemExit``, ``asyncio.CancelledError``): the hooks'
post-hook never runs then. A forward is running exactly while ``nn.Module._call_impl`` of the
model is on its thread's stack, so the hooks look there, and only off the normal path (a busy
lock, a config read inside the window). No frame is kept after the look. Only the calling
thread's own stack is read: the frames of a thread that is running cannot be read safely from
another one (reading their locals races with that thread and can crash the interpreter), so a
forward owned by another thread counts as running exactly while that thread is alive.
"""

from __future__ import annotations

import sys
import threading

from torch import nn

_CALL_IMPL = nn.Module._call_impl.__code__


def forwards_on_stack(module: nn.Module, thread: int, at_most: int = 1 << 30) -> int:
    """How many forwards of ``module`` are on the stack of ``thread``, counting up to ``at_most``;
    for another thread 1 while it is alive, 0 once it has ended (module docstring)."""
    if thread != threading.get_ident():
        return int(at_most > 0 and any(alive.ident == thread for alive in threading.enumerate()))
    frame = sys._getframe()
    count = 0
    while frame is not None and count < at_most:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            count += 1
        frame = frame.f_back
    return count
