"""Wall time and peak memory of one call, on CPU or CUDA.

Memory is the growth of the peak over what was live just before the call:

* CPU: resident set. ``exact_cpu_memory`` first makes glibc map every block of 1 MiB or more on
  its own and unmap it when freed (by default it keeps freed blocks of up to 32 MiB for reuse,
  so the resident peak would count dead memory, more for some variants than for others). Before
  each call freed heap pages are returned (``malloc_trim``) and the kernel's high-water mark is
  reset (``/proc/self/clear_refs`` <- ``5``); the result is ``VmHWM - VmRSS(before)``.
* CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus
  ``memory_allocated()`` before (the caching allocator's reserve is not counted).
"""

from __future__ import annotations

import ctypes
import gc
import re
import time
from typing import Any, Callable

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


class Meter:
    """Times and peak memory of calls on one device."""

    def __init__(self, device: str) -> None:
        self.cuda = device != "cpu"
        self._libc = None if self.cuda else ctypes.CDLL("libc.so.6")

    def exact_cpu_memory(self) -> None:
        """Large blocks mapped and unmapped one by one from now on (glibc ``M_MMAP_THRESHOLD``).

        Changes allocation speed, so call it after the timed runs, before the memory probes.
        """
        if self._libc is not None:
            m_mmap_threshold = -3
            self._libc.mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(1 << 20))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds of one call, device work included."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def peak_growth(self, fn: Callable[[], Any]) -> tuple[int, int]:
        """(peak bytes above the live bytes before the call, absolute peak bytes) of one call."""
        gc.collect()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            self.sync()
            peak = torch.cuda.max_memory_allocated()
            return peak - before, peak
        assert self._libc is not None
        self._libc.malloc_trim(0)
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        fn()
        peak = _status_kib("VmHWM")
        return (peak - before) * 1024, peak * 1024
