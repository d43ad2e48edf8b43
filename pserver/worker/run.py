"""One worker's training run: what the loop (pserver.worker.loop) and its batch source
(pserver.worker.sources) share once the worker registered, and the exchange with the shards.

A Run is built once, after Register: its `rank` is the one the shards know (--rank, or the one
shard 0 assigned to --rank auto), and `data_slice` is the slice of each epoch that rank trains
(slices: a joiner's rank may be at or above --num-workers, the number of slices). The rest
(clock, samples, outcomes, the chief's epoch logs) is what the steps move.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from pserver.config import WorkerConfig
from pserver.errors import StaleStep
from pserver.observe.metrics import EvalCurve, StepTimer
from pserver.observe.progress import Progress
from pserver.observe.telemetry import TrainingReport
from pserver.worker.client import PSClient
from pserver.worker.stragglers import Delay


@dataclasses.dataclass(eq=False)
class Run:
    """One worker's run, from its registration to its last step."""
    cfg: WorkerConfig
    rank: int                      # as registered: --rank, or shard 0's answer to --rank auto
    ds: Any                        # a Dataset or Stream, fitted to the model
    model: Any
    client: PSClient
    w: np.ndarray                  # the weights, pulled into after every step
    rows: Any                      # loop.Rows: the model's sparse tables, as this worker sees them
    report: TrainingReport
    callbacks: Any                 # Keras's callback methods (loop.NoCallbacks when no one listens)
    mode: str                      # the shards' consistency mode
    progress: Progress
    gradient: Callable             # loop.gradient_fn: f(w, x, y, g, clock, lookups) -> loss
    delay: Delay
    start: int = 0                 # the step of the run it goes on from (a resumed rank's; else 0)
    data_slice: int = dataclasses.field(init=False)
    g: np.ndarray = dataclasses.field(init=False)
    timer: StepTimer = dataclasses.field(init=False, default_factory=StepTimer)
    curve: EvalCurve = dataclasses.field(init=False)
    clock: int = dataclasses.field(init=False)      # this rank's steps of the run, pushes counted
    samples: int = 0               # trained on by this worker in this run
    outcomes: dict = dataclasses.field(default_factory=dict)    # each push's outcome, counted
    epochs_log: list = dataclasses.field(default_factory=list)  # the chief's line of each epoch
    # The chief's evaluation of the run's last epoch and the weights it evaluated (w, metrics):
    # the summary's, when the final weights are those (loop.finish)
    last_eval: tuple | None = None
    epoch_started: float = dataclasses.field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.data_slice = self.rank % self.cfg.num_workers
        self.g = np.empty_like(self.w)
        self.curve = EvalCurve(self.cfg.eval_every if self.rank == 0 else 0.0)
        self.clock = self.start

    @property
    def chief(self) -> bool:
        return self.rank == 0

    def over(self) -> bool:
        """Whether the shards ended the run (too few workers left) or --max-steps is reached."""
        return bool(self.client.finished or (self.cfg.max_steps and self.clock >= self.cfg.max_steps))

    def begin_epoch(self, epoch: int) -> None:
        self.epoch_started = time.monotonic()
        if epoch < self.cfg.epochs:
            self.callbacks.on_epoch_begin(epoch, {})
            self.follow_lr()

    def follow_lr(self) -> None:
        """A learning rate the callbacks set (Keras's LearningRateScheduler, ReduceLROnPlateau):
        the chief sets it on every shard before its next push, so that in sync every shard takes
        it at the same step; the other workers' callbacks made the same decision on the chief's
        logs and only keep it in their model."""
        lr = self.callbacks.lr_change()
        if lr is not None and self.chief:
            self.client.set_lr(lr)
            self.progress.say(f"learning rate {lr:g} on every shard from the next step (the chief's "
                              "callbacks)")

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    @property
    def empty_counts(self) -> bool:
        """Whether a worker with no batch pushes one of no samples, so that the others do not wait
        for it: in sync and backup it counts toward the step; in ssp it takes this worker's clock
        on (nothing applied), the others' pulls waiting on the slowest clock."""
        return self.mode in ("sync", "backup", "ssp")

    def push_empty(self) -> None:
        """No batch to train: push 0 samples (counted toward the step, weighing nothing)."""
        self.g.fill(0.0)
        with self.timer("push_pull"):
            for outcome in push_pull(self.client, self.g, self.w, 0, self.clock):
                self.count(outcome)
        self.clock += 1


def push_pull(client: PSClient, g: np.ndarray, w: np.ndarray, batch: int, clock: int, lookups=(),
              tables=(), lease=None, trained=(0.0, 0.0, ())) -> list[str]:
    """Push, then pull into w (one exchange per shard over the data plane); the outcomes.
    A rejection for a stale step (sync after a timeout; a push already held) is survivable:
    the pull brings the current version and training goes on."""
    try:
        return client.push_pull(g, w, batch, clock, lookups=lookups, tables=tables, lease=lease,
                                trained=trained)
    except StaleStep:
        client.pull(w, clock + 1)
        return ["rejected"]
