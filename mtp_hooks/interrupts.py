"""Telling a forward that is still running from one that an interrupt abandoned.

torch runs ``always_call`` forward hooks when a forward raises an ``Exception``, but not for other
``BaseException``s (``KeyboardInterrupt``, ``SystemExit``, ``asyncio.CancelledError``): the hooks'
post-hook never runs then. A forward is running exactly while ``nn.Module._call_impl`` of the
model is on its thread's stack, so the hooks look there, and only off the normal path (a busy
lock, a config read inside the window). No frame is kept after the look.
"""

from __future__ import annotations

import sys
import threading

from torch import nn

_CALL_IMPL = nn.Module._call_impl.__code__


def forwards_on_stack(module: nn.Module, thread: int, at_most: int = 1 << 30) -> int:
    """How many forwards of ``module`` are on the stack of ``thread`` (0 if it no longer exists),
    counting up to ``at_most``."""
    frame = sys._getframe() if thread == threading.get_ident() else sys._current_frames().get(thread)
    count = 0
    while frame is not None and count < at_most:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            count += 1
        frame = frame.f_back
    return count
