"""Shard 0's data leases: the coordinator (pserver.server.coordinator) behind the shard's lock,
its sessions (Membership) and its memory budget.

The coordinator is pure logic over one run's plan; this is what a shard does around it: a
request is authorized first, a new plan's size is admitted in --max-memory-mb before anything
of it is built (its first chunk order is drawn outside the lock), a leased push is checked
against the lease before the mode sees it and counted in its epoch once taken, and the chief's
epoch logs are passed on to every worker. Every shard has one; only shard 0 leases.
"""

from __future__ import annotations

from pserver.config import ServerConfig
from pserver.errors import FailedPrecondition, LeaseGone
from pserver.modes import Outcome
from pserver.records import PushRequest
from pserver.server.budget import Budget
from pserver.server.coordinator import EpochSums, Lease, Plan
from pserver.server.membership import Membership
from pserver.server.store import ShardStore


class Leases:
    def __init__(self, cfg: ServerConfig, store: ShardStore, members: Membership, budget: Budget) -> None:
        self.cfg, self.store, self.members, self.budget = cfg, store, members, budget

    @property
    def coordinator(self):
        return self.store.coordinator      # a restore replaces it (ShardStore.restore)

    def _require_shard0(self, what: str) -> None:
        if self.cfg.shard != 0:
            raise FailedPrecondition(f"{what}: the data coordinator is in shard 0, "
                                     f"not shard {self.cfg.shard}")

    def lease(self, rank: int, session: str | None, plan: Plan, finished: tuple[int, int] | None,
              restart: bool, done_before_restore) -> tuple[Lease | None, bool]:
        """Shard.lease: authorized twice, since the new plan's first order is built without
        the lock, and the plan admitted again after it, as the state may have grown meanwhile."""
        self._require_shard0("lease")
        order = None
        with self.store.cond:
            self.members.authorize(rank, session)
            if plan != self.coordinator.plan:       # a new plan: its size first, in the budget
                plan.check()
                self._admit(plan)
        if plan != self.coordinator.plan:
            order = self.coordinator.prepared(plan, restart)   # built outside the lock
        with self.store.cond:
            self.members.authorize(rank, session)
            c = self.coordinator
            if plan != c.plan:
                self._admit(plan)                         # again: the state may have grown meanwhile
            c.configure(plan, restart, order, job=self.members.job)
            c.done_before_restore(done_before_restore)
            session = self.members.sessions[rank]
            gone = finished is not None and not c.holds(rank, session, *finished)
            lease = c.lease(rank, self.members.sessions[rank], finished, workers=self.members.sharing())
            c.tell(rank)
            return lease, gone

    def _admit(self, plan: Plan) -> None:
        """The plan's coordinator state (Plan.nbytes) in place of the plan it replaces (cond held)."""
        self.budget.admit(self.store.tables, plan, self.coordinator.nbytes)

    def epoch_sums(self, epoch: int | None = None) -> EpochSums:
        with self.store.cond:
            return self.coordinator.epoch_sums(epoch)

    def epoch_logs(self, rank: int, session: str | None, epoch: int, share=None):
        """Shard.epoch_logs."""
        self._require_shard0("epoch logs")
        with self.store.cond:
            self.members.authorize(rank, session)
            if share is not None:
                self.coordinator.share_logs(rank, epoch, *share)
            return (*self.coordinator.logs(epoch), 0 in self.members.live())

    def check_push(self, req: PushRequest) -> None:
        """A push's data lease (epoch, chunk, batch) goes to the coordinator (cond held); one the
        rank no longer holds (released when it was marked dead, then the chunk went elsewhere) is
        refused with LeaseGone before the policy sees it. Other shards took the push in already
        when there are several: that batch counts in batches_retrained."""
        if req.lease is None or self.cfg.shard != 0:
            return
        c = self.coordinator
        if c.progress_of(req.rank, self.members.sessions[req.rank], *req.lease):
            return
        if self.cfg.num_shards > 1:
            c.counters["batches_retrained"] += 1
        epoch, chunk, batch = req.lease
        raise LeaseGone(f"lease: worker {req.rank} no longer holds chunk {chunk} of epoch {epoch + 1} (its "
                        f"lease ended: the worker was marked dead, or shard 0 restored); batch {batch} was "
                        f"not taken in: drop the chunk and ask for another")

    def took(self, req: PushRequest, outcome: Outcome) -> None:
        """A leased push the policy took: what its step measured counts in its epoch's sums; one
        dropped late counts as done (the worker moved on)."""
        if req.lease is None or self.cfg.shard != 0:
            return
        with self.store.cond:
            if outcome is Outcome.DROPPED_LATE:
                self.coordinator.dropped()
            else:
                loss_sum, correct, *sums = req.trained
                self.coordinator.tally(req.lease[0], loss_sum, correct, req.num_samples, *sums)
