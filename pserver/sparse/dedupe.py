"""A batch's ids made unique, and its row gradients summed per unique id (the worker's side).

`unique_inverse` is one pass of an open-addressing hash table (probed as pserver.sparse.index
probes) that starts small and doubles, so that a batch with few distinct ids keeps its table
in cache; `segment_sum` is the scatter-add that np.add.at does, compiled; `first_repeat` is
the shard's check that a push's ids are distinct. Each has a NumPy twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from pserver.errors import InvalidArgument
from pserver.sparse import index
from pserver.sparse.hashing import as_ids


@njit(cache=True, nogil=True)
def _rehash(uniq, u, bits):
    """(slots, slot_keys) of 2**bits slots indexing uniq[:u]."""
    slots = np.full(1 << bits, index.EMPTY, np.int32)
    slot_keys = np.empty(1 << bits, np.uint64)
    mask = (1 << bits) - 1
    for e in range(u):
        pos = index.home(uniq[e], bits)
        while slots[pos] != index.EMPTY:
            pos = (pos + 1) & mask
        slots[pos], slot_keys[pos] = e, uniq[e]
    return slots, slot_keys


@njit(cache=True, nogil=True)
def _unique_inverse_kernel(ids, uniq, inverse):
    """uniq[:u] = the distinct ids in order of first appearance, inverse[i] = the position of
    ids[i] there; returns u.

    Unlike a table's index, this short-lived one keeps a copy of each key beside its slot:
    comparing it does not wait for a second, dependent load (about twice as fast here).
    """
    bits = index.MIN_BITS
    slots, slot_keys = _rehash(uniq, 0, bits)
    mask, u = (1 << bits) - 1, 0
    for i in range(ids.shape[0]):
        x, pos = ids[i], index.home(ids[i], bits)
        while True:
            e = slots[pos]
            if e == index.EMPTY:
                e, uniq[u], slots[pos], slot_keys[pos] = u, x, u, x
                u += 1
                if u > (1 << bits) * index.MAX_LOAD:
                    bits, mask = bits + 1, (2 << bits) - 1
                    slots, slot_keys = _rehash(uniq, u, bits)
                break
            if slot_keys[pos] == x:
                break
            pos = (pos + 1) & mask
        inverse[i] = e
    return u


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uniq, inverse) of a 1-D uint64 array: uniq in order of first appearance, uniq[inverse] == ids."""
    ids = _check_ids(ids)
    uniq, inverse = np.empty_like(ids), np.empty(ids.shape, np.int64)
    u = _unique_inverse_kernel(ids, uniq, inverse)
    return uniq[:u].copy(), inverse


@njit(cache=True, nogil=True)
def _first_repeat_kernel(ids):
    bits = index.bits_for(ids.shape[0])
    slots = np.full(1 << bits, index.EMPTY, np.int32)
    mask = (1 << bits) - 1
    for i in range(ids.shape[0]):
        pos = index.home(ids[i], bits)
        while slots[pos] != index.EMPTY:
            if ids[slots[pos]] == ids[i]:
                return i
            pos = (pos + 1) & mask
        slots[pos] = i
    return -1


def first_repeat(ids: np.ndarray) -> int:
    """The first i such that ids[i] occurs in ids[:i], or -1 when the ids are distinct: the
    check that unique_inverse would make, without building uniq and inverse."""
    return _first_repeat_kernel(_check_ids(ids))


def first_repeat_numpy(ids: np.ndarray) -> int:
    """NumPy twin of first_repeat."""
    ids = _check_ids(ids)
    first = np.zeros(ids.shape[0], bool)
    first[np.unique(ids, return_index=True)[1]] = True
    repeats = np.flatnonzero(~first)
    return int(repeats[0]) if repeats.size else -1


