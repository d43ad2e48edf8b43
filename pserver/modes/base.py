"""What every consistency mode shares: who the workers are, and the rules all modes keep.

A policy decides two things over one ShardStore: what a push does (apply it, hold it
for the step's mean, drop it as late, or reject it) and how long a pull waits. The
servicer and the store never look at the mode's name.
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod

import numpy as np

from pserver.config import ServerConfig
from pserver.errors import FailedPrecondition
from pserver.server.store import ShardStore

log = logging.getLogger("pserver.modes")


class Outcome(enum.Enum):
    APPLIED = 1        # applied on arrival
    AGGREGATED = 2     # held for its step's mean
    DROPPED_LATE = 3   # its step had already completed


class Policy(ABC):
    """Membership and the shared checks; subclasses define push and the pull wait."""

    name = ""

    def __init__(self, store: ShardStore, cfg: ServerConfig) -> None:
        self.store, self.cfg = store, cfg
        self.num_workers = cfg.num_workers   # 0 until the first Register says
        self.registered: set[int] = set()
        self.left: set[int] = set()
        self.dead: set[int] = set()
        self.clocks: dict[int, int] = {}     # rank -> pushes completed (ssp)
        self.finished = False                # no step can complete any more: workers stop

    # --- membership; all called with store.cond held -------------------------------
    def check_join(self, rank: int, num_workers: int) -> None:
        """What join checks, changing nothing: Shard.register calls it before it fixes the layout."""
        if self.num_workers and num_workers != self.num_workers:
            raise FailedPrecondition(f"num_workers: worker {rank} says {num_workers} workers but "
                                     f"this shard serves {self.num_workers}")
        if not 0 <= rank < num_workers:
            raise FailedPrecondition(f"rank: {rank} is not a worker of this cluster (ranks 0..{num_workers - 1})")

    def join(self, rank: int, num_workers: int) -> None:
        self.check_join(rank, num_workers)
        self.num_workers = num_workers
        self.registered.add(rank)
        self.left.discard(rank)
        if rank in self.dead:
            self.dead.discard(rank)
            log.info("worker %d registered again and rejoins at version %d", rank, self.store.version)
        self.store.cond.notify_all()

    def leave(self, rank: int) -> None:
        self.check_rank(rank)
        self.left.add(rank)
        self.membership_changed()
        self.store.cond.notify_all()

    def mark_dead(self, ranks, why: str) -> None:
        ranks = sorted(set(ranks) - self.dead - self.left)
        if not ranks:
            return
        self.dead.update(ranks)
        self.store.counters.add("workers_marked_dead", len(ranks))
        log.warning("shard %d: marked worker(s) %s dead: %s", self.store.shard, ranks, why)
        self.membership_changed()

    def membership_changed(self) -> None:
        """A worker left or died: a step waiting for it may now be complete."""

    def finish(self, why: str) -> None:
        """End the run on this shard (cond held): pushes are dropped, pulls stop waiting."""
        if not self.finished:
            self.finished = True
            log.info("shard %d: run finished at version %d: %s", self.store.shard, self.store.version, why)
            self.store.cond.notify_all()

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < max(self.num_workers, 1):
            raise FailedPrecondition(f"rank: {rank} is not a worker of this cluster "
                                     f"(ranks 0..{self.num_workers - 1})")

    def check_member(self, rank: int) -> None:
        self.check_rank(rank)
        if rank not in self.registered:
            raise FailedPrecondition(f"rank: worker {rank} has not registered with shard "
                                     f"{self.store.shard}; call Register first")

    def expected(self) -> set[int]:
        """Ranks a step still counts on: all N, less those that left or were marked dead."""
        return set(range(self.num_workers)) - self.left - self.dead

    # --- the two decisions ----------------------------------------------------------
    @abstractmethod
    def push(self, rank: int, step: int, grad: np.ndarray, clock: int) -> tuple[Outcome, str]:
        """Decide what becomes of a validated gradient. Takes ownership of `grad`: the
        policy returns it to store.pool when done. Raises FailedPrecondition to reject."""

    def wait_pull(self, rank: int, seen_version: int, clock: int, timeout: float | None) -> None:
        """Block (cond held) as the mode requires before a pull. Default: until initialized."""
        self.store.wait_for(lambda: self.store.initialized, timeout)

    def check_pull(self, seen_version: int) -> None:
        if seen_version > self.store.version >= 0:
            raise FailedPrecondition(
                f"seen_version: {seen_version} is ahead of shard {self.store.shard}'s version "
                f"{self.store.version} (did the shard restart from an older checkpoint?)")


class StepWatch:
    """Notices a step (or clock) that has waited longer than --step-timeout."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.since: float | None = None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def reset(self) -> None:
        self.since = None

    def expired(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.timeout
