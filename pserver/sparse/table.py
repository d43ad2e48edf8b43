"""One sparse table on one shard: ids -> float32 rows, grown on demand and evicted by age.

Storage (all NumPy arrays, so the memory per row is what the arrays hold):

    ids     uint64 (cap,)               the id of each row, stored once
    slots   int32 (2**bits,)            open addressing over ids (pserver.sparse.index)
    data    float32 (cap, dim * (1+k))  each row and its k optimizer slots side by side
    last    int64 (cap,)                the step of each row's last update
    steps   int64 (cap,)                optimizers that count steps (adam): each row's own count

Rows 0..n-1 are live and dense: eviction moves the last row into each freed one. Each array
is a view of reserved address space with room for as many rows as the machine's memory could
hold (`_Entries`): rows written commit pages, growth never copies, and transparent huge pages
are asked for (a random row access in a large table misses the TLB less often,
bench/results/sparse/notes.md). Where the system refuses the reservation the arrays grow by
10% (at least MIN_CHUNK rows) into new arrays, copied. The shard's memory budget
(pserver.server.budget) asks a table what a push would add (`absent`, `growth_bytes`) and
makes room (`evict_for`).

Admission counts pushes of ids that are not stored, exactly, in a second index of the same
kind (`pending`, ids and counts); an id is admitted (its row created, initial value first) on
the push that brings its count to min_count, and that push's gradient is applied. Until then
it reads its initial value and its gradients are counted, not stored. An evicted id starts
counting again from zero.

Counters: `creations` counts rows created (every admitted id, including an evicted id that
came back), `admissions` the ids that passed a min_count >= 2 filter, `evictions` rows evicted.

Checkpoints without a second copy (pserver.persist.checkpoint): `begin_dump` fixes the rows a
checkpoint holds (all of them, or for a delta those updated since the last dump began, with the
ids removed since: evicted), and `read_dump` hands them out a stripe at a time while pushes go on. Until
a stripe is read, a push, an admission or an eviction that is about to change one of its rows
first copies the row aside (copy-on-write at row granularity), so the file holds each row as it
was when the dump began: the extra memory is the rows changed during the write, not the table.

Every public method holds the table's lock, so a push never races a structural change; the
kernels release the GIL, so different tables run in parallel.

Threads: with `threads` > 1, a lookup, and the probe and the row optimizer of a push that the
caller has checked (`checked=True`: the shard checks every push for repeats and non-finite
values when it arrives), run in up to `threads` contiguous parts at once, each of at least
PARALLEL_MIN ids: one in the calling thread, the others on a process-wide pool. The parts
touch different rows, so the result is the one a single thread computes, bit for bit.
Creating rows, admission and eviction change the index and stay in one thread. Parts pay
because one core keeps only about 8 misses to memory in flight, and a random row update is
mostly waiting on them (bench/results/sparse/notes.md).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, fields

import numpy as np
from numba import njit

from pserver.errors import ConfigError, InvalidArgument, ResourceExhausted
from pserver.sparse import compact, index
from pserver.sparse.dedupe import _unique_inverse_kernel
from pserver.sparse.hashing import initial_row, table_key
from pserver.sparse.optim import RowOptimizer
from pserver.sparse.state import RowState

MIN_CHUNK = 1024   # rows: the smallest growth, so that a small table does not realloc per push
MAX_ENTRIES = (1 << 31) - 1   # rows of one table on one shard: the index stores int32 row numbers
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux's value; Python names it from 3.13
SHRINK_BYTES = 16 << 20   # evicted rows' pages given back once this many are free past the live rows
SOFT_LOAD = 0.4           # a growing index past it builds its successor on another thread
BACKGROUND_MIN_BITS = 20  # below 2**20 slots a rehash takes about 10 ms: done in place
COUNTERS = ("admissions", "creations", "evictions")
PARALLEL_MIN = 8192   # ids per part, at least: below it a hand-off to a thread costs more than it saves
MAX_THREADS = 64
REMOVED_MAX = 2 << 20   # ids removed between two dumps that a delta records (16 MiB); past it, a base

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> ThreadPoolExecutor:
    """The process's pool for table parts; its threads start on demand, never more than the
    parts submitted at once."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="pserver-table")
        return _pool


