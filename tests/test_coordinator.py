"""The data coordinator (pserver/server/coordinator.py) against a plain model of training.

The state machine's workers lease chunks, push their batches one by one (each push says which
batch it carries, so the ones before it are done), finish chunks, die, and shard 0 checkpoints,
restores and reshards. The model counts how often each (epoch, batch) was trained; the checks:
no chunk is lost (an epoch ends only with every batch trained), the chunks and the pieces split at
an epoch's end cover every batch exactly once, and every batch trained more than once is counted
(batches_retrained) or falls after a restored checkpoint.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pserver.errors import FailedPrecondition, InvalidArgument, LeaseGone
from pserver.persist.reshard import for_new_shard
from pserver.server.coordinator import Coordinator, EpochSums, Plan, chunk_order
from tests.support.pushes import push_request

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
        self.log: dict[int, list] = {r: [] for r in range(RANKS)}   # rank -> (epoch, chunk, end) done
        self.saved = None                        # (state JSON, trained then, batches in flight then)
        self.allowance = 0                       # trainings undone by restores that no worker reported
        self.epoch_seen = 0

    @precondition(lambda self: self.plan is None)
    @rule(num_batches=st.integers(1, 12), chunk=st.integers(1, 5), seed=st.integers(0, 3),
          epochs=st.sampled_from([0, 2, 3]))
    def configure(self, num_batches, chunk, seed, epochs):
        self.plan = Plan(num_batches, chunk, seed, "fp", epochs)
        self.coord.configure(self.plan)

    def _check_epoch_over(self, epoch: int) -> None:
        for e in range(self.epoch_seen, epoch):
            lost = [b for b in range(self.plan.num_batches) if self.trained[(e, b)] == 0]
            assert not lost, f"epoch {e} ended with batches {lost} never trained"
        self.epoch_seen = max(self.epoch_seen, epoch)

    @precondition(lambda self: self.plan is not None)
    @rule(rank=st.integers(0, RANKS - 1), workers=st.integers(0, RANKS + 1))
    def ask(self, rank, workers):
        held = self.work.get(rank)
        if held is not None and held[1] < held[0].end:
            return                                   # still busy with its chunk
        finished = (held[0].epoch, held[0].chunk) if held is not None else None
        if held is not None:
            self.log[rank].append((held[0].epoch, held[0].chunk, held[0].end))
        left = sum(self.coord._left(c) for c in self.coord.queue) if held is None or finished else 0
        lease = self.coord.lease(rank, self.sessions[rank], finished, workers=workers)
        self.work.pop(rank, None)
        if lease is None:
            return
        self._check_epoch_over(lease.epoch)
        start, end = self.coord.bounds(lease.chunk)
        assert (lease.first, lease.end) != (start, start) and lease.end == end
        if workers >= 2 and left and lease.epoch == self.coord.epoch and held is not None:
            assert lease.end - lease.first <= max(self.plan.chunk_batches, -(-left // workers)), (lease, left)
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
        self.log[rank] = []                          # a dead process reports nothing
        self.sessions[rank] = new_session()

    @precondition(lambda self: self.plan is not None)
    @rule(rank=st.integers(0, RANKS - 1))
    def stale_progress_refused(self, rank):
        """A push for a chunk the rank does not hold (a worker back after its lease was released)
        moves no lease and counts nothing: shard 0 refuses it (LeaseGone), so it is not trained."""
        before = self.coord.state()
        assert not self.coord.progress_of(rank, "not-a-session", self.coord.epoch, 0, 0)
        assert self.coord.state() == before

    @precondition(lambda self: self.plan is not None)
    @rule()
    def checkpoint(self):
        c = self.coord
        inflight = {(c.epoch, i) for _, chunk, i in c.leases.values()
                    if i >= c.bounds(chunk)[0] + c.progress.get(chunk, 0)}
        self.saved = (json.loads(json.dumps(c.state())), Counter(self.trained), inflight)

    @precondition(lambda self: self.saved is not None)
    @rule(reshard=st.booleans())
    def restore(self, reshard):
        state, trained_then, inflight_then = self.saved
        if reshard:                                  # old shard 0's state goes to new shard 0 only
            assert for_new_shard({0: state, 1: None}, 1) is None
            state = for_new_shard({0: state, 1: None}, 0)
        old_ident = self.coord.ident
        self.coord = Coordinator.load(state)
        assert self.coord.ident != old_ident
        # The live workers report what they did under the old coordinator: their finished chunks
        # and the part of the one they held. Each batch reported that was trained after the
        # checkpoint must be counted once; the rest (a dead worker's part of a chunk no one
        # finished; trainings after the checkpoint counted by releases the restore rolled back)
        # is the allowance.
        reports = [r for log in self.log.values() for r in log]
        reports += [(lease.epoch, lease.chunk, nxt) for lease, nxt in self.work.values()]
        before = self.coord.counters["batches_retrained"]
        self.coord.done_before_restore(reports)
        assert self.coord.done_before_restore(reports) == 0          # a report twice counts once
        covered = {(e, b) for e, c, end in reports for b in range(self.coord._span(c)[0], end)}
        after_ckpt = self.trained - trained_then
        self.allowance += sum(n - (key in covered) for key, n in after_ckpt.items())
        # A batch in flight at the checkpoint counts once at the load (its next holder redoes it),
        # and a report of it cannot tell its first holder finishing it from a later holder that
        # redid it before the restore (its lease released, then leased again): that one redo is
        # not counted (docs/guide/data-leases.md says so).
        self.allowance += sum(1 for key in inflight_then if after_ckpt[key] > 0)
        counted = self.coord.counters["batches_retrained"] - before
        assert counted <= sum(after_ckpt.values()), (counted, after_ckpt)   # never counts what was not redone
        self.work.clear()                            # every session is gone with the old shard
        self.log = {r: [] for r in range(RANKS)}
        self.sessions = {r: new_session() for r in range(RANKS)}

    @invariant()
    def chunks_partitioned(self):
        c = self.coord
        if c.plan is None or (c.plan.epochs and c.epoch >= c.plan.epochs):
            return
        leased = [chunk for _, chunk, _ in c.leases.values()]
        every = list(c.queue) + leased + sorted(c.done)
        assert len(every) == len(set(every)) == c.num_pieces(), (c.queue, leased, c.done)
        spans = sorted(c.bounds(chunk) for chunk in every)   # the pieces tile the epoch's batches
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]], spans
        assert spans[-1][1] == c.plan.num_batches, spans

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


def test_no_lease_past_the_jobs_epochs():
    """Fails if the coordinator opens epoch --epochs: its chunks would be leased and released as the
    workers leave, counted as chunks_released for nothing."""
    c = Coordinator()
    c.configure(Plan(2, 1, 0, "fp", 1))
    first = c.lease(0, "a")
    second = c.lease(1, "b")
    assert c.lease(0, "a", (0, first.chunk)) is None and c.lease(1, "b", (0, second.chunk)) is None
    assert c.epoch == 1 and c.leases == {}
    assert c.counters == dict(chunks_done=2, chunks_released=0, batches_retrained=0, batches_dropped=0)


def test_batches_reported_from_an_epoch_after_the_checkpoints_count_as_retrained():
    """A worker trained epoch 0 and part of epoch 1 after shard 0's checkpoint (taken at epoch 0);
    shard 0 restores it and the worker reports both at its first ask. The epoch-1 batch is trained
    again once the loaded coordinator reaches epoch 1, so it counts now: a report comes only once.
    Fails if a report of a later epoch than the loaded one's is dropped (hypothesis found it:
    batches_retrained said 1 for 2 batches trained twice). A report past the job's epochs counts
    nothing."""
    c = Coordinator()
    c.configure(Plan(1, 1, 0, "fp", 2))
    saved = json.loads(json.dumps(c.state()))
    first = c.lease(0, "a")
    assert c.progress_of(0, "a", 0, first.chunk, 0)
    second = c.lease(0, "a", (0, first.chunk))
    assert second.epoch == 1 and c.progress_of(0, "a", 1, second.chunk, 0)
    d = Coordinator.load(saved)
    d.configure(Plan(1, 1, 0, "fp", 2))
    assert d.done_before_restore([(0, 0, 1), (1, 0, 1), (2, 0, 1)]) == 2
    assert d.done_before_restore([(1, 0, 1)]) == 0                   # once


def test_a_finished_coordinator_starts_over_only_for_a_new_run():
    """A second run on shards whose coordinator finished: with the same plan nothing is left
    (resume), with more epochs it goes on at the next, --no-resume (restart) or other data starts
    at epoch 0; while a run goes on, a
    restart is ignored (a late worker of a --no-resume run must not throw its progress away) and
    other data is refused. Catches a restart that resets a running job, and a finished one that
    no new run can use."""
    plan = Plan(2, 1, 0, "fp", 1)
    c = Coordinator()
    c.configure(plan)
    a = c.lease(0, "a")
    c.configure(plan, restart=True)                          # running: ignored
    assert c.leases and c.epoch == 0 and c.lease(0, "a") == a
    c.lease(1, "b", None)
    c.lease(0, "a", (0, a.chunk))
    c.lease(1, "b", (0, c.leases[1][1]))
    assert c.finished and not c.leases
    c.configure(plan)                                        # the same run's data: nothing left
    assert c.lease(0, "c") is None and c.finished
    c.configure(plan, restart=True)                          # --no-resume: epoch 0 again
    assert not c.finished and c.lease(0, "c").epoch == 0
    with pytest.raises(FailedPrecondition, match="other data"):
        c.configure(Plan(2, 1, 0, "other", 1), restart=True)  # a lease is out: not finished
    d = Coordinator.load(c.state())
    d.done, d.queue, d.epoch = {0, 1}, [], 1                 # finished (as after its last chunk)
    d.configure(Plan(2, 1, 0, "fp", 3))                      # more epochs: goes on at epoch 2 of 3
    assert d.epoch == 1 and sorted(d.queue) == [0, 1] and not d.done and d.lease(0, "e").epoch == 1
    e = Coordinator.load(c.state())
    e.done, e.queue, e.epoch = {0, 1}, [], 1
    e.configure(Plan(4, 2, 0, "new", 2))                     # another plan: a new run
    assert e.plan == Plan(4, 2, 0, "new", 2) and e.epoch == 0 and len(e.queue) == 2


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


# --- in a real shard: leases, pushes that carry progress, dead workers, checkpoints --------------

def _cluster(tmp_path=None, workers=2, **cfg):
    import numpy as np

    from pserver.models.layout import Layout
    from tests.support.shards import make_cluster
    extra = dict(checkpoint_dir=str(tmp_path)) if tmp_path is not None else {}
    return make_cluster(Layout.of([("w", (4,))]), np.ones(4, np.float32), 1, workers,
                        optimizer="adam", lr=0.1, **extra, **cfg)[0]


def _push(shard, rank, samples, lease=None, value=1.0, trained=(0.0, 0.0)):
    import numpy as np

    return shard.push(push_request(np.full(4, value, np.float32), rank=rank, step=shard.store.version,
                                    samples=samples, lease=lease, trained=trained))[0]


@pytest.mark.parametrize("correct", [-1.0, 9.0, float("nan")])
def test_a_push_claiming_an_impossible_count_of_right_samples_is_refused_and_changes_nothing(correct):
    """Each leased push's count of samples classed right goes into every worker's History: one
    outside [0, the batch's samples] is refused in one line, before the gradient, the lease's
    progress or the epoch's sums change; a NaN or infinite loss is taken (a diverged run shows it)."""
    from pserver.errors import InvalidArgument
    shard = _cluster(mode="async")
    plan = Plan(8, 4, 1, "fp", 1)
    lease, _ = shard.lease(0, None, plan)
    params, version = shard.store.params.copy(), shard.store.version
    with pytest.raises(InvalidArgument, match=r"^lease_correct: .* in a batch of 8; send how many") as e:
        _push(shard, 0, 8, lease=(0, lease.chunk, lease.first), trained=(1.0, correct))
    assert "\n" not in str(e.value)
    c = shard.store.coordinator
    assert shard.store.version == version and (shard.store.params == params).all()
    assert c.trained == {} and c.progress == {}
    _push(shard, 0, 8, lease=(0, lease.chunk, lease.first), trained=(float("inf"), 8.0))
    assert c.trained[0][1:] == (8.0, 8) and c.trained[0][0] == float("inf")


@pytest.mark.parametrize("mode", ["sync", "backup"])
def test_an_empty_contribution_counts_toward_the_step_and_weighs_nothing(mode):
    """Fails if a 0-sample push is refused, waited past, weighed (the mean halves), or if a step of
    empty pushes only moves the optimizer (adam steps on a zero gradient)."""
    import numpy as np
    extra = dict(backup_workers=1, workers=3) if mode == "backup" else {}   # backup: a quorum of 2
    shard, alone = _cluster(mode=mode, **extra), _cluster(mode="sync")
    _push(shard, 0, 3, value=2.0)
    _push(shard, 1, 0, value=0.0)
    assert shard.store.version == 1
    alone_members = alone.members
    with alone.store.cond:
        alone_members.leave(1)                      # the same step with rank 0's push alone
    _push(alone, 0, 3, value=2.0)
    assert shard.store.params.tobytes() == alone.store.params.tobytes()
    before = shard.store.params.copy(), {k: v.copy() for k, v in shard.store.optimizer.state.items()}
    _push(shard, 0, 0, value=0.0)
    _push(shard, 1, 0, value=0.0)
    assert shard.store.version == 2 and np.array_equal(shard.store.params, before[0])
    assert all(np.array_equal(v, before[1][k]) for k, v in shard.store.optimizer.state.items())


def test_a_dead_workers_lease_goes_to_the_next_worker_from_its_first_batch_not_done():
    """Shard 0 wiring: a push's lease progress reaches the coordinator, marking the worker dead
    releases its lease (on_change), the next ask gets the rest, status shows the counts, and the dead
    worker's push when it comes back is refused (LeaseGone) and changes nothing. Fails without the
    release hook (rank 0 would get a fresh chunk), without progress on push, or if a stale lease's
    push is taken in (the weights move; issue 34's "told to stop")."""
    import numpy as np
    shard = _cluster(mode="async")
    plan = Plan(8, 4, 5, "fp")
    held, _ = shard.lease(1, None, plan)
    assert (held.first, held.end) == shard.store.coordinator.plan.bounds(held.chunk)
    for b in range(held.first, held.first + 3):
        _push(shard, 1, 2, lease=(held.epoch, held.chunk, b))
    with shard.store.cond:
        shard.members.mark_dead({1}, "a test")
    counts = shard.status()["counters"]
    assert (counts["chunks_released"], counts["batches_retrained"]) == (1, 1)
    assert shard.store.coordinator.leases == {}
    mine, _ = shard.lease(0, None, plan)
    assert (mine.chunk, mine.first, mine.end) == (held.chunk, held.first + 2, held.end)
    params = shard.store.params.copy()
    with pytest.raises(LeaseGone, match="no longer holds chunk"):          # back: its old lease is gone
        _push(shard, 1, 2, lease=(held.epoch, held.chunk, held.first + 3))
    assert np.array_equal(shard.store.params, params)                      # refused: not trained again
    assert shard.status()["counters"]["batches_retrained"] == 1
    assert shard.store.coordinator.leases[0][1] == held.chunk              # rank 0 holds it still


def test_a_chunk_reported_finished_after_its_lease_ended_is_said_gone_and_trained_again():
    """A worker marked dead after its chunk's last push (SIGSTOPped while it waits for its step) asks
    for its next lease with that chunk finished: the lease had ended and the chunk went back to the
    queue, so the reply says `gone` and the chunk is not counted done (the next ask gets it again from
    its first batch not done). Fails if a report of a chunk the rank no longer holds counts, or if the
    worker is not told (it would say nothing of the chunk trained twice)."""
    shard = _cluster(mode="async")
    plan = Plan(8, 4, 5, "fp")
    held, gone = shard.lease(1, None, plan)
    assert not gone
    for b in range(held.first, held.end):
        _push(shard, 1, 2, lease=(held.epoch, held.chunk, b))
    with shard.store.cond:
        shard.members.mark_dead({1}, "a test")
    nxt, gone = shard.lease(1, None, plan, finished=(held.epoch, held.chunk))
    assert gone and shard.status()["counters"]["chunks_done"] == 0
    assert nxt.chunk == held.chunk and nxt.first == held.end - 1      # its last push may not have applied
    mine, gone = shard.lease(1, None, plan, finished=(nxt.epoch, nxt.chunk))
    assert not gone and shard.status()["counters"]["chunks_done"] == 1 and mine.chunk != held.chunk


def test_with_several_shards_a_refused_stale_lease_push_counts_as_retrained():
    """Shard 0 of 2 refuses a push for a lease its worker no longer holds, but shard 1 took that push in
    (a worker pushes to every shard at once): the batch counts in batches_retrained. Fails if the
    refusal is missing or the count is (the counters would claim fewer batches trained twice)."""
    import numpy as np

    from pserver.models.layout import Layout
    from tests.support.shards import make_cluster
    shard = make_cluster(Layout.of([("w", (4,))]), np.ones(4, np.float32), 2, 2, mode="async")[0]
    n = shard.store.end - shard.store.start

    def push(lease):
        return shard.push(push_request(np.ones(n, np.float32), rank=1, step=shard.store.version, samples=2,
                                        lease=lease))

    plan = Plan(8, 4, 5, "fp")
    held, _ = shard.lease(1, None, plan)
    push((held.epoch, held.chunk, held.first))
    with shard.store.cond:
        shard.members.mark_dead({1}, "a test")
    assert shard.store.coordinator.counters["batches_retrained"] == 1       # its in-flight batch
    with pytest.raises(LeaseGone):
        push((held.epoch, held.chunk, held.first + 1))
    assert shard.store.coordinator.counters["batches_retrained"] == 2

def test_a_worker_with_other_data_is_refused_and_shard_1_has_no_coordinator():
    shard = _cluster()
    shard.lease(0, None, Plan(8, 4, 5, "fp"))
    with pytest.raises(FailedPrecondition, match="reads other data"):
        shard.lease(1, None, Plan(8, 4, 5, "other"))
    from pserver.config import ServerConfig
    from pserver.server.shard import Shard
    with pytest.raises(FailedPrecondition, match="coordinator is in shard 0"):
        Shard(ServerConfig(shard=1, num_shards=2, num_workers=2)).lease(0, None, Plan(8, 4, 5, "fp"))


def test_the_coordinator_is_checkpointed_with_shard_0_and_resharded_to_the_new_shard_0(tmp_path):
    """meta["coordinator"] round trip through a real file and a restored shard (its leases released),
    and reshard.combine: new shard 0 gets old shard 0's state, the others none."""
    from pserver.config import ServerConfig
    from pserver.persist import checkpoint, reshard
    from pserver.server.shard import Shard
    shard = _cluster(tmp_path)
    plan = Plan(8, 4, 5, "fp")
    first, _ = shard.lease(0, None, plan)
    _push(shard, 0, 2, lease=(0, first.chunk, first.first + 1))
    _push(shard, 1, 2)
    path, _ = shard.checkpoint(0)
    saved = checkpoint.load(path)
    assert saved.coordinator == shard.store.coordinator.state()
    restored = Shard(ServerConfig(num_workers=2, optimizer="adam", lr=0.1, restore=str(tmp_path)))
    c = restored.store.coordinator
    assert c.leases == {} and c.queue[0] == first.chunk and c.progress == {first.chunk: 1}
    assert c.counters["chunks_released"] == 1 and c.counters["batches_retrained"] == 1
    other = checkpoint.Checkpoint(**{**saved.__dict__, "shard": 1, "coordinator": None})
    for new in (1, 2, 3):
        got = [reshard.combine([saved, other], new, j).coordinator for j in range(new)]
        assert got == [saved.coordinator] + [None] * (new - 1)



def test_a_restored_shard_0_counts_the_batches_done_since_its_checkpoint_once(tmp_path):
    """A real checkpoint file and a Shard restored from it: chunk a was done at the checkpoint, chunk
    b had its first batch in flight; after it, b was finished and c begun. The worker reports what it
    did (a, b whole, c's first batch) and the restored coordinator counts b's first (in flight, at
    load), b's second and c's first: 3, and nothing more when the report comes again. Fails if the
    restore counts nothing (the old behaviour), counts chunk a (done at the checkpoint) or counts b's
    first batch twice."""
    from pserver.config import ServerConfig
    from pserver.models.layout import Layout
    from pserver.server.shard import Shard
    shard = _cluster(tmp_path, mode="async")
    plan = Plan(8, 2, 5, "fp")
    a, _ = shard.lease(0, None, plan)
    _push(shard, 0, 2, lease=(0, a.chunk, a.first))
    _push(shard, 0, 2, lease=(0, a.chunk, a.first + 1))
    b, _ = shard.lease(0, None, plan, finished=(0, a.chunk))
    _push(shard, 0, 2, lease=(0, b.chunk, b.first))
    shard.checkpoint(0)
    _push(shard, 0, 2, lease=(0, b.chunk, b.first + 1))
    c, _ = shard.lease(0, None, plan, finished=(0, b.chunk))
    _push(shard, 0, 2, lease=(0, c.chunk, c.first))
    assert shard.store.coordinator.counters["batches_retrained"] == 0
    restored = Shard(ServerConfig(num_workers=2, optimizer="adam", lr=0.1, mode="async",
                                  restore=str(tmp_path)))
    restored.register(0, 2, 0, 1, Layout.of([("w", (4,))]))
    coordinator = restored.store.coordinator
    assert coordinator.ident != shard.store.coordinator.ident           # what tells the workers
    assert coordinator.counters["batches_retrained"] == 1               # b's first batch, in flight
    report = [(0, a.chunk, a.end), (0, b.chunk, b.end), (0, c.chunk, c.first + 1)]
    again, _ = restored.lease(0, None, plan, done_before_restore=report)
    assert coordinator.counters["batches_retrained"] == 3
    assert again.chunk == b.chunk and again.first == b.first            # b is trained again from its start
    restored.lease(0, None, plan, done_before_restore=report)
    assert coordinator.counters["batches_retrained"] == 3

# --- over gRPC: LeaseData and the push that carries a lease's progress ----------------------------

def test_lease_data_over_grpc_carries_progress_and_refuses_other_data(shard_server):
    """A real shard server and two clients (the same-host data plane on): the push that carries a
    lease goes by gRPC with its progress (a data-plane push would lose it: the second worker would
    get the chunk from its first batch), the other worker gets the rest once the first leaves,
    status counts it, and a worker with another dataset gets one FAILED_PRECONDITION line."""
    import numpy as np

    from pserver.errors import FailedPrecondition as Refused
    from tests.support.clients import LAYOUT, ready_client
    addr, _ = shard_server(optimizer="sgd", lr=0.1, num_workers=2, mode="async")
    a = ready_client(addr, num_workers=2, rank=0, plane="auto")
    b = ready_client(addr, num_workers=2, rank=1, plane="auto", init=False)
    plan = (12, 4, 3, "fp")
    got = a.lease_data(*plan)
    assert got.has_lease and got.end_batch - got.first_batch == 4
    w = np.empty(LAYOUT.total, np.float32)
    a.pull(w)
    for batch in range(got.first_batch, got.first_batch + 3):
        a.push(np.ones(LAYOUT.total, np.float32), 1, lease=(got.epoch, got.chunk, batch))
    a.leave()
    rest = b.lease_data(*plan)
    assert (rest.chunk, rest.first_batch, rest.end_batch) == (got.chunk, got.first_batch + 2, got.end_batch)
    st = b.status()[0].counters
    assert (st.chunks_released, st.batches_retrained, st.chunks_done) == (1, 1, 0)
    done = b.lease_data(*plan, finished=(rest.epoch, rest.chunk))
    assert done.has_lease and done.chunk != got.chunk and b.status()[0].counters.chunks_done == 1
    with pytest.raises(Refused, match="reads other data") as e:
        b.lease_data(12, 4, 3, "another")
    assert "\n" not in str(e.value)
    a.close()
    b.close()


def test_lease_replies_sum_what_every_workers_steps_measured_over_the_finished_epoch(shard_server):
    """Keras's per-epoch training loss and accuracy over every worker's batches: each push with a
    lease carries its batch's loss x samples and samples classed right, one worker over the data
    plane and one over gRPC; shard 0 sums the pushes it takes, and the replies once the epoch is
    done say exactly those sums. A refused push (a lease not held) counts for nothing; a sum lost
    by either transport, or one counted per worker only, fails."""
    import numpy as np

    from tests.support.clients import LAYOUT, ready_client
    addr, _ = shard_server(optimizer="sgd", lr=0.1, num_workers=2, mode="async")
    a = ready_client(addr, num_workers=2, rank=0, plane="auto")
    b = ready_client(addr, num_workers=2, rank=1, plane="grpc", init=False)
    plan = (8, 2, 5, "fp", 2)                  # four chunks of two batches an epoch, two epochs
    w, g = np.empty(LAYOUT.total, np.float32), np.ones(LAYOUT.total, np.float32)
    replies = {a: a.lease_data(*plan), b: b.lease_data(*plan)}
    a.pull(w)
    b.pull(w)
    with pytest.raises(LeaseGone):             # b's chunk is not a's: refused, counted nowhere
        a.push(g, 100, lease=(0, replies[b].chunk, replies[b].first_batch), trained=(1e6, 100.0))
    a.pull(w)
    expected, k = [0.0, 0.0, 0], 0
    while all(r.epoch == 0 for r in replies.values()):
        for client in (a, b):
            lease = replies[client]
            assert lease.trained_samples == 0          # nothing finished yet: nothing to report
            if lease.epoch == 0 and lease.has_lease:
                for batch in range(lease.first_batch, lease.end_batch):
                    k += 1
                    loss_sum, correct, n = 0.25 * k, float(k % 3), k
                    client.push(g, n, lease=(0, lease.chunk, batch), trained=(loss_sum, correct))
                    expected = [expected[0] + loss_sum, expected[1] + correct, expected[2] + n]
                replies[client] = client.lease_data(*plan, finished=(0, lease.chunk))
            elif lease.epoch == 0:
                replies[client] = client.lease_data(*plan)
    ended = [r for r in replies.values() if r.epoch == 1]
    ended.append(b.lease_data(*plan) if replies[a].epoch == 1 else a.lease_data(*plan))
    for r in ended:                            # the epoch's end, as both workers hear of it
        assert (r.trained_loss_sum, r.trained_correct, r.trained_samples) == tuple(expected)
    assert k == 8 and expected[2] == 36
    a.close()
    b.close()


def test_the_epochs_sums_survive_a_checkpoint_and_a_new_run_starts_without_them():
    """The sums are part of shard 0's checkpoint (a restored coordinator reports the epoch it had
    summed); the newest KEPT_EPOCH_SUMS are kept (test_an_epoch_logs_ask_answers_the_sums_of_any_
    finished_epoch_kept); a new run's plan drops them."""
    c = Coordinator()
    c.configure(Plan(4, 2, 1, "fp", 3))
    c.tally(0, 2.0, 1.0, 3)
    c.tally(0, 1.5, 2.0, 3)
    c.tally(1, 4.0, 4.0, 8)
    restored = Coordinator.load(json.loads(json.dumps(c.state())))
    assert restored.trained == {0: (3.5, 3.0, 6), 1: (4.0, 4.0, 8)}
    older = c.state()                          # a checkpoint written before the sums and --no-shuffle
    del older["trained"]
    older["plan"] = older["plan"][:5]
    back = Coordinator.load(json.loads(json.dumps(older)))
    assert back.trained == {} and back.plan == restored.plan and not back.plan.in_order
    c.tally(2, 1.0, 1.0, 1)
    assert set(c.trained) == {0, 1, 2}
    c.epoch = 3                                # finished, nothing leased: a new run may start over
    c.configure(Plan(4, 2, 1, "other data", 3))
    assert c.trained == {}


def lockstep_epoch(num_batches: int, chunk: int, workers: int, share: bool) -> tuple[int, Counter, int]:
    """Sync-style steps: each step every worker with a lease trains its next batch; one whose chunk
    is done asks again (the ones with none push empty contributions). Returns (steps until every
    chunk of epoch 1 is done, times each batch was trained, chunks_done)."""
    c = Coordinator()
    c.configure(Plan(num_batches, chunk, 7, "fp", 1))
    held = {r: c.lease(r, f"s{r}", workers=workers if share else 0) for r in range(workers)}
    at = {r: lease.first for r, lease in held.items() if lease is not None}
    trained, steps = Counter(), 0
    while not c.finished:
        steps += 1
        for r in range(workers):
            lease = held[r]
            if lease is None:
                continue
            trained[at[r]] += 1
            assert c.progress_of(r, f"s{r}", lease.epoch, lease.chunk, at[r])
            at[r] += 1
        for r in range(workers):
            lease = held[r]
            if lease is None or at[r] == lease.end:
                finished = (lease.epoch, lease.chunk) if lease is not None else None
                held[r] = c.lease(r, f"s{r}", finished, workers=workers if share else 0)
                if held[r] is not None:
                    at[r] = held[r].first
    return steps, trained, c.counters["chunks_done"]


@pytest.mark.parametrize("num_batches, chunk, workers",
                         [(70, 16, 4), (937, 16, 4), (100, 16, 3), (33, 8, 8), (40, 16, 2)])
def test_the_epochs_end_is_shared_out_so_sync_steps_keep_every_worker_busy(num_batches, chunk, workers):
    """Catches an epoch's end left to whole chunks (the quick start's 937 batches in chunks of 16 on
    4 workers ran 241 steps, 16 of them with only 2 or 3 workers training) and a split that loses or
    repeats a batch: with the end shared out, the epoch takes at most 2 steps more than
    ceil(batches / workers), every batch once, and chunks_done still counts each chunk once."""
    steps, trained, done = lockstep_epoch(num_batches, chunk, workers, share=True)
    assert sorted(trained) == list(range(num_batches)) and set(trained.values()) == {1}
    assert done == Plan(num_batches, chunk, 7, "fp").num_chunks
    assert steps <= -(-num_batches // workers) + 2, steps
    whole, _, _ = lockstep_epoch(num_batches, chunk, workers, share=False)
    assert whole > steps


def test_a_restore_counts_what_was_trained_on_pieces_since_the_checkpoint_exactly():
    """The epoch's end is split into pieces; shard 0 checkpoints while a piece is half done, then
    the piece and another are trained, and shard 0 restores. The workers' reports (a bad id and an
    earlier epoch's chunk among them, which count nothing and must not stop the count) name pieces
    the restored coordinator may not have; what they cover past the checkpoint counts once. Fails
    if a piece's span is taken wrongly from its id, or a bad report ends the counting."""
    c = Coordinator()
    plan = Plan(24, 8, 1, "fp", 2)
    c.configure(plan)
    held = {r: c.lease(r, f"s{r}", workers=2) for r in (0, 1)}       # two whole chunks of three
    for r in (0, 1):
        for b in range(held[r].first, held[r].end):
            assert c.progress_of(r, f"s{r}", 0, held[r].chunk, b)
        # 8 batches left for 2 workers: 4 and a piece of 4, which the second takes whole
        held[r] = c.lease(r, f"s{r}", (0, held[r].chunk), workers=2 if r == 0 else 0)
    assert [h.end - h.first for h in held.values()] == [4, 4]
    pieces = {r: h.chunk for r, h in held.items()}
    p0 = next(p for p in pieces.values() if p >= plan.num_chunks)      # a piece, id num_chunks + first
    holder = next(r for r, p in pieces.items() if p == p0)
    first, end = c.bounds(p0)
    assert c.progress_of(holder, f"s{holder}", 0, p0, first)            # its first batch, then a checkpoint
    assert c.progress_of(holder, f"s{holder}", 0, p0, first + 1)
    state = json.loads(json.dumps(c.state()))                           # first done, first + 1 in flight
    for b in range(first + 1, end):
        assert c.progress_of(holder, f"s{holder}", 0, p0, b)
    restored = Coordinator.load(state)
    assert restored.counters["batches_retrained"] == 1      # first + 1, in flight at the checkpoint
    report = [(0, 10 ** 9, 5), (-1, 0, 4), (0, p0, end)]
    # after the checkpoint: first + 1 (counted at load) and first + 2 .. end - 1
    assert restored.done_before_restore(report) == end - first - 2
    assert restored.done_before_restore(report) == 0


def test_a_plan_refused_or_failing_to_build_changes_nothing(monkeypatch):
    """46.6: a plan's fields are checked before anything is built, and a build that fails (a
    MemoryError once left the plan fixed with no queue, and every real worker refused) leaves
    the coordinator as it was. Catches a plan set before its queue is built."""
    import pserver.server.coordinator as coordinator_module

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate")

    c = Coordinator()
    with monkeypatch.context() as m:
        m.setattr(coordinator_module, "chunk_order", no_memory)
        with pytest.raises(MemoryError):
            c.configure(Plan(10, 1, 0, "fp", 1))
    assert c.plan is None and c.queue == []
    for bad, field in ((Plan(10, 1, -1, "fp", 1), "seed -1"), (Plan(0, 1, 0, "fp", 1), "num_batches 0"),
                       (Plan(10, 0, 0, "fp", 1), "chunk_batches 0"), (Plan(10, 1, 0, "fp", -2), "epochs -2"),
                       (Plan(10, 1, 0, "f" * 300, 1), "fingerprint of 300")):
        with pytest.raises(InvalidArgument, match=field):
            c.configure(bad)
        assert c.plan is None and c.queue == [] and c.nbytes == 0
    plan = Plan(10, 3, 0, "fp", 1)
    assert plan.nbytes == 4 * 112 + 10 * 2
    c.configure(plan, order=c.prepared(plan))
    assert c.plan == plan and sorted(c.queue) == [0, 1, 2, 3] and c.queue == chunk_order(4, 0, 0)
    before = c.state()
    with pytest.raises(FailedPrecondition):
        c.configure(Plan(10, 3, 0, "fp", 2))               # a run going on: its --epochs stay
    assert c.state() == before


def test_a_restored_coordinator_takes_more_epochs_until_it_hands_out_a_lease():
    """45.6: a job stopped, started again from its checkpoint with more --epochs, trains the
    epochs left: the restored coordinator, which has handed out no lease since, takes the plan
    with other epochs and keeps its position; once a lease is out, --epochs must match again.
    Catches a restart refused with '... 2 vs 1 epochs'."""
    c = Coordinator()
    c.configure(Plan(4, 1, 0, "fp", 1))
    c.lease(0, "a", None)
    c.lease(0, "a", (0, c.leases[0][1]))                  # one chunk done, one leased
    d = Coordinator.load(json.loads(json.dumps(c.state())))
    assert not d.finished and d.epoch == 0 and len(d.queue) == 3
    d.configure(Plan(4, 1, 0, "fp", 2))
    assert d.plan.epochs == 2 and d.epoch == 0 and len(d.queue) == 3 and len(d.done) == 1
    d.lease(0, "b", None)
    with pytest.raises(FailedPrecondition, match="2 vs 3 epochs|3 vs 2 epochs"):
        d.configure(Plan(4, 1, 0, "fp", 3))
    e = Coordinator.load(c.state())
    with pytest.raises(FailedPrecondition, match="other data"):
        e.configure(Plan(4, 1, 0, "other", 2))               # other data is still refused


def test_the_chief_s_epoch_logs_reach_every_worker_and_nothing_else_can_write_them(shard_server):
    """Keras on a cluster: the chief gives its epoch logs and stop decision through shard 0
    (LeaseData with epoch_logs); another worker reads them exactly, in the chief's order. Catches
    a worker other than the chief, a wrong session, or a request past the bounds (names, epoch)
    changing what every worker's callbacks get, and a waiting worker not told the chief left."""
    import grpc

    from pserver._proto import pserver_pb2 as pb
    from pserver._proto import pserver_pb2_grpc
    from pserver.errors import FailedPrecondition, InvalidArgument
    from tests.support.clients import ready_client
    addr, _ = shard_server(optimizer="sgd", lr=0.1, num_workers=2, mode="sync")
    a = ready_client(addr, num_workers=2, rank=0)
    b = ready_client(addr, num_workers=2, rank=1, init=False)
    plan = (12, 4, 3, "fp", 2)
    b.lease_data(*plan)
    first = b.epoch_logs(0)
    assert not first.has_logs and first.chief_live and not first.chief_told
    with pytest.raises(FailedPrecondition, match="only the chief"):
        b.epoch_logs(0, share=({"loss": 0.0}, True))
    with pytest.raises(InvalidArgument, match="at most 64 names"):
        a.epoch_logs(0, share=({f"m{i}": 0.0 for i in range(65)}, False))
    with pytest.raises(InvalidArgument, match="for an epoch of the run's plan"):
        a.epoch_logs(3, share=({"loss": 0.0}, False))
    raw = pserver_pb2_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    with pytest.raises(grpc.RpcError) as e:
        raw.LeaseData(pb.LeaseDataRequest(rank=0, session="not-the-chief-s", epoch_logs=True, logs_epoch=0,
                                          share_logs=True, log_names=["loss"], log_values=[9.0]), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        raw.LeaseData(pb.LeaseDataRequest(rank=0, session=a.shards[0].session, epoch_logs=True, logs_epoch=0,
                                          share_logs=True, log_names=["loss", "x"], log_values=[9.0]),
                      timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not b.epoch_logs(0).has_logs                       # nothing refused was kept
    a.lease_data(*plan)
    logs = {"loss": 0.123456789012345, "accuracy": 0.5, "val_loss": 1e-300, "val_accuracy": 0.25}
    a.epoch_logs(0, share=(logs, True))
    got = b.epoch_logs(0)
    assert got.has_logs and got.stop_training
    assert list(got.log_names) == list(logs) and list(got.log_values) == list(logs.values())
    assert not b.epoch_logs(1).has_logs
    a.leave()
    assert not b.epoch_logs(1).chief_live


def test_a_lease_reply_carries_the_sums_of_the_epoch_before_it(shard_server):
    """What the leased pushes of an epoch measured reaches every worker with the first lease of
    the next (LeaseDataReply.trained_*, through Shard.epoch_sums), from the coordinator that
    summed them (coordinator_id). Catches a reply that reports the epoch being trained, another
    epoch's sums, or sums read from another coordinator; before any epoch ended they are zero."""
    import numpy as np

    from tests.support.clients import LAYOUT, ready_client
    addr, shard = shard_server(optimizer="sgd", lr=0.1, mode="async")
    c = ready_client(addr)
    w = np.empty(LAYOUT.total, np.float32)
    plan = (4, 2, 7, "fp", 2)                                 # 4 batches in 2 chunks, 2 epochs
    reply = c.lease_data(*plan)
    assert (reply.epoch, reply.trained_samples, reply.trained_loss_sum) == (0, 0, 0.0)
    assert reply.coordinator_id == shard.store.coordinator.ident
    for n, step in enumerate((3.0, 5.0)):                      # each chunk's two batches
        for batch in range(reply.first_batch, reply.end_batch):
            c.pull(w)
            c.push(np.zeros(LAYOUT.total, np.float32), 4, lease=(reply.epoch, reply.chunk, batch),
                   trained=(step * 4, 2.0 + n))
        reply = c.lease_data(*plan, finished=(reply.epoch, reply.chunk))
        assert reply.trained_samples == (0 if n == 0 else 16)   # the epoch ended with the second
    assert reply.has_lease and reply.epoch == 1
    assert (reply.trained_loss_sum, reply.trained_correct) == (2 * 12.0 + 2 * 20.0, 2 * 2.0 + 2 * 3.0)
    assert reply.coordinator_id == shard.store.coordinator.ident
    c.close()


def test_an_epoch_logs_ask_answers_the_sums_of_any_finished_epoch_kept(shard_server):
    """A worker that was away while the others trained through several epochs asks shard 0 for
    each one's sums (an epoch_logs request: LeaseDataReply.trained_* of `logs_epoch`): each
    finished epoch its own, the open one none; the newest KEPT_EPOCH_SUMS are kept, and a
    checkpoint keeps them. Catches an answer of the epoch before the open one whatever was asked,
    sums dropped after two epochs (the chief's summary then lacked the windows it missed), an
    unbounded dict, sums lost by a restore."""
    import numpy as np

    from pserver.server.coordinator import KEPT_EPOCH_SUMS
    from tests.support.clients import LAYOUT, ready_client
    addr, shard = shard_server(optimizer="sgd", lr=0.1, mode="async")
    c = ready_client(addr)
    w, g = np.empty(LAYOUT.total, np.float32), np.zeros(LAYOUT.total, np.float32)
    plan = (2, 2, 7, "fp", 4)                                 # one chunk of 2 batches, 4 epochs
    reply = c.lease_data(*plan)
    for epoch in range(3):
        for batch in range(reply.first_batch, reply.end_batch):
            c.pull(w)
            c.push(g, 4, lease=(epoch, reply.chunk, batch), trained=(4.0 * (epoch + 1), 1.0 + epoch))
        reply = c.lease_data(*plan, finished=(epoch, reply.chunk))
    assert reply.epoch == 3
    for epoch in range(3):
        got = c.epoch_logs(epoch)
        assert (got.epoch, got.trained_samples) == (3, 8), (epoch, got)
        assert (got.trained_loss_sum, got.trained_correct) == (8.0 * (epoch + 1), 2.0 + 2 * epoch)
    c.pull(w)                                                 # the open epoch's first batch
    c.push(g, 4, lease=(3, reply.chunk, reply.first_batch), trained=(4.0, 1.0))
    for open_or_later in (3, 7):                              # not finished: none, whatever it summed
        got = c.epoch_logs(open_or_later)
        assert (got.epoch, got.trained_samples, got.trained_loss_sum) == (3, 0, 0.0), got
    c.close()
    co = Coordinator()
    co.configure(Plan(4, 2, 1, "fp", 0))
    for epoch in range(KEPT_EPOCH_SUMS + 5):
        co.tally(epoch, 1.0, 1.0, epoch + 1)
    co.epoch = KEPT_EPOCH_SUMS + 5
    assert len(co.trained) == KEPT_EPOCH_SUMS + 1
    restored = Coordinator.load(json.loads(json.dumps(co.state())))
    co.tally(co.epoch, 1.0, 1.0, 1)
    assert co.epoch_sums(3) == EpochSums(co.epoch, co.ident) == co.epoch_sums(co.epoch)   # dropped; open
    assert restored.epoch_sums(KEPT_EPOCH_SUMS).samples == KEPT_EPOCH_SUMS + 1
    assert restored.epoch_sums().samples == KEPT_EPOCH_SUMS + 5


def test_a_worker_that_asks_before_the_others_register_gets_only_its_share_of_a_short_epoch():
    """Rank 0 of 2 registers and asks for data while rank 1 has not registered yet (it starts
    slower): the epoch's 6 batches are one chunk, and rank 0 must get 3 of them, not all 6 (rank 1
    would then push empty contributions, and which batches a sync step trains would hang on who
    registered first: tests/e2e/test_cuda_sim.py's CPU and CUDA runs once trained different
    batches). Fails if the share counts only the registered workers."""
    import numpy as np

    from pserver.config import ServerConfig
    from pserver.models.layout import Layout
    from pserver.server.shard import Shard
    from tests.support.shards import fill_with
    layout = Layout.of([("w", (4,))])
    shard = Shard(ServerConfig(shard=0, num_shards=1, num_workers=2, mode="sync"))
    shard.register(0, 2, 0, 1, layout)
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.ones(4, np.float32)))
    plan = Plan(6, 16, 5, "fp", 1)
    first, _ = shard.lease(0, None, plan)
    assert (first.first, first.end) == (0, 3)
    shard.register(1, 2, 0, 1, layout)
    second, _ = shard.lease(1, None, plan)
    assert second.first == 3                          # the rest is shared out again, as ever
    with shard.store.cond:
        shard.members.mark_dead({1}, "a test")
    assert shard.members.sharing() == 1                  # a worker marked dead is not waited for


def test_lease_replies_add_the_metric_sums_of_every_worker_s_pushes(shard_server):
    """The compiled metrics' state (pserver.models.metrics) rides with the lease: one worker over
    the data plane (WITH_SUMS), one over gRPC (lease_metric_sums); the finished epoch's reply holds
    their element-wise sum, and shard 0's checkpoint keeps it. Catches: sums lost by either
    transport, a vector replaced instead of added, sums missing after a restore."""
    import numpy as np

    from tests.support.clients import LAYOUT, ready_client
    addr, _ = shard_server(optimizer="sgd", lr=0.1, num_workers=2, mode="async")
    a = ready_client(addr, num_workers=2, rank=0, plane="auto")
    b = ready_client(addr, num_workers=2, rank=1, plane="grpc", init=False)
    plan = (4, 1, 5, "fp", 2)                  # four chunks of one batch an epoch
    w, g = np.empty(LAYOUT.total, np.float32), np.ones(LAYOUT.total, np.float32)
    replies = {a: a.lease_data(*plan), b: b.lease_data(*plan)}
    expected, k = np.zeros(3), 0
    while all(r.epoch == 0 for r in replies.values()):
        for client in (a, b):
            lease = replies[client]
            if lease.epoch == 0 and lease.has_lease:
                client.pull(w)
                k += 1
                sums = (float(k), 0.5 * k, 1000.0 + k)
                client.push(g, 4, lease=(0, lease.chunk, lease.first_batch), trained=(1.0, 1.0, sums))
                expected += sums
                replies[client] = client.lease_data(*plan, finished=(0, lease.chunk))
            elif lease.epoch == 0:
                replies[client] = client.lease_data(*plan)
    done = next(r for r in replies.values() if r.epoch == 1)
    assert k == 4 and list(done.trained_metric_sums) == list(expected)
    a.close()
    b.close()
    c = Coordinator()
    c.configure(Plan(4, 2, 1, "fp", 3))
    c.tally(0, 1.0, 1.0, 2, (1.0, 2.0))
    c.tally(0, 1.0, 1.0, 2, (0.5, 0.5))
    c.epoch = 1
    restored = Coordinator.load(json.loads(json.dumps(c.state())))
    assert restored.epoch_sums().metric_sums == (1.5, 2.5)


def test_a_worker_that_lags_epochs_behind_the_chief_still_gets_each_epoch_s_logs():
    """Async: a worker may end its share of epoch 1 when the chief has trained on through epoch 3
    and left; its callbacks still take epoch 1's logs. Catches keeping only the newest two epochs'
    (a lagging worker's fit failed with "the chief left before it gave epoch 1's logs")."""
    from pserver.server.coordinator import KEPT_EPOCH_LOGS
    c = Coordinator()
    c.configure(Plan(4, 2, 1, "fp", KEPT_EPOCH_LOGS + 5))
    for epoch in range(4):
        c.share_logs(0, epoch, ["loss"], [float(epoch)], False)
    assert [c.logs(e)[0] for e in range(4)] == [(["loss"], [float(e)], False) for e in range(4)]
    for epoch in range(4, KEPT_EPOCH_LOGS + 2):                 # bounded: the oldest go
        c.share_logs(0, epoch, ["loss"], [float(epoch)], epoch == KEPT_EPOCH_LOGS + 1)
    assert sorted(c.shared) == list(range(2, KEPT_EPOCH_LOGS + 2))
    assert c.logs(KEPT_EPOCH_LOGS + 1)[0] == (["loss"], [float(KEPT_EPOCH_LOGS + 1)], True)


def test_the_chief_s_epoch_logs_are_bounded_exactly_at_their_limits():
    """share_logs' refusals at their edges (mutmut found them untested): MAX_EPOCH_LOGS names and
    names of 100 characters are taken, one more of either is refused; so is an epoch past the
    plan's (the plan's last, `epochs`, is the one a finished run reports); with no plan, only 0."""
    from pserver.server.coordinator import MAX_EPOCH_LOGS
    c = Coordinator()
    c.share_logs(0, 0, ["loss"], [1.0], False)                  # no plan yet: epoch 0 only
    with pytest.raises(InvalidArgument):
        c.share_logs(0, 1, ["loss"], [1.0], False)
    c.configure(Plan(4, 2, 1, "fp", 3))
    names = [f"m{i}" for i in range(MAX_EPOCH_LOGS)]
    c.share_logs(0, 3, names, [0.0] * MAX_EPOCH_LOGS, False)    # the plan's last epoch, every name
    c.share_logs(0, 0, ["x" * 100], [0.0], False)
    for bad in ((0, names + ["one more"], [0.0] * (MAX_EPOCH_LOGS + 1)), (0, ["x" * 101], [0.0]),
                (4, ["loss"], [0.0]), (-1, ["loss"], [0.0]), (0, ["a", "b"], [0.0])):
        with pytest.raises(InvalidArgument):
            c.share_logs(0, bad[0], bad[1], bad[2], False)
