"""A shard's operations as plain Python calls: what the servicer exposes over gRPC.

`Shard` composes the store (state), the mode's policy (when updates happen) and the
optimizer (how). It takes and returns numpy arrays and plain values, so tests drive it
without a network, and the servicer only translates protobuf to these calls.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from typing import Callable

import numpy as np

from pserver import sparse
from pserver.config import ServerConfig
from pserver.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    LeaseGone,
    OverBudget,
    ResourceExhausted,
    RpcError,
)
from pserver.models.layout import Layout
from pserver.modes import Outcome, make_policy
from pserver.observe.telemetry import ShardMetrics
from pserver.optim import make_optimizer
from pserver.persist import checkpoint_dir, reshard
from pserver.records import PushRequest, Registration
from pserver.server import checkpoint, memory
from pserver.server.budget import Budget
from pserver.server.coordinator import Lease, Plan
from pserver.server.limits import Limits, pool_threads
from pserver.server.membership import Membership
from pserver.server.store import ShardStore, first_nonfinite
from pserver.sparse import RowGrads
from pserver.wire.codec import DTYPE_NAME, PROTOCOL_VERSION
from pserver.wire.frames import host_id
from pserver.wire.sharding import shard_range

log = logging.getLogger("pserver.server")
# How a push's payload arrives: a function that writes it into the array it is given (the
# gRPC stream, copied into a pool buffer), or an array that its client can still write (a
# data-plane connection's shared buffer), which the shard copies and checks in one pass.
Fill = Callable[[np.ndarray], None] | np.ndarray
MAX_PARAMS = 1 << 33                  # 8G elements (32 GB) per model: a sanity bound on declared sizes
MAX_TABLES = 1024                     # sparse tables per model
MAX_ROW_DIM = 1 << 16                 # values per sparse row
MAX_EPOCH_LOGS = 64                   # names in the chief's epoch logs (Keras: loss, metrics, val_*)
EXPIRY_SLACK = 0.005                  # seconds the reaper wakes after a session falls due (and at least)


def checked_total(layout: Layout) -> int:
    """P of a layout a worker declared, checked before anything is allocated. Python
    integers, capped: numpy's int64 product wraps around, which would let a huge layout
    pass as a small (or empty) one."""
    if any(d < 0 for t in layout.tensors for d in t.shape):
        raise InvalidArgument("layout: a tensor has a negative dimension")
    total = 0
    for t in layout.tensors:
        size = 1
        for d in t.shape:
            size = min(size * d, MAX_PARAMS + 1)
        total = min(total + size, MAX_PARAMS + 1)
    if not 1 <= total <= MAX_PARAMS:
        told = f"more than {MAX_PARAMS}" if total > MAX_PARAMS else str(total)
        raise InvalidArgument(f"layout: {len(layout.tensors)} tensors, {told} elements; "
                              f"need 1 to {MAX_PARAMS} elements")
    return total


def checked_tables(tables) -> None:
    """The sparse tables a worker declared, checked before anything is allocated."""
    if len(tables) > MAX_TABLES:
        raise InvalidArgument(f"tables: {len(tables)} sparse tables; at most {MAX_TABLES}")
    names = [t.name for t in tables]
    for t in tables:
        if not t.name or names.count(t.name) > 1:
            raise InvalidArgument(f"tables: sparse table names must be unique and non-empty, got {names}")
        if not 1 <= t.dim <= MAX_ROW_DIM:
            raise InvalidArgument(f"tables: table '{t.name}' has dim {t.dim}; need 1 to {MAX_ROW_DIM}")
        try:
            t.check()
        except (ValueError, ConfigError) as e:
            raise InvalidArgument(f"tables: table '{t.name}': {e}") from None


def check_trained(trained: tuple[float, float], num_samples: int) -> None:
    """What a leased push says its batch's step measured (loss x samples, samples classed right)
    is summed into every worker's History: a count of right samples outside [0, num_samples] (NaN
    too) is no count, and the push is refused before anything changes. The loss is taken as it
    comes, NaN or infinite included: a run whose loss diverged shows it, as Keras does."""
    correct = trained[1]
    if not 0 <= correct <= num_samples:
        raise InvalidArgument(f"lease_correct: {correct} samples classed right in a batch of {num_samples}; "
                              f"send how many of the batch's samples the model classed right (0 to "
                              f"num_samples)")


def check_samples(num_samples: int) -> None:
    """A push's gradient is the mean over the samples it carries, and a sync or backup step
    weighs each push by them (docs/semantics.md): a gradient of no samples has no weight, and
    a negative count is no count. Every push carries a gradient (its range's values); one of 0
    samples is an empty contribution (a worker with no chunk of the data left this epoch): it counts
    toward its step and weighs nothing."""
    if num_samples < 0:
        raise InvalidArgument(f"num_samples: {num_samples} for a push; a gradient is the mean over its "
                              f"batch and a sync step weighs it by the batch's samples, so send the "
                              f"batch's size (0 for an empty contribution: a worker with no chunk left)")


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), or 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Shard:
    def __init__(self, cfg: ServerConfig, open_now: bool = True) -> None:
        self.cfg = cfg
        self.store = ShardStore(cfg.shard, cfg.num_shards, self._optimizer_for, cfg.table_threads)
        self.members = Membership(self.store, cfg, on_change=self._members_changed,
                                  on_takeover=self._taken_over)
        self.policy = make_policy(self.store, cfg, self.members)
        self.started = time.monotonic()
        self.dataplane = None          # a DataPlaneServer, when app.py starts one
        self.readiness = None          # the health service's state, when app.py serves one
        self.ended = threading.Event() # the chief ended the run (stop_after_checkpoint): serve() exits 0
        self.metrics = ShardMetrics()  # for --metrics-port; the counters are read when scraped
        self.metrics.watch(self)
        self.init_lock = threading.Lock()
        self.seeded_by = -1            # the rank whose Init supplied the values
        self.instance = secrets.token_hex(8)   # tells a restarted shard from the one before
        # --max-memory-mb bounds the state and the pushes in flight together: an explicit budget
        # keeps at most an eighth of itself for the bytes in flight (--max-inflight-mb) and a
        # sixteenth for what is copied for a moment (an index rehashed, a push's checks), the
        # rest for the state (pserver.server.budget).
        limit = cfg.max_memory_mb << 20 or int(0.9 * available_memory()) or (1 << 62)
        inflight = cfg.max_inflight_mb << 20
        if cfg.max_memory_mb:
            inflight = min(inflight, limit // 8)
        self.limits = Limits(pool_threads(cfg.threads, cfg.num_workers), inflight,
                             cfg.step_timeout, self.store.counters)
        if inflight < cfg.max_inflight_mb << 20:
            self.limits.inflight_flag = (f"--max-inflight-mb {cfg.max_inflight_mb} lowered to an eighth of "
                                         f"--max-memory-mb {cfg.max_memory_mb}")
        state = limit - (inflight + limit // 16 if cfg.max_memory_mb else 0)
        self.budget = Budget(state, self.store.counters, dense=lambda: self._dense_bytes(self.store.size),
                             fixed=lambda: self.store.coordinator.nbytes)
        # Sessions expire and idle streams are cancelled even when no call is waiting.
        threading.Thread(target=Shard._reap, args=(weakref.ref(self), min(1.0, cfg.step_timeout / 4)),
                         name="pserver-reaper", daemon=True).start()
        self.checkpointer = None
        if open_now:
            self.open()

    def _members_changed(self) -> None:
        """A worker left or was marked dead: its lease of the data ends (cond held)."""
        self.store.coordinator.release_all_but(self.members.live())
        self.policy.membership_changed()

    def _taken_over(self, rank: int) -> None:
        self.store.coordinator.release(rank)
        self.policy.forget(rank)

    def lease(self, rank: int, session: str | None, plan: Plan,
              finished: tuple[int, int] | None = None, restart: bool = False,
              done_before_restore=()) -> Lease | None:
        """rank's lease of the training data from shard 0's coordinator (pserver.server.coordinator):
        the one it holds, or, once `finished` (epoch, chunk) is done, the next; None when every
        chunk of the epoch is leased to others. A worker whose data differs (plan) is refused.
        `done_before_restore`: (epoch, chunk, end) the worker trained under the coordinator before
        this one was restored (it saw `coordinator.ident` change): counted in batches_retrained."""
        if self.cfg.shard != 0:
            raise FailedPrecondition(f"lease: the data coordinator is in shard 0, not shard {self.cfg.shard}")
        order = None
        with self.store.cond:
            self.members.authorize(rank, session)
            if plan != self.store.coordinator.plan:       # a new plan: its size first, in the budget
                plan.check()
                self._admit(plan)
        if plan != self.store.coordinator.plan:
            order = self.store.coordinator.prepared(plan, restart)   # built outside the lock
        with self.store.cond:
            self.members.authorize(rank, session)
            if plan != self.store.coordinator.plan:
                self._admit(plan)                         # again: the state may have grown meanwhile
            self.store.coordinator.configure(plan, restart, order)
            self.store.coordinator.done_before_restore(done_before_restore)
            lease = self.store.coordinator.lease(rank, self.members.sessions[rank], finished,
                                                 workers=len(self.members.live()))
            self.store.coordinator.told[rank] = self.store.coordinator.epoch
            return lease

    def epoch_logs(self, rank: int, session: str | None, epoch: int, share=None):
        """Keras on a cluster: the chief's logs of `epoch` for every worker's callbacks, through
        shard 0's coordinator. `share` (names, values, stop): the chief (rank 0) gives them.
        Returns (names, values, stop) or None before the chief gave them, whether the chief was
        told that epoch ended, and whether it is live."""
        if self.cfg.shard != 0:
            raise FailedPrecondition(f"epoch logs: the data coordinator is in shard 0, "
                                     f"not shard {self.cfg.shard}")
        with self.store.cond:
            self.members.authorize(rank, session)
            c = self.store.coordinator
            if share is not None:
                names, values, stop = share
                if rank != 0:
                    raise FailedPrecondition(f"epoch logs: only the chief (rank 0) gives them, "
                                             f"not rank {rank}")
                last = c.plan.epochs if c.plan else 0
                if len(names) != len(values) or len(names) > MAX_EPOCH_LOGS \
                        or any(len(n) > 100 for n in names) or not 0 <= epoch <= last:
                    raise InvalidArgument(f"epoch logs: {len(names)} names, {len(values)} values for epoch "
                                          f"{epoch}: give one value per name, at most {MAX_EPOCH_LOGS} names "
                                          f"of at most 100 characters, for an epoch of the run's plan")
                c.share_logs(epoch, names, values, stop)
            return c.shared.get(epoch), c.told.get(0, -1) > epoch, 0 in self.members.live()

    def _admit(self, plan: Plan) -> None:
        """A plan's coordinator state (Plan.nbytes) must fit in --max-memory-mb beside what the
        shard holds, in place of the plan it replaces: OverBudget naming its sizes before any of
        it is built (cond held)."""
        self.budget.admit(self.store.tables, plan.nbytes, self.store.coordinator.nbytes,
                          f"data: num_batches {plan.num_batches:,} in chunks of chunk_batches "
                          f"{plan.chunk_batches:,} ({plan.num_chunks:,} chunks)")

    def _check_lease(self, rank: int, lease: tuple[int, int, int]) -> None:
        """A push's data lease (epoch, chunk, batch) goes to the coordinator (cond held); one the
        rank no longer holds (released when it was marked dead, then the chunk went elsewhere) is
        refused with LeaseGone before the policy sees it. Other shards took the push in already
        when there are several: that batch counts in batches_retrained."""
        if self.store.coordinator.progress_of(rank, self.members.sessions[rank], *lease):
            return
        if self.cfg.num_shards > 1:
            self.store.coordinator.counters["batches_retrained"] += 1
        epoch, chunk, batch = lease
        raise LeaseGone(f"lease: worker {rank} no longer holds chunk {chunk} of epoch {epoch + 1} (its lease "
                        f"ended: the worker was marked dead, or shard 0 restored); batch {batch} was not "
                        f"taken in: drop the chunk and ask for another")

    def open(self) -> None:
        """Refuse another run's checkpoint directory (checkpoint_dir.check_start), restore (--restore)
        and start checkpointing: what the shard does before it accepts workers. app.py calls it
        once the port is open, so that health probes see the restore."""
        first = checkpoint_dir.check_start(self.cfg.checkpoint_dir, self.cfg.restore)   # another run: refused
        if first:
            log.info("shard %d: %s", self.cfg.shard, first)
        elif self.cfg.restore:
            self._restore(self.cfg.restore)
        where = checkpoint_dir.write_directory(self.cfg)
        self.checkpointer = checkpoint.Checkpointer(*where, self.store, self.cfg) if where else None

    def _restore(self, directory: str) -> None:
        point = reshard.restore_point(directory, self.cfg.shard, self.cfg.num_shards, self.cfg.mode,
                                      self.cfg.restore_fresh_if_corrupt)
        ckpt = point.ckpt
        if ckpt is None:
            log.info("shard %d: no checkpoint in %s; starting fresh", self.cfg.shard, directory)
            return
        if ckpt.optimizer != self.cfg.optimizer:
            raise ConfigError(f"--restore: {ckpt.path} was written with --optimizer {ckpt.optimizer}, "
                              f"this shard runs {self.cfg.optimizer}")
        self.store.restore(ckpt)
        used = self.budget.used(self.store.tables)
        if used > self.budget.limit:
            raise ConfigError(f"--restore: {ckpt.path} holds {used / 2**20:,.1f} MiB of state on shard "
                              f"{self.cfg.shard} and its budget is {self.budget.limit / 2**20:,.1f} MiB "
                              f"(--max-memory-mb, less what pushes in flight may take); raise it")
        log.info("shard %d: restored version %d from %s%s", self.cfg.shard, ckpt.version, ckpt.path,
                 f" (written by {point.resharded_from} shards, now {self.cfg.num_shards})"
                 if point.resharded_from else "")

    def checkpoint(self, rank: int | None = None, session: str | None = None) -> tuple[str, int]:
        """Write a checkpoint now, for the chief (rank) or for the shard itself (None, when it
        stops); ("", version) without a directory. Concurrent requests share one write."""
        if rank is not None:
            with self.store.cond:
                self.members.authorize(rank, session)
        if self.checkpointer is None or not self.store.initialized:
            return "", self.store.version
        return self.checkpointer.request()

    def stop_after_checkpoint(self, rank: int, session: str | None) -> tuple[str, int]:
        """The chief ends the run (worker --stop-shards, how `pserver slurm` ends its step):
        once every worker has left, checkpoint, then set `ended`, on which serve() exits 0."""
        with self.store.cond:
            self.members.authorize(rank, session)
            live = sorted(self.members.live())
        if rank != 0:
            raise FailedPrecondition(f"then_stop: only the chief (rank 0) ends the run, not rank {rank}")
        if live:
            raise FailedPrecondition(f"then_stop: worker(s) {live} are still training")
        result = self.checkpoint(rank, session)
        self.ended.set()
        return result

    def _optimizer_for(self, size: int):
        c = self.cfg
        return make_optimizer(c.optimizer, size, lr=c.lr, schedule=c.lr_schedule,
                              momentum=c.momentum, nesterov=c.nesterov, beta1=c.beta1,
                              beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay)

    def check_shard(self, shard: int, num_shards: int | None = None) -> None:
        if shard != self.cfg.shard or (num_shards is not None and num_shards != self.cfg.num_shards):
            told = f"shard {shard}" + (f" of {num_shards}" if num_shards is not None else "")
            raise FailedPrecondition(f"shard: the request is for {told} but this is shard "
                                     f"{self.cfg.shard} of {self.cfg.num_shards}")

    def register(self, rank: int, num_workers: int, shard: int, num_shards: int,
                 layout: Layout, protocol_version: int = PROTOCOL_VERSION, data_seed: int = 0,
                 steps_per_epoch: int = 0, previous_session: str = "",
                 auto_rank: bool = False) -> Registration:
        """Join `rank` (Membership.join); `previous_session`: the credential the worker held
        before it restarted, with which it takes its live session over at once. `auto_rank`
        (shard 0 only): `rank` is ignored and a free one assigned (Membership.assign_rank)."""
        if protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol_version: the worker speaks wire protocol {protocol_version} and this "
                f"shard speaks {PROTOCOL_VERSION}; run the same pserver release on both sides")
        self.check_shard(shard, num_shards)
        if num_workers < 1:
            raise InvalidArgument(f"num_workers: must be >= 1, got {num_workers}")
        total = checked_total(layout)
        checked_tables(layout.tables)
        start, end = shard_range(total, self.cfg.num_shards, self.cfg.shard)
        s = self.store
        with s.cond:
            # Everything that can refuse runs before anything changes: a refused Register
            # must not fix the layout or allocate.
            if auto_rank:
                if self.cfg.shard != 0:
                    raise FailedPrecondition(f"rank: only shard 0 assigns --rank auto; this is shard "
                                             f"{self.cfg.shard}")
                if not self.members.elastic():
                    raise FailedPrecondition(
                        f"rank: --rank auto joins a job that has room for more workers, and this one "
                        f"serves exactly {self.members.num_workers or num_workers}; start the shards "
                        f"with --max-workers")
                rank = self.members.assign_rank(previous_session)
            self.policy.check_join(rank, num_workers)
            self.members.check_join(rank, num_workers)
            if not s.signature:
                self._check_memory(end - start)
            s.configure(layout.signature(), total, start, end, layout.tables)
            session, took_over = self.members.join(rank, num_workers, previous_session)
            self.policy.registered(rank)
            return Registration(self.cfg.mode, s.version, s.initialized, s.start, s.end, s.total,
                                s.signature, self.cfg.optimizer, self.cfg.lr,
                                self.dataplane.address if self.dataplane else "", host_id(),
                                session, self.cfg.step_timeout, restored_from=s.restored_from,
                                seeded_by_rank=self.seeded_by,
                                position=s.position_of(rank, data_seed, steps_per_epoch),
                                settings=self.cfg.training_settings(self.members.num_workers),
                                instance=self.instance, took_over=took_over, assigned_rank=rank,
                                elastic_initial_workers=self.members.num_workers,
                                elastic_max_workers=self.members.rank_limit)

    def join_step(self, rank: int, step: int, session: str | None = None) -> tuple[int, int]:
        """An elastic worker counts from `step` (Policy.join_step); returns (the version now,
        the step it counts from)."""
        with self.store.cond:
            self.members.authorize(rank, session)
            return self.store.version, self.policy.join_step(rank, step)

    def _dense_bytes(self, size: int) -> int:
        """The dense range's bytes: parameters, optimizer state, one gradient (float32)."""
        return size * 4 * (2 + len(self._optimizer_for(0).state))

    def _check_memory(self, size: int) -> None:
        """RESOURCE_EXHAUSTED, before allocating, when the shard's range cannot fit."""
        need, limit = self._dense_bytes(size), self.budget.limit
        if need > limit:
            raise ResourceExhausted(
                f"layout: shard {self.cfg.shard}'s range of {size} elements needs {need >> 20} MiB "
                f"(parameters, {self.cfg.optimizer} state and one gradient, float32) and the limit "
                f"is {limit >> 20} MiB (--max-memory-mb; default 90% of available memory)")

    def heartbeat(self, rank: int, session: str | None = None) -> int:
        with self.store.cond:
            self.members.authorize(rank, session)
            return self.store.version

    @staticmethod
    def _reap(ref: weakref.ref, tick: float) -> None:
        """Expire silent sessions when they fall due (a little after --step-timeout of silence,
        not a tick later); every tick also cancel stalled streams and trim the heap. Holds the
        shard only weakly, so a Shard that is dropped (tests make many) takes its thread with it."""
        wait, next_tick = tick, time.monotonic() + tick
        while True:
            time.sleep(wait)
            shard = ref()
            if shard is None or shard.store.closed:
                return
            with shard.store.cond:
                due = shard.members.expire()
            now = time.monotonic()
            if now >= next_tick:
                shard.limits.cancel_idle()
                memory.trim()
                next_tick = now + tick
            del shard
            wait = next_tick - now if due is None else min(next_tick - now, due + EXPIRY_SLACK)
            wait = max(wait, EXPIRY_SLACK)

    def init(self, rank: int, signature: str, num_elements: int, dtype: str, fill: Fill,
             session: str | None = None) -> tuple[bool, int]:
        """Take the chief's initial values unless the shard already holds values.

        The values land straight in the (not yet initialized) parameters, so a 40 MB model
        costs no second 40 MB; a payload that fails validation leaves them zeroed and the
        shard still uninitialized. Inits take turns on their own lock, so a client that
        stalls mid-stream holds up other Inits, not pulls, pushes or Status."""
        s = self.store
        with s.cond:
            s.require_configured()
            self.members.authorize(rank, session)
            if signature != s.signature:
                raise FailedPrecondition(f"layout_signature: {signature} does not match {s.signature}")
            self._check_payload(num_elements, dtype)
        with self.init_lock:
            if s.initialized:                 # checked again: another Init may have won
                return True, s.version
            try:
                s.fill(fill, s.params)
            except BaseException:
                s.params[:] = 0
                raise
            with s.cond:
                s.version = 0
                self.seeded_by = rank
                s.cond.notify_all()
            return False, s.version

    def _check_payload(self, num_elements: int, dtype: str) -> None:
        if dtype != DTYPE_NAME:
            raise InvalidArgument(f"dtype: '{dtype}' is not supported; send '{DTYPE_NAME}'")
        if num_elements != self.store.size:
            raise InvalidArgument(f"num_elements: {num_elements} does not match shard "
                                  f"{self.cfg.shard}'s range of {self.store.size} elements")

    def table(self, name: str) -> sparse.SparseTable:
        table = self.store.tables.get(name)
        if table is None:
            have = ", ".join(self.store.tables) or "none"
            raise InvalidArgument(f"table: the model has no sparse table '{name}' (its tables: {have})")
        return table

    def check_ids(self, ids: np.ndarray, what: str) -> None:
        """Every id must live on this shard: a client that hashed wrongly would otherwise
        create rows that no other worker ever reads."""
        i = sparse.first_foreign(ids, self.cfg.num_shards, self.cfg.shard)
        if i >= 0:
            owner = int(sparse.shard_of(ids[i:i + 1], self.cfg.num_shards)[0])
            raise InvalidArgument(f"{what}: id {ids[i]} (element {i}) lives on shard {owner}, not on "
                                  f"shard {self.cfg.shard} (pserver.sparse.shard_of)")

    def pull_rows(self, rank: int, shard: int, table: str, ids: np.ndarray,
                  session: str | None = None, out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """(version, rows) of one sparse table for `ids` (uint64): stored rows, or their
        initial values, written into `out` when given (the data plane's buffer: no copy).
        No wait: a worker calls it after the pull that waited."""
        t, version = self._table_for(rank, shard, table, session)
        self.check_ids(ids, "ids")
        rows = np.empty((ids.size, t.config.dim), dtype=np.float32) if out is None else out
        t.lookup(ids, rows)
        self.store.counters.add("rows_pulled", ids.size)
        return version, rows

    def _table_for(self, rank: int, shard: int, table: str, session: str | None):
        """(table, version) for a worker's read of a table's rows: this shard, configured, the
        session authorized (a worker marked dead rejoins)."""
        self.check_shard(shard)
        with self.store.cond:
            self.store.require_configured()
            self.members.authorize(rank, session, revive=True)
            return self.table(table), self.store.version

    def export_rows(self, rank: int, shard: int, table: str, session: str | None = None,
                    page_bytes: int | None = None):
        """(version, total, pages): every row `table` holds, as pages of (ascending ids, rows)
        of at most about `page_bytes` (--chunk-bytes), read page by page (8 bytes a row are
        copied up front: the ids, sorted). Authorized as pull_rows. A row evicted while the
        pages are read reads its initial value; one pushed to meanwhile, its value then."""
        t, version = self._table_for(rank, shard, table, session)
        ids = t.sorted_ids()
        per_page = max(1, (page_bytes or self.cfg.chunk_bytes) // (8 + 4 * t.config.dim))

        def pages():
            for a in range(0, ids.shape[0], per_page):
                page = ids[a:a + per_page]
                rows = np.empty((page.shape[0], t.config.dim), dtype=np.float32)
                t.lookup(page, rows)
                self.store.counters.add("rows_pulled", page.shape[0])
                yield page, rows
        return version, int(ids.shape[0]), pages()

    def row_buffers(self, parts: list[tuple[str, int]]) -> list[RowGrads]:
        """Shard-owned arrays for a push's sparse parts [(table, number of ids)], checked
        before a byte of them is received."""
        out, nbytes = [], 0
        for name, n in parts:
            t = self.table(name)
            if n < 0:
                raise InvalidArgument(f"num_ids: must be >= 0, got {n} for table '{name}'")
            nbytes += n * (8 + 4 * t.config.dim)
            if nbytes > self.limits.max_inflight_bytes:
                raise OverBudget(f"sparse: the push's rows need more than {nbytes >> 20} MiB and "
                                        f"one push may carry {self.limits.max_inflight_bytes >> 20} MiB "
                                        f"({self.limits.inflight_flag})")
            out.append(RowGrads(name, np.empty(n, np.uint64), np.empty((n, t.config.dim), np.float32)))
        return out

    def check_rows(self, rows: list[RowGrads]) -> None:
        """What a sparse push must be before anything is applied: ids unique, on this shard,
        one part per table, gradients finite."""
        seen = set()
        for p in rows:
            if p.table in seen:
                raise InvalidArgument(f"sparse: table '{p.table}' appears twice in one push; send "
                                      f"each table's rows once")
            seen.add(p.table)
            self.check_ids(p.ids, f"sparse '{p.table}'")
            if sparse.first_repeat(p.ids) >= 0:
                raise InvalidArgument(f"sparse '{p.table}': ids repeat within the push; sum the "
                                      f"gradients of each id and send it once")
            bad = first_nonfinite(p.grads.reshape(-1))
            if bad >= 0:
                row, col = divmod(bad, p.grads.shape[1])
                raise InvalidArgument(f"sparse '{p.table}': the gradient of id {p.ids[row]} holds a "
                                      f"non-finite value ({p.grads[row, col]}) at column {col}")

    def pull(self, rank: int, shard: int, seen_version: int, clock: int,
             timeout: float | None, session: str | None = None,
             alive: Callable[[], bool] | None = None) -> tuple[int, np.ndarray, bool]:
        """Wait as the mode says, then return (version, parameters, finished). In sync mode the
        parameters cannot change until this worker pushes again, so a view is safe to
        stream; in async modes a racy read is the point. `alive` says whether the caller is
        still there: a pull whose client went away stops waiting (and a waiting pull keeps
        its worker's session live)."""
        self.check_shard(shard)
        s = self.store
        with s.cond:
            s.require_configured()
            self.members.authorize(rank, session, revive=True)
            self.policy.check_pull(seen_version)

        def still_there() -> bool:
            self.members.touch(rank)
            return alive is None or alive()

        with self.limits.waiting(rank, still_there) as waiter, s.cond:
            with self.metrics.pull_wait.time():
                self.policy.wait_pull(rank, seen_version, clock, timeout, waiter=waiter)
            s.counters.add("pulls_served")
            self.metrics.sent.inc(s.params.nbytes)
            return s.version, s.params, self.policy.finished

    def push(self, req: PushRequest) -> tuple[Outcome, int, str, bool]:
        """Receive, validate, and hand a gradient to the policy; state is untouched by any
        rejection because everything is checked before the policy sees the gradient. `req.rows`:
        the push's sparse parts, in arrays from row_buffers that `req.fill` fills with the
        dense gradient (or already filled, when fill is an array)."""
        s = self.store
        s.counters.add("pushes_received")
        try:
            self.check_shard(req.shard)
            check_samples(req.num_samples)   # before authorize, which may revive the rank
            if req.lease is not None:
                check_trained(req.trained, req.num_samples)
            with s.cond:
                s.require_configured()
                self.members.authorize(req.rank, req.session, revive=True)
                if req.lease is not None and self.cfg.shard == 0:
                    self._check_lease(req.rank, req.lease)
            self._check_payload(req.num_elements, req.dtype)
            self.metrics.received.inc(req.num_elements * 4)      # float32, checked above
            outcome, message = self._receive_and_decide(req)
            if req.lease is not None and self.cfg.shard == 0:
                with s.cond:
                    if outcome is Outcome.DROPPED_LATE:
                        s.coordinator.dropped()      # its batch counts as done: the worker moved on
                    else:                            # taken: what its step measured counts in the epoch's
                        s.coordinator.tally(req.lease[0], *req.trained, req.num_samples)
        except RpcError as e:
            s.counters.add("pushes_rejected")
            self.metrics.rejected.labels(e.code_name.lower()).inc()
            raise
        if self.checkpointer is not None:
            self.checkpointer.maybe()
        return outcome, s.version, message, self.policy.finished

    def _receive_and_decide(self, req: PushRequest) -> tuple[Outcome, str]:
        grad = self.store.pool.acquire()
        try:
            self.store.fill(req.fill, grad)
            self.check_rows(req.rows)
            # room for its new rows and the rows it holds until its step applies, or refused
            held = self.budget.reserve(self.store.tables, req.rows, self.policy.held_row_bytes(req.rows))
        except BaseException:
            self.store.pool.release(grad)
            raise
        try:
            outcome = self.policy.push(req, grad)
        except RpcError:
            self.store.pool.release(grad)   # rejected: the policy did not keep it
            self.budget.release(held)
            raise
        self.budget.hold(req.step, held, req.rows)   # until its step is applied (now, in async modes)
        self.budget.settle(self.store.version)
        return outcome

    def leave(self, rank: int, session: str | None = None) -> None:
        with self.store.cond:
            self.members.authorize(rank, session)
            self.members.leave(rank)

    def status(self) -> dict:
        s, p = self.store, self.members
        with s.cond:
            live = sorted(p.live())
            dead = sorted(p.dead)
            return dict(shard=self.cfg.shard, num_shards=self.cfg.num_shards, mode=self.cfg.mode,
                        version=s.version, num_params=s.size, total_params=s.total,
                        num_workers=p.num_workers, optimizer=self.cfg.optimizer, lr=self.cfg.lr,
                        counters={**s.counters.snapshot(), **s.coordinator.counters},
                        live_workers=live, dead_workers=dead, registered_workers=sorted(p.registered),
                        uptime_seconds=time.monotonic() - self.started,
                        layout_signature=s.signature, restored_from=s.restored_from,
                        seeded_by_rank=self.seeded_by, instance=self.instance,
                        settings=self.cfg.training_settings(p.num_workers),
                        tables=[dict(name=n, dim=t.config.dim, optimizer=t.config.optimizer, **t.stats())
                                for n, t in s.tables.items()],
                        memory=self.budget.report(s.tables))

    def close(self) -> None:
        if self.readiness is not None:
            self.readiness.stopping()  # NOT_SERVING first: probes see the shutdown begin
        self.store.close()
        if self.dataplane is not None:
            self.dataplane.close()
