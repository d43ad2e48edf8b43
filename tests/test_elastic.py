"""Elastic workers (docs/operations.md, "Elastic workers"): ranks, join steps, members, quorums.

Driven in-process on real Shards (the e2e tests, tests/e2e/test_elastic_mnist.py and
test_elastic_e2e.py, run real processes); each test names the bug it catches.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver.config import AUTO_RANK, ServerConfig, WorkerConfig, parse_rank
from pserver.errors import ConfigError, FailedPrecondition, JoinStepOpen, ResourceExhausted, StaleStep
from pserver.models.layout import Layout
from pserver.modes import Outcome
from pserver.server.shard import Shard
from tests.support.pushes import fill_with, push_request
from tests.support.shards import SETTINGS

pytestmark = pytest.mark.usefixtures("kernels_loaded")   # the kernels load once, before the timeouts

LAYOUT = Layout.of([("w", (4,))])


def elastic_shard(num_workers=2, max_workers=4, shard=0, num_shards=1, **cfg) -> Shard:
    """A shard of a job started with `num_workers` that has room for `max_workers`, with the
    initial workers registered and zeros as initial values."""
    cfg = {"mode": "sync", "optimizer": "sgd", "lr": 1.0} | cfg
    s = Shard(ServerConfig(shard=shard, num_shards=num_shards, num_workers=num_workers,
                           max_workers=max_workers, **cfg))
    for r in range(num_workers):
        s.register(r, num_workers, shard, num_shards, LAYOUT)
    s.init(0, LAYOUT.signature(), s.store.size, "float32", fill_with(np.zeros(s.store.size, np.float32)))
    return s


def auto(shard, num_workers=4, previous=""):
    return shard.register(0, num_workers, 0, 1, LAYOUT, previous_session=previous, auto_rank=True)


def push(shard, rank, step, g, samples=1):
    g = np.asarray(g, np.float32)
    return shard.push(push_request(g, rank=rank, step=step, samples=samples))[0]


def step_all(shard, ranks, g=(1, 1, 1, 1)):
    for r in ranks:
        push(shard, r, shard.store.version, g)


# --- flags -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, says", [
    (dict(num_workers=4, max_workers=2), "--max-workers: 2 is below --num-workers=4"),
    (dict(num_workers=2, max_workers=4, min_workers=5), "--min-workers: 5 is above --max-workers=4"),
    (dict(max_workers=4), "--max-workers: needs --num-workers"),
    (dict(num_workers=2, min_workers=-1), "--min-workers: must be >= 1"),
])
def test_elastic_flags_are_checked_with_one_line_each(kw, says):
    # catches: a --max-workers below N accepted (ranks the launcher starts would be refused later)
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        ServerConfig(**kw)


def test_rank_auto_parses_and_a_wrong_rank_says_how_to_join():
    assert parse_rank("auto") == AUTO_RANK and parse_rank("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="a number or auto"):
        parse_rank("three")
    assert WorkerConfig(rank=AUTO_RANK, num_workers=1).rank == AUTO_RANK
    with pytest.raises(ConfigError, match="--rank auto"):
        WorkerConfig(rank=5, num_workers=2)
    with pytest.raises(ConfigError, match="--stop-shards"):   # auto is never the chief
        WorkerConfig(rank=AUTO_RANK, stop_shards=True)


# --- ranks -------------------------------------------------------------------------------
def test_shard_0_assigns_the_lowest_free_rank_never_0_and_reuses_a_rank_that_left():
    # catches: auto handing out rank 0 (a second chief), or a live rank (two workers on one rank)
    s = elastic_shard(num_workers=1, max_workers=4)
    got = [auto(s).assigned_rank for _ in range(3)]
    assert got == [1, 2, 3]
    with pytest.raises(ResourceExhausted, match="no free rank"):
        auto(s)
    s.leave(2)
    assert auto(s).assigned_rank == 2


def test_a_restarted_auto_worker_with_its_session_gets_its_rank_back():
    # catches: take-over with --rank auto assigning a new rank (the old one then waits out its timeout)
    s = elastic_shard(num_workers=1, max_workers=4)
    first = auto(s)
    auto(s)
    again = auto(s, previous=first.session)
    assert again.assigned_rank == first.assigned_rank and again.took_over


def test_auto_rank_is_refused_where_it_cannot_be_served_and_changes_nothing():
    # catches: a fixed-size job silently growing, or shard 1 assigning ranks shard 0 never heard of
    fixed = elastic_shard(num_workers=2, max_workers=0)
    with pytest.raises(FailedPrecondition, match="--max-workers"):
        auto(fixed)
    assert fixed.members.registered == {0, 1}
    other = elastic_shard(num_workers=2, max_workers=4, shard=1, num_shards=2)
    with pytest.raises(FailedPrecondition, match="only shard 0"):
        other.register(0, 4, 1, 2, LAYOUT, auto_rank=True)
    assert other.members.registered == {0, 1}


def test_a_joiner_beyond_max_workers_is_refused():
    s = elastic_shard(num_workers=2, max_workers=3)
    with pytest.raises(FailedPrecondition, match="ranks 0..2"):
        s.register(3, 3, 0, 1, LAYOUT)


# --- join steps --------------------------------------------------------------------------
def test_a_registered_joiner_never_blocks_a_step_and_counts_from_its_step():
    # catches: a joiner counted as soon as it registers (the open step would wait for a worker
    # that only pulls), or never counted (its pushes refused forever)
    s = elastic_shard()
    r = auto(s).assigned_rank
    step_all(s, [0, 1])
    assert s.store.version == 1                        # the joiner did not hold step 0 up
    j = s.store.version + 2
    assert s.join_step(r, j) == (1, j)
    with pytest.raises(StaleStep, match=f"member from step {j}"):
        push(s, r, 1, [1, 1, 1, 1])                    # until j it only pulls
    step_all(s, [0, 1])
    step_all(s, [0, 1])
    assert s.store.version == j and s.members.expected() == {0, 1, r}
    push(s, 0, j, [1, 1, 1, 1])
    push(s, 1, j, [1, 1, 1, 1])
    assert s.store.version == j                         # step j waits for the joiner
    push(s, r, j, [4, 4, 4, 4])
    assert s.store.version == j + 1


def test_a_joiner_is_not_left_waiting_when_every_member_leaves_before_its_step():
    # catches: a joiner pulling forever for a step nobody will push (the job's first workers
    # finished their epochs between its proposal and its step)
    s = elastic_shard()
    r = auto(s).assigned_rank
    s.join_step(r, 3)
    s.leave(0)
    assert s.store.version == 0                         # worker 1 is still a member
    s.leave(1)
    assert s.store.version == 3 and s.members.expected() == {r}
    push(s, r, 3, [2, 2, 2, 2])
    assert s.store.version == 4
    np.testing.assert_array_equal(s.pull(r, 0, -1, 0, timeout=5)[1], -2)   # empty steps applied nothing


def test_joining_from_a_step_already_opened_is_refused_with_its_kind():
    # catches: a member added to an open step (shards would disagree on its members)
    s = elastic_shard()
    r = auto(s).assigned_rank
    step_all(s, [0, 1])
    for step in (0, 1):
        with pytest.raises(JoinStepOpen, match="already opened"):
            s.join_step(r, step)
    assert r not in s.members.join_at


@SETTINGS
@given(plan=st.lists(st.tuples(st.integers(2, 5), st.integers(0, 6)), max_size=8), steps=st.integers(1, 6))
def test_a_steps_members_are_fixed_when_it_opens(plan, steps):
    # catches: membership of an open step changing with a join (the property the join protocol keeps)
    s = elastic_shard(num_workers=2, max_workers=6)
    joined: dict[int, int] = {}
    ranks = {r for r, _ in plan}
    for r in sorted(ranks):
        s.register(r, 6, 0, 1, LAYOUT)
    for _ in range(steps):
        members = set(s.members.expected())
        for r, ahead in plan:                           # joins proposed while the step is open
            want = s.store.version + ahead - 2
            try:
                joined[r] = s.join_step(r, want)[1]
            except JoinStepOpen:
                assert want <= s.store.version
            assert s.members.expected() == members      # the open step's members are unchanged
        step_all(s, sorted(members))
        v = s.store.version
        assert s.members.expected() == {0, 1} | {r for r, j in joined.items() if j <= v}


# --- the mean, the quorum, the minimum ---------------------------------------------------
@SETTINGS
@given(samples=st.lists(st.integers(0, 5), min_size=2, max_size=5), seed=st.integers(0, 2**16))
def test_zero_sample_members_count_toward_the_step_and_weigh_nothing(samples, seed):
    # catches: an empty contribution averaged in (a smaller step) or not counted (the step hangs)
    n = len(samples)
    s = elastic_shard(num_workers=n, max_workers=n)
    g = np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)
    for r in range(n):
        push(s, r, 0, g[r], samples[r])
    assert s.store.version == 1
    w = s.pull(0, 0, -1, 0, timeout=5)[1]
    if sum(samples):
        want = -(np.asarray(samples, np.float64) @ g) / sum(samples)
    else:
        want = np.zeros(4)                              # nothing weighed: only the version moved
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)


def test_backup_quorum_is_members_minus_b_with_joiners():
    # catches: backup's quorum fixed at N-b (joiners' pushes dropped late, their work wasted)
    s = elastic_shard(num_workers=2, max_workers=4, mode="backup", backup_workers=1)
    for r in (2, 3):
        s.register(r, 4, 0, 1, LAYOUT)
        s.join_step(r, 2)
    assert s.policy.quorum() == 1
    step_all(s, [0])
    step_all(s, [1])
    assert s.store.version == 2 and s.policy.quorum() == 3
    assert [push(s, r, 2, [1, 1, 1, 1]) for r in (3, 0, 2)] == [Outcome.AGGREGATED] * 3
    assert s.store.version == 3
    assert push(s, 1, 2, [1, 1, 1, 1]) is Outcome.DROPPED_LATE


def test_below_min_workers_sync_waits_and_a_joiner_counts_from_the_waiting_step():
    # catches: steps going on below --min-workers, or a stalled step refusing the joiner that
    # would bring it back to the minimum (it would wait forever)
    s = elastic_shard(num_workers=2, max_workers=3, min_workers=2)
    s.members.mark_dead([1], "test")
    push(s, 0, 0, [1, 1, 1, 1])
    assert s.store.version == 0 and s.policy.below_min()
    r = auto(s, num_workers=3).assigned_rank
    assert s.join_step(r, 2) == (0, 0)                  # not fixed while below the minimum
    push(s, r, 0, [1, 1, 1, 1])
    assert s.store.version == 1


@pytest.mark.parametrize("mode, n, cfg, leaves_first", [("sync", 2, {}, True), ("sync", 2, {}, False),
                                                         ("backup", 3, dict(backup_workers=1), True)])
def test_a_worker_that_finished_and_left_never_holds_a_step_below_min_workers(mode, n, cfg, leaves_first):
    # catches (issue 46.3): the job's end hanging: the last rank has less work, finishes and leaves;
    # the others' last step waited forever below --min-workers=n (a rank that left counted as
    # missing), whether they pushed before the leave or after it (backup: its quorum, n - 1, is
    # the others: they never wait for the last rank's push)
    s = elastic_shard(num_workers=n, max_workers=n + 1, min_workers=n, mode=mode, **cfg)
    others = list(range(n - 1))
    step_all(s, others if mode == "backup" else range(n))
    assert s.store.version == 1
    if leaves_first:
        s.leave(n - 1)
        assert not s.policy.below_min()
        step_all(s, others)
    else:
        step_all(s, others)
        assert s.store.version == 1                     # waits for the last rank's push
        s.leave(n - 1)
    assert s.store.version == 2 and not s.policy.pending
    step_all(s, others)                                 # and every step after it
    assert s.store.version == 3
    # A member marked dead still holds the steps below the minimum: that is what it is for.
    s.register(n - 1, n, 0, 1, LAYOUT)
    s.members.mark_dead([n - 1], "test")
    step_all(s, others)
    assert s.store.version == 3 and s.policy.below_min()


def test_a_step_that_waited_below_min_workers_times_out_from_when_a_joiner_lifts_it():
    # catches (issue 46.4): the step's --step-timeout counted while it waited below --min-workers,
    # so the joiner that lifts it to the minimum, which has not pushed yet, was marked dead at the
    # first tick after it joined, and the step went on without it (its push then refused as stale)
    s = elastic_shard(num_workers=2, max_workers=3, min_workers=2, step_timeout=1.0)
    s.members.mark_dead([1], "test")
    push(s, 0, 0, [2, 2, 2, 2])
    pulled = {}
    waiting = threading.Thread(target=lambda: pulled.update(v=s.pull(0, 0, 0, 1, timeout=20)[0]), daemon=True)
    waiting.start()            # rank 0 waits for version 1; its pull ticks the policy's timer
    time.sleep(1.6)            # the step waits below the minimum, longer than --step-timeout
    assert s.store.version == 0 and s.policy.below_min()
    r = s.register(2, 3, 0, 1, LAYOUT).assigned_rank    # a joiner (rank 1's session expired: not 1)
    assert s.join_step(r, 2) == (0, 0)
    with s.store.cond:
        s.policy.check_timeout()                        # as the next tick of a waiting pull
    assert s.members.dead == {1} and r in s.members.expected()
    assert push(s, r, 0, [4, 4, 4, 4]) is Outcome.AGGREGATED
    waiting.join(30)
    assert pulled == {"v": 1} and s.members.dead == {1}
    assert s.store.counters.snapshot()["workers_marked_dead"] == 1
    np.testing.assert_array_equal(s.store.params, -np.full(4, 3, np.float32))   # (2 + 4) / 2, lr 1


def test_without_min_workers_a_dead_worker_never_holds_the_others():
    s = elastic_shard(num_workers=2, max_workers=3)
    s.members.mark_dead([1], "test")
    push(s, 0, 0, [1, 1, 1, 1])
    assert s.store.version == 1


def test_an_ssp_joiner_starts_at_the_slowest_live_clock():
    # catches: a joiner at clock 0 holding every other worker back by up to s clocks
    s = elastic_shard(num_workers=2, max_workers=3, mode="ssp", staleness=1)
    s.store.clocks.update({0: 7, 1: 5})
    r = auto(s, num_workers=3).assigned_rank
    assert s.store.clocks[r] == 5 and r in s.members.expected()
    assert push(s, r, s.store.version, [1, 1, 1, 1]) is Outcome.APPLIED


def test_a_fixed_size_job_keeps_todays_rules():
    # catches: the elastic paths changing a job without --max-workers
    s = elastic_shard(num_workers=2, max_workers=0)
    with pytest.raises(FailedPrecondition, match="says 3 workers"):
        s.register(1, 3, 0, 1, LAYOUT)
    s.leave(1)
    assert dataclasses.asdict(s.register(1, 2, 0, 1, LAYOUT))["assigned_rank"] == 1
