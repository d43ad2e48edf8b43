"""What every consistency mode shares: the rules all modes keep.

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
from pserver.errors import SeenVersionAhead
from pserver.records import PushRequest

log = logging.getLogger("pserver.modes")


class Outcome(enum.Enum):
    APPLIED = 1        # applied on arrival
    AGGREGATED = 2     # held for its step's mean
    DROPPED_LATE = 3   # its step had already completed


class Policy(ABC):
    """What a push does and how long a pull waits; subclasses define both. Who the workers
    are (sessions, liveness) is the shard's Membership (pserver.server.membership), which
    each policy reads as `self.members` and which calls `membership_changed` when a worker
    leaves or is marked dead."""

    name = ""

    def __init__(self, store, cfg: ServerConfig, members) -> None:
        self.store, self.cfg, self.members = store, cfg, members
        self.clocks = store.clocks           # rank -> steps taken in (store.took); ssp bounds
                                             # staleness by them
        self.finished = False                # no step can complete any more: workers stop

    def check_join(self, rank: int, num_workers: int) -> None:
        """What this mode asks of a Register, changing nothing (Shard.register calls it, with
        the membership's own checks, before it fixes the layout). Default: nothing."""

    def membership_changed(self) -> None:
        """A worker left or died: a step waiting for it may now be complete."""

    def registered(self, rank: int) -> None:
        """`rank` registered (cond held). Default: nothing (sync and backup take a joiner as a
        member from the step it proposes, `join_step`)."""

    def join_step(self, rank: int, step: int) -> int:
        """An elastic worker counts from `step` (cond held); returns the step it counts from.
        Default (async, ssp): from its Register on, so 0."""
        self.members.check_member(rank)
        return 0

    def forget(self, rank: int) -> None:
        """A restarted worker took `rank`'s session over (cond held): drop what the old session
        holds for the open step, uncounted, so the new one trains that batch again. Default:
        nothing is held (async modes apply on arrival)."""

    def held_row_bytes(self, rows) -> int:
        """Bytes a push's sparse rows (RowGrads) keep until its step applies, counted in the
        memory budget at arrival (Budget.reserve). Default: none (async modes apply on arrival;
        the rows are in flight, bounded by --max-inflight-mb)."""
        return 0

    def begin_again(self) -> None:
        """Another job begins on these shards (Membership.maybe_begin_again, cond held): one that
        the last job's end finished (backup: too few unfinished workers for the quorum) takes
        steps again, as a second fit under `pserver run` does."""
        self.finished = False

    def finish(self, why: str) -> None:
        """End the run on this shard (cond held): pushes are dropped, pulls stop waiting."""
        if not self.finished:
            self.finished = True
            log.info("shard %d: run finished at version %d: %s", self.store.shard, self.store.version, why)
            self.store.cond.notify_all()

    # --- the two decisions ----------------------------------------------------------
    @abstractmethod
    def push(self, req: PushRequest, grad: np.ndarray) -> tuple[Outcome, str]:
        """Decide what becomes of a validated push: `grad`, its dense gradient (filled from
        req.fill into the shard's buffer), and the sparse rows that came with it (req.rows,
        pserver.sparse.RowGrads): both are applied together, or dropped together. Takes
        ownership of `grad`: the policy returns it to store.pool when done, and counts
        req.num_samples as trained once the gradient is applied (never when it is dropped).
        Raises FailedPrecondition (StaleStep for a step it does not take now) to reject, and
        TakenOver (Membership.check_session, cond held) for a push whose session was taken
        over while its payload arrived."""

    def wait_pull(self, rank: int, seen_version: int, clock: int, timeout: float | None,
                  waiter=None) -> None:
        """Block (cond held) as the mode requires before a pull. Default: until initialized.
        `waiter`: see ShardStore.wait_for."""
        self.store.wait_for(lambda: self.store.initialized, timeout, waiter=waiter)

    def check_pull(self, seen_version: int) -> None:
        if seen_version > self.store.version >= 0:
            raise SeenVersionAhead(
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
