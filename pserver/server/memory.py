"""Keeping a shard's resident memory close to what its arrays hold (glibc's allocator).

A sparse table grows by copying its arrays into larger ones; pushes allocate and free
buffers of every size from several threads. glibc keeps freed memory for reuse unless told
otherwise, so a shard's RSS would drift far above its tables. Three calls fix that; elsewhere
(another C library) they do nothing.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8   # mallopt's parameters, from glibc's <malloc.h>
MMAP_THRESHOLD = 128 << 10       # bytes (glibc's initial value): larger allocations get pages of their own
ARENAS = 1                       # malloc arenas for all of the shard's threads

try:
    _LIBC = ctypes.CDLL(None)
    _MALLOPT, _TRIM = _LIBC.mallopt, _LIBC.malloc_trim
except (OSError, AttributeError):
    _MALLOPT = _TRIM = None


def configure() -> None:
    """Called once at start, before the shard's threads exist.

    The mmap threshold: by default it rises after each large free (up to 32 MiB), so a
    growing table's next arrays come from the heap, and the old ones, freed, stay in the
    process. A fixed threshold keeps large arrays in their own mappings, returned when freed.

    The arenas: glibc gives threads up to 8 per core, each keeping its own free memory. gRPC
    receives payloads in small slices on whichever of its threads runs; with an arena each,
    four workers' 40 MB pushes left tens of MiB of free slices spread over the arenas. One
    arena shared by all threads (large arrays are mmapped, and Python's small objects have
    their own allocator) peaked 5-9 MiB lower than two in bench/transport.py's shard memory
    row, at the same speed within its noise."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _MALLOPT(M_ARENA_MAX, ARENAS)


def trim() -> None:
    """Give the heap's free pages back to the system (the shard's reaper calls it every tick)."""
    if _TRIM is not None:
        _TRIM(0)
