"""The data coordinator: shard 0 leases chunks of each epoch's batches to workers.

An epoch's batches (its permutation of the training set from `seed + epoch`, cut into
`num_batches` batches, which every worker computes alike) are cut into chunks of
`chunk_batches` consecutive batches; the chunks are handed out in an order drawn from
`seed + epoch`. A worker holds at most one lease: (epoch, chunk, first batch not done, end).

- A push to shard 0 for a batch of the lease says which batch it carries (`progress`): every
  batch of the chunk before it is done (the worker only pushes batch k+1 once every shard has
  taken batch k in), and batch k+1 is in flight.
- The worker ends its lease when the chunk is done (`lease(..., finished=...)`, which also
  hands it the next one) or its session ends (`release`: it left, or was marked dead): the
  rest of the chunk, from the first batch not done, goes to the front of the queue, to be
  leased to the next worker that asks. A batch that was in flight (at most one per released
  lease) may be trained twice: it is counted in `batches_retrained`.
- The epoch ends when every chunk is done; the next lease opens the next epoch. A worker that
  asks while every chunk of the epoch is leased gets none and pushes empty contributions.
- The epoch's end is shared out (guided self-scheduling): once the batches not yet leased are
  fewer than the workers (live, or starting and not registered yet) times `chunk_batches`, a
  worker that asks gets at most ceil(remaining / workers) of them; the rest of its chunk
  becomes a piece of its own (id num_chunks + its first batch) at the front of the queue. So
  the last steps of a sync epoch do not wait on two workers' whole chunks while the others push
  empty contributions (each of those steps still moved the weights by a whole optimizer step on
  fewer samples). `chunks_done` counts a chunk once all its pieces are done.

Pure logic, no grpc: the shard calls it with store.cond held, but for prepared(), which builds a
new plan's first order outside it once the plan's size is admitted (Leases.lease). `state()` /
`load()` are plain JSON-able data, checkpointed by shard 0 (meta["coordinator"]); sessions are
not kept, so every lease of a loaded state is released (its in-flight batch counted as retrained).

After a restore the chunks done since the checkpoint are trained again. The loaded coordinator
keeps what was done at its checkpoint (`restored`); the workers, who see a new `ident` in its
replies, report what they did under the one before (`done_before_restore`), and what of it falls
after the checkpoint counts in `batches_retrained`, once per batch however many workers report it.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from pserver.errors import FailedPrecondition, InvalidArgument

DEFAULT_CHUNK_BATCHES = 16
COUNTERS = ("chunks_done", "chunks_released", "batches_retrained", "batches_dropped")
# The most epochs whose batches reported done before a restore shard 0 keeps track of (one mask
# of num_batches each): a report of more (a restore of a checkpoint many epochs old) counts the first.
REPORTED_EPOCHS = 64
# What a plan costs shard 0 (Plan.nbytes, counted in --max-memory-mb): per chunk, its place in
# the queue (a list slot and an int, 36 bytes measured), the permutation it is drawn from
# (8), its entry in `done` once done (a set's slot and hash, up to 32) and its copy in a
# checkpoint's state (up to 24 as JSON text); per batch, the masks of a restore (one byte each,
# the checkpoint's and one per epoch reported).
CHUNK_BYTES, BATCH_BYTES = 112, 2
FINGERPRINT_CHARS = 256     # a worker's is under 60 (pserver.data): far more is not one
MAX_EPOCH_LOGS = 64         # names in the chief's epoch logs (Keras: loss, metrics, val_*)
# Epochs whose logs are kept (the newest): in async a worker may end an epoch's share after the chief
# trained on through several more, and its callbacks still take that epoch's logs (at most 64 names of
# 100 characters each: under 2 MB)
KEPT_EPOCH_LOGS = 256
# Epochs whose sums (`tally`) are kept, the newest: a worker that was away while others trained
# through several (backing off from a restarted shard 0; evaluating) asks for each it missed
# (an epoch_logs request), so that the chief's summary has every epoch's, a stream's every window's.
# Each is in shard 0's checkpoints: with Keras's AUC, 800 numbers (16: about 250 KB of JSON).
KEPT_EPOCH_SUMS = 16


@dataclass(frozen=True)
class Plan:
    """What every worker must agree on: refused at the first lease that disagrees."""
    num_batches: int      # batches per epoch
    chunk_batches: int    # batches per chunk (the last chunk may be shorter)
    seed: int
    fingerprint: str      # of the dataset: its length and a hash of a sample (worker side)
    epochs: int = 0       # the job's epochs: none is opened past them (0: no end)
    in_order: bool = False  # --no-shuffle: chunks handed out in order every epoch

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.num_batches / self.chunk_batches)

    @property
    def nbytes(self) -> int:
        """What the coordinator holds for this plan, at most (CHUNK_BYTES): counted in shard 0's
        --max-memory-mb before anything of it is built (Leases.lease)."""
        return self.num_chunks * CHUNK_BYTES + self.num_batches * BATCH_BYTES

    def check(self) -> None:
        """InvalidArgument naming the field and value of a plan no worker sends: checked before
        its size is (Plan.nbytes), and before anything is built from it."""
        for field, value, low in (("num_batches", self.num_batches, 1), ("seed", self.seed, 0),
                                  ("chunk_batches", self.chunk_batches, 1), ("epochs", self.epochs, 0)):
            if value < low:
                raise InvalidArgument(f"data: {field} {value} must be at least {low} ({self.num_batches} "
                                      f"batches per epoch in chunks of {self.chunk_batches}, seed "
                                      f"{self.seed}, {self.epochs} epochs)")
        if len(self.fingerprint) > FINGERPRINT_CHARS:
            raise InvalidArgument(f"data: fingerprint of {len(self.fingerprint):,} characters; a dataset's "
                                  f"is at most {FINGERPRINT_CHARS}")

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_batches
        return start, min(start + self.chunk_batches, self.num_batches)


@dataclass(frozen=True)
class Lease:
    epoch: int
    chunk: int
    first: int    # the epoch's batch index of the first batch not done
    end: int      # one past the chunk's last batch


@dataclass(frozen=True)
class EpochSums:
    """What a lease reply tells besides the lease (LeaseDataReply): the epoch open, the
    coordinator's ident, and what the pushes of the epoch before measured (`tally`)."""
    epoch: int
    ident: str
    loss_sum: float = 0.0     # loss x samples
    correct: float = 0.0      # samples classed right
    samples: int = 0
    metric_sums: tuple = ()   # the compiled metrics' sums (TensorHeader.lease_metric_sums), added