def in_parts(fn, n: int, threads: int) -> int:
    """fn(a, b) over contiguous [a, b) covering [0, n), in min(threads, n // PARALLEL_MIN)
    parts at once (at least one): the first in this thread, the others on the shared pool.
    Returns the number of parts. Every part has finished when it returns, or raises."""
    k = max(1, min(threads, n // PARALLEL_MIN))
    if k == 1:
        fn(0, n)
        return 1
    bounds = [n * j // k for j in range(k + 1)]
    pool, others = _shared_pool(), []
    try:
        for j in range(1, k):
            others.append(pool.submit(fn, bounds[j], bounds[j + 1]))
        fn(0, bounds[1])
    finally:
        # Every part ends before this returns or raises: the caller's lock guards the arrays
        # that they write. Then the first part's error, if any, is raised.
        wait(others)
    for f in others:
        f.result()
    return k


@dataclass(frozen=True)
class TableConfig:
    name: str                  # unique per model, e.g. "emb_deep"
    dim: int                   # floats per row (the Embedding's output_dim)
    optimizer: str = "adagrad" # a name in optim.ROWS
    lr: float = 0.05           # the row optimizer's learning rate (alpha for ftrl)
    init_scale: float = 0.05   # initial values uniform(-init_scale, init_scale); 0 -> zeros
    seed: int = 0              # the run's seed: part of every row's initial value
    min_count: int = 0         # admission: an id is stored once pushed this many times; 0/1 = at once
    max_rows: int = 0          # eviction per shard, least recently updated first; 0 = no bound
    ttl_steps: int = 0         # eviction of rows not updated for this many steps; 0 = never
    params: tuple = ()         # optimizer extras as sorted (key, value) pairs (its RowRule.params)
    row_dtype: str = "float32" # how rows are stored: float32, float16 or bfloat16 (pserver.sparse.compact)
    state_dtype: str = "float32"   # the optimizer slots': float32, or "row" (the row's type)

    def __post_init__(self) -> None:
        if isinstance(self.params, dict):   # accepted for convenience, kept as sorted pairs
            object.__setattr__(self, "params", tuple(sorted(self.params.items())))
        self.check()

    def check(self) -> None:
        """ConfigError naming the field, for any value a table cannot run with."""
        what = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{what}: name must be a non-empty string")
        for field, low in (("dim", 1), ("seed", 0), ("min_count", 0), ("max_rows", 0),
                           ("ttl_steps", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ConfigError(f"{what}: {field} must be an integer >= {low}, got {v!r}")
        if self.seed >= 1 << 64:
            raise ConfigError(f"{what}: seed must be below 2**64, got {self.seed}")
        if not (isinstance(self.init_scale, (int, float)) and math.isfinite(self.init_scale)
                and self.init_scale >= 0):
            raise ConfigError(f"{what}: init_scale must be a finite number >= 0, got {self.init_scale!r}")
        pairs = self.params
        if (not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
                or [k for k, _ in pairs] != sorted({k for k, _ in pairs})):
            raise ConfigError(f"{what}: params must be (key, value) pairs sorted by distinct key, "
                              f"got {pairs!r}")
        RowOptimizer(self.optimizer, self.lr, dict(pairs), what=what)
        compact.check_dtypes(what, self.row_dtype, self.state_dtype)

    def layout(self) -> compact.Layout:
        """Where an entry's row and slots lie, in their types."""
        opt = RowOptimizer(self.optimizer, self.lr, dict(self.params))
        return compact.Layout(self.dim, self.row_dtype, self.state_dtype, len(opt.slots), opt.second_moments)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = [list(p) for p in self.params]
        return d

    @classmethod
    def from_dict(cls, d: dict, stored: bool = False) -> TableConfig:
        """A config from to_dict()'s form. An unknown field is refused, unless `stored`: d was read
        from a file (a checkpoint's meta) that another version of pserver wrote, whose fields
        since removed are left out; fields added since take their defaults either way."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown and not stored:
            raise ConfigError(f"table config: unknown field {unknown[0]!r}; fields are {sorted(names)}")
        d = {k: v for k, v in d.items() if k in names}
        params = d.get("params", ())   # Register's map __post_init__ sorts; JSON's pairs as tuples
        d["params"] = params if isinstance(params, dict) else tuple(tuple(p) for p in params)
        return cls(**d)

    def signature(self) -> str:
        """Stable text of every field: equal for equal configs, on every process. The row and state
        types are left out at their defaults (float32), so a layout's signature, and the checkpoints
        that record it, stay what they were before compact rows."""
        d = self.to_dict()
        for k in ("row_dtype", "state_dtype"):
            if d[k] == "float32":
                del d[k]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))


class _Entries:
    """Keys stored once in entry order, their hash index, and per-entry arrays growing with them.

    Each array is a view of one reserved stretch of address space (`reserved`) with room for
    `limit` entries: growing commits the next pages as they are first written and never copies
    or moves what is there, so a table's peak is the table itself, not two copies of it. Where
    the system refuses such a reservation (overcommit disabled), the arrays grow the old way,
    copied into new ones 10% larger. Evicted entries' pages past the live ones go back to the
    system once they add up to SHRINK_BYTES."""

    def __init__(self, columns: dict, background: bool = False):
        # columns: name -> (shape of one entry, dtype)
        # background: the index's successor is built on another thread while the table grows
        # (entries move only in evictions, which call moved()); else it is rehashed in place
        self.background, self.next, self.moves = background, None, 0
        self.n = 0
        self.high = 0                       # entries written since the last shrink: pages in use
        self.columns = {"keys": ((), np.uint64), **columns}
        self.entry_bytes = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                               for shape, dt in self.columns.values())
        limit = min(MAX_ENTRIES, max(MIN_CHUNK, physical_memory() // self.entry_bytes))
        made = {k: reserved((limit, *shape), dt) for k, (shape, dt) in self.columns.items()}
        if all(a is not None for a in made.values()):
            self.growable = True
        else:                                 # no reservation: arrays that grow by copying
            self.growable = False
            made = {k: np.empty((0, *shape), dt) for k, (shape, dt) in self.columns.items()}
        self.keys = made.pop("keys")
        self.arrays = made
        self.bits = index.MIN_BITS
        self.slots = np.full(1 << self.bits, index.EMPTY, np.int32)

    def reserve(self, extra: int) -> None:
        """Room for `extra` more entries, and an index that holds them within its load bound."""
        need = self.n + extra
        if need > self.keys.shape[0]:
            if self.growable and need > MAX_ENTRIES:
                raise ResourceExhausted(f"a table holds at most {MAX_ENTRIES:,} rows per shard")
            cap = need + max(need // 10, MIN_CHUNK)   # reservation used up, or none: copy
            self.keys = _grown(self.keys, cap, self.n)
            self.arrays = {k: _grown(a, cap, self.n) for k, a in self.arrays.items()}
            self.growable = False
        self.high = max(self.high, need)
        bits = index.bits_for(need)
        if bits > self.bits:
            self._grow_index(bits)
        elif (self.background and self.next is None and self.bits >= BACKGROUND_MIN_BITS
              and need > (1 << self.bits) * SOFT_LOAD):
            # Past SOFT_LOAD: build the successor (twice the slots) from the entries there are
            # now, on another thread; the load bound takes it in with the entries added since.
            self.next = (_builder().submit(index.rehash, self.keys, self.n, self.bits + 1),
                         self.n, self.bits + 1, self.moves)

    def _grow_index(self, bits: int) -> None:
        """An index of 2**bits slots at least: the successor built meanwhile when no entry has
        moved since it began (waiting for it if it is still being built), else a rehash."""
        pending, self.next = self.next, None
        if pending is not None:
            future, n0, built, moves = pending
            slots = future.result()
            if moves == self.moves and built >= bits:
                index.insert_range(slots, self.keys, n0, self.n, built)
                self.bits, self.slots = built, slots
                return
        self.bits, self.slots = bits, index.rehash(self.keys, self.n, bits)

    def moved(self) -> None:
        """Entries moved (an eviction): a successor built from the old places is void."""
        self.moves += 1

    def shrunk(self, force: bool = False) -> None:
        """After eviction: give back the pages past the live entries when they are many (or
        any, forced: the shard's budget needs them)."""
        if self.growable and self.high > self.n and (force or
                                                     (self.high - self.n) * self.entry_bytes >= SHRINK_BYTES):
            for a in (self.keys, *self.arrays.values()):
                release_tail(a, self.n)
            self.high = self.n

    def fill(self, keys: np.ndarray, arrays: dict) -> None:
        """Set the entries of an empty store to `keys` and their arrays (already checked)."""
        self.moved()
        self.reserve(keys.shape[0])
        self.n = keys.shape[0]
        self.keys[:self.n] = keys
        for k, a in arrays.items():
            self.arrays[k][:self.n] = a
        self.slots = index.rehash(self.keys, self.n, self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes in use: the entries written (a reservation's untouched rest costs nothing), or
        the arrays' whole capacity where they grow by copying, and the index."""
        entries = self.high if self.growable else self.keys.shape[0]
        building = (4 << self.next[2]) if self.next is not None else 0    # the successor's slots
        return entries * self.entry_bytes + self.slots.nbytes + building


_index_builder: ThreadPoolExecutor | None = None


def _builder() -> ThreadPoolExecutor:
    """One thread, for the process, that builds growing tables' next indexes (numba's kernel
    releases the GIL, so it runs beside the pushes)."""
    global _index_builder
    with _pool_lock:
        if _index_builder is None:
            _index_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pserver-index")
        return _index_builder


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 36


def reserved(shape: tuple, dtype) -> np.ndarray | None:
    """An array of `shape` over anonymous memory reserved, not committed: pages are taken when
    first written (zeros until then). None where the system will not reserve it."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return None
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError, OverflowError):
        return None
    if hasattr(mmap, "MADV_HUGEPAGE"):    # random row access: fewer TLB misses with huge pages
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=dtype).reshape(shape)


def release_tail(a: np.ndarray, n: int) -> None:
    """Give the pages of a reserved array past its first n entries back (they read as zeros)."""
    m = _map_of(a)
    start = -(-n * a[:1].nbytes // mmap.PAGESIZE) * mmap.PAGESIZE   # the first page past entry n-1
    if m is not None and start < len(m):
        m.madvise(mmap.MADV_DONTNEED, start, len(m) - start)


def _map_of(a: np.ndarray) -> mmap.mmap | None:
    base = a.base
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


def _grown(a: np.ndarray, cap: int, n: int) -> np.ndarray:
    """A new array of cap entries (like a's) holding a's first n."""
    new = np.empty((cap, *a.shape[1:]), a.dtype)
    new[:n] = a[:n]
    return new


class SparseTable:
    """One table on one shard; thread-safe (its own lock). See the module docstring."""

    def __init__(self, config: TableConfig, table_index: int, backend: str = "numba",
                 threads: int = 1):
        config.check()
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ConfigError(f"table {config.name!r}: threads must be an integer in [1, {MAX_THREADS}], "
                              f"got {threads!r}")
        self.threads = threads if backend == "numba" else 1   # the NumPy twins hold the GIL
        self.config, self.table_index = config, int(table_index)
        self.dim = config.dim
        self.opt = RowOptimizer(config.optimizer, config.lr, dict(config.params), backend,
                                what=f"table {config.name!r}")
        self._key = table_key(config.seed, self.table_index)
        self._slot_init = np.repeat(np.array(self.opt.initial, np.float32), self.dim)
        self.layout = compact.Layout(self.dim, config.row_dtype, config.state_dtype, len(self.opt.slots),
                                     self.opt.second_moments)
        self._fast = backend == "numba"
        self._lock = threading.Lock()
        self.track = False       # record removed ids for incremental checkpoints (set by the shard)
        self._reset()

    def _reset(self) -> None:
        lay = self.layout
        data = ((lay.words,), np.uint16) if lay.compact else ((self.opt.width(self.dim),), np.float32)
        cols = {"data": data, "last": ((), np.int64)}
        if self.opt.counts_steps:
            cols["steps"] = ((), np.int64)
        self._rows = _Entries(cols, background=True)
        self._pending = _Entries({"count": ((), np.int64)})
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._low: int | None = None          # the lowest step applied since the last dump began
        self._removed: list[np.ndarray] = []  # ids removed (evicted) since then (when tracked)
        self._removed_count, self._removed_overflow = 0, False
        self._dump: _Dump | None = None
        self.dump_peak = 0                    # bytes the last dump kept aside, at most

    # -- reading ------------------------------------------------------------------------------

    def lookup(self, ids: np.ndarray, out: np.ndarray) -> None:
        """out[i] = the stored row of ids[i], else its initial value (computed, not stored)."""
        ids = self._check_ids(ids)
        if out.dtype != np.float32 or out.shape != (ids.shape[0], self.dim) or not out.flags.c_contiguous:
            raise InvalidArgument(f"table {self.config.name!r}: out needs a C-contiguous "
                                  f"float32[{ids.shape[0]}, {self.dim}], got {out.dtype}{list(out.shape)}")
        with self._lock:
            r, data, scale = self._rows, self._rows.arrays["data"], float(self.config.init_scale)
            if self.layout.compact:
                fmt = self.layout.row_fmt
                in_parts(lambda a, b: compact.lookup(r.slots, r.keys, r.bits, data, ids[a:b], self._key,
                                                     scale, fmt, out[a:b]), ids.shape[0], self.threads)
                return
            in_parts(lambda a, b: _lookup(r.slots, r.keys, r.bits, data, ids[a:b], self._key, scale,
                                          out[a:b]), ids.shape[0], self.threads)

    def sorted_ids(self) -> np.ndarray:
        """The ids the table holds now, ascending (a copy: 8 bytes a row)."""
        with self._lock:
            return np.sort(self._rows.keys[:self._rows.n])

    @property
    def nbytes(self) -> int:
        """The bytes stats() reports, without the lock (a racing push may move it a little)."""
        return self._rows.nbytes + self._pending.nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"rows": self._rows.n, "bytes": self._rows.nbytes + self._pending.nbytes,
                    "pending_ids": self._pending.n, **self._counters}

    # -- writing ------------------------------------------------------------------------------

    def apply(self, ids: np.ndarray, grads: np.ndarray, step: int, scale: float = 1.0,
              checked: bool = False) -> None:
        """Push grads * scale for distinct ids at `step`: admission, creation, the row optimizer,
        last update = step, then eviction (see the module docstring). An id repeated in one push
        (TableLookup.of never does it) is counted and stepped once per occurrence.

        `checked`: the caller (the shard: pserver.server.checks.check_rows) has already checked
        that no id repeats and that every gradient is finite. Then the gradients are not scanned again,
        and the probe and the update may run in parts (module docstring); a wrong promise would
        let two threads step one row at once."""
        ids, grads, step, scale = self._check_push(ids, grads, step, scale, finite=checked)
        c = self.config
        threads = self.threads if checked else 1
        with self._lock:
            r, p = self._rows, self._pending
            idx = np.empty(ids.shape[0], np.int64)
            in_parts(lambda a, b: index.find_many(r.slots, r.keys, ids[a:b], r.bits, idx[a:b]),
                     ids.shape[0], threads)
            creates, new_pending = _plan(p.slots, p.keys, p.bits, p.arrays["count"], ids,
                                         c.min_count, idx)
            r.reserve(creates)
            p.reserve(new_pending)
            if self._dump is not None:       # rows about to change or be created in place
                self._dump.save(self, np.concatenate([idx[idx >= 0], np.arange(r.n, r.n + creates)]))
            self._low = step if self._low is None else min(self._low, step)
            before, lay = r.n, self.layout
            # Initial rows go straight into data, or (compact) into float32 first, then rounded.
            init = (np.empty((creates, self.opt.width(self.dim)), np.float32) if lay.compact
                    else r.arrays["data"])
            r.n, p.n = _admit(r.slots, r.keys, r.bits, r.n, init, before if lay.compact else 0,
                              self._steps(), p.slots, p.keys, p.bits, p.n, p.arrays["count"], ids, idx,
                              c.min_count, self._key, float(c.init_scale), self._slot_init)
            if lay.compact and r.n > before:
                compact.store_initial(r.arrays["data"], before, init[:r.n - before], lay, self._fast)
            self._counters["creations"] += r.n - before
            if c.min_count > 1:
                self._counters["admissions"] += r.n - before
            data, steps, last = r.arrays["data"], self._steps(), r.arrays["last"]

            def update(a, b):
                if lay.compact:
                    compact.step_rows(self.opt, data, steps, idx[a:b], ids[a:b], grads[a:b], scale,
                                      self._key, step, lay, self._fast)
                else:
                    self.opt.step(data, steps, idx[a:b], grads[a:b], scale)
                _touch(last, idx[a:b], step)

            in_parts(update, ids.shape[0], threads)
            self._evict(step)

    def _steps(self) -> np.ndarray:
        return self._rows.arrays.get("steps", _NO_STEPS)

    def _evict(self, step: int) -> None:
        """Evict rows idle for more than ttl_steps, then the least recently updated beyond
        max_rows."""
        c, r = self.config, self._rows
        k = max(r.n - c.max_rows, 0) if c.max_rows else 0
        if c.ttl_steps:
            k = max(k, int(np.count_nonzero(r.arrays["last"][:r.n] < step - c.ttl_steps)))
        self._evict_oldest(k)

    def _evict_oldest(self, k: int, release: bool = False, keep: np.ndarray | None = None) -> None:
        """Evict the k least recently updated rows: the k smallest (last update, id), found by
        one partition, not a scan per row; `release`: their pages go back at once; `keep`: a
        mask of rows that may not go. Holds the lock."""
        r = self._rows
        if k <= 0:           # (before the row list: n positions, 76 MiB at 10M rows, on every push)
            return
        rows = np.arange(r.n) if keep is None else np.flatnonzero(~keep[:r.n])
        k = min(k, rows.shape[0])
        if k <= 0:
            return
        last = r.arrays["last"][rows]
        bound = np.partition(last, k - 1)[k - 1]
        below = rows[last < bound]
        tied = rows[last == bound]
        need = k - below.shape[0]
        # Ties (rows last updated at the same step) go by id, so eviction is deterministic.
        tied = tied[np.argpartition(r.keys[tied], need - 1)[:need]] if need < tied.shape[0] else tied
        victims = np.sort(np.concatenate([below, tied]))[::-1].copy()
        if self._dump is not None:           # the holes, and the last rows that fill them
            self._dump.save(self, np.concatenate([victims, np.arange(r.n - k, r.n)]))
        if self.track and not self._removed_overflow:
            self._removed.append(r.keys[victims].copy())
            self._removed_count += victims.shape[0]
            if self._removed_count > REMOVED_MAX:    # a delta would be as big as a base: drop them,
                self._removed, self._removed_overflow = [], True   # and the next dump is whole
        r.n = _evict(r.slots, r.keys, r.bits, r.n, r.arrays["data"], r.arrays["last"],
                     self._steps(), victims)
        r.moved()
        r.shrunk(force=release)
        self._counters["evictions"] += k

    # -- the shard's memory budget (pserver.server.budget) ------------------------------------

    @property
    def evictable(self) -> bool:
        """Whether rows may be evicted to make room: the table has an eviction rule of its own
        (max_rows or ttl_steps), so its user has accepted that rows go."""
        return bool(self.config.max_rows or self.config.ttl_steps)

    def growth_bytes(self, new: int) -> int:
        """What `new` rows created (or ids counted for admission) add at most: their entries, and
        the index when it must grow to hold them (it doubles: a push that crosses the bound pays
        for the whole new index)."""
        with self._lock:
            worst = 0
            for e in (self._rows, self._pending):
                bits = index.bits_for(e.n + new)
                grown = ((1 << bits) - (1 << e.bits)) * 4 if bits > e.bits else 0
                if e.next is not None and e.next[2] >= bits:
                    grown = 0          # the successor being built is big enough: nbytes counts it already
                worst = max(worst, new * e.entry_bytes + grown)
            return worst

    def absent(self, ids: np.ndarray) -> int:
        """How many of ids (distinct, checked) the table does not hold: at most the rows or
        pending entries a push of them creates."""
        with self._lock:
            r = self._rows
            idx = np.empty(ids.shape[0], np.int64)
            index.find_many(r.slots, r.keys, ids, r.bits, idx)
            return int(np.count_nonzero(idx == index.EMPTY))

    def _kept(self, keep_ids) -> np.ndarray:
        """A mask over the rows: those of the ids in keep_ids (arrays of distinct ids). Holds the lock."""
        r = self._rows
        mask = np.zeros(r.n, bool)
        for ids in keep_ids:
            idx = np.empty(ids.shape[0], np.int64)
            index.find_many(r.slots, r.keys, ids, r.bits, idx)
            mask[idx[idx != index.EMPTY]] = True
        return mask

    def evictable_bytes(self, keep_ids=()) -> int:
        """What evicting every row but those of keep_ids would free (0 without an eviction rule)."""
        if not self.evictable:
            return 0
        with self._lock:
            r = self._rows
            kept = int(np.count_nonzero(self._kept(keep_ids)))
            return (r.n - kept) * r.entry_bytes + (max(r.high - r.n, 0) * r.entry_bytes if r.growable else 0)

    def evict_for(self, nbytes: int, keep_ids=()) -> int:
        """Evict least recently updated rows, their pages given back, until nbytes are free or
        no row is left, never the rows of keep_ids (a push's own, and those of pushes waiting
        for their step); the rows evicted."""
        with self._lock:
            k = -(-nbytes // self._rows.entry_bytes)
            before = self._rows.n
            self._evict_oldest(k, release=True, keep=self._kept(keep_ids) if keep_ids else None)
            return before - self._rows.n

    def warm(self) -> None:
        """Load (or compile, on a cold cache) every kernel this table's pushes, lookups,
        evictions and index builds run, on a throwaway table of the same kind: the memory and
        the time that takes belong to the shard's start, not to the push that first evicts."""
        spare = SparseTable(self.config, self.table_index)
        ids = np.arange(1, 65, dtype=np.uint64)
        for step in range(max(self.config.min_count, 1)):    # past admission, rows created
            spare.apply(ids, np.zeros((ids.shape[0], self.dim), np.float32), step)
        spare.lookup(ids, np.empty((ids.shape[0], self.dim), np.float32))
        spare.absent(ids)
        spare.evict_for(8 * spare._rows.entry_bytes, [ids[:4]])
        r = spare._rows
        index.insert_range(np.full(1 << index.MIN_BITS, index.EMPTY, np.int32), r.keys, 0, 4, index.MIN_BITS)

    # -- checking -----------------------------------------------------------------------------

    def _check_ids(self, ids) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
            raise InvalidArgument(f"table {self.config.name!r}: ids need a 1-D uint64 array, got "
                                  f"{getattr(ids, 'dtype', type(ids).__name__)}{list(np.shape(ids))}")
        return np.ascontiguousarray(ids)

    def _check_push(self, ids, grads, step, scale, finite=False):
        ids, name = self._check_ids(ids), self.config.name
        if (not isinstance(grads, np.ndarray) or grads.dtype != np.float32
                or grads.shape != (ids.shape[0], self.dim)):
            raise InvalidArgument(f"table {name!r}: grads need float32[{ids.shape[0]}, {self.dim}], got "
                                  f"{getattr(grads, 'dtype', type(grads).__name__)}{list(np.shape(grads))}")
        i = -1 if finite else first_nonfinite_row(grads)
        if i >= 0:
            raise InvalidArgument(f"table {name!r}: the gradient of id {int(ids[i])} (row {i} of the "
                                  f"push) is not finite: {grads[i].tolist()}")
        if not math.isfinite(scale):
            raise InvalidArgument(f"table {name!r}: scale must be finite, got {scale}")
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise InvalidArgument(f"table {name!r}: step must be an integer >= 0, got {step!r}")
        return ids, np.ascontiguousarray(grads), int(step), float(scale)

    # -- checkpoints --------------------------------------------------------------------------

    @property
    def columns(self) -> list[str]:
        """The state() arrays that an entry's `data` holds side by side, in order (a slot held as
        its square root is slot_<name>.sqrt: compact.slot_key)."""
        return ["rows"] + [compact.slot_key(name, root)
                           for name, root in zip(self.opt.slots, self.layout.roots)]

    def entry_dtype(self) -> np.dtype:
        """One row of a checkpoint file's entries array: id, last update, [steps], data."""
        data = self._rows.arrays["data"]
        return np.dtype([("id", "<u8"), ("last", "<i8")]
                        + ([("steps", "<i8")] if self.opt.counts_steps else [])
                        + [("data", data.dtype.str, (data.shape[1],))])

    def _entries(self, where) -> np.ndarray:
        """The entries at `where` (a slice or positions) as an entry_dtype array. Holds the lock."""
        r = self._rows
        keys = r.keys[where]
        out = np.empty(keys.shape[0], self.entry_dtype())
        out["id"], out["last"], out["data"] = keys, r.arrays["last"][where], r.arrays["data"][where]
        if self.opt.counts_steps:
            out["steps"] = self._steps()[where]
        return out

    @property
    def needs_base(self) -> bool:
        """More ids were removed since the last dump than a delta keeps (REMOVED_MAX)."""
        return self._removed_overflow

    def begin_dump(self, delta: bool) -> tuple[int, dict[str, np.ndarray]]:
        """Fix what a checkpoint holds now: every row, or (delta) the rows updated since the last
        dump began. Returns how many entries `read_dump` will hand out, and the small arrays,
        copied: pending ids and counts, counters, and (delta) "removed": the ids that left the
        table since (every way a row leaves is an eviction here: max_rows, ttl_steps, memory)."""
        with self._lock:
            if delta and self._removed_overflow:
                raise RuntimeError(f"table {self.config.name!r}: a delta after {REMOVED_MAX:,} evictions")
            r, p = self._rows, self._pending
            if not delta:
                chosen = None
            elif self._low is None:
                chosen = np.empty(0, np.int64)
            else:
                chosen = np.flatnonzero(r.arrays["last"][:r.n] >= self._low)
            removed = np.concatenate(self._removed) if self._removed else np.empty(0, np.uint64)
            self._low, self._removed = None, []
            self._removed_count, self._removed_overflow = 0, False
            self._dump = _Dump(r.n, chosen)
            small = {"pending_ids": p.keys[:p.n].copy(), "pending_counts": p.arrays["count"][:p.n].copy(),
                     "counters": np.array([self._counters[k] for k in COUNTERS], np.int64)}
            if delta:
                small["removed"] = removed
            return self._dump.count, small

    def read_dump(self, a: int, b: int) -> np.ndarray:
        """Entries a..b-1 of the dump (in row order) as they were when it began. Read them in
        order: rows before b are no longer kept aside once read."""
        with self._lock:
            d = self._dump
            if d is None:
                raise RuntimeError(f"table {self.config.name!r}: no checkpoint dump in progress")
            where = slice(a, b) if d.chosen is None else d.chosen[a:b]
            out = self._entries(where)
            if b > a:
                first, last = (a, b - 1) if d.chosen is None else (int(where[0]), int(where[-1]))
                d.restore(out, first, last, None if d.chosen is None else where)
                d.advance(last + 1)
            return out

    def end_dump(self) -> None:
        with self._lock:
            if self._dump is not None:
                self.dump_peak = self._dump.peak
            self._dump = None

    def state(self) -> RowState:
        """Copies of everything needed to continue exactly (load is its inverse)."""
        with self._lock:
            r, p, d = self._rows, self._pending, self.dim
            data = r.arrays["data"][:r.n]
            cols = (self.layout.unpack(data) if self.layout.compact      # each column in its own type
                    else [data[:, s * d:(s + 1) * d].copy() for s in range(1 + len(self.opt.slots))])
            return RowState(ids=r.keys[:r.n].copy(), rows=cols[0], last_update=r.arrays["last"][:r.n].copy(),
                            pending_ids=p.keys[:p.n].copy(), pending_counts=p.arrays["count"][:p.n].copy(),
                            counters=np.array([self._counters[k] for k in COUNTERS], np.int64),
                            slots=dict(zip(self.columns[1:], cols[1:])),
                            steps=self._steps()[:r.n].copy() if self.opt.counts_steps else None)

    def load(self, state: RowState) -> None:
        """Replace the table by a state() (checked first: on an error nothing changes). Its slots
        may be in another state type or form (slot_<name> or slot_<name>.sqrt, as a checkpoint
        written before the float16 slots kept their roots): converted to the table's, rounded
        to nearest (compact.convert_slot)."""
        state = _check_state(self, state)
        columns = [state["rows"]] + [state[k] for k in self.columns[1:]]
        data = compact.pack(columns) if self.layout.compact else np.concatenate(columns, axis=1)
        arrays = {"data": data, "last": state["last_update"]}
        if self.opt.counts_steps:
            arrays["steps"] = state["steps"]
        with self._lock:
            self._reset()                      # (ends a dump: the rows it promised are gone)
            self._rows.fill(state["ids"], arrays)
            self._pending.fill(state["pending_ids"], {"count": state["pending_counts"]})
            self._counters = dict(zip(COUNTERS, (int(v) for v in state["counters"])))


_NO_STEPS = np.empty(0, np.int64)


class _Dump:
    """The rows one checkpoint of a table holds: positions 0..n0-1 (all, or `chosen` of them),
    read in increasing position; rows at or past `cursor` that are about to change are copied
    aside first (`save`), and a read takes those copies over the live rows. Used under the
    table's lock.

    The copies are kept in buckets of BUCKET positions, so that a read looks only at the
    buckets its stripe spans and a bucket the cursor has passed is freed whole. A bucket's
    copies go into chunks that are filled in place and never grown or merged: a chunk holds
    16, 32, 64... up to CHUNK rows (each twice the one before, so a bucket's unfilled room is
    at most its rows, and one chunk), and the next row goes into a new one. Merging a bucket's
    copies by concatenation kept the old and the merged arrays alive at once and left freed
    blocks of every growing size behind, which the heap could not reuse: the first write under
    pushes took 1.7x the bytes kept aside in RSS, and 1.06x with chunks (3M rows, 22 MiB kept
    aside, bench/checkpoint_incremental.py --parts c). Chunks come in a few sizes, so a freed
    one is reused whole. `bytes` counts the chunks'
    room and the bit mask of rows already copied (n0 / 8 bytes)."""

    BUCKET = 1 << 15                                 # positions per bucket
    CHUNK = 256                                      # rows in a bucket's largest chunk
    FIRST = 16                                       # rows in a bucket's first chunk

    def __init__(self, n0: int, chosen: np.ndarray | None):
        self.n0, self.chosen, self.cursor = n0, chosen, 0
        self.count = n0 if chosen is None else int(chosen.shape[0])
        self.seen: np.ndarray | None = None          # positions already copied aside (bits of n0)
        # bucket -> its chunks, each [positions, entries, rows filled]
        self.buckets: dict[int, list[list]] = {}
        self.bytes = self.peak = 0                   # bytes kept aside now, and at most

    def save(self, table: SparseTable, positions: np.ndarray) -> None:
        positions = positions[(positions >= self.cursor) & (positions < self.n0)]
        if self.chosen is not None and positions.size:
            at = np.minimum(np.searchsorted(self.chosen, positions), max(self.chosen.shape[0] - 1, 0))
            positions = positions[self.chosen[at] == positions] if self.chosen.size else positions[:0]
        if not positions.size:
            return
        if self.seen is None:
            self.seen = np.zeros((self.n0 + 7) >> 3, np.uint8)
            self.bytes += self.seen.nbytes
        positions = np.unique(positions)
        bits = (np.uint8(1) << (positions & 7).astype(np.uint8))
        fresh = (self.seen[positions >> 3] & bits) == 0
        positions, bits = positions[fresh], bits[fresh]
        if not positions.size:
            return
        np.bitwise_or.at(self.seen, positions >> 3, bits)
        copies = table._entries(positions)
        keys = positions // self.BUCKET
        cuts = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1, [positions.shape[0]]])
        for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            chunks = self.buckets.setdefault(int(keys[lo]), [])
            while lo < hi:
                if not chunks or chunks[-1][2] == chunks[-1][0].shape[0]:
                    room = min(self.CHUNK, 2 * chunks[-1][0].shape[0] if chunks else self.FIRST)
                    chunks.append([np.empty(room, np.int64), np.empty(room, copies.dtype), 0])
                    self.bytes += chunks[-1][0].nbytes + chunks[-1][1].nbytes
                pos, entries, filled = chunks[-1]
                n = min(hi - lo, pos.shape[0] - filled)
                pos[filled:filled + n], entries[filled:filled + n] = positions[lo:lo + n], copies[lo:lo + n]
                chunks[-1][2] = filled + n
                lo += n
        self.peak = max(self.peak, self.bytes)

    def restore(self, out: np.ndarray, first: int, last: int, where: np.ndarray | None) -> None:
        """Put the copies of rows first..last (positions) over `out`, the live rows there."""
        for key in range(first // self.BUCKET, last // self.BUCKET + 1):
            for pos, entries, filled in self.buckets.get(key, ()):
                pos = pos[:filled]
                hit = (pos >= first) & (pos <= last)
                if hit.any():
                    at = pos[hit] - first if where is None else np.searchsorted(where, pos[hit])
                    out[at] = entries[:filled][hit]

    def advance(self, cursor: int) -> None:
        """Rows before cursor are written: the buckets wholly before it are dropped, and those
        rows change freely."""
        self.cursor = cursor
        for key in [k for k in self.buckets if (k + 1) * self.BUCKET <= cursor]:
            self.bytes -= sum(p.nbytes + e.nbytes for p, e, _ in self.buckets.pop(key))


def _check_state(table: SparseTable, state: RowState) -> dict:
    """The arrays of a state() for this table, by name, or ConfigError naming the first
    inconsistency."""
    what, d, opt, state = f"table {table.config.name!r} state", table.dim, table.opt, state.arrays()
    lay = table.layout
    row_type = compact.STORAGE[lay.row_dtype]
    # A slot in either form (compact.slot_key) and any state type: converted below.
    given = {}
    for name, key in zip(opt.slots, table.columns[1:]):
        forms = [k for k in (f"slot_{name}", f"slot_{name}.sqrt") if k in state]
        given[key] = forms[0] if len(forms) == 1 else key
    want = {"ids": (np.uint64, 1), "rows": (row_type, 2), "last_update": (np.int64, 1),
            "pending_ids": (np.uint64, 1), "pending_counts": (np.int64, 1), "counters": (np.int64, 1),
            **{k: ((np.float32, np.float16, np.uint16), 2) for k in given.values()},
            **({"steps": (np.int64, 1)} if opt.counts_steps else {})}
    if sorted(state) != sorted(want):
        raise ConfigError(f"{what}: has arrays {sorted(state)}, a {opt.name} table keeps "
                          f"{sorted(want.keys() - given.values() | given.keys())}")
    arrays = {k: np.asarray(v) for k, v in state.items()}
    for k, (dtype, ndim) in want.items():
        if arrays[k].dtype not in np.atleast_1d(dtype) or arrays[k].ndim != ndim:
            kind = (f" (the table stores {lay.row_dtype}: row_dtype {lay.row_dtype}, state_dtype "
                    f"{table.config.state_dtype})") if k == "rows" else ""
            names = " or ".join(np.dtype(t).name for t in np.atleast_1d(dtype))
            raise ConfigError(f"{what}: {k} is {arrays[k].dtype}{list(arrays[k].shape)}, needs "
                              f"{names} with {ndim} dimension(s){kind}")
    n, p = arrays["ids"].shape[0], arrays["pending_ids"].shape[0]
    shapes = {"rows": (n, d), "last_update": (n,), "pending_counts": (p,), "counters": (len(COUNTERS),),
              **{k: (n, d) for k in given.values()}, **({"steps": (n,)} if opt.counts_steps else {})}
    for k, shape in shapes.items():
        if arrays[k].shape != shape:
            raise ConfigError(f"{what}: {k} has shape {list(arrays[k].shape)}, needs {list(shape)} "
                              f"({n} rows, {p} pending ids, dim {d})")
    _check_values(what, arrays, table.config.min_count)
    for s_, (key, have) in enumerate(given.items()):
        arrays[key] = compact.convert_slot(arrays.pop(have), have.endswith(".sqrt"), lay, s_)
    return arrays


def _check_values(what: str, a: dict, min_count: int) -> None:
    from pserver.sparse.dedupe import unique_inverse
    every = np.concatenate([a["ids"], a["pending_ids"]])
    if unique_inverse(every)[0].shape[0] != every.shape[0]:
        raise ConfigError(f"{what}: an id appears twice among ids and pending_ids")
    for k in a:
        v = a[k]
        if v.dtype == np.uint16 and k != "pending_counts":   # bfloat16 words: the high half of a float32
            v = (v.astype(np.uint32) << np.uint32(16)).view(np.float32)
        if v.dtype in (np.float32, np.float16) and not np.isfinite(v).all():
            raise ConfigError(f"{what}: {k} holds a value that is not finite")
    for k in ("last_update", "counters", "steps"):
        if k in a and a[k].size and a[k].min() < 0:
            raise ConfigError(f"{what}: {k} holds a negative value")
    if a["pending_counts"].size and not (1 <= a["pending_counts"].min() and
                                         a["pending_counts"].max() < max(min_count, 1)):
        raise ConfigError(f"{what}: pending_counts must lie in [1, min_count={min_count})")


# -- kernels --------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _lookup(slots, keys, bits, data, ids, key, scale, out):
    d = out.shape[1]
    idx = np.empty(ids.shape[0], np.int64)
    index.find_many(slots, keys, ids, bits, idx)
    for i in range(ids.shape[0]):
        index.prefetch_ahead(data, idx, i)
        e = idx[i]
        if e == index.EMPTY:
            initial_row(key, ids[i], scale, out[i])
        else:
            for j in range(d):
                out[i, j] = data[e, j]


@njit(cache=True, nogil=True)
def _plan(pslots, pkeys, pbits, pcounts, ids, min_count, idx):
    """Given idx[i] = the row of ids[i] or EMPTY (index.find_many), returns (at most how many
    rows this push creates, at most how many pending entries it adds), counting each id not
    stored once, with all its occurrences (a repeated id may reach min_count within one push)."""
    missing = ids[idx == index.EMPTY]
    uniq, inverse = np.empty_like(missing), np.empty(missing.shape[0], np.int64)
    u = _unique_inverse_kernel(missing, uniq, inverse)
    seen = np.zeros(u, np.int64)
    for k in inverse:
        seen[k] += 1
    if min_count <= 1:
        return u, 0
    creates, new_pending = 0, 0
    for k in range(u):
        _, pe = index.find(pslots, pkeys, uniq[k], pbits)
        count = 0 if pe == index.EMPTY else pcounts[pe]
        creates += count + seen[k] >= min_count
        # Even if admitted in this push, a repeated id is pending until its k-th occurrence.
        new_pending += pe == index.EMPTY
    return creates, new_pending


@njit(cache=True, nogil=True)
def _count(pslots, pkeys, pbits, pn, pcounts, id_, min_count):
    """Count one push of an id that is not stored; returns (admitted, pending entries)."""
    pos, pe = index.find(pslots, pkeys, id_, pbits)
    if pe == index.EMPTY:
        pe = pn
        pkeys[pe], pcounts[pe], pslots[pos] = id_, 0, pe
        pn += 1
    pcounts[pe] += 1
    if pcounts[pe] < min_count:
        return False, pn
    # Admitted: its count is no longer kept; the last pending entry fills the hole.
    index.delete_at(pslots, pkeys, pos, pbits)
    pn -= 1
    if pe != pn:
        index.repoint(pslots, pkeys, pkeys[pn], pe, pbits)
        pkeys[pe], pcounts[pe] = pkeys[pn], pcounts[pn]
    return True, pn


@njit(cache=True, nogil=True)
def _admit(slots, keys, bits, n, init, base, steps, pslots, pkeys, pbits, pn, pcounts, ids, idx,
           min_count, key, scale, slot_init):
    """Count the ids that _plan found absent; create the rows of those admitted (idx[i] = row),
    their initial values written to init[row - base] (the table's data, base 0, or a float32
    scratch that a compact table rounds into its data)."""
    d = init.shape[1] - slot_init.shape[0]
    for i in range(ids.shape[0]):
        if idx[i] != index.EMPTY:
            continue
        pos, e = index.find(slots, keys, ids[i], bits)
        if e != index.EMPTY:   # created earlier in this push: a repeated id shares its row
            idx[i] = e
            continue
        if min_count > 1:
            admitted, pn = _count(pslots, pkeys, pbits, pn, pcounts, ids[i], min_count)
            if not admitted:
                continue
        keys[n], slots[pos], idx[i] = ids[i], n, n
        initial_row(key, ids[i], scale, init[n - base, :d])
        init[n - base, d:] = slot_init
        if steps.shape[0]:
            steps[n] = 0
        n += 1
    return n, pn


@njit(cache=True, nogil=True)
def first_nonfinite_row(grads):
    """The first row of grads holding a NaN or an infinity, or -1. x - x is 0 for a finite x
    and NaN otherwise: a test of a whole row without a branch, which vectorizes."""
    for i in range(grads.shape[0]):
        bad = False
        for j in range(grads.shape[1]):
            bad |= (grads[i, j] - grads[i, j]) != 0
        if bad:
            return i
    return -1


@njit(cache=True, nogil=True)
def _touch(last, idx, step):
    for i in range(idx.shape[0]):
        if i + index.PROBE_AHEAD < idx.shape[0]:
            index.prefetch(last, max(idx[i + index.PROBE_AHEAD], 0))
        if idx[i] >= 0:
            last[idx[i]] = step


@njit(cache=True, nogil=True)
def _evict(slots, keys, bits, n, data, last, steps, victims):
    """Remove the rows in victims (distinct, descending); the last row fills each hole."""
    for e in victims:
        pos, _ = index.find(slots, keys, keys[e], bits)
        index.delete_at(slots, keys, pos, bits)
        n -= 1
        if e != n:
            index.repoint(slots, keys, keys[n], e, bits)
            keys[e], last[e] = keys[n], last[n]
            data[e, :] = data[n, :]
            if steps.shape[0]:
                steps[e] = steps[n]
    return n
