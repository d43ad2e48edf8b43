"""Open addressing over uint64 keys that are stored once, in an array of entries.

`slots` (int32, a power of two long) holds entry numbers, EMPTY where free; the key of entry e
is keys[e], in whatever array owns the entries (a batch's unique ids, a table's row ids). A
slot costs 4 bytes and a key is never copied into the index, which is what keeps a table's
memory per row low. Probing is linear from the key's home slot, the top bits of
splitmix64(key): ids that shard_of sent to one shard still spread over every slot, since
shard_of hashes id ^ HASH_SEED instead.

Deletion shifts later entries of the probe run back (Knuth's Algorithm R) rather than
leaving tombstones: eviction deletes rows all the time, and tombstones would lengthen every
probe until a full rehash. Callers keep the load at most MAX_LOAD, so a probe always ends.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pserver.kernels.cpu import splitmix64 as _draw

EMPTY = -1
# Load bound: linear probing then needs about 1.5 probes to find a key and 2.5 to miss one,
# each probe one read of keys[] elsewhere in memory.
MAX_LOAD = 0.5
MIN_BITS = 4
_ZERO = np.uint64(0)


def bits_for(count: int) -> int:
    """log2 of the smallest slot count that holds `count` keys within MAX_LOAD."""
    bits = MIN_BITS
    while (1 << bits) * MAX_LOAD < count:
        bits += 1
    return bits


@njit(cache=True, nogil=True, inline="always")
def home(key, bits):
    """The first slot probed for `key` in a table of 2**bits slots."""
    return np.int64(_draw(key, _ZERO) >> np.uint64(64 - bits))


@njit(cache=True, nogil=True)
def find(slots, keys, key, bits):
    """(slot, entry) of `key`; (the free slot where it would go, EMPTY) if it is absent."""
    mask = slots.shape[0] - 1
    pos = home(key, bits)
    while True:
        e = slots[pos]
        if e == EMPTY or keys[e] == key:
            return pos, e
        pos = (pos + 1) & mask


def rehash(keys: np.ndarray, count: int, bits: int) -> np.ndarray:
    """New slots (2**bits of them) indexing entries 0..count-1 of keys (which are distinct).

    Allocated by NumPy, which asks for transparent huge pages for large arrays (numba's
    allocator does not): a probe into a large index then rarely misses the TLB.
    """
    slots = np.full(1 << bits, EMPTY, np.int32)
    _fill(slots, keys, count, bits)
    return slots


@njit(cache=True, nogil=True)
def _fill(slots, keys, count, bits):
    mask = slots.shape[0] - 1
    for e in range(count):
        pos = home(keys[e], bits)
        while slots[pos] != EMPTY:
            pos = (pos + 1) & mask
        slots[pos] = e


@njit(cache=True, nogil=True)
def delete_at(slots, keys, pos, bits):
    """Free slot `pos`, moving back every later entry of its probe run that may live earlier."""
    mask = slots.shape[0] - 1
    hole, j = pos, (pos + 1) & mask
    while slots[j] != EMPTY:
        h = home(keys[slots[j]], bits)
        # The entry at j may fill the hole unless its home lies cyclically in (hole, j].
        if ((j - h) & mask) >= ((j - hole) & mask):
            slots[hole] = slots[j]
            hole = j
        j = (j + 1) & mask
    slots[hole] = EMPTY


@njit(cache=True, nogil=True)
def repoint(slots, keys, key, entry, bits):
    """The slot of `key` now holds `entry` (the key moved to another entry number)."""
    pos, e = find(slots, keys, key, bits)
    if e == EMPTY:
        raise ValueError("sparse index: a key to move is not in the index")
    slots[pos] = entry


@njit(cache=True, nogil=True)
def find_many(slots, keys, ids, bits, out):
    """out[i] = the entry of ids[i], EMPTY where absent.

    A key is at its home slot most of the time, so the first two passes read every id's home
    slot, then that slot's key, without a branch on what they find: the loads of many ids are
    in flight at once instead of one cache miss after another. The ids that were not settled
    there (a home slot holding another key) are probed one by one.
    """
    n = ids.shape[0]
    if keys.shape[0] == 0:   # no entry yet (keys[0] below must exist)
        out[:] = EMPTY
        return
    for i in range(n):
        out[i] = slots[home(ids[i], bits)]
    redo, m = np.empty(n, np.int64), 0
    for i in range(n):
        e = out[i]
        other = keys[max(e, 0)] != ids[i]
        redo[m] = i
        m += (e != EMPTY) & other
    for j in range(m):
        i = redo[j]
        out[i] = find(slots, keys, ids[i], bits)[1]
