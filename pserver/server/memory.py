"""Keeping a shard's resident memory close to what its arrays hold (glibc's allocator).

A sparse table grows by copying its arrays into larger ones; pushes allocate and free
buffers of every size from several threads. glibc keeps freed memory for reuse unless told
otherwise, so a shard's RSS would drift far above its tables. Two calls fix that; elsewhere
(another C library) they do nothing.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3            # mallopt's parameter, from glibc's <malloc.h>
MMAP_THRESHOLD = 128 << 10       # bytes (glibc's initial value): larger allocations get pages of their own

try:
    _LIBC = ctypes.CDLL(None)
    _MALLOPT, _TRIM = _LIBC.mallopt, _LIBC.malloc_trim
except (OSError, AttributeError):
    _MALLOPT = _TRIM = None


def pin_mmap_threshold() -> None:
    """By default the threshold rises after each large free (up to 32 MiB), so a growing
    table's next arrays come from the heap, and the old ones, freed, stay in the process. A
    fixed threshold keeps large arrays in their own mappings, returned when freed."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim() -> None:
    """Give the heap's free pages back to the system (the shard's reaper calls it every tick)."""
    if _TRIM is not None:
        _TRIM(0)