def unique_inverse_numpy(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of unique_inverse (np.unique, then renumbered by first appearance)."""
    ids = _check_ids(ids)
    sorted_uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return sorted_uniq[order], rank[inverse.reshape(-1)].astype(np.int64)


def _check_ids(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise InvalidArgument(f"ids: needs a 1-D uint64 array (see as_ids), got "
                              f"{getattr(ids, 'dtype', type(ids).__name__)}{list(np.shape(ids))}")
    return np.ascontiguousarray(ids)


@njit(cache=True, nogil=True)
def _segment_sum_kernel(grads, inverse, out):
    u = out.shape[0]
    for i in range(grads.shape[0]):
        k = inverse[i]
        # numba does not bounds-check: a bad inverse would write outside out.
        if k < 0 or k >= u:
            raise ValueError("segment_sum: inverse has a value outside [0, u)")
        for j in range(grads.shape[1]):
            out[k, j] += grads[i, j]


def _check_segments(grads: np.ndarray, inverse: np.ndarray, u: int) -> np.ndarray:
    if grads.dtype != np.float32 or grads.ndim != 2:
        raise InvalidArgument(f"grads: needs float32 (n, dim), got {grads.dtype}{list(grads.shape)}")
    if inverse.shape != grads.shape[:1] or inverse.dtype.kind not in "iu":
        raise InvalidArgument(f"inverse: needs integers of shape ({grads.shape[0]},), got "
                              f"{inverse.dtype}{list(inverse.shape)}")
    if u < 0:
        raise InvalidArgument(f"u: must be >= 0, got {u}")
    return np.zeros((u, grads.shape[1]), np.float32)


def segment_sum(grads: np.ndarray, inverse: np.ndarray, u: int) -> np.ndarray:
    """out[k] = sum of grads[i] over every i with inverse[i] == k: float32 (u, dim)."""
    out = _check_segments(grads, inverse, u)
    _segment_sum_kernel(np.ascontiguousarray(grads), inverse.astype(np.int64, copy=False), out)
    return out


def segment_sum_numpy(grads: np.ndarray, inverse: np.ndarray, u: int) -> np.ndarray:
    """NumPy twin of segment_sum."""
    out = _check_segments(grads, inverse, u)
    if inverse.size and not 0 <= inverse.min() <= inverse.max() < u:
        raise ValueError("segment_sum: inverse has a value outside [0, u)")
    np.add.at(out, inverse, grads)
    return out


class PaddedIds:
    """A list feature's ids (n, length) whose `padding` id marks no id (a shorter list's end):
    what a model's batch_ids gives for a field its pooled Embedding reads with mask_zero."""

    def __init__(self, ids: np.ndarray, padding: int) -> None:
        self.ids, self.padding = ids, padding


@dataclass
class TableLookup:
    """What the worker hands a model for one table and one batch."""

    uniq: np.ndarray     # uint64 (u,): the batch's unique ids, in order of first appearance
    inverse: np.ndarray  # int64, the shape of the batch's ids: uniq[inverse] == ids
    rows: np.ndarray     # float32 (u, dim): the pulled rows (the worker fills them)
    grads: np.ndarray    # float32 (u, dim): d loss / d row, summed per unique id (the model writes)

    @classmethod
    def of(cls, ids, dim: int, what: str = "ids") -> TableLookup:
        """The lookup of a batch's ids (any shape, any integer type as_ids takes). PaddedIds:
        its padding is no id (pulled, pushed or counted nowhere) and its inverse is -1."""
        if isinstance(ids, PaddedIds):
            keep = ids.ids != ids.padding
            flat = as_ids(ids.ids[keep], what)
            uniq, kept = unique_inverse(flat)
            inverse = np.full(ids.ids.shape, -1, np.int64)
            inverse[keep] = kept
            return cls.like(cls(uniq, inverse, None, None), dim)
        ids = as_ids(ids, what)
        uniq, inverse = unique_inverse(ids.reshape(-1))
        return cls.like(cls(uniq, inverse.reshape(ids.shape), None, None), dim)

    @classmethod
    def like(cls, other: TableLookup, dim: int) -> TableLookup:
        """A lookup of the same ids as `other` (sharing its uniq and inverse) for a table of `dim`."""
        rows = np.zeros((other.uniq.shape[0], dim), np.float32)
        return cls(other.uniq, other.inverse, rows, np.zeros_like(rows))
