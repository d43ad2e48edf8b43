"""backup: sync that completes a step once the first N-b distinct workers have pushed.

Backup workers (Chen et al. 2016; TensorFlow's SyncReplicasOptimizer with
replicas_to_aggregate = N-b), except that the N-b gradients always come from distinct
workers, and what arrives after the step completed is answered dropped_late and counted.
"""

from __future__ import annotations

from pserver.errors import FailedPrecondition
from pserver.modes.base import Outcome
from pserver.modes.sync import SyncPolicy


class BackupPolicy(SyncPolicy):
    name = "backup"

    def join(self, rank, num_workers):
        if self.cfg.backup_workers >= num_workers:
            raise FailedPrecondition(f"backup_workers: b={self.cfg.backup_workers} must be below "
                                     f"the number of workers N={num_workers}")
        super().join(rank, num_workers)

    def quorum(self) -> int:
        return min(self.num_workers - self.cfg.backup_workers, len(self.expected()))

    def off_step(self, rank, step, grad):
        if step < self.store.version:
            self.store.pool.release(grad)
            self.store.counters.add("pushes_dropped_late")
            return Outcome.DROPPED_LATE, (f"step {step} already completed with the first "
                                          f"{self.quorum()} workers; now at {self.store.version}")
        raise FailedPrecondition(f"step: push for step {step} is ahead of shard "
                                 f"{self.store.shard}'s version {self.store.version}")
