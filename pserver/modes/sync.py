"""sync: one update per step, the rank-ordered, sample-weighted mean of every live worker's gradient.

w(t+1) = opt(w(t), sum(n_i g_i) / sum(n_i) over the pushes for step t), n_i the samples push
i carries, summed in rank order so the result does not depend on arrival order: N workers on
batches b1..bN of any sizes give the weights one process would get on their concatenation
(equal batches: the sum times 1/N, as unweighted). A sparse row's denominator is the step's
samples, touched or not (ShardStore.apply). A push for any step but t is rejected; a pull
waits until the version after the one the worker has seen exists.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from pserver.config import notice_every
from pserver.errors import AlreadyPushed, StaleStep
from pserver.modes.base import Outcome, Policy, StepWatch
from pserver.sparse.merge import merge_bytes

log = logging.getLogger("pserver.modes")


class SyncPolicy(Policy):
    name = "sync"

    def __init__(self, store, cfg, members) -> None:
        super().__init__(store, cfg, members)
        self.pending: dict[int, np.ndarray] = {}   # rank -> gradient for the current step
        self.pending_samples: dict[int, int] = {}  # rank -> samples behind that gradient
        self.pending_rows: dict[int, list] = {}    # rank -> its sparse rows for the step
        self.pending_clocks: dict[int, int] = {}   # rank -> its own step count for that push
        self.pending_stats: dict[int, object] = {}  # rank -> its statistics carried apart (PushRequest)
        self.watch = StepWatch(cfg.step_timeout)
        self.below_min_told, self.notice_every = -math.inf, notice_every()

    def below_min(self) -> bool:
        """Fewer members than --min-workers, live or left (Membership.toward_minimum): steps wait
        (never when it is not set)."""
        return bool(self.cfg.min_workers) and self.members.toward_minimum() < self.cfg.min_workers

    def join_step(self, rank, step):
        self.members.check_member(rank)
        member_from = self.members.join_step(rank, step, fixed=not self.below_min())
        self.maybe_complete()
        return member_from

    def quorum(self) -> int:
        """How many distinct workers complete a step: all the live ones. A worker that
        pushed for this step and then left still counts, or its pending gradient would
        stand in for a live worker's missing one."""
        return len(self.members.expected() | self.pending.keys())

    def held_row_bytes(self, rows) -> int:
        """A push's rows wait in pending_rows for the step, then go through its merge: both count
        in the memory budget from arrival until the step applies (Budget.reserve, settle)."""
        return sum(p.ids.nbytes + p.grads.nbytes + merge_bytes(p) for p in rows)

    def push(self, req, grad):
        rank, step, clock = req.rank, req.step, req.clock
        with self.store.cond:
            self.members.check_session(rank, req.session)   # not taken over while it streamed in
            version = self.store.version
            if self.finished:
                return self.drop(rank, clock, grad, "the run is over on this shard")
            if step != version:
                return self.off_step(rank, step, clock, grad)
            if self.members.join_at.get(rank, 0) > step or (
                    rank >= self.members.num_workers and rank not in self.members.join_at):
                raise StaleStep(f"step: worker {rank} is a member from step "
                                f"{self.members.join_at.get(rank, 'it proposes (ElasticJoinStep)')}, "
                                f"not {step}; it pulls until then")
            if rank in self.pending:
                raise AlreadyPushed(f"rank: worker {rank} already pushed for step {step}")
            self.members.revive(rank, "pushed in time")   # marked dead while its push was arriving
            self.pending[rank] = grad
            self.pending_samples[rank] = req.num_samples
            self.pending_rows[rank] = list(req.rows)
            self.pending_clocks[rank] = clock
            self.pending_stats[rank] = req.statistics
            self.store.counters.add("pushes_aggregated")
            self.maybe_complete()
            return Outcome.AGGREGATED, ""

    def drop(self, rank, clock, grad, why: str):
        self.store.pool.release(grad)
        self.store.took(rank, clock)           # its batch is consumed all the same
        self.store.counters.add("pushes_dropped_late")
        return Outcome.DROPPED_LATE, why

    def off_step(self, rank, step, clock, grad):
        raise StaleStep(f"step: push for step {step} but shard {self.store.shard} is at "
                        f"version {self.store.version}; pull and compute again")

    def maybe_complete(self) -> None:
        if self.pending and len(self.pending) >= max(self.quorum(), 1) and not self.below_min():
            self.complete()
        self.skip_to_joiners()
        self.time_step()

    def time_step(self) -> None:
        """A step's --step-timeout counts from when it can go on: from its first push, once it is
        not below --min-workers (a step that waited below it starts counting when a joiner, or a
        worker back from the dead, lifts it there; before, no member is late)."""
        if self.pending and not self.below_min():
            self.watch.start()
        else:
            self.watch.reset()

    def skip_to_joiners(self) -> None:
        """Steps with no member at all (every member left or died) while a joiner waits for a
        later step: each passes empty (the version advances, nothing is applied), the same on
        every shard, so that the joiner is not left waiting for steps nobody will push."""
        m = self.members
        while not self.pending and not m.expected() and not self.below_min():
            waiting = [j for j in m.join_at.values() if j > self.store.version]
            if not waiting or self.store.version < 0:
                return
            self.store.advance_empty()

    def complete(self) -> None:
        """Apply the pending gradients' mean, each weighted by the samples its push carried,
        summed in rank order (ShardStore.apply); cond held."""
        ranks = sorted(self.pending)
        counts = [self.pending_samples.pop(r) for r in ranks]
        rows = [(p, n) for r, n in zip(ranks, counts) for p in self.pending_rows.pop(r)]
        # A member with no data left pushes an empty contribution (0 samples): it counted toward
        # the step's quorum above and weighs nothing here; a step of empty ones only advances.
        weighed = [i for i, n in enumerate(counts) if n > 0]
        stats = [self.pending_stats.pop(r) for r in ranks]
        if weighed:
            self.store.apply([self.pending[ranks[i]] for i in weighed], [counts[i] for i in weighed],
                             [(p, n) for p, n in rows if n > 0],
                             [stats[i] for i in weighed])
        else:
            self.store.advance_empty()
        self.store.counters.add("samples_pushed", sum(counts))
        for r in ranks:
            self.store.pool.release(self.pending.pop(r))
            self.store.took(r, self.pending_clocks.pop(r))
        self.watch.reset()

    def membership_changed(self) -> None:
        self.maybe_complete()

    def forget(self, rank: int) -> None:
        if rank not in self.pending:
            return
        self.store.pool.release(self.pending.pop(rank))
        self.pending_samples.pop(rank)
        self.pending_rows.pop(rank)
        self.pending_clocks.pop(rank)          # not took(): its batch counts as not trained
        self.pending_stats.pop(rank)
        self.store.counters.add("pushes_aggregated", -1)
        self.time_step()

    def check_timeout(self) -> None:
        """Runs while pulls wait: a step that waited too long goes on without the missing."""
        self.time_step()
        if self.below_min():
            now = time.monotonic()
            if now - self.below_min_told >= self.notice_every:
                self.below_min_told = now
                log.warning("shard %d: step %d waits: %d member(s) live or finished, below "
                            "--min-workers=%d", self.store.shard, self.store.version,
                            self.members.toward_minimum(),
                            self.cfg.min_workers)
            return
        if self.watch.expired():
            missing = self.members.expected() - set(self.pending)
            self.members.mark_dead(missing, f"step {self.store.version} waited more than "
                                    f"{self.cfg.step_timeout:g} s (--step-timeout)")
            self.maybe_complete()

    def wait_pull(self, rank, seen_version, clock, timeout, waiter=None):
        store = self.store
        store.wait_for(lambda: (store.initialized and store.version > seen_version) or self.finished,
                       timeout, on_tick=self.check_timeout, waiter=waiter)
