"""One shard's state: its slice of the parameters, optimizer state, version and counters.

The store knows nothing about consistency modes; a policy (pserver.modes) decides when
`apply` runs. Everything but the Hogwild apply happens under `cond`, whose
notify_all wakes pulls waiting for a new version.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import numba
import numpy as np

from pserver import sparse
from pserver.errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotRegistered,
    Unavailable,
)
from pserver.server.coordinator import Coordinator
from pserver.server.statistics import MovingStatistics, weighted_mean
from pserver.sparse.merge import RowGrads, merge_rows
from pserver.wire import frames
from pserver.wire.codec import Position

log = logging.getLogger("pserver.server")
STALENESS_BUCKETS = 17   # histogram buckets 0..15, and one for 16 and more
# A float32 whose exponent bits are all ones is +-Inf or NaN: testing the bits of uint32
# views needs no float compare, so the loops below vectorize like a plain memcpy.
EXPONENT = np.uint32(0x7F800000)


@numba.njit(cache=True, nogil=True)
def _copy_words(src, dst):
    """dst[:] = src over uint32 words; True if any word copied is a non-finite float32.
    Each word is loaded once and both stored and tested, so what passed is what dst holds."""
    bad = False
    for i in range(src.size):
        w = src[i]
        dst[i] = w
        bad |= (w & EXPONENT) == EXPONENT
    return bad


@numba.njit(cache=True, nogil=True)
def _any_nonfinite_word(words):
    bad = False
    for i in range(words.size):
        bad |= (words[i] & EXPONENT) == EXPONENT
    return bad


@numba.njit(cache=True, nogil=True)
def _first_nonfinite_word(words):
    """Only after a scan found one: a loop that can stop early does not vectorize."""
    for i in range(words.size):
        if (words[i] & EXPONENT) == EXPONENT:
            return i
    return -1


def first_nonfinite(a: np.ndarray) -> int:
    """The index of the first NaN or +-Inf in a float32 array, or -1 (no temporary array)."""
    words = a.view(np.uint32)
    return _first_nonfinite_word(words) if _any_nonfinite_word(words) else -1


def copy_finite(src: np.ndarray, dst: np.ndarray) -> int:
    """dst[:] = src (float32) in one pass that also checks every value it copies; returns the
    index of the first non-finite value copied, or -1. Only dst is searched afterwards: src
    may be memory that another process is still writing."""
    if _copy_words(src.view(np.uint32), dst.view(np.uint32)):
        return _first_nonfinite_word(dst.view(np.uint32))
    return -1


def shared_zeros(size: int) -> tuple[int | None, np.ndarray]:
    """(fd, zeroed float32 array) in a memfd that the data plane can hand to workers: sealed,
    so they can map it read-only and never resize it. (None, array) where there is none."""
    if size == 0 or not frames.supported():
        return None, np.zeros(size, dtype=np.float32)
    try:
        fd, mm = frames.sealed_memfd("pserver-params", size * 4, clients_write=False)
    except OSError as e:
        # Linux < 5.1 has no F_SEAL_FUTURE_WRITE: no data plane rather than an unsafe one
        log.warning("parameters cannot be shared read-only (%s); same-host workers use gRPC", e)
        return None, np.zeros(size, dtype=np.float32)
    return fd, np.frombuffer(mm, dtype=np.float32)


class Counters:
    """What became of every push, and staleness, behind a lock of its own."""

    FIELDS = ("pushes_received", "pushes_applied", "pushes_aggregated", "pushes_dropped_late",
              "pushes_rejected", "updates_applied", "workers_marked_dead", "samples_pushed",
              "pulls_served", "clock_gap_max", "checkpoints_written", "checkpoints_failed",
              "workers_rejoined", "sessions_replaced", "sessions_taken_over", "requests_refused_busy",
              "rows_pulled", "rows_pushed", "rows_evicted_for_memory", "pushes_refused_for_memory")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._staleness_sum = 0
        self._staleness_max = 0
        self._histogram = [0] * STALENESS_BUCKETS

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def raise_to(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = max(self._values[name], value)

    def record_staleness(self, staleness: int) -> None:
        with self._lock:
            self._staleness_sum += staleness
            self._staleness_max = max(self._staleness_max, staleness)
            self._histogram[min(staleness, STALENESS_BUCKETS - 1)] += 1

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._values)
            recorded = sum(self._histogram)
            out["staleness_mean"] = self._staleness_sum / recorded if recorded else 0.0
            out["staleness_max"] = self._staleness_max
            out["staleness_histogram"] = list(self._histogram)
            return out


class BufferPool:
    """Reusable float32 scratch arrays of one size, so a push never allocates afresh.

    Policies hand every gradient back with `release` when done with it; arrays that were
    not acquired here (a caller driving a policy directly with its own) are ignored.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = []
        self._own: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
            buf = np.empty(self.size, dtype=np.float32)
            self._own.add(id(buf))
            return buf

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            if id(buf) in self._own:
                self._free.append(buf)


