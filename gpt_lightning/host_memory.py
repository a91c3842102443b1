"""Freed host memory kept in the process, so a CPU step's large temporaries come back from the heap
instead of fresh pages the kernel faults in and zeroes every step (as PyTorch's caching allocator does
on a GPU; docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt(3)'s parameters (malloc.h) and their largest value (an int).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _INT_MAX = -1, -3, -4, 2**31 - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (no ``mmap`` per large block, no heap trimming), once per
    process; False (nothing done) where the C library is not glibc or the environment tunes malloc."""
    if any(name.startswith("MALLOC_") for name in os.environ) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return False
    unmapped = mallopt(_M_MMAP_THRESHOLD, _INT_MAX) or mallopt(_M_MMAP_MAX, 0)
    untrimmed = mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    return bool(unmapped and untrimmed)
