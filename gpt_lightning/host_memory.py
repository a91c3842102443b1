"""Freed host memory kept in the process, so a CPU step's large temporaries come back from the heap.

glibc's malloc hands each block over 32 MB to the kernel with its own ``mmap`` and returns it at
``free``; a heap top over its trim threshold goes back too. A CPU training step allocates hundreds of
MB a step (a loss chunk's logits at GPT-2's vocabulary: 50257 floats a row), so every step faulted in
and zeroed those pages again: 40% of the time of a tiny-cpu step (docs/benchmarks.md). Keeping them
is what PyTorch's caching allocator does on a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt(3)'s parameters (malloc.h) and their largest value (an int).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _INT_MAX = -1, -3, -4, 2**31 - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse: ``mmap`` only for blocks over 2 GB (none before glibc
    2.35, which caps that threshold at 32 MB), no trimming of the heap. The process's resident memory
    then stays at its peak, which each step reaches again anyway. Once per process; False (nothing
    done) where the C library is not glibc (macOS, musl) or the environment sets malloc's own
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES=glibc.malloc.*``)."""
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
