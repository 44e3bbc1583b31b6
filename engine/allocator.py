"""The process's heap, tuned for an inference engine on CPU (glibc only; elsewhere nothing changes).

glibc serves every allocation above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with
a fresh `mmap` and returns it with `munmap` on free: a prefill of 2000 tokens allocates and frees
activations of 4-12 MB per op, and every one of them comes back as new pages the kernel must fault
in and zero. Raising the mmap and trim thresholds keeps those buffers in the heap for reuse (the
effect tcmalloc or jemalloc give other CPU serving stacks). On a 2-core AVX2 + FMA machine a
2000-token fp32 prefill took about 4.5 s with it and 5.2-6.3 s without (transformers `generate`,
run in the same process by the engine benchmark, gains as much). The cost: up to the trim threshold
of freed heap stays with the worker instead of going back to the OS.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for it on 64-bit
_TRIM_THRESHOLD = 1 << 30
_done = False


def keep_large_allocations() -> bool:
    """Once per process: raise glibc's mmap and trim thresholds. Returns whether they were set."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not _done:
        log.info("could not raise glibc's malloc thresholds; large buffers stay mmap-backed")
    return _done
