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

# mallopt(3)'s parameters (malloc.h) and their largest value (an int).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _INT_MAX = -1, -3, 2**31 - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse: ``mmap`` only for blocks over 2 GB, no trimming of the
    heap. The process's resident memory then stays at its peak, which each step reaches again anyway.
    Once per process; False (nothing done) where the C library is not glibc (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _INT_MAX) and mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
