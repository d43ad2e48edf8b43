"""The rules of docs/semantics.md ("Modes", "Sharding") that a one-line change to pserver/modes, the shard's
validate-and-apply path or its bounds (server/limits.py) would break, driven in-process
on real Shards.

Each test names in its docstring the wrong implementation it fails for.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from pserver.config import ServerConfig
from pserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from pserver.models.layout import Layout
from pserver.modes import Outcome
from pserver.persist import checkpoint
from pserver.server.limits import Limits
from pserver.server.shard import Shard
from pserver.server.store import Counters
from pserver.sparse import TableConfig
from tests.support.pushes import fill_with, push, push_request
from tests.support.shards import counters, heartbeats, make_cluster, one_shard

pytestmark = pytest.mark.usefixtures("kernels_loaded")   # the kernels load once, before the timeouts

ONES = np.ones(4, np.float32)


def mark_dead(shard, ranks):
    with shard.store.cond:
        shard.members.mark_dead(ranks, "test")


# --- sync: the mean is summed in rank order ----------------------------------------------

# Three ranks' float32 gradients whose sum depends on the order: (1e8 + 1) - 1e8 is 0 in
# float32 but (1e8 - 1e8) + 1 is 1. Each column puts the small value at another rank.
ORDER_SENSITIVE = np.array([[1e8, 1.0, 1e8], [1.0, 1e8, -1e8], [-1e8, -1e8, 1.0]], np.float32)


@pytest.mark.parametrize("mode, extra", [("sync", {}), ("backup", {"backup_workers": 1})])
def test_the_step_mean_is_summed_in_rank_order_whatever_the_arrival_order(mode, extra):
    """Fails for a sum taken in arrival order (the pending dict's insertion order): the
    update then depends on which worker's gradient came first."""
    workers = 3 if mode == "sync" else 4          # backup: the first 3 of 4 make the step
    for order in itertools.permutations(range(3)):
        shard = one_shard(3, workers, mode=mode, optimizer="sgd", lr=1.0, **extra)
        for r in order:
            assert push(shard, r, 0, ORDER_SENSITIVE[r]) is Outcome.AGGREGATED
        acc = ORDER_SENSITIVE[0] + ORDER_SENSITIVE[1] + ORDER_SENSITIVE[2]
        expected = np.zeros(3, np.float32) - acc * np.float32(1.0 / 3)   # sgd, lr 1, from 0
        assert shard.store.version == 1
        assert shard.store.params.tobytes() == expected.tobytes(), order


# --- backup: distinct workers, and a future step is rejected -----------------------------

def test_backup_refuses_a_second_push_from_the_same_rank_in_one_step():
    """Fails for backup accepting the same rank twice in one step: the step would be made
    (or its gradient replaced) by one worker's two pushes instead of N-b distinct ones."""
    shard = one_shard(2, 3, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0)
    push(shard, 0, 0, np.array([2, 4], np.float32))
    with pytest.raises(FailedPrecondition, match="already pushed"):
        push(shard, 0, 0, np.array([100, 100], np.float32))
    assert shard.store.version == 0, "one worker's two pushes made a quorum of 2"
    push(shard, 1, 0, np.array([4, 8], np.float32))
    assert shard.store.version == 1
    np.testing.assert_array_equal(shard.store.params, [-3, -6])    # the first push counted
    c = counters(shard)
    assert (c["pushes_aggregated"], c["pushes_rejected"], c["pushes_dropped_late"]) == (2, 1, 0)


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_backup_push_for_a_future_step_is_rejected_not_dropped(ahead):
    """Fails for a push for a step the shard has not reached being answered dropped_late
    (as if it were late): a worker ahead of the shard must hear that it is wrong."""
    shard = one_shard(2, 3, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0)
    with pytest.raises(FailedPrecondition, match="ahead"):
        push(shard, 0, ahead, ONES[:2])
    c = counters(shard)
    assert (c["pushes_rejected"], c["pushes_dropped_late"], c["pushes_aggregated"]) == (1, 0, 0)
    assert every_buffer_back(shard), "a rejected push kept its buffer"
    push(shard, 0, 0, ONES[:2])
    push(shard, 1, 0, ONES[:2])                        # step 0 completes with 2 of 3
    assert push(shard, 2, 0, ONES[:2]) is Outcome.DROPPED_LATE   # a past step is late
    assert counters(shard)["pushes_dropped_late"] == 1


# --- async and ssp: staleness and versions ------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_staleness_is_version_now_minus_version_computed_on_for_applied_pushes_only(mode):
    """Fails for staleness counted off by one, or recorded for a push that is then rejected."""
    shard = one_shard(4, 1, mode=mode, optimizer="sgd", lr=1.0, staleness=100)
    for clock in range(3):                             # all computed on version 0
        assert push(shard, 0, 0, ONES, clock=clock) is Outcome.APPLIED
    push(shard, 0, 2, ONES, clock=3)                   # on version 2, now 3: staleness 1
    for bad in (shard.store.version + 1, -1):
        with pytest.raises(FailedPrecondition, match="step"):
            push(shard, 0, bad, ONES, clock=4)
    c = counters(shard)
    assert c["staleness_histogram"][:4] == [1, 2, 1, 0] and sum(c["staleness_histogram"]) == 4
    assert c["staleness_max"] == 2 and c["staleness_mean"] == 1.0
    assert (c["pushes_applied"], c["pushes_rejected"]) == (4, 2)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_async_push_for_a_version_that_does_not_exist_is_rejected(mode):
    """Fails for a push computed on version t+1 (or later) being applied while the shard is
    at t: no worker can have pulled that version."""
    shard = one_shard(4, 2, mode=mode, optimizer="sgd", lr=1.0, staleness=100)
    params = shard.store.params.copy()
    with pytest.raises(FailedPrecondition, match="step: push computed on version 1"):
        push(shard, 0, 1, ONES)
    assert shard.store.version == 0 and counters(shard)["updates_applied"] == 0
    np.testing.assert_array_equal(shard.store.params, params)
    assert push(shard, 0, 0, ONES) is Outcome.APPLIED  # version 0 exists
    assert shard.store.version == 1


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_async_push_applies_its_rows_with_its_dense_part(mode):
    """Fails for an async push that applies the dense gradient and drops the sparse rows that came
    with it (the rows' path is otherwise tested over gRPC only, in tests/test_sparse_server.py)."""
    table = TableConfig("emb", 2, optimizer="sgd", lr=0.5, init_scale=0.1, seed=7)
    layout = Layout.of([("b", (3,))], [table])
    shard = make_cluster(layout, np.zeros(3, np.float32), 1, 1, mode=mode, optimizer="sgd", lr=1.0)[0]
    ids = np.array([5, 9], np.uint64)
    before = shard.pull_rows(0, 0, "emb", ids)[1].copy()
    rows = shard.row_buffers([("emb", 2)])
    rows[0].ids[:] = ids
    row_grads = np.array([[1, 2], [3, 4]], np.float32)
    rows[0].grads[:] = row_grads
    g = np.ones(3, np.float32)
    assert shard.push(push_request(g, rows=rows))[0] is Outcome.APPLIED
    np.testing.assert_allclose(shard.pull_rows(0, 0, "emb", ids)[1], before - 0.5 * row_grads, rtol=1e-6)
    np.testing.assert_array_equal(shard.store.params, -g)
    assert shard.store.tables["emb"].stats()["rows"] == 2


# --- a dead worker rejoins on its next push or pull ---------------------------------------

@pytest.mark.parametrize("mode", ["sync", "backup", "async", "ssp"])
@pytest.mark.parametrize("how", ["pull", "push"])
def test_a_worker_marked_dead_is_live_again_after_it_pushes_or_pulls(mode, how):
    """Fails for a worker once marked dead never revived (in any mode): it stays out of the
    live workers, and sync steps would go on without it for the rest of the run."""
    shard = one_shard(4, 3, mode=mode, optimizer="sgd", lr=1.0, backup_workers=1, staleness=5)
    mark_dead(shard, [2])
    assert shard.status()["live_workers"] == [0, 1]
    if how == "pull":
        assert shard.pull(2, 0, -1, 0, timeout=5)[0] == 0
    else:
        push(shard, 2, 0, ONES)
    st = shard.status()
    assert st["live_workers"] == [0, 1, 2] and st["dead_workers"] == []
    assert st["counters"]["workers_rejoined"] == 1 and st["counters"]["workers_marked_dead"] == 1


def test_a_revived_sync_worker_is_waited_for_in_the_next_step():
    """Fails for a revive that only updates the status: the worker must count again."""
    shard = one_shard(4, 2, mode="sync", optimizer="sgd", lr=1.0)
    mark_dead(shard, [1])
    push(shard, 0, 0, ONES)                            # step 0 goes on without worker 1
    assert shard.store.version == 1
    push(shard, 1, 1, ONES)                            # worker 1 is back and pushes for step 1
    assert shard.store.version == 1, "step 1 completed without worker 0"
    push(shard, 0, 1, ONES)
    assert shard.store.version == 2


# --- ssp: the clock bound -----------------------------------------------------------------

@pytest.mark.parametrize("s", [0, 1, 2])
def test_ssp_lets_a_worker_run_exactly_s_clocks_ahead_and_no_further(s):
    """Fails for the ssp clock off by one: with s = 0 both workers' first pulls deadlock (or
    one waits for the other forever), or a worker may pull one clock further than s."""
    shard = one_shard(4, 2, mode="ssp", staleness=s, optimizer="sgd", lr=1.0, step_timeout=60)
    for clock in range(s + 1):                         # worker 0 runs ahead while 1 stays at 0
        shard.pull(0, 0, -1, clock, timeout=5)
        push(shard, 0, shard.store.version, ONES, clock=clock)
    assert shard.policy.clocks[0] == s + 1
    with pytest.raises(DeadlineExceeded):              # clock s+1 is s+1 ahead of worker 1's 0
        shard.pull(0, 0, -1, s + 1, timeout=0.5)
    shard.pull(1, 0, -1, 0, timeout=10)                # the slowest never waits
    push(shard, 1, shard.store.version, ONES, clock=0)
    assert shard.pull(0, 0, -1, s + 1, timeout=10)[0] == s + 2
    assert counters(shard)["clock_gap_max"] == s


# --- step timeouts fire for workers that are alive but slow -------------------------------

@pytest.mark.parametrize("mode, extra", [("sync", {}), ("backup", {"backup_workers": 1})])
def test_a_step_waiting_for_live_but_slow_workers_times_out(mode, extra):
    """Fails for the sync/backup step timeout never firing: the stragglers heartbeat, so
    their sessions stay live and only the step timeout can mark them dead."""
    shard = one_shard(4, 3, mode=mode, optimizer="sgd", lr=1.0, step_timeout=1.0, **extra)
    push(shard, 0, 0, ONES)
    with heartbeats(shard, 1), heartbeats(shard, 2):
        assert shard.pull(0, 0, 0, 1, timeout=20)[0] == 1
    st = shard.status()
    assert st["dead_workers"] == [1, 2] and st["counters"]["workers_marked_dead"] == 2
    np.testing.assert_array_equal(shard.store.params, -ONES)      # worker 0's gradient alone


def test_an_ssp_clock_waiting_for_a_live_but_slow_worker_times_out():
    """Fails for the ssp step timeout never firing: the slow worker heartbeats, so its
    session stays live and only the clock's timeout can mark it dead."""
    shard = one_shard(4, 2, mode="ssp", staleness=0, optimizer="sgd", lr=1.0, step_timeout=1.0)
    for r in (0, 1):                                   # both at clock 1: the slowest clock is not 0
        push(shard, r, shard.store.version, ONES, clock=0)
    push(shard, 0, shard.store.version, ONES, clock=1)
    with heartbeats(shard, 1):
        assert shard.pull(0, 0, -1, 2, timeout=20)[0] == 3
    st = shard.status()
    assert st["dead_workers"] == [1] and st["counters"]["workers_marked_dead"] == 1


# --- NaN and Inf anywhere, the last element included --------------------------------------

POISONS = [np.nan, np.inf, -np.inf]


def poisoned(size: int, where: int, value: float) -> np.ndarray:
    g = np.arange(1, size + 1, dtype=np.float32)
    g[where] = value
    return g


def fills(g: np.ndarray):
    """The two ways a payload arrives: written by a function (gRPC) or a client's array
    that the shard copies and checks in one pass (data plane)."""
    return {"function": fill_with(g), "array": g}


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("size", [1, 2, 7, 64, 1001])
@pytest.mark.parametrize("via", ["function", "array"])
def test_a_gradient_with_a_non_finite_last_element_is_rejected(value, size, via):
    """Fails for a check loop that stops one element short (range(n - 1)): NaN or Inf in the
    last element was applied. Shard 1 of 2, so the message must name the flat index."""
    layout = Layout.of([("w", (2 * size,))])
    shards = make_cluster(layout, np.zeros(2 * size, np.float32), 2, 1, optimizer="sgd", lr=1.0)
    shard = shards[1]
    for where in sorted({0, size // 2, size - 1}):
        g = poisoned(size, where, value)
        with pytest.raises(InvalidArgument, match=f"non-finite.* element {size + where} "):
            shard.push(push_request(shard=1, fill=fills(g)[via], size=size))
    assert shard.store.version == 0 and not shard.store.params.any()
    assert every_buffer_back(shard), "a refused gradient kept its buffer"
    good = np.arange(1, size + 1, dtype=np.float32)
    shard.push(push_request(shard=1, fill=fills(good)[via], size=size))
    assert shard.store.params.tobytes() == (-good).tobytes()       # every element applied


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("via", ["function", "array"])
def test_init_values_with_a_non_finite_last_element_are_refused(value, via):
    """Fails for Init's check stopping one element short: the shard started from NaN."""
    size = 9
    layout = Layout.of([("w", (size,))])
    shard = Shard(ServerConfig())
    shard.register(0, 1, 0, 1, layout)
    with pytest.raises(InvalidArgument, match=f"element {size - 1} "):
        shard.init(0, layout.signature(), size, "float32", fills(poisoned(size, size - 1, value))[via])
    assert not shard.store.initialized and not shard.store.params.any()
    good = np.arange(size, dtype=np.float32)
    assert shard.init(0, layout.signature(), size, "float32", fills(good)[via]) == (False, 0)
    assert shard.store.params.tobytes() == good.tobytes()


# --- checkpoints: a writer killed mid-write leaves no file under a final name -------------

WRITER = """
import resource, signal, sys
import numpy as np
from pserver.persist import checkpoint, checkpoint_dir
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)         # Python ignores it; the default ends the process
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
params = np.ones(1 << 20, np.float32)                 # 4 MiB: the kernel kills the writer at 1 MiB
checkpoint.save(sys.argv[1], checkpoint.Checkpoint(path="", version=2, shard=0, num_shards=1, signature="sig",
                                                   total=params.size, start=0, end=params.size,
                                                   optimizer="sgd", params=params, state={}))
"""


def test_a_checkpoint_writer_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    """Fails for a checkpoint written in place instead of to a temporary file renamed over
    the final name: the killed writer left a torn file named as version 2. The kill is
    real: the writer runs with a 1 MiB file-size limit, so the kernel ends it (SIGXFSZ)."""
    params = np.zeros(8, np.float32)
    first = checkpoint.save(str(tmp_path), checkpoint.Checkpoint(path="", version=1, shard=0, num_shards=1,
                                                                 signature="sig", total=8, start=0, end=8,
                                                                 optimizer="sgd", params=params, state={}))
    run = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], capture_output=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == -signal.SIGXFSZ, run.stderr.decode()[-2000:]
    assert checkpoint.candidates(str(tmp_path), 0, 1) == [(1, first)]
    assert checkpoint.load_latest(str(tmp_path), 0, 1).version == 1


# --- what mutation testing found unchecked ------------------------------------------------

def every_buffer_back(shard) -> bool:
    """With no gradient pending, every buffer the pool ever handed out is free again (a
    count of buffers made would not do: a leaked buffer's id is reused by the next one)."""
    pool = shard.store.pool
    return len(pool._free) == len(pool._own)


def test_a_dropped_push_says_why_and_its_buffer_is_reused():
    """Fails for a dropped push whose buffer is not given back to the pool (every late push
    then allocates a new gradient buffer) or whose reply does not say why it was dropped."""
    shard = one_shard(4, 3, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0)
    for step in range(20):
        for r in range(3):
            outcome, version, message, _ = shard.push(push_request(ONES, rank=r, step=step))
        assert outcome is Outcome.DROPPED_LATE and f"step {step} already completed" in message
        assert every_buffer_back(shard), "a late push kept its buffer from the pool"


def test_an_applied_async_push_reuses_its_buffer_and_counts_its_samples():
    """Fails for an async push that keeps its buffer from the pool, counts one sample per
    push instead of num_samples, or answers with a message (applied needs none)."""
    shard = one_shard(4, 1, mode="async", optimizer="sgd", lr=1.0)
    for step in range(10):
        outcome, _, message, _ = shard.push(push_request(ONES, step=step, samples=7, clock=step))
        assert (outcome, message) == (Outcome.APPLIED, "")
        assert every_buffer_back(shard)
    assert counters(shard)["samples_pushed"] == 70


def test_a_backup_run_that_cannot_finish_uncounts_the_held_gradients():
    """Fails for the end of a backup run counting its held gradients as aggregated twice
    (+dropped instead of -dropped) or keeping their buffers."""
    shard = one_shard(4, 3, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0)
    push(shard, 0, 0, ONES)
    shard.leave(1)
    shard.leave(2)                                     # 1 unfinished worker, the quorum is 2
    c = counters(shard)
    assert (c["pushes_aggregated"], c["pushes_dropped_late"]) == (0, 1) and shard.policy.finished
    assert every_buffer_back(shard)
    outcome, _, message, finished = shard.push(push_request(ONES))
    assert (outcome, message, finished) == (Outcome.DROPPED_LATE, "the run is over on this shard", True)
    assert every_buffer_back(shard)


def test_an_ssp_pull_at_clock_1_after_a_restart_proves_one_push():
    """Fails for a missing clock counted as 1 rather than 0 when a pull proves its pushes:
    two workers each showing clock 1 (s = 0) then wait for each other for ever."""
    shard = one_shard(4, 2, mode="ssp", staleness=0, optimizer="sgd", lr=1.0, step_timeout=60)
    shard.store.clocks.clear()                         # as after a restart without clocks
    waiting = pull_in_thread(shard, 1, clock=1)
    assert shard.pull(0, 0, -1, 1, timeout=10)[0] == 0
    waiting.join(10)
    assert waiting.result == 0


def test_a_left_ssp_worker_that_is_the_last_never_waits():
    """Fails for the 'no live worker' clock being small: a pull with no live worker to wait
    for must not block (ssp with every worker gone)."""
    shard = one_shard(4, 1, mode="ssp", staleness=0, optimizer="sgd", lr=1.0, step_timeout=60)
    shard.leave(0)
    assert shard.pull(0, 0, -1, 5, timeout=5)[0] == 0


def test_a_late_ssp_push_or_pull_with_an_older_clock_does_not_move_the_clock_back():
    """Fails for a push's or a pull's clock replacing the worker's clock instead of raising
    it: a late call with an old clock made the others wait for pushes already done."""
    shard = one_shard(4, 2, mode="ssp", staleness=0, optimizer="sgd", lr=1.0, step_timeout=60)
    for clock in range(3):
        push(shard, 0, shard.store.version, ONES, clock=clock)
    assert shard.store.clocks[0] == 3                  # 3 pushes taken in
    push(shard, 0, 0, ONES, clock=0)                   # a late push, computed long ago
    assert shard.store.clocks[0] == 3, "a late push moved worker 0's clock back"
    for clock in range(3):                             # worker 1 catches up without waiting
        assert shard.pull(1, 0, -1, clock, timeout=1)[0] == 4 + clock
        push(shard, 1, shard.store.version, ONES, clock=clock)
    shard.pull(0, 0, -1, 1, timeout=1)                 # a late pull (a retry) of worker 0
    assert shard.store.clocks == {0: 3, 1: 3}, "a late pull moved worker 0's clock back"
    assert shard.pull(1, 0, -1, 3, timeout=1)[0] == 7  # worker 0's 3 pushes still count
    assert counters(shard)["clock_gap_max"] == 0


def test_an_async_pull_before_init_keeps_its_deadline_and_notices_a_gone_caller():
    """Fails for the default pull wait (async: until the chief's Init) dropping its timeout
    (it waited forever) or its waiter (a caller that went away kept a thread)."""
    shard = Shard(ServerConfig(mode="async", num_workers=1))
    shard.register(0, 1, 0, 1, Layout.of([("w", (4,))]))
    with pytest.raises(DeadlineExceeded):
        shard.pull(0, 0, -1, 0, timeout=0.3)
    with pytest.raises(Unavailable, match="went away"):
        shard.pull(0, 0, -1, 0, timeout=30, alive=lambda: False)


class PullThread:
    """A pull that may wait, in a thread; `result` is its version (or the exception it raised)."""

    def __init__(self, shard, rank: int, clock: int) -> None:
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(shard, rank, clock), daemon=True)
        self.thread.start()

    def _run(self, shard, rank, clock):
        try:
            self.result = shard.pull(rank, 0, -1, clock, timeout=10)[0]
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            self.result = e

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def pull_in_thread(shard, rank: int, clock: int) -> PullThread:
    return PullThread(shard, rank, clock)


# --- the shard's other calls --------------------------------------------------------------

def test_control_calls_check_the_session_and_report_the_shard():
    """Fails for Heartbeat, Leave or Checkpoint not checking the caller's session, for a
    Checkpoint without a directory failing or naming a file, for Status fields left out,
    and for close() not ending waits."""
    shard = Shard(ServerConfig(mode="sync", num_workers=1, shard=1, num_shards=2, lr=0.5))
    session = shard.register(0, 1, 1, 2, Layout.of([("w", (8,))])).session
    wrong = "not-" + session
    calls = [lambda: shard.heartbeat(0, wrong), lambda: shard.leave(0, wrong),
             lambda: shard.checkpoint(0, wrong),
             lambda: shard.init(0, shard.store.signature, 4, "float32", fill_with(ONES), session=wrong)]
    for call in calls:
        with pytest.raises(Unauthenticated, match="session"):
            call()
    assert shard.init(0, shard.store.signature, 4, "float32", fill_with(ONES), session=session) == (False, 0)
    assert shard.init(0, shard.store.signature, 4, "float32", fill_with(ONES), session=session) == (True, 0)
    for call in (lambda: shard.pull(0, 1, -1, 0, timeout=5, session=wrong),
                 lambda: shard.push(push_request(ONES, shard=1, session=wrong))):
        with pytest.raises(Unauthenticated, match="session"):
            call()
    assert shard.checkpoint(0, session) == ("", 0)
    assert shard.heartbeat(0, session) == 0
    st = shard.status()
    assert {k: st[k] for k in ("shard", "num_shards", "mode", "num_params", "total_params", "num_workers",
                               "optimizer", "lr", "version")} == dict(
        shard=1, num_shards=2, mode="sync", num_params=4, total_params=8, num_workers=1,
        optimizer="sgd", lr=0.5, version=0)
    assert 0 <= st["uptime_seconds"] < 3600
    assert shard.limits.max_inflight_bytes == shard.cfg.max_inflight_mb << 20
    shard.close()
    with pytest.raises(Unavailable, match="shutting down"):
        shard.pull(0, 1, 0, 1, timeout=5, session=session)   # waits for version 1


def test_limits_refuse_the_first_call_past_each_bound():
    """Fails for a bound off by one: the pull share admitting one more parked pull than
    max_pulls, or a byte bound that allows two streams when one fills --max-inflight-mb."""
    lim = Limits(24, 10 << 20, 1.0, Counters())
    with contextlib.ExitStack() as stack:
        for rank in range(lim.max_pulls):              # one each: the per-worker bound is not hit
            stack.enter_context(lim.waiting(rank, lambda: True)).park()
        with pytest.raises(ResourceExhausted, match=f"the bound is {lim.max_pulls}"):
            with lim.waiting(lim.max_pulls, lambda: True) as extra:
                extra.park()
    assert lim.stream_slots(8 << 20) == 1
    with lim.stream(lambda: None, 8 << 20):
        with pytest.raises(ResourceExhausted, match="the bound is 1"):
            with lim.stream(lambda: None, 8 << 20):
                pass


def test_sync_replies_pull_deadlines_and_request_checks():
    """Fails for an aggregated push answered with a message, a sync pull that ignores its
    deadline, a heartbeat that revives a worker marked dead (only a push or pull does),
    a seen_version ahead of version 0 accepted, num_samples = 1 refused, -1 or -2 accepted, or a
    layout with an empty tensor refused."""
    shard = one_shard(4, 2, mode="sync", optimizer="sgd", lr=1.0)
    outcome, _, message, _ = shard.push(push_request(ONES))
    assert (outcome, message) == (Outcome.AGGREGATED, "")
    for samples in (-1, -2):     # 0 is an empty contribution (tests/test_coordinator.py)
        with pytest.raises(InvalidArgument, match=f"num_samples: {samples} for a push; a gradient is"):
            shard.push(push_request(ONES, rank=1, samples=samples))
    with pytest.raises(DeadlineExceeded):
        shard.pull(0, 0, 0, 1, timeout=0.3)            # worker 1 has not pushed
    with pytest.raises(FailedPrecondition, match="seen_version: 1 is ahead"):
        shard.pull(0, 0, 1, 1, timeout=5)
    mark_dead(shard, [1])
    shard.heartbeat(1)
    assert shard.status()["dead_workers"] == [1]
    layout = Layout.of([("w", (4,)), ("none", (0, 3))])
    assert Shard(ServerConfig()).register(0, 1, 0, 1, layout).total_params == 4


def test_idle_streams_are_cancelled_once_and_busy_ones_never():
    """Fails for the idle watchdog cancelling a stream that just delivered, or cancelling
    one idle stream again on every tick."""
    lim = Limits(24, 10 << 20, 0.2, Counters())
    cancelled = []
    with lim.stream(lambda: cancelled.append("idle"), 4) as idle, \
            lim.stream(lambda: cancelled.append("busy"), 4):
        assert lim.cancel_idle() == 0
        idle.last -= 1.0                               # delivered nothing for a second
        assert lim.cancel_idle() == 1 and lim.cancel_idle() == 0
    assert cancelled == ["idle"]
