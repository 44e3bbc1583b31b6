"""Large host buffers on 2 MiB pages: the CPU KV pool.

The decode step reads every running sequence's KV from blocks scattered over the pool. On 4 KiB pages
each block a head reads (2 KiB at 16 tokens x 64 dims in bfloat16) costs a TLB miss and a page walk
besides its cache lines; on 2 MiB pages a walk covers a thousand blocks. Linux backs memory with
transparent huge pages when the system's mode is `always`, or, in the common `madvise` mode, only
where the process asks (`madvise(MADV_HUGEPAGE)`) before the pages are first touched. So a buffer is
allocated untouched, advised, then zeroed. Where the kernel says `never`, or on another OS, the buffer
is an ordinary one: huge pages are a speed-up, never a requirement.

`PDSERVE_HUGE_PAGES=0` turns the advice off (to measure what it buys). No Ray, no engine imports.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux, every architecture
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SWITCH = "PDSERVE_HUGE_PAGES"


def thp_mode(text: str | None = None) -> str:
    """The kernel's transparent huge page mode: `always`, `madvise`, `never`, or `unavailable`.

    text: the sysfs file's contents (read when None), e.g. "always [madvise] never".
    """
    if text is None:
        try:
            text = THP_MODE.read_text()
        except OSError:
            return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def advisable_range(start: int, nbytes: int) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside [start, start + nbytes), as (first byte, length); None if there are none."""
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else None


def _madvise_huge(start: int, length: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, length, MADV_HUGEPAGE) == 0:
        return True
    log.info("madvise(MADV_HUGEPAGE) refused: %s", os.strerror(ctypes.get_errno()))
    return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, str]:
    """A zeroed tensor, on 2 MiB pages where the host allows it; and how its pages were chosen (for logs).

    Device memory and small buffers are plain `torch.zeros`.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), "device memory"
    mode = thp_mode()
    if os.environ.get(SWITCH, "1") == "0":
        return torch.zeros(shape, dtype=dtype), f"4 KiB pages ({SWITCH}=0)"
    if not sys.platform.startswith("linux") or mode in ("never", "unavailable"):
        return torch.zeros(shape, dtype=dtype), f"4 KiB pages (transparent huge pages: {mode})"
    t = torch.empty(shape, dtype=dtype)  # large allocations come untouched from mmap
    span = advisable_range(t.data_ptr(), t.numel() * t.element_size())
    if mode == "always":
        how = "2 MiB pages (transparent huge pages: always)"
    elif span is not None and _madvise_huge(*span):
        how = "2 MiB pages (madvise)"
    else:
        how = "4 KiB pages (madvise refused or buffer under 2 MiB)"
    t.zero_()
    return t, how
