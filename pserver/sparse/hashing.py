"""Ids and what is derived from them by hashing: the id type, the shard of an id, initial rows.

Everything here is a pure function of its arguments, so every worker, every shard and every
restart agree without coordination. The hash is splitmix64 (Steele, Lea and Flood 2014):
`splitmix64(x)` is the first output of the generator seeded with x, i.e. its finaliser applied
to x + 0x9E3779B97F4A7C15; the one compiled copy is pserver.kernels.cpu.splitmix64, which
dropout's masks use as well.

Each numba function has a NumPy twin (`*_numpy`) that the tests compare it with.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pserver.errors import InvalidArgument
from pserver.kernels import reference
from pserver.kernels.cpu import splitmix64 as _draw

# Mixed into every id before its shard is chosen, so that shard_of is not the bare hash that
# the workers' own per-field id hashing (or a table's slots) may also use.
HASH_SEED = 0x2545F4914F6CDD1D
_U64_MASK = (1 << 64) - 1
_ZERO = np.uint64(0)


# -- splitmix64 and shard_of --------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _splitmix64_kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = _draw(x[i], _ZERO)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (any shape): a new uint64 array."""
    x = np.asarray(x, dtype=np.uint64)
    out = np.empty(x.size, np.uint64)
    _splitmix64_kernel(np.ascontiguousarray(x).reshape(-1), out)
    return out.reshape(x.shape)


def splitmix64_numpy(x: np.ndarray) -> np.ndarray:
    """NumPy twin of splitmix64."""
    return reference.splitmix64(np.asarray(x, dtype=np.uint64), np.zeros(np.shape(x), np.uint64))


@njit(cache=True, nogil=True)
def _shard_of_kernel(ids, num_shards, out):
    seed, s = np.uint64(HASH_SEED), np.uint64(num_shards)
    for i in range(ids.shape[0]):
        out[i] = np.int64(_draw(ids[i] ^ seed, _ZERO) % s)


def _check_shards(num_shards) -> int:
    if isinstance(num_shards, bool) or int(num_shards) != num_shards or num_shards < 1:
        raise InvalidArgument(f"num_shards: must be an integer >= 1, got {num_shards!r}")
    return int(num_shards)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (int64 in [0, num_shards)) of every id: splitmix64(id ^ HASH_SEED) % num_shards."""
    s = _check_shards(num_shards)
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    out = np.empty(ids.shape, np.int64)
    _shard_of_kernel(ids.reshape(-1), s, out.reshape(-1))
    return out


def shard_of_numpy(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """NumPy twin of shard_of."""
    mixed = splitmix64_numpy(np.asarray(ids, dtype=np.uint64) ^ np.uint64(HASH_SEED))
    return (mixed % np.uint64(_check_shards(num_shards))).astype(np.int64)


@njit(cache=True, nogil=True)
def _first_foreign_kernel(ids, num_shards, shard):
    if num_shards == 1:   # no hash needed: every id is on shard 0
        return -1 if shard == 0 or ids.shape[0] == 0 else 0
    seed, s = np.uint64(HASH_SEED), np.uint64(num_shards)
    for i in range(ids.shape[0]):
        if np.int64(_draw(ids[i] ^ seed, _ZERO) % s) != shard:
            return i
    return -1


def first_foreign(ids: np.ndarray, num_shards: int, shard: int) -> int:
    """The first i with shard_of(ids[i]) != shard, or -1: a shard's check of a request, in one
    pass that allocates nothing (1-D uint64 ids)."""
    return _first_foreign_kernel(np.ascontiguousarray(ids, dtype=np.uint64), _check_shards(num_shards),
                                 int(shard))


def first_foreign_numpy(ids: np.ndarray, num_shards: int, shard: int) -> int:
    """NumPy twin of first_foreign."""
    wrong = np.flatnonzero(shard_of_numpy(ids, num_shards) != shard)
    return int(wrong[0]) if wrong.size else -1


# -- as_ids -------------------------------------------------------------------------------------

def _where(a: np.ndarray, flat_index: int):
    """A flat index as the user wrote it: an int for 1-D input, a tuple otherwise."""
    index = np.unravel_index(flat_index, a.shape)
    return int(index[0]) if a.ndim == 1 else tuple(int(i) for i in index)


def _refuse(what: str, a: np.ndarray, flat_index: int, why: str):
    value = a.reshape(-1)[flat_index]
    value = value.item() if isinstance(value, np.generic) else value
    raise InvalidArgument(f"{what}: ids must be integers in [-2**63, 2**64), {why}: "
                          f"{value!r} at index {_where(a, flat_index)}")


def _python_ids(a: np.ndarray, what: str) -> np.ndarray:
    """Ids given as Python objects (a list, an object array): checked one by one."""
    flat = a.reshape(-1)
    for i, v in enumerate(flat):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            _refuse(what, a, i, f"got {type(v).__name__}")
        if not -(1 << 63) <= int(v) < 1 << 64:
            _refuse(what, a, i, "out of range")
    # Two's complement: -1 is 2**64 - 1, bit for bit as an int64 viewed as uint64.
    return np.array([int(v) & _U64_MASK for v in flat], dtype=np.uint64).reshape(a.shape)


def as_ids(x, what: str) -> np.ndarray:
    """Ids as uint64, same shape: int64 bit for bit (a view), uint64 as is, other integer dtypes
    widened (signed ones sign-extended first). Python ints must lie in [-2**63, 2**64).
    Anything else (bool, float, str, object that is not an int) is refused with InvalidArgument
    naming `what`, the first bad value and its index."""
    a = x if isinstance(x, np.ndarray) else np.array(x, dtype=object)
    kind = a.dtype.kind
    if kind == "O":
        return _python_ids(a, what)
    if kind == "u":
        return a.astype(np.uint64, copy=False)
    if kind == "i":
        return a.astype(np.int64, copy=False).view(np.uint64)
    if a.size == 0:
        raise InvalidArgument(f"{what}: ids must be integers, got an empty {a.dtype} array")
    _refuse(what, a, 0, f"got dtype {a.dtype}")


# -- initial rows -------------------------------------------------------------------------------

def table_key(seed: int, table: int) -> np.uint64:
    """The key of table `table` in a run with `seed`: what every row's initial value starts from."""
    if not 0 <= seed < 1 << 64:
        raise InvalidArgument(f"seed: must be in [0, 2**64), got {seed}")
    if not 0 <= table < 1 << 63:
        raise InvalidArgument(f"table: must be >= 0, got {table}")
    first = int(splitmix64(np.array([seed], np.uint64))[0])
    return splitmix64(np.array([first ^ table], np.uint64))[0]