def _added(summed: tuple, sums) -> tuple:
    """Two pushes' metric sums added element by element (a shorter one as if padded with 0s: a
    worker that compiled no metrics sends none)."""
    a, b = np.asarray(summed, np.float64), np.asarray(sums, np.float64)
    if a.size < b.size:
        a, b = b, a
    out = a.copy()
    out[:b.size] += b
    return tuple(out.tolist())


def chunk_order(num_chunks: int, seed: int, epoch: int, in_order: bool = False) -> list[int]:
    """The order the chunks of `epoch` are handed out in: the same on every run (`in_order`: 0, 1, ...)."""
    if in_order:
        return list(range(num_chunks))
    return [int(c) for c in np.random.default_rng([seed, epoch, 0x1EA5E]).permutation(num_chunks)]


class Coordinator:
    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.epoch = 0
        self.queue: list[int] = []            # chunks of this epoch neither leased nor done, next first
        self.progress: dict[int, int] = {}    # chunk -> batches of it done (only chunks begun)
        self.done: set[int] = set()
        self.leases: dict[int, tuple[str, int, int]] = {}   # rank -> (session, chunk, batch in flight or -1)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.ident = secrets.token_hex(6)   # new with every coordinator: a worker seeing it change knows
        self.restored: dict | None = None   # load(): what was done at the checkpoint (epoch, done, progress)
        self.fresh = False                  # loaded, and no lease handed out since: takes other --epochs
        self.counted: dict[int, np.ndarray] = {}   # epoch -> batches counted as retrained (restores)
        self.pieces: dict[int, tuple[int, int]] = {}    # this epoch's split chunks and pieces -> (start, end)
        # epoch -> (loss x samples, samples classed right, samples) over the pushes shard 0 took
        # with a lease of it: Keras's per-epoch training loss and accuracy over every worker's batches
        self.trained: dict[int, tuple[float, float, int]] = {}
        self.metric_sums: dict[int, tuple] = {}      # epoch -> the compiled metrics' sums (tally)
        # Keras on a cluster: epoch -> the chief's logs (names, values) and stop decision, which every
        # worker's callbacks take (this epoch and the one before kept); rank -> the newest epoch a
        # lease reply told it (a worker waiting for the chief's logs knows whether the chief is told)
        self.shared: dict[int, tuple[list[str], list[float], bool]] = {}
        self.told: dict[int, int] = {}
        # The job (shard 0's Membership.job) whose restart (--no-resume; a second Keras fit) began
        # this run: its other workers' restarts join it, even finished (configure).
        self.run_job: int | None = None

    # -- the plan ---------------------------------------------------------------------------
    def configure(self, plan: Plan, restart: bool = False,
                  order: tuple[int, list[int]] | None = None, job: int | None = None) -> None:
        """Fix the plan at the first worker's lease; a later one must match it. A coordinator that
        finished its epochs with no lease out takes a new run: the same data with other --epochs
        goes on from the epoch it reached (a job given more epochs); so does one loaded from a
        checkpoint that has handed out no lease since (a stopped job started again with more
        --epochs). A new run that asks to (`restart`: --no-resume), or one with other data,
        batches or chunks, starts over once the finished run holds no lease.
        `order`: (epoch, its chunk_order) built by the caller outside the shard's lock (prepared()),
        used if this call opens that epoch. A plan refused, or one whose build fails, changes nothing.
        `job`: the job the asking worker is in (shard 0's Membership.job): a restart asked in the job
        whose restart began this run is not another run but this one's, which the job's first
        worker may already have finished alone (async: a second Keras fit's chief trained every
        epoch before the other worker's first ask, which then started the data over and waited for
        logs the chief, gone, never gave)."""
        restart = restart and (job is None or job != self.run_job)
        mine = self.plan
        over = self.finished and not self.leases       # a finished run: a new one may start over
        if plan == mine and not (restart and over):
            return
        plan.check()
        idle = mine is not None and not self.leases and (self.finished or self.fresh)
        if idle and not restart and plan == Plan(**{**vars(mine), "epochs": plan.epochs}) and (
                self.finished or not plan.epochs or self.epoch < plan.epochs):
            if self.finished and not (plan.epochs and self.epoch >= plan.epochs):
                self._open(self.epoch, self._order(plan, self.epoch, order))   # the first epoch not trained
            self.plan = plan
            return
        if mine is None or (over and (restart or plan != mine)):
            queue = self._order(plan, 0, order)        # before anything changes: it may fail
            self.plan = plan
            self.trained.clear()                       # a new run's epochs: no earlier run's sums
            self.metric_sums.clear()
            self.shared.clear()
            self.told.clear()
            self.run_job = job if restart else None
            self._open(0, queue)
            return
        if plan.fingerprint != mine.fingerprint:
            raise FailedPrecondition(f"data: this worker reads other data (fingerprint {plan.fingerprint}) "
                                     f"than the job's (fingerprint {mine.fingerprint}); every worker must "
                                     f"read the same training set")
        if plan.in_order != mine.in_order:
            def order_of(p):
                return "in order (--no-shuffle)" if p.in_order else "shuffled each epoch"
            raise FailedPrecondition(f"data: this worker trains on the data {order_of(plan)}, the job's "
                                     f"coordinator {order_of(mine)}; every worker must give --no-shuffle "
                                     f"(Keras: fit(shuffle=False)) or none")
        raise FailedPrecondition(
            f"data: this worker cuts the data into {plan.num_batches} batches per epoch, chunks of "
            f"{plan.chunk_batches}, seed {plan.seed}; the job's coordinator has {mine.num_batches}, "
            f"{mine.chunk_batches}, seed {mine.seed}, {plan.epochs} vs {mine.epochs} epochs (--batch-size, "
            f"--chunk-batches, --seed and --epochs must match)")

    def prepared(self, plan: Plan, restart: bool = False) -> tuple[int, list[int]] | None:
        """The (epoch, chunk order) configure(plan, restart) would build, built by the caller without
        the shard's lock (Leases.lease), the plan's size checked first. Read without the lock, this
        coordinator may have moved on: configure then builds what it needs itself. None when it
        would build nothing (the same plan, or a run going on)."""
        mine = self.plan
        if plan == mine and not (restart and self.finished):
            return None
        if mine is not None and not restart and plan == Plan(**{**vars(mine), "epochs": plan.epochs}):
            return (self.epoch, self._order(plan, self.epoch)) if self.finished else None
        if mine is not None and not self.finished:
            return None
        return 0, self._order(plan, 0)

    @staticmethod
    def _order(plan: Plan, epoch: int, order: tuple[int, list[int]] | None = None) -> list[int]:
        if order is not None and order[0] == epoch and len(order[1]) == plan.num_chunks:
            return order[1]
        return chunk_order(plan.num_chunks, plan.seed, epoch, plan.in_order)

    @property
    def nbytes(self) -> int:
        """What this coordinator's plan may hold (Plan.nbytes), counted in shard 0's budget."""
        return 0 if self.plan is None else self.plan.nbytes

    @property
    def finished(self) -> bool:
        """Every epoch of the plan is done (no lease will be handed out)."""
        return self.plan is not None and bool(self.plan.epochs) and self.epoch >= self.plan.epochs

    def _open(self, epoch: int, queue: list[int] | None = None) -> None:
        queue = self._order(self.plan, epoch) if queue is None else queue
        self.epoch = epoch
        self.queue = queue
        self.progress.clear()
        self.done.clear()
        self.pieces.clear()

    def bounds(self, chunk: int) -> tuple[int, int]:
        """(first batch, one past the last) of a chunk or piece of this epoch."""
        got = self.pieces.get(chunk)
        return got if got is not None else self.plan.bounds(chunk)

    def num_pieces(self) -> int:
        """The chunks and pieces this epoch is cut into (num_chunks, plus one per split)."""
        return self.plan.num_chunks + sum(c >= self.plan.num_chunks for c in self.pieces)

    def parent(self, chunk: int) -> int:
        """The chunk a piece was split from (a chunk is its own)."""
        n = self.plan.num_chunks
        return chunk if chunk < n else (chunk - n) // self.plan.chunk_batches

    def _left(self, chunk: int) -> int:
        start, end = self.bounds(chunk)
        return end - start - self.progress.get(chunk, 0)

    def _share_out(self, chunk: int, workers: int) -> None:
        """Guided self-scheduling at the epoch's end: cut `chunk` (just taken off the queue) to
        ceil(remaining / workers) batches when the remaining are fewer than workers x chunk_batches;
        the rest goes to the queue's front as a piece of its own."""
        if workers < 2:
            return
        left = self._left(chunk)
        remaining, enough = left, workers * self.plan.chunk_batches
        for c in self.queue:              # stop at `enough`: the share is then a whole chunk or more
            if remaining >= enough:
                return
            remaining += self._left(c)
        share = max(1, math.ceil(remaining / workers))
        if left <= share:
            return
        start, end = self.bounds(chunk)
        cut = start + self.progress.get(chunk, 0) + share
        self.pieces[chunk] = (start, cut)
        piece = self.plan.num_chunks + cut
        self.pieces[piece] = (cut, end)
        self.queue.insert(0, piece)

    # -- leases -----------------------------------------------------------------------------
    def lease(self, rank: int, session: str, finished: tuple[int, int] | None = None,
              workers: int = 0) -> Lease | None:
        """rank's lease: the one it holds, or the next chunk; None when every chunk of the epoch
        is leased to others (the worker pushes an empty contribution and asks again).
        `finished` (epoch, chunk): the worker's chunk is done, every batch taken in by every shard.
        `workers`: how many are live, to share the epoch's end out among (0: no sharing)."""
        self._require_plan()
        held = self.leases.get(rank)
        if held is not None and held[0] != session:     # a new session of the rank: the old one ended
            self.release(rank)
            held = None
        if finished is not None and held is not None and (self.epoch, held[1]) == tuple(finished):
            self._complete(held[1])
            del self.leases[rank]
            held = None
        if held is None:
            if not self.queue and len(self.done) == self.num_pieces():
                if self.plan.epochs and self.epoch + 1 >= self.plan.epochs:
                    self.epoch = self.plan.epochs      # the job's data is done: no more leases
                    return None
                self._open(self.epoch + 1)
            if not self.queue:
                return None
            chunk = self.queue.pop(0)
            self._share_out(chunk, workers)
            self.fresh = False
            held = (session, chunk, -1)
            self.leases[rank] = held
        return self._lease_of(held[1])

    def holds(self, rank: int, session: str, epoch: int, chunk: int) -> bool:
        """Whether rank's session holds chunk `chunk` of epoch `epoch` (a report of it finished
        counts only then: one released meanwhile went back to the queue, to be trained again)."""
        held = self.leases.get(rank)
        return held is not None and held[0] == session and held[1] == chunk and epoch == self.epoch

    def progress_of(self, rank: int, session: str, epoch: int, chunk: int, batch: int) -> bool:
        """A push to shard 0 carries batch `batch` of rank's lease: the batches before it are done
        and this one is in flight. False when rank no longer holds that lease (it was released
        and the chunk went elsewhere): shard 0 refuses the push, the worker drops the chunk and
        asks for another."""
        held = self.leases.get(rank)
        start, end = self.bounds(chunk) if held is not None and held[1] == chunk else (0, 0)
        if held is None or held[0] != session or epoch != self.epoch or held[1] != chunk \
                or not start <= batch < end:
            # A worker that came back after its lease was released (or a shard 0 restored under
            # it): shard 0 refuses the push (LeaseGone) and the worker drops the chunk.
            return False
        self.progress[chunk] = max(self.progress.get(chunk, 0), batch - start)
        self.leases[rank] = (session, chunk, batch)
        return True

    def done_before_restore(self, reports) -> int:
        """Workers' reports (epoch, chunk, end: batches from the chunk's first to `end` were done)
        of what they trained under the coordinator before this one was loaded from a checkpoint:
        each batch past what the checkpoint had done counts in batches_retrained, once, whether its
        epoch is this one or a later one (which the loaded coordinator opens again: a report of it
        comes once, at the worker's first ask after the restore). Returns how many were counted.
        Without a restore (or a plan) there is nothing to count."""
        if self.restored is None or self.plan is None:
            return 0
        r, added = self.restored, 0
        for epoch, chunk, end in reports:
            span = self._span(chunk)
            if span is None or epoch < r["epoch"] or (self.plan.epochs and epoch >= self.plan.epochs):
                continue                                # bad, or done before the checkpoint
            if epoch not in self.counted and len(self.counted) >= REPORTED_EPOCHS:
                continue                                # a bound on what a report may make it hold
            start, end = span[0], min(end, span[1])
            if end <= start:
                continue
            counted = self.counted.setdefault(epoch, np.zeros(self.plan.num_batches, bool))
            new = ~counted[start:end]
            if epoch == r["epoch"]:     # less what the checkpoint had done (in flight: counted at load)
                new &= ~r["mask"][start:end]
            added += int(new.sum())
            counted[start:end] = True
        self.counters["batches_retrained"] += added
        return added

    def _span(self, chunk: int) -> tuple[int, int] | None:
        """The batches a reported chunk or piece may cover, from its id alone (the restored
        coordinator may not have split where the old one did): a chunk's own; a piece's, from
        its first batch to its chunk's end. None for an id that is neither."""
        n = self.plan.num_chunks
        if 0 <= chunk < n:
            return self.plan.bounds(chunk)
        if n <= chunk < n + self.plan.num_batches:
            return chunk - n, self.plan.bounds((chunk - n) // self.plan.chunk_batches)[1]
        return None

    def release(self, rank: int) -> bool:
        """rank's session ended (left, marked dead, replaced): the rest of its chunk goes to the
        front of the queue. Returns whether it held a lease."""
        held = self.leases.pop(rank, None)
        if held is None:
            return False
        _, chunk, inflight = held
        start, _ = self.bounds(chunk)
        if inflight >= start + self.progress.get(chunk, 0):
            self.counters["batches_retrained"] += 1    # it may have been applied; the next holder redoes it
        self.counters["chunks_released"] += 1
        self.queue.insert(0, chunk)
        return True

    def release_all_but(self, live: set[int]) -> None:
        """Release the leases of every rank not in `live` (Membership's on_change)."""
        for rank in sorted(set(self.leases) - live):
            self.release(rank)

    def tally(self, epoch: int, loss_sum: float, correct: float, samples: int, sums=()) -> None:
        """A push with a lease of `epoch` was taken: what its batch's step measured counts in the
        epoch's sums (LeaseDataReply.trained_* once the epoch is done; `sums`, the compiled metrics',
        added element by element). The newest KEPT_EPOCH_SUMS epochs are kept: the one a lease
        reply reports, the one being trained, and those a worker that was away asks for."""
        loss, right, n = self.trained.get(epoch, (0.0, 0.0, 0))
        self.trained[epoch] = (loss + float(loss_sum), right + float(correct), n + int(samples))
        if len(sums) or epoch in self.metric_sums:
            self.metric_sums[epoch] = _added(self.metric_sums.get(epoch, ()), sums)
        for kept in (self.trained, self.metric_sums):
            for old in [e for e in kept if e < epoch - KEPT_EPOCH_SUMS]:
                del kept[old]

    def epoch_sums(self, epoch: int | None = None) -> EpochSums:
        """The open epoch, the ident, and the sums of `epoch` (the one before the open one when
        None); none (0 samples) for an epoch not finished or no longer kept."""
        epoch = self.epoch - 1 if epoch is None else epoch
        if epoch >= self.epoch:
            return EpochSums(self.epoch, self.ident)
        return EpochSums(self.epoch, self.ident, *self.trained.get(epoch, (0.0, 0.0, 0)),
                         self.metric_sums.get(epoch, ()))

    def tell(self, rank: int) -> None:
        """A lease reply to rank tells it the epoch now (`told`, read by `logs`)."""
        self.told[rank] = self.epoch

    def share_logs(self, rank: int, epoch: int, names: list[str], values: list[float], stop: bool) -> None:
        """The chief's logs of `epoch` and whether it stopped there, for every worker's callbacks
        (Keras on a cluster), refused unless they come from the chief (rank 0), as one value per
        name, for an epoch of the plan. The newest KEPT_EPOCH_LOGS epochs' logs are kept."""
        if rank != 0:
            raise FailedPrecondition(f"epoch logs: only the chief (rank 0) gives them, not rank {rank}")
        last = self.plan.epochs if self.plan else 0
        if len(names) != len(values) or len(names) > MAX_EPOCH_LOGS \
                or any(len(n) > 100 for n in names) or not 0 <= epoch <= last:
            raise InvalidArgument(f"epoch logs: {len(names)} names, {len(values)} values for epoch "
                                  f"{epoch}: give one value per name, at most {MAX_EPOCH_LOGS} names "
                                  f"of at most 100 characters, for an epoch of the run's plan")
        self.shared[epoch] = (list(names), list(values), bool(stop))
        for old in [e for e in self.shared if e <= epoch - KEPT_EPOCH_LOGS]:
            del self.shared[old]

    def logs(self, epoch: int) -> tuple[tuple[list[str], list[float], bool] | None, bool]:
        """(the chief's logs of `epoch` or None before it gave them, whether a lease reply told
        the chief that epoch ended)."""
        return self.shared.get(epoch), self.told.get(0, -1) > epoch

    def dropped(self, n: int = 1) -> None:
        """Backup: a push dropped late; its batch counts as done (the worker moved on)."""
        self.counters["batches_dropped"] += n

    def _complete(self, chunk: int) -> None:
        """A chunk or piece is done; chunks_done counts its chunk once every piece of it is."""
        self.done.add(chunk)
        self.progress.pop(chunk, None)
        parent = self.parent(chunk)
        if all(c in self.done for c in self.pieces if self.parent(c) == parent):   # a split one: itself too
            self.counters["chunks_done"] += 1

    def _lease_of(self, chunk: int) -> Lease:
        start, end = self.bounds(chunk)
        return Lease(self.epoch, chunk, start + self.progress.get(chunk, 0), end)

    def _require_plan(self) -> None:
        if self.plan is None:
            raise FailedPrecondition("data: no worker has said how its data is cut yet (Register first)")

    # -- status, checkpoints, reshard ---------------------------------------------------------
    def status(self) -> dict:
        out = dict(self.counters)
        if self.plan is not None:
            out.update(epoch=self.epoch, chunks=self.num_pieces(), chunks_done_this_epoch=len(self.done),
                       chunks_leased=len(self.leases), chunks_waiting=len(self.queue))
        return out

    def state(self) -> dict | None:
        """Plain JSON-able data for shard 0's checkpoint; None before any plan."""
        if self.plan is None:
            return None
        p = self.plan
        return {"plan": [p.num_batches, p.chunk_batches, p.seed, p.fingerprint, p.epochs, p.in_order],
                "epoch": self.epoch, "queue": list(self.queue),
                "progress": {str(c): n for c, n in self.progress.items()},
                "done": sorted(self.done),
                "leases": {str(r): [chunk, inflight] for r, (_, chunk, inflight) in self.leases.items()},
                "pieces": {str(c): list(b) for c, b in self.pieces.items()},
                "trained": {str(e): list(t) for e, t in self.trained.items()},
                **({"metric_sums": {str(e): list(t) for e, t in self.metric_sums.items()}}
                   if self.metric_sums else {}),
                "counters": dict(self.counters)}

    @classmethod
    def load(cls, state: dict | None) -> Coordinator:
        """A coordinator from state(); the sessions it held are gone, so their leases are released."""
        self = cls()
        if state is None:
            return self
        nb, cb, seed, fp, epochs, *in_order = state["plan"]        # checkpoints before --no-shuffle: 5
        self.plan = Plan(int(nb), int(cb), int(seed), str(fp), int(epochs), bool(in_order and in_order[0]))
        self.epoch = int(state["epoch"])
        self.queue = [int(c) for c in state["queue"]]
        self.progress = {int(c): int(n) for c, n in state["progress"].items()}
        self.done = {int(c) for c in state["done"]}
        self.leases = {int(r): ("", int(c), int(i)) for r, (c, i) in state["leases"].items()}
        self.pieces = {int(c): (int(a), int(b)) for c, (a, b) in state.get("pieces", {}).items()}
        self.trained = {int(e): (float(loss), float(right), int(n))
                        for e, (loss, right, n) in state.get("trained", {}).items()}
        self.metric_sums = {int(e): tuple(map(float, t)) for e, t in state.get("metric_sums", {}).items()}
        self.counters.update({k: int(v) for k, v in state.get("counters", {}).items() if k in COUNTERS})
        mask = np.zeros(self.plan.num_batches, bool)      # the epoch's batches done at the checkpoint
        for c in self.done:
            mask[slice(*self.bounds(c))] = True
        for c, n in self.progress.items():
            start = self.bounds(c)[0]
            mask[start:start + n] = True
        for _, c, i in self.leases.values():               # in flight: counted when released below
            if i >= self.bounds(c)[0] + self.progress.get(c, 0):
                mask[i] = True
        self.restored = {"epoch": self.epoch, "mask": mask}
        self.release_all_but(set())
        self.fresh = True
        return self
