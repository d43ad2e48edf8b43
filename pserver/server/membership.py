"""Who the workers of a shard are: their sessions and their liveness, for every mode.

The shard owns one Membership; its consistency policy (pserver.modes) reads it to decide
which workers a step still counts on, and hears of every change (a worker left or was marked
dead) through `on_change`, so that a step waiting for that worker may complete.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from typing import Callable

from pserver.config import ServerConfig
from pserver.errors import (
    AlreadyExists,
    FailedPrecondition,
    JoinStepOpen,
    NotRegistered,
    ResourceExhausted,
    TakenOver,
    Unauthenticated,
)
from pserver.server.store import ShardStore

log = logging.getLogger("pserver.modes")


class Membership:
    """Registration, sessions and liveness; every method is called with store.cond held.

    Sessions (docs/semantics.md, "Security"): Register hands each worker a random credential, and every later
    call for that rank must carry it, so a token holder cannot act for another worker. A
    session is live while its worker made an RPC (or heartbeat) within --step-timeout;
    `expire` marks the others dead in every mode, and only then (or after Leave) may a new
    Register take the rank, unless it presents the live session's credential (a restarted
    worker's session file): then it takes the rank over at once, `on_takeover(rank)` lets the
    policy discard what the old session held for the open step, and the old credential is
    refused from then on with "taken over". A worker marked dead rejoins on its next push or pull.
    """

    def __init__(self, store: ShardStore, cfg: ServerConfig,
                 on_change: Callable[[], None] = lambda: None,
                 on_takeover: Callable[[int], None] = lambda rank: None,
                 on_new_job: Callable[[], None] = lambda: None) -> None:
        self.store, self.cfg = store, cfg
        self.on_change = on_change             # a worker left or died (the policy's membership_changed)
        self.on_takeover = on_takeover         # a rank's live session was taken over (the policy's forget)
        self.on_new_job = on_new_job           # a Register began another job (the policy's begin_again)
        self.num_workers = cfg.num_workers   # 0 until the first Register says
        self.job = 0                           # jobs begun here before this one (maybe_begin_again)
        self.registered: set[int] = set()
        self.left: set[int] = set()
        self.dead: set[int] = set()
        self.sessions: dict[int, str] = {}   # rank -> its worker's credential
        self.displaced: dict[int, set[str]] = {}  # rank -> credentials taken over (told "taken over")
        self.last_seen: dict[int, float] = {}  # rank -> time.monotonic() of its last call
        # Elastic workers (docs/operations.md, "Elastic workers"): ranks below num_workers are
        # members from the start; a rank at or above it (below max_workers) is a member from the
        # step in join_at, the same on every shard (sync, backup), or from its Register (async, ssp).
        self.max_workers = cfg.max_workers
        self.join_at: dict[int, int] = {}

    @property
    def rank_limit(self) -> int:
        return max(self.max_workers, self.num_workers)

    def elastic(self) -> bool:
        return self.max_workers > self.num_workers

    def check_join(self, rank: int, num_workers: int) -> None:
        """What join checks, changing nothing: Shard.register calls it before it fixes the layout."""
        if self.elastic():
            # a joining worker's --num-workers is the size it brings the job to (its data slice)
            if not 1 <= num_workers <= self.rank_limit:
                raise FailedPrecondition(f"num_workers: worker {rank} says {num_workers} workers but "
                                         f"this shard takes at most {self.rank_limit} (--max-workers)")
            limit = self.rank_limit
        else:
            if self.num_workers and num_workers != self.num_workers:
                raise FailedPrecondition(f"num_workers: worker {rank} says {num_workers} workers but "
                                         f"this shard serves {self.num_workers}")
            limit = num_workers
        if not 0 <= rank < limit:
            raise FailedPrecondition(f"rank: {rank} is not a worker of this cluster "
                                     f"(ranks 0..{limit - 1})")

    def assign_rank(self, num_workers: int, previous: str = "") -> int:
        """--rank auto (shard 0 only, in a job with room for more workers): the rank whose session
        `previous` is (a restarted worker with its session file takes its rank back), else the
        lowest free rank in 1..max-1: one with no session, or whose session left or expired.
        Never 0, the chief. `num_workers`: what the worker says, named when refused."""
        if self.store.shard != 0:
            raise FailedPrecondition(f"rank: only shard 0 assigns --rank auto; this is shard "
                                     f"{self.store.shard}")
        if not self.elastic():
            raise FailedPrecondition(
                f"rank: --rank auto joins a job that has room for more workers, and this one "
                f"serves exactly {self.num_workers or num_workers}; start the shards "
                f"with --max-workers")
        if previous:
            for rank, cred in self.sessions.items():
                if rank in self.registered and rank not in self.left and \
                        hmac.compare_digest(previous.encode(), cred.encode()):
                    return rank
        for rank in range(1, self.rank_limit):
            if not self.session_live(rank):
                return rank
        raise ResourceExhausted(f"rank: --rank auto found no free rank on shard {self.store.shard}: all "
                                f"ranks 1..{self.rank_limit - 1} are live (--max-workers)")

    def join_step(self, rank: int, step: int, fixed: bool) -> int:
        """An elastic worker counts from `step` (sync, backup; cond held). Refused when this
        shard has already opened it, since an open step's members are fixed, unless `fixed` is
        False: the open step waits below --min-workers, its members are not fixed yet, and the
        worker counts from it. Returns the step it counts from."""
        version = self.store.version
        if rank < self.num_workers:
            return 0                       # a member from the start
        if self.join_at.get(rank, version + 1) <= version:
            return self.join_at[rank]      # already a member of the open step: it stays one
        if not fixed:
            step = version
        elif step <= version:
            raise JoinStepOpen(f"step: shard {self.store.shard} has already opened step {step} "
                               f"(it is at version {version}); propose a later one")
        self.join_at[rank] = step
        log.info("shard %d: worker %d joins, a member from step %d (now at %d)",
                 self.store.shard, rank, step, version)
        self.store.cond.notify_all()
        return step

    def join(self, rank: int, num_workers: int, previous: str = "") -> tuple[str, bool]:
        """Register `rank`; returns (its new session credential, whether it took a live session
        over). Refused while the rank's session is live, unless `previous` is that session's
        credential (checked after the layout, so a wrong model hears that first)."""
        self.check_join(rank, num_workers)
        self.maybe_begin_again(rank)
        took_over = bool(previous) and rank in self.registered and rank not in self.left and \
            hmac.compare_digest(previous.encode(), self.sessions[rank].encode())
        if self.session_live(rank) and not took_over:
            ago = time.monotonic() - self.last_seen[rank]
            raise AlreadyExists(
                f"rank: worker {rank} is already registered with shard {self.store.shard} and its "
                f"session is live (last seen {ago:.1f} s ago; it expires after "
                f"{self.cfg.step_timeout:g} s without a call, --step-timeout)")
        if not self.elastic():
            self.num_workers = num_workers
        elif not self.num_workers:
            self.num_workers = num_workers
        self.join_at.pop(rank, None)          # a joiner (re)joins from the step it proposes next
        if took_over:
            self.displaced.setdefault(rank, set()).add(self.sessions[rank])
            self.store.counters.add("sessions_taken_over")
            log.info("shard %d: worker %d registered again with its previous session's credential and "
                     "takes the rank over at once", self.store.shard, rank)
            self.on_takeover(rank)
        elif rank in self.sessions:
            why = "left" if rank in self.left or rank not in self.registered else "expired"
            self.store.counters.add("sessions_replaced")
            log.info("shard %d: worker %d registered again (its previous session %s)",
                     self.store.shard, rank, why)
        self.sessions[rank] = secrets.token_hex(16)
        self.registered.add(rank)
        self.left.discard(rank)
        self.touch(rank)
        self.revive(rank, "registered again")
        self.store.cond.notify_all()
        return self.sessions[rank], took_over

    def maybe_begin_again(self, rank: int) -> None:
        """A Register after every registered worker left (none live, none marked dead: the job on
        these shards ended) begins another job: every starting rank counts again until it
        registers, as at a first start. Without this the first worker of the next job (a second
        fit under `pserver run`, a job run again on shards still up) trained its steps alone,
        the others' gradients missing until they registered, and took a short epoch's data for
        itself (`sharing`). A starting rank (below num_workers) that never registered is not
        the next job's but this one's, late: its process started after the others finished
        (an async job on --data-assignment slices, whose chief waits for it to train its slice)."""
        if not self.registered or not self.registered <= self.left:
            return
        if rank < self.num_workers and rank not in self.registered:
            return
        log.info("shard %d: every worker of the last job left; worker %d begins another, whose steps "
                 "wait for every starting rank again", self.store.shard, rank)
        self.registered, self.left, self.dead = set(), set(), set()    # a rank dead and then left too
        self.join_at.clear()
        self.job += 1
        self.on_new_job()

    def session_live(self, rank: int) -> bool:
        return (rank in self.sessions and rank in self.registered and rank not in self.left
                and time.monotonic() - self.last_seen.get(rank, 0.0) <= self.cfg.step_timeout)

    def authorize(self, rank: int, session: str | None, revive: bool = False) -> None:
        """Check that `session` is rank's credential and note that the worker is alive.

        session None is an in-process caller (tests, a Python user driving a Shard): the
        credential is checked on every call that comes over the wire (gRPC, data plane),
        where a missing one arrives as "". `revive`: a push or pull brings a worker marked
        dead back (docs/semantics.md, "Dead workers")."""
        self.check_session(rank, session)
        self.touch(rank)
        if revive:
            self.revive(rank, "pushed or pulled again")

    def check_session(self, rank: int, session: str | None) -> None:
        """What authorize checks, changing nothing: `session` is rank's credential now. A policy
        checks it again when it holds a push (cond held, as a take-over is), so a push that was
        authorized before its rank was taken over, while its payload streamed in, is refused
        then ("taken over") and changes nothing."""
        self.check_member(rank)
        if session is not None and not hmac.compare_digest(session.encode(), self.sessions[rank].encode()):
            given = session.encode()
            if any(hmac.compare_digest(given, old.encode()) for old in self.displaced.get(rank, ())):
                raise TakenOver(
                    f"session: rank {rank} was taken over by a restarted process of the same worker "
                    f"(it registered with this session's credential); this process must stop")
            raise Unauthenticated(
                f"session: the call for worker {rank} does not carry that worker's session "
                f"credential (from its Register; another process may have registered as rank {rank})")

    def touch(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()

    def revive(self, rank: int, why: str) -> None:
        if rank in self.dead:
            self.dead.discard(rank)
            self.store.counters.add("workers_rejoined")
            log.info("shard %d: worker %d %s and rejoins at version %d",
                     self.store.shard, rank, why, self.store.version)
            self.store.cond.notify_all()

    def live(self) -> set[int]:
        """The ranks registered and neither left nor marked dead."""
        return self.registered - self.left - self.dead

    def sharing(self) -> int:
        """The live workers and the starting ranks (below num_workers) not registered yet: the
        workers an epoch's end is shared among. A worker that asks for data before the others
        have registered must not take a whole short epoch for itself (in sync the others would
        then push empty contributions, and which batches a step trains would hang on who
        registered first)."""
        coming = set(range(self.num_workers)) - self.registered
        return len(self.live() | coming)

    def expire(self) -> float | None:
        """Mark dead every worker whose session saw no call within --step-timeout. Returns the
        seconds until the next live session would expire (None when none is live), so the
        reaper can wake then: a dead worker's leases go at --step-timeout after its last call."""
        now, limit = time.monotonic(), self.cfg.step_timeout
        watched = self.live()
        stale = [r for r in watched if now - self.last_seen.get(r, now) > limit]
        self.mark_dead(stale, f"no call or heartbeat for more than {limit:g} s (--step-timeout)")
        live = [self.last_seen[r] + limit - now for r in watched - set(stale) if r in self.last_seen]
        return max(0.0, min(live)) if live else None

    def leave(self, rank: int) -> None:
        self.check_rank(rank)
        self.left.add(rank)
        self.on_change()
        self.store.cond.notify_all()

    def mark_dead(self, ranks, why: str) -> None:
        ranks = sorted(set(ranks) - self.dead - self.left)
        if not ranks:
            return
        self.dead.update(ranks)
        self.store.counters.add("workers_marked_dead", len(ranks))
        log.warning("shard %d: marked worker(s) %s dead: %s", self.store.shard, ranks, why)
        self.on_change()

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < max(self.rank_limit, 1):
            raise FailedPrecondition(f"rank: {rank} is not a worker of this cluster "
                                     f"(ranks 0..{self.rank_limit - 1})")

    def check_member(self, rank: int) -> None:
        self.check_rank(rank)
        if rank not in self.registered:
            raise NotRegistered(f"rank: worker {rank} has not registered with shard "
                                f"{self.store.shard}; call Register first")

    def members(self) -> set[int]:
        """The open step's members: the N started with the job and the joiners that are members
        from this step or before."""
        version = self.store.version
        return set(range(self.num_workers)) | {r for r, j in self.join_at.items() if j <= version}

    def expected(self) -> set[int]:
        """Ranks the open step still counts on: its members less those that left or were marked dead."""
        return self.members() - self.left - self.dead

    def toward_minimum(self) -> int:
        """How many of the open step's members count toward --min-workers (docs/operations/elastic.md):
        the live ones and those that left. A worker that leaves is done (it finished, or was stopped
        and said so): the job winds down without it, and no step waits below the minimum for it.
        What a step waits for is a member marked dead (until a joiner takes its place, or it comes
        back) or, in a job started below the minimum, the joiners that bring it there."""
        return len(self.members() - (self.dead - self.left))
