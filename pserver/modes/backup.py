"""backup: sync that completes a step once the first N-b distinct workers have pushed.

Backup workers (Chen et al. 2016; TensorFlow's SyncReplicasOptimizer with
replicas_to_aggregate = N-b), except that the N-b gradients always come from distinct
workers, and what arrives after the step completed is answered dropped_late and counted.

An update is the sample-weighted mean (as sync's) of min(N-b, live) distinct workers'
pushes, never fewer, the late pushes' samples in neither sum: a worker marked dead
lowers the quorum only once the slack of b backups is used up (N=4, b=1: one dead worker
leaves the quorum at 3). Workers that finished their epochs do not lower the quorum: once
the unfinished ones are fewer than the quorum, no step can complete, so the run is over, as
TensorFlow's ends at a global step. The stragglers' remaining pushes are dropped late and
they are told to stop.
"""

from __future__ import annotations

from pserver.errors import FailedPrecondition, StaleStep
from pserver.modes.sync import SyncPolicy


class BackupPolicy(SyncPolicy):
    name = "backup"

    def check_join(self, rank, num_workers):
        # Checked before Shard.register fixes the layout: a refused Register changes nothing.
        if self.cfg.backup_workers >= num_workers:
            raise FailedPrecondition(f"backup_workers: b={self.cfg.backup_workers} must be below "
                                     f"the number of workers N={num_workers}")

    def quorum(self) -> int:
        """max(1, min(members-b, live members)): the members are the N started with the job and
        the joiners that count from this step; finished workers still count as live (see above)."""
        m = self.members
        version = self.store.version
        members = set(range(m.num_workers)) | {r for r, j in m.join_at.items() if j <= version}
        live = len(members) - len((m.dead - m.left) & members)
        return max(1, min(len(members) - self.cfg.backup_workers, live))

    def membership_changed(self) -> None:
        # Only finishing ends a run: workers marked dead may still come back.
        if self.members.left and len(self.members.expected()) < self.quorum():
            dropped = len(self.pending)
            for r in list(self.pending):           # a step that can no longer complete
                self.store.pool.release(self.pending.pop(r))
                self.pending_samples.pop(r)        # dropped work trained nothing
                self.pending_rows.pop(r)
                self.pending_stats.pop(r)
                self.store.took(r, self.pending_clocks.pop(r))   # its batch is consumed all the same
            self.store.counters.add("pushes_aggregated", -dropped)
            self.store.counters.add("pushes_dropped_late", dropped)
            self.watch.reset()
            self.finish(f"{len(self.members.expected())} unfinished worker(s) cannot make the quorum "
                        f"of {self.quorum()}")
        else:
            self.maybe_complete()

    def off_step(self, rank, step, clock, grad):
        if step < self.store.version:
            return self.drop(rank, clock, grad, f"step {step} already completed with the first "
                                   f"{self.quorum()} workers; now at {self.store.version}")
        raise StaleStep(f"step: push for step {step} is ahead of shard "
                        f"{self.store.shard}'s version {self.store.version}")
