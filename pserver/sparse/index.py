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
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pserver.kernels.cpu import splitmix64 as _draw

EMPTY = -1
# Load bound: linear probing then needs about 1.5 probes to find a key and 2.5 to miss one,
# each probe one read of keys[] elsewhere in memory.
MAX_LOAD = 0.5
MIN_BITS = 4
_ZERO = np.uint64(0)
# How many entries ahead a batch kernel asks for the memory it will touch: far enough for a
# miss (about 100 ns) to arrive in time, near enough that the line is still cached when used.
# A row update does about 20 ns of arithmetic per row, a probe pass almost none, hence two
# distances. Measured on a 1M-row adagrad table (dim 16), 64k ids: the row update went from
# 13.4 to 5.1 ms, find_many from 5.4 to 3.5 ms.
AHEAD = 8
PROBE_AHEAD = 32


@intrinsic
def prefetch(typingctx, arr, i):
    """Ask the CPU to start loading the cache line of arr[i] (of arr[i, 0] for a 2-D array):
    a hint that changes no value, so a kernel with it computes what its NumPy twin does."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        where = [args[1]] + [zero] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, where, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        # The typed-pointer name (numba >= 0.59 ships LLVM 14); newer LLVMs remangle it.
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # read (0), keep in every cache level (3), data cache (1)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(arr, types.intp), codegen


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(data, r):
    """prefetch every cache line of row r of a 2-D C-contiguous array."""
    row = data[r]
    for c in range(0, row.shape[0], 16):
        prefetch(row, c)
    prefetch(row, row.shape[0] - 1)   # a row need not start on a line: its end may be one more


@njit(cache=True, nogil=True, inline="always")
def prefetch_ahead(data, idx, i):
    """prefetch_row the row of idx[i + AHEAD], if there is one (idx < 0: no row)."""
    if i + AHEAD < idx.shape[0]:
        r = idx[i + AHEAD]
        if r >= 0:
            prefetch_row(data, r)


@njit(cache=True, nogil=True)
def bits_for(count):
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
    insert_range(slots, keys, 0, count, bits)
    return slots


@njit(cache=True, nogil=True)
def insert_range(slots, keys, start, stop, bits):
    """Index entries start..stop-1 of keys (distinct, and absent from slots)."""
    mask = slots.shape[0] - 1
    for e in range(start, stop):
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

    A key is at its home slot most of the time, so the passes compute every id's home slot,
    read those slots, then their keys, without a branch on what they find, prefetching
    PROBE_AHEAD ids in advance: the loads of many ids are in flight at once instead of one
    cache miss after another. The ids that were not settled there (a home slot holding
    another key) are probed one by one.
    """
    n = ids.shape[0]
    if keys.shape[0] == 0:   # no entry yet (keys[0] below must exist)
        out[:] = EMPTY
        return
    for i in range(n):
        out[i] = home(ids[i], bits)
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch(slots, out[i + PROBE_AHEAD])
        out[i] = slots[out[i]]
    redo, m = np.empty(n, np.int64), 0
    for i in range(n):
        if i + PROBE_AHEAD < n:
            prefetch(keys, max(out[i + PROBE_AHEAD], 0))
        e = out[i]
        other = keys[max(e, 0)] != ids[i]
        redo[m] = i
        m += (e != EMPTY) & other
    for j in range(m):
        i = redo[j]
        out[i] = find(slots, keys, ids[i], bits)[1]
