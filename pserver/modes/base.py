"""What every consistency mode shares: who the workers are, and the rules all modes keep.

A policy decides two things over one ShardStore: what a push does (apply it, hold it
for the step's mean, drop it as late, or reject it) and how long a pull waits. The
servicer and the store never look at the mode's name.
"""

from __future__ import annotations

import enum
import hmac
import logging
import secrets
import time
from abc import ABC, abstractmethod

import numpy as np

from pserver.config import ServerConfig
from pserver.errors import AlreadyExists, FailedPrecondition, Unauthenticated
from pserver.server.store import ShardStore

log = logging.getLogger("pserver.modes")


class Outcome(enum.Enum):
    APPLIED = 1        # applied on arrival
    AGGREGATED = 2     # held for its step's mean
    DROPPED_LATE = 3   # its step had already completed


class Policy(ABC):
    """Membership, sessions and the shared checks; subclasses define push and the pull wait.

    Sessions (docs/semantics.md, "Security"): Register hands each worker a random credential, and every later
    call for that rank must carry it, so a token holder cannot act for another worker. A
    session is live while its worker made an RPC (or heartbeat) within --step-timeout;
    `expire` marks the others dead in every mode, and only then (or after Leave) may a new
    Register take the rank. A worker marked dead rejoins on its next push or pull.
    """

    name = ""

    def __init__(self, store: ShardStore, cfg: ServerConfig) -> None:
        self.store, self.cfg = store, cfg
        self.num_workers = cfg.num_workers   # 0 until the first Register says
        self.registered: set[int] = set()
        self.left: set[int] = set()
        self.dead: set[int] = set()
        self.sessions: dict[int, str] = {}   # rank -> its worker's credential
        self.last_seen: dict[int, float] = {}  # rank -> time.monotonic() of its last call
        self.clocks = store.clocks           # rank -> steps taken in (store.took); ssp bounds staleness by them
        self.finished = False                # no step can complete any more: workers stop

    # --- membership; all called with store.cond held -------------------------------
    def check_join(self, rank: int, num_workers: int) -> None:
        """What join checks, changing nothing: Shard.register calls it before it fixes the layout."""
        if self.num_workers and num_workers != self.num_workers:
            raise FailedPrecondition(f"num_workers: worker {rank} says {num_workers} workers but "
                                     f"this shard serves {self.num_workers}")
        if not 0 <= rank < num_workers:
            raise FailedPrecondition(f"rank: {rank} is not a worker of this cluster (ranks 0..{num_workers - 1})")

    def join(self, rank: int, num_workers: int) -> str:
        """Register `rank`; returns its new session credential. Refused while the rank's
        session is live (checked after the layout, so a wrong model hears that first)."""
        self.check_join(rank, num_workers)
        if self.session_live(rank):
            ago = time.monotonic() - self.last_seen[rank]
            raise AlreadyExists(
                f"rank: worker {rank} is already registered with shard {self.store.shard} and its "
                f"session is live (last seen {ago:.1f} s ago; it expires after "
                f"{self.cfg.step_timeout:g} s without a call, --step-timeout)")
        self.num_workers = num_workers
        if rank in self.sessions:
            why = "left" if rank in self.left else "expired"
            self.store.counters.add("sessions_replaced")
            log.info("shard %d: worker %d registered again (its previous session %s)",
                     self.store.shard, rank, why)
        self.sessions[rank] = secrets.token_hex(16)
        self.registered.add(rank)
        self.left.discard(rank)
        self.touch(rank)
        self.revive(rank, "registered again")
        self.store.cond.notify_all()
        return self.sessions[rank]

    def session_live(self, rank: int) -> bool:
        return (rank in self.sessions and rank not in self.left
                and time.monotonic() - self.last_seen.get(rank, 0.0) <= self.cfg.step_timeout)

    def authorize(self, rank: int, session: str | None, revive: bool = False) -> None:
        """Check that `session` is rank's credential and note that the worker is alive.

        session None is an in-process caller (tests, a Python user driving a Shard): the
        credential is checked on every call that comes over the wire (gRPC, data plane),
        where a missing one arrives as "". `revive`: a push or pull brings a worker marked
        dead back (docs/semantics.md, "Dead workers")."""
        self.check_member(rank)
        if session is not None and not hmac.compare_digest(session.encode(), self.sessions[rank].encode()):
            raise Unauthenticated(
                f"session: the call for worker {rank} does not carry that worker's session "
                f"credential (from its Register; another process may have registered as rank {rank})")
        self.touch(rank)
        if revive:
            self.revive(rank, "pushed or pulled again")

    def touch(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()

    def revive(self, rank: int, why: str) -> None:
        if rank in self.dead:
            self.dead.discard(rank)
            self.store.counters.add("workers_rejoined")
            log.info("shard %d: worker %d %s and rejoins at version %d",
                     self.store.shard, rank, why, self.store.version)
            self.store.cond.notify_all()

    def expire(self) -> None:
        """Mark dead every worker whose session saw no call within --step-timeout."""
        now, limit = time.monotonic(), self.cfg.step_timeout
        stale = [r for r in self.registered - self.left - self.dead
                 if now - self.last_seen.get(r, now) > limit]
        self.mark_dead(stale, f"no call or heartbeat for more than {limit:g} s (--step-timeout)")

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
    def push(self, rank: int, step: int, grad: np.ndarray, clock: int,
             samples: int = 0, rows: list = ()) -> tuple[Outcome, str]:
        """Decide what becomes of a validated gradient and the sparse rows that came with it
        (store.RowGrads): both are applied together, or dropped together. Takes ownership of
        `grad`: the policy returns it to store.pool when done, and counts `samples` as
        trained once the gradient is applied (never when it is dropped). Raises
        FailedPrecondition to reject."""

    def wait_pull(self, rank: int, seen_version: int, clock: int, timeout: float | None,
                  waiter=None) -> None:
        """Block (cond held) as the mode requires before a pull. Default: until initialized.
        `waiter`: see ShardStore.wait_for."""
        self.store.wait_for(lambda: self.store.initialized, timeout, waiter=waiter)

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
