"""The data coordinator (pserver/server/coordinator.py) against a plain model of training.

The state machine's workers lease chunks, push their batches one by one (each push says which
batch it carries, so the ones before it are done), finish chunks, die, and shard 0 checkpoints,
restores and reshards. The model counts how often each (epoch, batch) was trained; the checks:
no chunk is lost (an epoch ends only with every batch trained), no chunk is held twice, and every
batch trained more than once is counted (batches_retrained) or falls after a restored checkpoint.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pserver.errors import FailedPrecondition
from pserver.server.coordinator import Coordinator, Plan, chunk_order, for_new_shard

RANKS = 3
_sessions = itertools.count()


def new_session() -> str:
    return f"s{next(_sessions)}"


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coord = Coordinator()
        self.plan: Plan | None = None
        self.trained: Counter = Counter()        # (epoch, batch) -> times trained
        self.sessions = {r: new_session() for r in range(RANKS)}
        self.work: dict[int, list] = {}          # rank -> [lease, next batch to push]
        self.saved = None                        # (state JSON, trained then)
        self.allowance = 0                       # trainings undone by restores (not the coordinator's)
        self.epoch_seen = 0

    @precondition(lambda self: self.plan is None)
    @rule(num_batches=st.integers(1, 12), chunk=st.integers(1, 5), seed=st.integers(0, 3))
    def configure(self, num_batches, chunk, seed):
        self.plan = Plan(num_batches, chunk, seed, "fp")
        self.coord.configure(self.plan)

    def _check_epoch_over(self, epoch: int) -> None:
        for e in range(self.epoch_seen, epoch):
            lost = [b for b in range(self.plan.num_batches) if self.trained[(e, b)] == 0]
            assert not lost, f"epoch {e} ended with batches {lost} never trained"
        self.epoch_seen = max(self.epoch_seen, epoch)

    @precondition(lambda self: self.plan is not None)
    @rule(rank=st.integers(0, RANKS - 1))
    def ask(self, rank):
        held = self.work.get(rank)
        if held is not None and held[1] < held[0].end:
            return                                   # still busy with its chunk
        finished = (held[0].epoch, held[0].chunk) if held is not None else None
        lease = self.coord.lease(rank, self.sessions[rank], finished)
        self.work.pop(rank, None)
        if lease is None:
            return
        self._check_epoch_over(lease.epoch)
        start, end = self.plan.bounds(lease.chunk)
        assert (lease.first, lease.end) != (start, start) and lease.end == end
        assert start <= lease.first < end
        for b in range(start, lease.first):          # what it skips was trained
            assert self.trained[(lease.epoch, b)] >= 1
        self.work[rank] = [lease, lease.first]

    @precondition(lambda self: self.work)
    @rule(data=st.data())
    def push(self, data):
        rank = data.draw(st.sampled_from(sorted(self.work)))
        lease, batch = self.work[rank]
        if batch >= lease.end:
            return
        self.trained[(lease.epoch, batch)] += 1
        assert self.coord.progress_of(rank, self.sessions[rank], lease.epoch, lease.chunk, batch)
        self.work[rank][1] = batch + 1

    @precondition(lambda self: self.plan is not None)
    @rule(rank=st.integers(0, RANKS - 1))
    def kill(self, rank):
        """The worker dies (or leaves): its session ends, a new process registers later."""
        self.coord.release(rank)
        self.work.pop(rank, None)
        self.sessions[rank] = new_session()

    @precondition(lambda self: self.plan is not None)
    @rule(rank=st.integers(0, RANKS - 1))
    def stale_progress_refused(self, rank):
        """A push for a chunk the rank does not hold changes nothing."""
        before = json.dumps(self.coord.state(), sort_keys=True)
        assert not self.coord.progress_of(rank, "not-a-session", self.coord.epoch, 0, 0)
        assert json.dumps(self.coord.state(), sort_keys=True) == before

    @precondition(lambda self: self.plan is not None)
    @rule()
    def checkpoint(self):
        self.saved = (json.loads(json.dumps(self.coord.state())), Counter(self.trained))

    @precondition(lambda self: self.saved is not None)
    @rule(reshard=st.booleans())
    def restore(self, reshard):
        state, trained_then = self.saved
        if reshard:                                  # old shard 0's state goes to new shard 0 only
            assert for_new_shard({0: state, 1: None}, 1) is None
            state = for_new_shard({0: state, 1: None}, 0)
        self.coord = Coordinator.load(state)
        self.allowance += sum((self.trained - trained_then).values())
        self.work.clear()                            # every session is gone with the old shard
        self.sessions = {r: new_session() for r in range(RANKS)}

    @invariant()
    def chunks_partitioned(self):
        c = self.coord
        if c.plan is None:
            return
        leased = [chunk for _, chunk, _ in c.leases.values()]
        every = list(c.queue) + leased + sorted(c.done)
        assert sorted(every) == list(range(c.plan.num_chunks)), (c.queue, leased, c.done)

    @invariant()
    def extra_training_counted(self):
        extra = sum(n - 1 for n in self.trained.values() if n > 1)
        assert extra <= self.coord.counters["batches_retrained"] + self.allowance


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_all_workers_busy_the_epoch_ends_with_every_chunk_done():
    """A loop of two workers, one killed halfway: catches a chunk lost on release."""
    c = Coordinator()
    c.configure(Plan(10, 3, 7, "fp"))
    sessions = {0: "a", 1: "b"}
    held: dict[int, tuple] = {}
    trained = Counter()
    for step in range(200):
        for rank in (0, 1):
            lease, nxt = held.get(rank, (None, None))
            if lease is None or nxt == lease.end:
                lease = c.lease(rank, sessions[rank], (lease.epoch, lease.chunk) if lease else None)
                if lease is None:
                    held.pop(rank, None)
                    continue
                nxt = lease.first
            if lease.epoch == 2:
                break
            trained[(lease.epoch, nxt)] += 1
            c.progress_of(rank, sessions[rank], lease.epoch, lease.chunk, nxt)
            held[rank] = (lease, nxt + 1)
        if step == 3:
            c.release(1)
            sessions[1] = "b2"
            held.pop(1)
    assert c.epoch == 2
    assert all(trained[(e, b)] >= 1 for e in (0, 1) for b in range(10))
    assert c.counters["chunks_done"] == 2 * 4 and c.counters["chunks_released"] == 1
    assert c.counters["batches_retrained"] == 1
    assert sum(n - 1 for n in trained.values()) == 1


def test_chunk_order_follows_seed_and_epoch():
    """Catches an order that ignores the epoch or the seed, or is not a permutation."""
    assert sorted(chunk_order(20, 1, 0)) == list(range(20))
    assert chunk_order(20, 1, 0) == chunk_order(20, 1, 0)
    assert chunk_order(20, 1, 0) != chunk_order(20, 1, 1)
    assert chunk_order(20, 1, 0) != chunk_order(20, 2, 0)


def test_a_worker_reading_other_data_is_refused_and_changes_nothing():
    c = Coordinator()
    c.configure(Plan(10, 3, 7, "abc"))
    before = c.state()
    with pytest.raises(FailedPrecondition, match="other data"):
        c.configure(Plan(10, 3, 7, "xyz"))
    with pytest.raises(FailedPrecondition, match="--chunk-batches"):
        c.configure(Plan(10, 4, 7, "abc"))
    assert c.state() == before and c.plan == Plan(10, 3, 7, "abc")


def test_a_new_session_of_the_rank_releases_the_old_lease():
    """A restarted worker (new session) asks again: its old lease's rest is released first."""
    c = Coordinator()
    c.configure(Plan(4, 2, 0, "fp"))
    first = c.lease(0, "old")
    c.progress_of(0, "old", first.epoch, first.chunk, first.first + 1)
    again = c.lease(0, "new")
    assert again == type(first)(0, first.chunk, first.first + 1, first.end)
    assert c.counters["chunks_released"] == 1 and c.counters["batches_retrained"] == 1
