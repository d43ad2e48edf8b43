"""glibc malloc settings that stop page-fault storms on large, short-lived buffers.

By default glibc serves every allocation above 128 KiB-32 MiB with a fresh mmap and
returns it to the kernel on free, so each multi-megabyte message costs thousands of
minor page faults (one per 4 KiB page it touches). Keeping freed memory in the process
makes the next buffer of that size free of faults: the same effect as MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=... MALLOC_TOP_PAD_=256MiB, applied by `pserver serve` and
`pserver worker` at start through mallopt(3).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = {M_MMAP_MAX: 0,                 # never mmap: large blocks come from the heap...
            M_TRIM_THRESHOLD: 2**31 - 1,   # ...and freed heap is kept, not trimmed...
            M_TOP_PAD: 256 << 20}          # ...and grown 256 MiB at a time


def tune() -> bool:
    """Apply SETTINGS; False where this is not glibc (then nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