@numba.njit(cache=True, nogil=True)
def _add_scaled(acc, g, w):
    """acc += g * w (float32; w a float32), without numpy's temporary array."""
    for i in range(acc.size):
        acc[i] += g[i] * w


@numba.njit(cache=True, nogil=True)
def _add_then_scale(a, b, scale, out):
    """out = (a + b) * scale element by element, each step rounded to float32 as NumPy's
    np.add(a, b, out); out *= scale round them (out may be a); one pass where those are two."""
    for i in range(out.size):
        out[i] = (a[i] + b[i]) * scale


def mean_gradient(grads: list[np.ndarray], counts: list[int], out: np.ndarray | None) -> np.ndarray:
    """The step's dense mean, sum(n_i g_i) / sum(n_i), of gradients in rank order (n_i =
    counts[i], the samples of each push), summed in that order into `out`, then scaled; the
    gradients are left as they are. With equal counts it is the plain sum times float32(1/N),
    the unweighted mean bit for bit. One gradient is its own mean, returned as it is.

    A sum of finite gradients can overflow float32: then the mean is computed again from
    gradients scaled by n_i / sum(n) first, so that it is finite, as every gradient was."""
    if len(grads) == 1:
        return grads[0]
    total = sum(counts)
    if len(set(counts)) == 1:
        # the last addition and the scaling in one pass (_add_then_scale): the same float32
        # roundings, in the same order, as adding every gradient and then scaling
        first = grads[0]
        if len(grads) > 2:
            with np.errstate(over="ignore"):    # found below, and summed again scaled first
                np.add(grads[0], grads[1], out=out)
                for g in grads[2:-1]:
                    out += g
            first = out
        _add_then_scale(first, grads[-1], np.float32(1.0 / len(grads)), out)
        if first_nonfinite(out) < 0:            # a non-finite sum stays so once scaled by 1/N
            return out
    else:
        np.multiply(grads[0], np.float32(counts[0]), out=out)
        for g, n in zip(grads[1:], counts[1:]):
            _add_scaled(out, g, np.float32(n))
        if first_nonfinite(out) < 0:
            out *= np.float32(1.0 / total)
            return out
    np.multiply(grads[0], np.float32(counts[0] / total), out=out)
    for g, n in zip(grads[1:], counts[1:]):
        _add_scaled(out, g, np.float32(n / total))
    return out


