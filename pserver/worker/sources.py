"""Where a worker's batches come from, and when its epochs end: its own slice of every epoch
(Slices), or chunks leased from shard 0's data coordinator (Leases, pserver/server/coordinator.py).

A source's `batches(run)` yields each Batch to train and an EpochEnd when an epoch is over; the
loop (pserver.worker.loop.train) trains the batch, sets its `outcome`, and asks for the next.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Iterator

from pserver.config import WorkerConfig
from pserver.worker.run import Run


@dataclasses.dataclass(eq=False)
class Batch:
    """A batch to train. The loop sets `outcome` before it asks its source for the next: "trained",
    "rejected" (its push was refused for a stale step, the weights pulled again) or "gone" (the
    chunk's lease was taken away: this worker was marked dead meanwhile)."""
    epoch: int
    step: int                    # its step in the epoch, as the callbacks hear it
    x: Any
    y: Any
    shown: int                   # the step its progress line shows
    last: bool = False           # the epoch's last: its progress line is shown whatever the time
    lease: tuple[int, int, int] | None = None    # (epoch, chunk, batch) leased by shard 0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    outcome: str = ""
    loss: float = 0.0
    exchange_started: float = 0.0


@dataclasses.dataclass
class EpochEnd:
    """Epoch `epoch` is over. `trained`: every worker's loss sum, samples classed right and samples
    of it, as shard 0's coordinator summed them (leases); `shared`: the chief shares its epoch logs
    and stop decision through shard 0, which every other worker's callbacks take (Keras on a cluster);
    `all_done`: it was the run's last, and every worker's batches are done (leases): no one trains.
    `again`: it ended before, then shard 0 restored a checkpoint from before that end, and the
    batches the checkpoint lacked were trained again (leases): the chief evaluates it again, the
    callbacks, which heard it, are not told twice."""
    epoch: int
    trained: dict | None = None
    shared: bool = False
    all_done: bool = False
    again: bool = False


class Slices:
    """Each rank's own slice of every epoch (--data-assignment slices, or data that cannot be cut
    into chunks), in order; a restarted rank goes on from the step the shards recorded for it."""
    retries = False              # a batch whose push was refused is not trained again
    line_at_end = True           # the run's last step shows its progress line

    def __init__(self, cfg: WorkerConfig, ds, rank: int, infos) -> None:
        self.steps = ds.steps(cfg.num_workers, cfg.batch_size)
        self.start = resume_clock(cfg, rank, infos, self.steps)

    def batches(self, run: Run) -> Iterator[Batch | EpochEnd]:
        cfg = run.cfg
        first, skip = divmod(self.start, self.steps) if self.steps else (0, 0)
        if cfg.max_steps and self.start >= cfg.max_steps:
            first = cfg.epochs                 # resumed past --max-steps: nothing left
        for epoch in range(first, cfg.epochs):
            run.begin_epoch(epoch)
            yield from self.epoch(run, epoch, skip)
            skip = 0                           # only a resumed epoch starts at its step
            yield EpochEnd(epoch)
            if run.client.finished:
                run.progress.say(f"the shards ended the run at step {max(run.client.versions)} "
                                 f"(too few unfinished workers left for a step); stopping")
                return
            if run.over():
                return

    def epoch(self, run: Run, epoch: int, offset: int) -> Iterator[Batch]:
        cfg = run.cfg
        batches = run.ds.epoch(run.data_slice, cfg.num_workers, cfg.batch_size, cfg.seed, epoch)
        for step, (x, y) in enumerate(itertools.islice(batches, offset, None), start=offset):
            yield Batch(epoch, step, x, y, shown=step, last=step == self.steps - 1)
            if run.over():
                return


def resume_clock(cfg: WorkerConfig, rank: int, infos, steps: int) -> int:
    """The step this rank goes on from: where every shard recorded it (the smallest, since each
    checkpointed at its own time), when it followed this data order; else 0. Says which, in one line."""
    found = [i.position for i in infos]
    if all(p is None or p.clock == 0 for p in found):
        return 0
    if cfg.no_resume:
        print(f"--no-resume: starting at epoch 1 (the shards recorded rank {rank} at step "
              f"{max(p.clock for p in found if p)})", flush=True)
        return 0
    why = other_order(cfg, found, steps)
    if why:
        print(f"the shards recorded rank {rank}'s position, but {why}: starting at epoch 1", flush=True)
        return 0
    clock = min(p.clock if p else 0 for p in found)
    print(resuming(cfg, rank, found[0]._replace(clock=clock), steps), flush=True)
    return clock


def resuming(cfg: WorkerConfig, rank: int, at, steps: int) -> str:
    """The line of a rank resumed at position `at` (pserver.wire.codec.Position)."""
    done = at.epoch >= cfg.epochs or (cfg.max_steps and at.clock >= cfg.max_steps)
    left = "nothing is left to train" if done else f"{steps * cfg.epochs - at.clock} step(s) to go"
    return (f"resuming rank {rank} at epoch {at.epoch + 1}/{cfg.epochs}, step {at.step + 1}/{steps} "
            f"(step {at.clock} of the run, as the shards recorded it; --no-resume starts over): {left}")


def other_order(cfg: WorkerConfig, found: list, steps: int) -> str:
    """Why positions the shards recorded do not count in this run's data order; "" when they do."""
    if not steps:
        return "its data has no known epoch length"
    other = next((p for p in found if p and (p.data_seed, p.steps_per_epoch) != (cfg.seed, steps)), None)
    if other is None:
        return ""
    return (f"they were counted in another data order (seed {other.data_seed}, "
            f"{other.steps_per_epoch} steps per epoch; now seed {cfg.seed}, {steps})")


class Leases:
    """The epochs on chunks leased from shard 0's coordinator: the worker asks for a chunk, trains
    its batches in order (each push to shard 0 says which batch it carries: the ones before it are
    done), reports it finished with the next ask, and goes on until the coordinator opens epoch
    --epochs. With no chunk left in the epoch it pushes an empty contribution in sync and backup
    (0 samples: it counts toward the step, weighs nothing) and waits a moment in the other modes.
    An epoch ends when every chunk is done, on every worker; this worker learns it at its next ask."""
    retries = True               # a batch whose push was refused is trained again: it is the lease's
    line_at_end = False          # the epoch's end shows the last line, when the worker learns it
    start = 0                    # shard 0's coordinator knows where the job is, not the rank

    def __init__(self, cfg: WorkerConfig, ds) -> None:
        window = {"window_batches": cfg.window_batches} if getattr(ds, "stream", False) else {}
        self.data = ds.leased_batches(cfg.batch_size, cfg.seed, cfg.chunk_batches, shuffle=not cfg.no_shuffle,
                                      **window)
        # a stream's chunks are leased in order, as its lines arrive (StreamBatches.in_order)
        self.plan = (self.data.num_batches, cfg.chunk_batches, cfg.seed, self.data.fingerprint, cfg.epochs,
                     cfg.no_shuffle or getattr(self.data, "in_order", False))
        # a progress bar's epoch: about this worker's share of the batches
        self.steps = max(1, -(-self.data.num_batches // cfg.num_workers))
        self.lease, self.at, self.finished = None, 0, None
        self.epoch: int | None = None          # None until the first reply says where the job is
        self.step = 0                          # this worker's batches of the epoch
        # What this worker did under shard 0's coordinator (epoch, chunk, end): reported when a reply
        # shows a new one (shard 0 restored), which counts what falls after its checkpoint.
        self.done_log: list[tuple[int, int, int]] = []
        self.coordinator = ""
        self.ended = -1                        # the last epoch whose end this worker heard
        self.restarts = 0                      # shard 0's restarts this worker had seen at its last ask

    def batches(self, run: Run) -> Iterator[Batch | EpochEnd]:
        if run.over() and self.epoch is None:    # the others ended the run before this worker came
            yield from self.missed(run, 0, run.cfg.epochs, self.shared(run))
        while not run.over():
            if self.lease is None:
                reply = self.ask(run)
                yield from self.follow(run, reply)
                if self.epoch >= run.cfg.epochs:
                    if self.kept(run):
                        return
                    continue
                if reply.has_lease:
                    self.lease, self.at = reply, reply.first_batch
            if self.lease is None:
                self.wait(run)
                continue
            x, y = self.data.batch(self.lease.epoch, self.at)
            if len(x) == 0:                    # a file's byte range where no training line starts
                self.advance()
                continue
            batch = Batch(self.epoch, self.step, x, y, shown=min(self.step, self.steps - 1),
                          lease=(self.lease.epoch, self.lease.chunk, self.at))
            yield batch
            self.took(batch)

    def ask(self, run: Run):
        """The coordinator's reply to this worker's ask (the chunk it finished, if any, reported)."""
        client = run.client
        reply = client.lease_data(*self.plan, finished=self.finished,
                                  restart=self.epoch is None and run.cfg.no_resume)
        if reply.finished_gone:                # marked dead after its last push: the chunk went back
            epoch, chunk = self.finished
            run.progress.say(f"worker {run.rank}: lease: worker {run.rank} no longer holds chunk {chunk} of "
                             f"epoch {epoch + 1} (its lease ended: the worker was marked dead); its batches "
                             f"are trained again by whoever leases it")
            run.count("lease_gone")
        self.finished = None
        if reply.coordinator_id != self.coordinator:
            if self.coordinator and self.done_log:      # shard 0 restored: report, then go on as told
                reply = client.lease_data(*self.plan, done_before_restore=self.done_log)
                run.progress.say(f"worker {run.rank}: shard 0's data coordinator restored from a "
                                 f"checkpoint; told it the {len(self.done_log)} chunk(s) this worker trained "
                                 f"before (what falls after the checkpoint counts as trained twice)")
            self.done_log, self.coordinator = [], reply.coordinator_id
        self.restarts = client.shards[0].restarts
        return reply

    def kept(self, run: Run) -> bool:
        """Whether the run's end, which the last ask told, holds. The chief asked every shard for a
        checkpoint at the last epoch's end (chief_epoch_end): from there on a restarted shard 0
        restores the end. Before it, shard 0 may have restarted (its RPCs found it so: a restart
        between the chief's last push and that checkpoint) from a checkpoint whose coordinator
        has chunks left; the chief then asks again, and trains them, where it would have ended the
        run on a model without them (another worker leaves: the chief's end is the commit)."""
        if not run.chief or run.client.shards[0].restarts == self.restarts:
            return True
        run.progress.say(f"worker {run.rank}: shard 0 restarted after the data's end, before its "
                         f"checkpoint of the end was written; its coordinator is back where it "
                         f"restored, and the chief trains the chunk(s) done after that again")
        return False

    def follow(self, run: Run, reply) -> Iterator[EpochEnd]:
        """The epoch the reply is at: at the first ask, the job's (one that goes on: not an epoch's
        end); a later one when every chunk of this one is done; an earlier one when shard 0 restored
        from an earlier epoch's checkpoint."""
        shared = self.shared(run)
        if self.epoch is None:
            self.epoch = reply.epoch
            say_where_leases_begin(run.cfg, reply.epoch, run.progress.say)
            yield from self.missed(run, 0, reply.epoch, shared, at_start=True)
            run.begin_epoch(self.epoch)
        elif reply.epoch > self.epoch:
            line = run.progress.epoch_ended(self.epoch)
            if line:
                run.report.progress(run.clock, *line)
            yield EpochEnd(self.epoch, epoch_sums(run, reply, self.epoch), shared=shared,
                           all_done=self.epoch + 1 >= run.cfg.epochs <= reply.epoch,
                           again=self.epoch <= self.ended)
            self.ended = max(self.ended, self.epoch)
            for ended in self.missed(run, self.epoch + 1, reply.epoch, shared, during=True):
                ended.again = ended.epoch <= self.ended
                self.ended = max(self.ended, ended.epoch)
                yield ended
            self.epoch, self.step = reply.epoch, 0
            run.begin_epoch(self.epoch)
        elif reply.epoch < self.epoch:
            self.epoch, self.step = reply.epoch, 0

    @staticmethod
    def shared(run: Run) -> bool:
        """Whether the chief shares its epoch logs with this worker's callbacks (EpochEnd.shared)."""
        return getattr(run.callbacks, "shares_logs", False) and run.cfg.num_workers > 1

    @staticmethod
    def missed(run: Run, first: int, end: int, shared: bool, at_start: bool = False,
               during: bool = False) -> Iterator[EpochEnd]:
        """Epochs first..end-1, which ended while this worker trained none of them (async: another
        worker trained on through several while this one started, evaluated, was slow or backed off
        from a restarted shard 0; backup: the quorum made each step without it): Keras on a cluster
        hears each, so that every worker's History is the chief's: the chief evaluates each (on the
        weights it has now) and gives its logs, and every other worker's callbacks hear each epoch
        with them (end_epoch waits for them). Without Keras the chief alone hears those that ended
        `during` its run, so that its summary has every epoch (a stream's every window) with what
        every worker's batches of it measured. Epochs that ended before this worker's first ask on
        shards restored from a checkpoint are an earlier run's: the chief gives none, and the others
        hear only those it gave logs for."""
        if not shared and not (run.chief and during):
            return
        earlier = at_start and bool(run.client.shards[0].info.restored_from)
        if run.chief and earlier:
            return
        for epoch in range(first, min(end, run.cfg.epochs)):
            answer = run.client.epoch_logs(epoch)     # its logs (once given) and its sums
            if earlier and not answer.has_logs:
                continue                      # an earlier run's epoch: the chief gave no logs
            run.begin_epoch(epoch)
            yield EpochEnd(epoch, sums_in(answer), shared=shared, all_done=epoch + 1 >= run.cfg.epochs <= end)

    def wait(self, run: Run) -> None:
        """No chunk for this worker now: an empty push where it counts toward the step, else a moment."""
        if run.empty_counts:
            run.push_empty()
        else:
            time.sleep(0.05)                   # async: nothing to wait for; ask again

    def took(self, batch: Batch) -> None:
        if batch.outcome == "gone":            # the chunk went elsewhere
            self.done_log.append((self.lease.epoch, self.lease.chunk, self.at))
            self.lease, self.finished = None, None
        elif batch.outcome == "trained":       # "rejected": the same batch again, on the weights pulled
            self.step += 1
            self.advance()

    def advance(self) -> None:
        """The lease's next batch; past its last, the chunk is done (every shard took it in)."""
        self.at += 1
        if self.at == self.lease.end_batch:
            self.done_log.append((self.lease.epoch, self.lease.chunk, self.at))
            self.finished, self.lease = (self.lease.epoch, self.lease.chunk), None


def epoch_sums(run: Run, reply, epoch: int) -> dict | None:
    """Every worker's batches of `epoch` as shard 0 summed them: the lease reply's when it is of the
    next epoch, else (several ended meanwhile) shard 0's answer for that one (an epoch_logs ask)."""
    return sums_in(reply if reply.epoch == epoch + 1 else run.client.epoch_logs(epoch))


def sums_in(reply) -> dict | None:
    """The sums a LeaseData reply carries (trained_*), None when it has none."""
    if reply.trained_samples <= 0:
        return None
    return {"loss_sum": reply.trained_loss_sum, "correct": reply.trained_correct,
            "samples": reply.trained_samples, "metric_sums": tuple(reply.trained_metric_sums)}


def say_where_leases_begin(cfg: WorkerConfig, epoch: int, say) -> None:
    """One line when shard 0's coordinator is past epoch 1 at this worker's first lease: a run that
    goes on from an earlier one's data (--no-resume starts a finished one over)."""
    if epoch == 0:
        return
    if epoch >= cfg.epochs:
        say(f"shard 0's data coordinator has done all {cfg.epochs} epoch(s) of this data: nothing is left "
            f"to train (--no-resume starts over)")
    else:
        say(f"shard 0's data coordinator is at epoch {epoch + 1}/{cfg.epochs} of this data: going on from "
            f"there (--no-resume starts a finished run over)")


def source_for(cfg: WorkerConfig, ds, rank: int, infos) -> Slices | Leases:
    """Leases when --data-assignment leases and the data can be cut into chunks; else slices (a
    user's generator keeps its rank's own batches, and the worker says so)."""
    if cfg.data_assignment != "leases":
        return Slices(cfg, ds, rank, infos)
    if getattr(ds, "leased_batches", None) is None:
        print(f"worker {rank}: --data-assignment leases: {ds.name} cannot be cut into chunks (batches "
              f"read in order); each rank reads its own batches (slices)", flush=True)
        return Slices(cfg, ds, rank, infos)
    return Leases(cfg, ds)