# Column c of a row draws the c-th output of splitmix64 seeded with the row's key; its top 24
# bits u (exact in float32) give (u / 2**23 - 1) * scale in [-scale, scale), computed in float64
# and rounded once to float32, the same in the kernel and in the twin.
_TOP = np.uint64(40)
_INV_2_23 = 1.0 / (1 << 23)


@njit(cache=True, nogil=True)
def initial_row(key, id_, scale, out):
    """out[:] = the initial row of `id_` in the table with key `key` (uint64 both)."""
    row_key = _draw(key ^ id_, _ZERO)
    for c in range(out.shape[0]):
        u = np.float64(_draw(row_key, np.uint64(c)) >> _TOP)
        out[c] = np.float32((u * _INV_2_23 - 1.0) * scale)


@njit(cache=True, nogil=True)
def _initial_rows_kernel(ids, key, scale, out):
    for i in range(ids.shape[0]):
        initial_row(key, ids[i], scale, out[i])


def _check_out(ids: np.ndarray, dim: int, out: np.ndarray) -> None:
    if out.dtype != np.float32 or out.shape != (ids.shape[0], dim) or not out.flags.c_contiguous:
        raise InvalidArgument(f"out: needs a C-contiguous float32[{ids.shape[0]}, {dim}], "
                              f"got {out.dtype}{list(out.shape)}")


def initial_rows(ids: np.ndarray, dim: int, seed: int, table: int, scale: float,
                 out: np.ndarray) -> None:
    """out[i] = the initial row of ids[i]: uniform(-scale, scale) per column, from splitmix64 of
    (seed, table, id, column). The same on every process and every restart."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    _check_out(ids, dim, out)
    _initial_rows_kernel(ids, table_key(seed, table), float(scale), out)


def initial_rows_numpy(ids: np.ndarray, dim: int, seed: int, table: int, scale: float,
                       out: np.ndarray) -> None:
    """NumPy twin of initial_rows."""
    ids = np.asarray(ids, dtype=np.uint64)
    _check_out(ids, dim, out)
    row_keys = splitmix64_numpy(ids ^ table_key(seed, table))
    draws = reference.splitmix64(row_keys[:, None], np.arange(dim, dtype=np.uint64)[None, :])
    u = (draws >> _TOP).astype(np.float64)
    out[:] = ((u * _INV_2_23 - 1.0) * float(scale)).astype(np.float32)