class StateDump:
    """A checkpoint's view of a store at one version (ShardStore.begin_dump): the meta, the
    dense arrays read a stripe at a time (`dense`), and per table its config, entry layout,
    entry count and small arrays, its entries read through the table (`rows`)."""

    def __init__(self, store: ShardStore, meta: dict, dense: dict[str, np.ndarray], tables: list):
        self.store, self.meta, self.tables = store, meta, tables
        self.dense = dense                            # name -> the live array
        self.read_to = dict.fromkeys(dense, 0)        # name -> elements read so far
        self.aside: dict[str, tuple[int, np.ndarray]] = {}   # name -> (from, copy of the rest)
        self.aside_bytes = 0
        self.delta = False                            # rows updated since the last dump only

    def before_step(self) -> None:
        """A sync step is about to change every dense element: keep what is not read yet."""
        for name, a in self.dense.items():
            if name not in self.aside and self.read_to[name] < a.size:
                start = self.read_to[name]
                self.aside[name] = (start, a[start:].copy())
                self.aside_bytes += a.nbytes - start * a.itemsize

    def read(self, name: str, a: int, b: int) -> np.ndarray:
        """Elements a..b-1 of a dense array as they were at the dump's version (read in order)."""
        with self.store.cond:
            if name in self.aside:
                start, copy = self.aside[name]
                out = copy[a - start:b - start].copy()
            else:
                out = self.dense[name][a:b].copy()
            self.read_to[name] = b
            if b >= self.dense[name].size:
                self.aside.pop(name, None)
            return out

    def stripes(self, name: str, stripe_bytes: int):
        """A dense array's stripes, in order."""
        a = self.dense[name]
        step = max(stripe_bytes // a.itemsize, 1)
        for i in range(0, a.size, step):
            yield self.read(name, i, min(i + step, a.size))

    def rows(self, table: int, stripe_bytes: int):
        """A table's entries, in stripes."""
        t = self.store.tables[self.tables[table][0].name]
        count, step = self.tables[table][3], max(stripe_bytes // self.tables[table][2].itemsize, 1)
        for i in range(0, count, step):
            yield t.read_dump(i, min(i + step, count))


class ShardStore:
    """Parameters [start, end) of the flat vector, the optimizer's state and the version, and
    this shard's rows of the model's sparse tables."""

    copy_finite = staticmethod(copy_finite)   # for the data plane, which this module imports

    def __init__(self, shard: int, num_shards: int, make_optimizer: Callable[[int], object],
                 table_threads: int = 1):
        self.shard, self.num_shards = shard, num_shards
        self.table_threads = table_threads   # per sparse lookup or push (SparseTable's threads)
        self._make_optimizer = make_optimizer
        self.cond = threading.Condition()
        self.counters = Counters()
        self.version = -1                 # -1 until the chief's Init (or a restore)
        self.signature = ""               # layout signature; "" until the first Register
        self.frozen: tuple | None = None   # the layout's frozen [start, end) ranges, from the first Register
        self.statistics: tuple = ()        # its moving statistics (Layout.statistics_pairs), from then too
        self.moving = MovingStatistics()   # those of them in this shard's range
        self.total = 0
        self.start = self.end = 0
        self.params: np.ndarray | None = None
        self.optimizer = None
        self.lr_set: float | None = None   # the chief's learning rate (set_lr), kept in checkpoints
        self.assigned_version = -1         # the version the chief's last assign made (-1: none)
        self.pool: BufferPool | None = None
        self.closed = False
        self.restored_from = ""            # the checkpoint this shard resumed from, if any
        self.seeded_by = -1                # the rank whose Init supplied the values
        self.init_lock = threading.Lock()  # Inits take turns (seed)
        self.params_fd: int | None = None  # memfd behind params, for the data plane
        # Where each worker stands (docs/semantics.md, "Resuming"), checkpointed with the rest:
        self.clocks: dict[int, int] = {}   # rank -> its steps taken in (ssp bounds staleness by them)
        self.positions: dict[int, tuple[int, int]] = {}   # rank -> (data_seed, steps_per_epoch)
        self.tables: dict[str, sparse.SparseTable] = {}   # the model's sparse tables: this shard's rows
        self.track = False                 # tables record removed ids (incremental checkpoints)
        self._dump: StateDump | None = None   # the checkpoint being written, if any
        self.coordinator = Coordinator()   # shard 0's leases of the training data (others' stay empty)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def initialized(self) -> bool:
        return self.version >= 0

    def configure(self, signature: str, total: int, start: int, end: int, tables=()) -> None:
        """Fix the layout at the first Register; later ones must match it. Holds cond."""
        if self.signature:
            if signature != self.signature or total != self.total:
                origin = f" (restored from {self.restored_from})" if self.restored_from else ""
                for t in tables:
                    have = self.tables.get(t.name)
                    if have is not None and ((have.config.row_dtype, have.config.state_dtype)
                                             != (t.row_dtype, t.state_dtype)):
                        c = have.config
                        raise FailedPrecondition(
                            f"table {t.name!r}: this shard stores its rows as {c.row_dtype} (state "
                            f"{c.state_dtype}){origin}, the worker declares {t.row_dtype} (state "
                            f"{t.state_dtype}); run the worker with --row-dtype {c.row_dtype} "
                            f"--state-dtype {c.state_dtype}")
                raise FailedPrecondition(
                    f"layout: signature {signature} ({total} params) does not match this shard's "
                    f"{self.signature} ({self.total} params){origin}; every worker must run the same model")
            return
        self._allocate(signature, total, start, end, tables)

    def _allocate(self, signature: str, total: int, start: int, end: int, tables) -> None:
        self.signature, self.total, self.start, self.end = signature, total, start, end
        self.tables = {t.name: sparse.SparseTable(t, i, threads=self.table_threads)
                       for i, t in enumerate(tables)}
        for table in self.tables.values():
            table.track = self.track
        for table in self.tables.values():     # their kernels' memory is the shard's from now on
            table.warm()
        # In a memfd where the platform has one: same-host workers map it read-only and
        # pull with one memcpy (pserver/server/dataplane.py). Otherwise plain memory.
        if self.params_fd is not None:
            os.close(self.params_fd)
        self.params_fd, self.params = shared_zeros(end - start)
        self.optimizer = self._make_optimizer(end - start)
        if self.frozen is not None:
            self.optimizer.freeze(self._own(self.frozen))
        self.pool = BufferPool(end - start)

    def freeze(self, frozen: tuple, statistics: tuple = ()) -> None:
        """The layout's frozen tensors ([start, end) in the flat vector), which the optimizer leaves
        as they are, and its moving statistics (update_statistics): fixed by the first Register (of
        this shard's life: a restore does not keep them), to be the same for every later one (cond
        held; after configure, which changed nothing then)."""
        if self.frozen is None:
            self.frozen, self.statistics = tuple(frozen), tuple(statistics)
            self.optimizer.freeze(self._own(self.frozen))
            self.moving = MovingStatistics(self.statistics, self.start, self.end)
        elif tuple(statistics) != self.statistics:
            raise FailedPrecondition(f"layout: the worker's moving statistics are {list(statistics)}, this "
                                     f"shard's {list(self.statistics)} ((mean, variance, size, momentum)); "
                                     "every worker must run the same model")
        elif tuple(frozen) != self.frozen:
            def say(ranges):
                return f"{sum(b - a for a, b in ranges):,} params in {len(ranges)} tensor(s)"
            raise FailedPrecondition(f"layout: the worker freezes {say(frozen)} (not trained), this shard "
                                     f"{say(self.frozen)}; every worker must train the same weights "
                                     "(layer.trainable, add_weight(trainable=False))")

    def _own(self, frozen: tuple) -> list[tuple[int, int]]:
        """The frozen ranges within this shard's slice, from its start."""
        return [(max(a, self.start) - self.start, min(b, self.end) - self.start)
                for a, b in frozen if a < self.end and b > self.start]

    def begin_dump(self, delta: bool) -> StateDump:
        """The state at this version, to be read a stripe at a time while training goes on (a
        checkpoint without a second copy): taken under cond, so consistent in sync modes; the
        dense arrays are copied aside only when a step is about to change them before they are
        read (copy-on-write in sync and backup), and each table keeps aside the rows a push is
        about to change (SparseTable.begin_dump). Async pushes change the dense arrays without
        the lock: a stripe read then is as consistent as any pull of a Hogwild array.
        `delta`: each table gives only the rows updated since the last dump began, unless one
        evicted more ids since than a delta records (then the dump is whole: `dump.delta`)."""
        with self.cond:
            self.require_configured()
            delta = delta and not any(t.needs_base for t in self.tables.values())
            tables = [(t.config, t.columns, t.entry_dtype(), *t.begin_dump(delta))
                      for t in self.tables.values()]
            meta = dict(version=self.version, signature=self.signature, total=self.total, start=self.start,
                        end=self.end, clocks={str(r): int(c) for r, c in self.clocks.items()},
                        positions={str(r): [int(v) for v in p] for r, p in self.positions.items()},
                        coordinator=self.coordinator.state(),
                        **({} if self.lr_set is None else {"lr_set": self.lr_set}))
            dense = {"params": self.params, **{f"opt.{k}": v for k, v in self.optimizer.state.items()}}
            self._dump = StateDump(self, meta, dense, tables)
            self._dump.delta = delta
            return self._dump

    def end_dump(self) -> StateDump | None:
        """The dump is written (or failed): pushes stop keeping rows aside for it."""
        with self.cond:
            dump, self._dump = self._dump, None
            for table in self.tables.values():
                table.end_dump()
            return dump

    def restore(self, ckpt) -> None:
        with self.cond:
            self._allocate(ckpt.signature, ckpt.total, ckpt.start, ckpt.end, ckpt.tables)
            if ckpt.params.shape != self.params.shape:
                raise ConfigError(f"--restore: {ckpt.path} holds {ckpt.params.size} params for "
                                  f"range [{ckpt.start}, {ckpt.end})")
            self.params[:] = ckpt.params
            self.optimizer.load_state(ckpt.state)
            if ckpt.lr_set is not None:            # the chief's change before the checkpoint holds
                self.set_lr(ckpt.lr_set)
            for name, table in self.tables.items():
                table.load(ckpt.rows[name])
            self.version = ckpt.version
            self.clocks.clear()
            self.clocks.update(ckpt.clocks)
            self.positions.clear()
            self.positions.update(ckpt.positions)
            self.coordinator = Coordinator.load(ckpt.coordinator)
            self.restored_from = ckpt.path
            self.cond.notify_all()

    def set_lr(self, lr: float) -> None:
        """The base learning rate from the next update on (the chief's change, or a restored one)."""
        self.optimizer.lr = self.lr_set = lr

    def assign(self, fill, expected: int) -> int:
        """The chief's values for this shard's range (Shard.assign), replacing the parameters if
        the version is still `expected` (FailedPrecondition otherwise, nothing changed): the
        optimizer's state stays, the version advances by one. The payload is checked into a pool
        buffer first, so a bad one changes nothing; a checkpoint being written keeps what it has
        not read yet (as before a sync step)."""
        values = self.pool.acquire()
        try:
            self.fill(fill, values)
            with self.cond:
                if self.version != expected:
                    raise FailedPrecondition(f"version: shard {self.shard} is at version {self.version}, "
                                             f"not {expected}: it changed since the chief read it")
                if self._dump is not None:
                    self._dump.before_step()
                self.params[:] = values
                self.version += 1
                self.assigned_version = self.version
                self.cond.notify_all()
                return self.version
        finally:
            self.pool.release(values)

    def took(self, rank: int, clock: int) -> None:
        """rank's step `clock` is taken in: applied, part of a completed step, or dropped late
        (its batch is consumed either way). Holds cond."""
        self.clocks[rank] = max(self.clocks.get(rank, 0), clock + 1)

    def position_of(self, rank: int, data_seed: int, steps_per_epoch: int) -> Position | None:
        """rank's recorded position (None when there is none), then the data order it registers
        with now. A rank that comes back with another data order starts its count again:
        its old clock does not say where it stands in the new order. Holds cond."""
        known = self.positions.get(rank)
        if known is None and rank not in self.clocks:
            found = None
        else:
            seed, steps = known or (data_seed, steps_per_epoch)
            found = Position(self.clocks.get(rank, 0), seed, steps)
        if known is not None and known != (data_seed, steps_per_epoch):
            self.clocks.pop(rank, None)
        self.positions[rank] = (data_seed, steps_per_epoch)
        return found

    def require_configured(self) -> None:
        if not self.signature:
            raise NotRegistered("layout: no worker has registered with this shard yet")

    def apply(self, grads: list[np.ndarray], counts: list[int],
              rows: list[tuple[RowGrads, int]] = (), away: list | None = None) -> None:
        """One optimizer step on the mean of a step's pushes: their gradients in rank order,
        counts[i] the samples the push of grads[i] carried, and their sparse rows, each with its
        push's samples (mean_gradient, merge_rows: a push that did not touch a row adds zero to
        it). `away`: each push's statistics carried apart (PushRequest.statistics), averaged with
        the same weights (update_statistics).
        The gradients are left as they are; the caller holds cond."""
        if sum(counts):    # a step of empty contributions only (no data left to any) trains nothing
            out = self.pool.acquire() if len(grads) > 1 else None
            if self._dump is not None:
                self._dump.before_step()
            try:
                mean = mean_gradient(grads, counts, out)
                self.optimizer.step(self.params, mean, self.version)
                self.update_statistics(mean, weighted_mean(away, counts) if self.moving.away else None)
            finally:
                if out is not None:
                    self.pool.release(out)
            for part, scale in merge_rows(list(rows), sum(counts)):
                self.apply_rows([part], scale, self.version)
        self.version += 1
        self.counters.add("updates_applied")
        self.cond.notify_all()

    def update_statistics(self, g: np.ndarray, away=None) -> None:
        """The moving statistics this shard holds, from the step's mean of the pushes' slots (or
        one push's) and of their values for the means another shard holds (MovingStatistics)."""
        if self.moving:
            self.moving.update(self.params, g, away)

    def advance_empty(self) -> None:
        """A sync step whose pushes all carried 0 samples: the version advances, nothing is
        applied (an optimizer step on a zero gradient would still move momentum or Adam)."""
        self.version += 1
        self.counters.add("updates_applied")     # the version advanced, as after any step
        self.cond.notify_all()

    def apply_rows(self, rows: list[RowGrads], scale: float, step: int) -> None:
        """Each table's row optimizer on its rows (scaled), at version `step`: the tables lock
        themselves, so this is safe with or without cond."""
        for part in rows:
            # Checked: checks.check_rows refused repeats and non-finite values as each push
            # arrived, and merge_rows sums per id into finite means.
            self.tables[part.table].apply(part.ids, part.grads, step, scale, checked=True)
            self.counters.add("rows_pushed", part.ids.size)

    def apply_hogwild(self, grad: np.ndarray, rows: list[RowGrads] = (), away=None) -> int:
        """Apply without the lock (async modes): concurrent callers race on purpose.

        The optimizer kernels release the GIL, so pushes from several gRPC threads update
        `params` at the same time (Hogwild!, Niu et al. 2011). Only the version counter and
        the wake-up take the lock. Returns the version after this update.
        """
        self.optimizer.step(self.params, grad, max(self.version, 0))
        self.update_statistics(grad, away)
        self.apply_rows(list(rows), 1.0, max(self.version, 0))
        with self.cond:
            self.version += 1
            self.counters.add("updates_applied")
            self.cond.notify_all()
            return self.version

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None,
                 on_tick: Callable[[], None] | None = None, tick: float = 0.25,
                 waiter=None) -> None:
        """Block (holding cond) until predicate() is true; DeadlineExceeded after timeout.

        `on_tick` runs every `tick` seconds while waiting: policies use it to notice a
        step that has waited too long for a worker. A `waiter` (server/limits.py) is asked
        to park before the first wait, which it may refuse (a bound on waiting calls),
        and whether its caller is alive every tick: a caller that went away (a closed
        connection) ends the wait at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        parked = waiter is None
        while not predicate():
            if self.closed:
                raise Unavailable(f"shard {self.shard}: shutting down")
            if not parked:
                waiter.park()
                parked = True
            if waiter is not None and not waiter.alive():
                raise Unavailable(f"shard {self.shard}: the caller went away while it waited")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"deadline: waited {timeout:.1f} s and what this call "
                                       f"waits for (a new version, a slow worker) did not come")
            self.cond.wait(tick if left is None else min(tick, left))
            if on_tick is not None:
                on_tick()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def warm_kernels(self) -> None:
        """Load the compiled kernels a dense push runs (validate-and-copy, the optimizer's
        update) on a few elements, so that the first step is not slow, and the memory they
        take is part of the shard's idle footprint rather than of its first push."""
        a, b = np.zeros(16, dtype=np.float32), np.zeros(16, dtype=np.float32)
        copy_finite(a, b)
        first_nonfinite(b)
        self._make_optimizer(a.size).step(a, b, 0)

    def check_gradient(self, grad: np.ndarray) -> None:
        """Refuse a gradient (or Init values) in shard-owned memory that holds NaN or Inf."""
        self.refuse_nonfinite(grad, first_nonfinite(grad))

    def seed(self, fill, rank: int) -> tuple[bool, int]:
        """The chief's initial values (Shard.init), unless the store already holds values:
        (whether it did, the version). They land straight in the (not yet initialized)
        parameters, so a 40 MB model costs no second 40 MB; a payload that fails validation
        leaves them zeroed and the store still uninitialized. Inits take turns on their own
        lock, so a client that stalls mid-stream holds up other Inits, not pulls, pushes or
        Status."""
        with self.init_lock:
            if self.initialized:                 # checked again: another Init may have won
                return True, self.version
            try:
                self.fill(fill, self.params)
            except BaseException:
                self.params[:] = 0
                raise
            with self.cond:
                self.version = 0
                self.seeded_by = rank
                self.cond.notify_all()
            return False, self.version

    def fill(self, fill, dst: np.ndarray) -> None:
        """dst from a push's or an Init's payload, every value checked: a client's shared
        memory (an array) as it is copied; a callable that checks as it copies (its
        `checks_values` is true) is left to; any other callable's result after it."""
        if isinstance(fill, np.ndarray):
            self.copy_gradient(fill, dst)
            return
        fill(dst)
        if not getattr(fill, "checks_values", False):
            self.check_gradient(dst)

    def copy_gradient(self, src: np.ndarray, dst: np.ndarray) -> None:
        """dst[:] = src, refused if a value copied is not finite. src may be a client's shared
        memory: checking the values as they are copied means what passed is what is applied."""
        self.refuse_nonfinite(dst, copy_finite(src, dst))

    def refuse_nonfinite(self, checked: np.ndarray, bad: int) -> None:
        if bad >= 0:
            raise InvalidArgument(f"data: the gradient holds a non-finite value ({checked[bad]}) at "
                                  f"element {self.start + bad} of the flat vector")
