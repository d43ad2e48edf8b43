"""A shard's operations as plain Python calls: what the servicer exposes over gRPC.

`Shard` composes its parts: the store (state), the workers' sessions (membership), the mode's
policy (when updates happen), the optimizer (how), the memory budget and the serving limits,
shard 0's data leases (leases), the request checks (checks) and the reaper. An operation checks
its request, authorizes it and calls the parts, in an order that refuses before anything changes.
It takes and returns numpy arrays and plain values, so tests drive it without a network, and
the servicer only translates protobuf to these calls.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from typing import Callable

import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver.config import ServerConfig
from pserver.errors import ConfigError, FailedPrecondition, InvalidArgument, RpcError
from pserver.models.layout import Layout
from pserver.modes import Outcome, make_policy
from pserver.observe.telemetry import ShardMetrics
from pserver.optim import make_optimizer
from pserver.persist import checkpoint_dir, reshard
from pserver.records import PushRequest, Registration
from pserver.server import budget, checkpoint, checks, reaper
from pserver.server.budget import Budget
from pserver.server.coordinator import EpochSums, Lease, Plan
from pserver.server.leases import Leases
from pserver.server.limits import Limits, pool_threads
from pserver.server.membership import Membership
from pserver.server.store import ShardStore
from pserver.sparse import RowGrads
from pserver.wire.codec import PROTOCOL_VERSION
from pserver.wire.frames import host_id
from pserver.wire.sharding import shard_range

log = logging.getLogger("pserver.server")
# How a push's payload arrives: a function that writes it into the array it is given (the
# gRPC stream, copied into a pool buffer), or an array that its client can still write (a
# data-plane connection's shared buffer), which the shard copies and checks in one pass.
Fill = Callable[[np.ndarray], None] | np.ndarray


class Shard:
    def __init__(self, cfg: ServerConfig, open_now: bool = True) -> None:
        self.cfg = cfg
        self.store = ShardStore(cfg.shard, cfg.num_shards, self._optimizer_for, cfg.table_threads)
        self.members = Membership(self.store, cfg, on_change=self._members_changed,
                                  on_takeover=self._taken_over, on_new_job=lambda: self.policy.begin_again())
        self.policy = make_policy(self.store, cfg, self.members)
        self.started = time.monotonic()
        self.dataplane = None          # a DataPlaneServer, when app.py starts one
        self.readiness = None          # the health service's state, when app.py serves one
        self.ended = threading.Event() # the chief ended the run (stop_after_checkpoint): serve() exits 0
        self.metrics = ShardMetrics()  # for --metrics-port; the counters are read when scraped
        self.metrics.watch(self)
        self.instance = secrets.token_hex(8)   # tells a restarted shard from the one before
        # --max-memory-mb bounds the state (Budget) and the pushes in flight (Limits) together
        split = budget.split(cfg.max_memory_mb, cfg.max_inflight_mb)
        self.limits = Limits(pool_threads(cfg.threads, cfg.num_workers), split.inflight,
                             cfg.step_timeout, self.store.counters, split.inflight_flag)
        store = self.store
        self.budget = Budget(split.state, store.counters, size=lambda: store.size,
                             slots=len(self._optimizer_for(0).state), fixed=lambda: store.coordinator.nbytes)
        self.leases = Leases(cfg, store, self.members, self.budget)
        reaper.start(self, min(1.0, cfg.step_timeout / 4))
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
              done_before_restore=()) -> tuple[Lease | None, bool]:
        """(lease, gone): rank's lease of the training data from shard 0's coordinator
        (pserver.server.leases): the one it holds, or, once `finished` (epoch, chunk) is done, the
        next; None when every chunk of the epoch is leased to others. `gone`: the chunk reported
        finished was no longer rank's (its lease ended: marked dead meanwhile), so it is trained
        again by whoever leases it. A worker whose data differs (plan) is refused.
        `done_before_restore`: (epoch, chunk, end) the worker trained under the coordinator before
        this one was restored (it saw `coordinator.ident` change): counted in batches_retrained."""
        return self.leases.lease(rank, session, plan, finished, restart, done_before_restore)

    def epoch_sums(self, epoch: int | None = None) -> EpochSums:
        """What a lease reply tells with the lease: the epoch open, the coordinator's ident and
        the sums of the epoch before it (of `epoch`, finished: an epoch_logs request's)."""
        return self.leases.epoch_sums(epoch)

    def answer_lease(self, r: pb.LeaseDataRequest) -> pb.LeaseDataReply:
        """A LeaseData request's reply, over gRPC or the data plane: a lease of the training data
        (lease), or, Keras on a cluster, the chief's epoch logs (epoch_logs), with the open epoch
        and the sums epoch_sums gives."""
        if r.epoch_logs:                   # Keras on a cluster: the chief's epoch logs, no lease
            share = (list(r.log_names), list(r.log_values), r.stop_training) if r.share_logs else None
            logs, told, live = self.epoch_logs(r.rank, r.session, r.logs_epoch, share)
            reply = _lease_reply(self.epoch_sums(r.logs_epoch), chief_told=told, chief_live=live)
            if logs is not None:
                reply.has_logs = True
                reply.log_names.extend(logs[0])
                reply.log_values.extend(logs[1])
                reply.stop_training = logs[2]
            return reply
        plan = Plan(r.num_batches, r.chunk_batches, r.seed, r.fingerprint, r.epochs, r.in_order)
        finished = (r.finished_epoch, r.finished_chunk) if r.finished else None
        lease, gone = self.lease(r.rank, r.session, plan, finished, r.restart,
                                 [(d.epoch, d.chunk, d.end) for d in r.done_before_restore])
        sums = self.epoch_sums()
        reply = _lease_reply(sums, coordinator_id=sums.ident, finished_gone=gone)
        if lease is not None:
            reply.has_lease, reply.epoch, reply.chunk = True, lease.epoch, lease.chunk
            reply.first_batch, reply.end_batch = lease.first, lease.end
        return reply

    def epoch_logs(self, rank: int, session: str | None, epoch: int, share=None):
        """Keras on a cluster: the chief's logs of `epoch` for every worker's callbacks, through
        shard 0's coordinator. `share` (names, values, stop): the chief (rank 0) gives them.
        Returns (names, values, stop) or None before the chief gave them, whether the chief was
        told that epoch ended, and whether it is live."""
        return self.leases.epoch_logs(rank, session, epoch, share)

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
        return make_optimizer(self.cfg.optimizer, size, **self.cfg.optimizer_args())

    def register(self, rank: int, num_workers: int, shard: int, num_shards: int,
                 layout: Layout, protocol_version: int = PROTOCOL_VERSION, data_seed: int = 0,
                 steps_per_epoch: int = 0, previous_session: str = "",
                 auto_rank: bool = False) -> Registration:
        """Join `rank` (Membership.join); `previous_session`: the credential the worker held
        before it restarted, with which it takes its live session over at once. `auto_rank`
        (shard 0 only): `rank` is ignored and a free one assigned (Membership.assign_rank)."""
        checks.check_protocol(protocol_version)
        checks.check_shard(self.cfg, shard, num_shards)
        total = checks.checked_registration(num_workers, layout)
        start, end = shard_range(total, self.cfg.num_shards, self.cfg.shard)
        s = self.store
        with s.cond:
            # Everything that can refuse runs before anything changes: a refused Register
            # must not fix the layout or allocate.
            if auto_rank:
                rank = self.members.assign_rank(num_workers, previous_session)
            self.policy.check_join(rank, num_workers)
            self.members.check_join(rank, num_workers)
            if not s.signature:
                self.budget.check_range(end - start, self.cfg.shard, self.cfg.optimizer)
            s.configure(layout.signature(), total, start, end, layout.tables)
            s.freeze(layout.frozen_ranges(), layout.statistics_pairs())
            session, took_over = self.members.join(rank, num_workers, previous_session)
            self.policy.registered(rank)
            return Registration(self.cfg.mode, s.version, s.initialized, s.start, s.end, s.total,
                                s.signature, self.cfg.optimizer, self.cfg.lr,
                                self.dataplane.address if self.dataplane else "", host_id(),
                                session, self.cfg.step_timeout, restored_from=s.restored_from,
                                seeded_by_rank=s.seeded_by,
                                position=s.position_of(rank, data_seed, steps_per_epoch),
                                settings=self.settings(self.members.num_workers),
                                instance=self.instance, took_over=took_over, assigned_rank=rank,
                                elastic_initial_workers=self.members.num_workers,
                                elastic_max_workers=self.members.rank_limit)

    def join_step(self, rank: int, step: int, session: str | None = None) -> tuple[int, int]:
        """An elastic worker counts from `step` (Policy.join_step); returns (the version now,
        the step it counts from)."""
        with self.store.cond:
            self.members.authorize(rank, session)
            return self.store.version, self.policy.join_step(rank, step)

    def heartbeat(self, rank: int, session: str | None = None) -> int:
        with self.store.cond:
            self.members.authorize(rank, session)
            return self.store.version

    def init(self, rank: int, signature: str, num_elements: int, dtype: str, fill: Fill,
             session: str | None = None) -> tuple[bool, int]:
        """Take the chief's initial values unless the shard already holds values
        (ShardStore.seed): (whether it did, the version)."""
        s = self.store
        with s.cond:
            s.require_configured()
            self.members.authorize(rank, session)
            if signature != s.signature:
                raise FailedPrecondition(f"layout_signature: {signature} does not match {s.signature}")
            checks.check_payload(self.cfg, s.size, num_elements, dtype)
        return s.seed(fill, rank)

    @property
    def payload_bytes(self) -> int:
        """A dense payload's bytes (an Init's values, a push's gradient: the range, float32)."""
        return self.store.size * 4

    def table_dims(self) -> list[tuple[str, int]]:
        """(name, dim) of the model's sparse tables, in the order the data plane numbers them."""
        return [(name, t.config.dim) for name, t in self.store.tables.items()]

    def pull_rows(self, rank: int, shard: int, table: str, ids: np.ndarray,
                  session: str | None = None, out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """(version, rows) of one sparse table for `ids` (uint64): stored rows, or their
        initial values, written into `out` when given (the data plane's buffer: no copy).
        No wait: a worker calls it after the pull that waited."""
        t, version = self._table_for(rank, shard, table, session)
        checks.check_ids(self.cfg, ids, "ids")
        rows = np.empty((ids.size, t.config.dim), dtype=np.float32) if out is None else out
        t.lookup(ids, rows)
        self.store.counters.add("rows_pulled", ids.size)
        return version, rows

    def _table_for(self, rank: int, shard: int, table: str, session: str | None):
        """(table, version) for a worker's read of a table's rows: this shard, configured, the
        session authorized (a worker marked dead rejoins)."""
        checks.check_shard(self.cfg, shard)
        with self.store.cond:
            self.store.require_configured()
            self.members.authorize(rank, session, revive=True)
            return checks.table(self.store.tables, table), self.store.version

    def export_rows(self, rank: int, shard: int, table: str, session: str | None = None,
                    page_bytes: int | None = None):
        """(version, total, pages): every row `table` holds, as pages of (ascending ids, rows)
        of at most about `page_bytes` (--chunk-bytes), read page by page (8 bytes a row are
        copied up front: the ids, sorted); an empty table gives one empty page, which says its
        dim. Authorized as pull_rows. A row evicted while the pages are read reads its initial
        value; one pushed to meanwhile, its value then."""
        t, version = self._table_for(rank, shard, table, session)
        ids = t.sorted_ids()
        per_page = max(1, (page_bytes or self.cfg.chunk_bytes) // (8 + 4 * t.config.dim))

        def pages():
            for a in range(0, max(ids.shape[0], 1), per_page):
                page = ids[a:a + per_page]
                rows = np.empty((page.shape[0], t.config.dim), dtype=np.float32)
                t.lookup(page, rows)
                self.store.counters.add("rows_pulled", page.shape[0])
                yield page, rows
        return version, int(ids.shape[0]), pages()

    def row_buffers(self, parts: list[tuple[str, int]]) -> list[RowGrads]:
        """Shard-owned arrays for a push's sparse parts [(table, number of ids)], checked
        before a byte of them is received (checks.row_buffers)."""
        return checks.row_buffers(self.store.tables, parts, self.limits.max_inflight_bytes,
                                  self.limits.inflight_flag)

    def pull(self, rank: int, shard: int, seen_version: int, clock: int,
             timeout: float | None, session: str | None = None,
             alive: Callable[[], bool] | None = None) -> tuple[int, np.ndarray, bool]:
        """Wait as the mode says, then return (version, parameters, finished). In sync mode the
        parameters cannot change until this worker pushes again, so a view is safe to
        stream; in async modes a racy read is the point. `alive` says whether the caller is
        still there: a pull whose client went away stops waiting (and a waiting pull keeps
        its worker's session live)."""
        checks.check_shard(self.cfg, shard)
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
            checks.check_shard(self.cfg, req.shard)
            checks.check_samples(req.num_samples)   # before authorize, which may revive the rank
            if req.lease is not None:
                checks.check_trained(req.trained, req.num_samples)
            with s.cond:
                s.require_configured()
                self.members.authorize(req.rank, req.session, revive=True)
                self.leases.check_push(req)
            checks.check_payload(self.cfg, s.size, req.num_elements, req.dtype)
            checks.check_statistics(s.moving.away, req.statistics)
            self.metrics.received.inc(req.num_elements * 4)      # float32, checked above
            outcome, message = self._receive_and_decide(req)
            self.leases.took(req, outcome)
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
            checks.check_rows(self.cfg, req.rows)
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

    def set_lr(self, rank: int, session: str | None, lr: float) -> tuple[int, float]:
        """The chief's new base learning rate (a Keras callback's), from the next update on:
        (the version it follows, the rate before). Kept in checkpoints (ShardStore.lr_set)."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise InvalidArgument(f"lr: the learning rate must be a finite number > 0, got {lr!r}")
        with self.store.cond:
            self.members.authorize(rank, session)
            if rank != 0:
                raise FailedPrecondition(f"lr: worker {rank} is not the chief; the chief (rank 0) "
                                         "changes the learning rate")
            self.store.require_configured()
            before = self.store.optimizer.lr
            self.store.set_lr(float(lr))
            log.info("shard %d: learning rate %g -> %g from version %d on (the chief's)",
                     self.cfg.shard, before, lr, self.store.version + 1)
            return self.store.version, before

    def assign(self, rank: int, expected: int, num_elements: int, dtype: str, fill: Fill,
               session: str | None = None) -> int:
        """The chief's replacement of this shard's dense values at the end of a Keras fit
        (EarlyStopping(restore_best_weights=True): the best epoch's weights), fenced: refused from
        another worker, while another worker is live (its push could land on either side), or
        once the version moved past `expected` (ShardStore.assign). The version after it."""
        s = self.store
        with s.cond:
            s.require_configured()
            self.members.authorize(rank, session)
            if rank != 0:
                raise FailedPrecondition(f"weights: worker {rank} is not the chief; the chief (rank 0) "
                                         "assigns the weights")
            others = sorted(self.members.live() - {rank})
            if others:
                raise FailedPrecondition(f"weights: worker(s) {others} still live on shard {self.cfg.shard}: "
                                         "the chief assigns the weights once every other worker left")
            checks.check_payload(self.cfg, s.size, num_elements, dtype)
        version = s.assign(fill, expected)
        log.info("shard %d: weights assigned by the chief at version %d", self.cfg.shard, version)
        return version

    def lr(self) -> float:
        """The base learning rate now: --lr, or the chief's last change."""
        return self.cfg.lr if self.store.lr_set is None else self.store.lr_set

    def settings(self, num_workers: int) -> dict:
        """The training settings a worker sees at Register and in status: the configured ones,
        with the learning rate as it is now."""
        return self.cfg.training_settings(num_workers) | {"lr": self.lr()}

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
                        num_workers=p.num_workers, optimizer=self.cfg.optimizer, lr=self.lr(),
                        counters={**s.counters.snapshot(), **s.coordinator.counters},
                        live_workers=live, dead_workers=dead, registered_workers=sorted(p.registered),
                        uptime_seconds=time.monotonic() - self.started,
                        layout_signature=s.signature, restored_from=s.restored_from,
                        seeded_by_rank=s.seeded_by, instance=self.instance,
                        settings=self.settings(p.num_workers),
                        assigned_version=s.assigned_version,
                        tables=[dict(name=n, dim=t.config.dim, optimizer=t.config.optimizer, **t.stats())
                                for n, t in s.tables.items()],
                        memory=self.budget.report(s.tables))

    def close(self) -> None:
        if self.readiness is not None:
            self.readiness.stopping()  # NOT_SERVING first: probes see the shutdown begin
        self.store.close()
        if self.dataplane is not None:
            self.dataplane.close()


def _lease_reply(sums: EpochSums, **fields) -> pb.LeaseDataReply:
    """A LeaseData reply with the open epoch and the sums (Shard.epoch_sums) it carries, and `fields`."""
    return pb.LeaseDataReply(epoch=sums.epoch, trained_loss_sum=sums.loss_sum, trained_correct=sums.correct,
                             trained_samples=sums.samples, trained_metric_sums=sums.metric_sums, **fields)
