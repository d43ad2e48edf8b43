"""Dead workers, rejoins, quorums and clocks: the rules of docs/semantics.md ("Modes") that a fault exercises.

Driven in-process on real Shards; each test names the bug it catches.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver.config import ServerConfig
from pserver.errors import FailedPrecondition
from pserver.models.layout import Layout
from pserver.modes import Outcome
from pserver.server.shard import Shard
from tests.support.pushes import fill_with, push, push_request
from tests.support.shards import SETTINGS, heartbeats, one_shard

pytestmark = pytest.mark.usefixtures("kernels_loaded")   # the kernels load once, before the timeouts

ONES = np.ones(4, np.float32)


def pull_in_thread(shard, rank, seen, clock=0, timeout=10.0):
    """Start a pull that may wait; returns (thread, result dict with 'version' once done)."""
    out: dict = {}

    def run():
        try:
            out["version"] = shard.pull(rank, 0, seen, clock, timeout=timeout)[0]
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def mark_dead_by_step_timeout(shard, alive: list[int], dead: list[int], step: int) -> None:
    """`alive` push for `step` and wait; the step times out and marks `dead` (who never push)."""
    for r in alive:
        assert push(shard, r, step, ONES) is Outcome.AGGREGATED
    with heartbeats(shard, alive[-1]):
        assert shard.pull(alive[0], 0, step, 1, timeout=10)[0] == step + 1
    assert sorted(shard.members.dead) == sorted(dead)


def test_backup_quorum_is_min_of_n_minus_b_and_live_never_fewer():
    """Catches quorum = max(1, N-b-dead): the b slack counted twice, so after two deaths a
    single worker's gradient made a step (N=4, b=1: min(3, 2 live) = 2, not 1)."""
    shard = one_shard(4, 4, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0, step_timeout=0.5)
    mark_dead_by_step_timeout(shard, [0, 1], [2, 3], step=0)
    assert push(shard, 0, 1, ONES) is Outcome.AGGREGATED
    time.sleep(0.05)
    assert shard.store.version == 1, "a step completed with 1 gradient while 2 workers live"
    assert push(shard, 1, 1, ONES) is Outcome.AGGREGATED
    assert shard.store.version == 2


def test_backup_quorum_keeps_n_minus_b_while_the_slack_covers_the_dead():
    """N=4, b=1, one dead: min(3, 3 live) = 3 (max(1, N-b-dead) gave 2)."""
    shard = one_shard(4, 4, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0, step_timeout=0.5)
    for r in (0, 1, 2):
        push(shard, r, 0, ONES)                       # step 0 completes with the first 3
    assert shard.store.version == 1
    shard.members.mark_dead([3], "test")
    push(shard, 0, 1, ONES)
    push(shard, 1, 1, ONES)
    assert shard.store.version == 1, "2 of 3 live workers made a step; the quorum is 3"
    push(shard, 2, 1, ONES)
    assert shard.store.version == 2


def test_a_dead_backup_worker_rejoins_on_its_next_pull_and_is_counted():
    """Catches a worker once marked dead never coming back (its late pushes are dropped, so
    in backup mode only a pull can bring it back)."""
    shard = one_shard(4, 4, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0, step_timeout=0.5)
    mark_dead_by_step_timeout(shard, [0, 1], [2, 3], step=0)
    assert shard.pull(2, 0, -1, 0, timeout=5)[0] == 1
    st = shard.status()
    assert 2 in st["live_workers"] and st["counters"].get("workers_rejoined") == 1
    for r in (0, 1):                                  # the quorum is min(3, 3 live) again
        push(shard, r, 1, ONES)
    assert shard.store.version == 1
    push(shard, 2, 1, ONES)
    assert shard.store.version == 2


def test_a_sync_straggler_marked_dead_is_waited_for_again_after_it_pulls():
    """Catches "a straggler marked dead is never waited for again": its late push is
    rejected, and the others' steps used to complete without it forever."""
    shard = one_shard(4, 2, mode="sync", optimizer="sgd", lr=1.0, step_timeout=0.5)
    mark_dead_by_step_timeout(shard, [0], [1], step=0)
    shard.pull(1, 0, -1, 0, timeout=5)                # the straggler comes back
    assert shard.status()["live_workers"] == [0, 1]
    push(shard, 0, 1, ONES)
    assert shard.store.version == 1, "step 1 completed without the worker that rejoined"
    push(shard, 1, 1, ONES)
    assert shard.store.version == 2
    assert shard.status()["counters"].get("workers_rejoined") == 1


def test_a_killed_worker_is_marked_dead_in_async_mode_too():
    """Catches async/ssp never marking a crashed worker dead (the chief then waited
    --rpc-deadline at the end): a session with no call for --step-timeout expires."""
    for mode in ("async", "ssp"):
        shard = one_shard(4, 2, mode=mode, optimizer="sgd", lr=1.0, step_timeout=0.5, staleness=5)
        with heartbeats(shard, 0):
            time.sleep(1.0)
        st = shard.status()
        assert st["live_workers"] == [0] and st["counters"]["workers_marked_dead"] == 1, (mode, st)


def test_ssp_clocks_survive_a_restart_from_a_checkpoint(tmp_path):
    """Catches a restored ssp shard with no clocks: the first pull at clock c > s waited for
    --step-timeout and then marked every other worker dead."""
    cfg = dict(mode="ssp", staleness=1, optimizer="sgd", lr=0.1, step_timeout=20.0)
    shard = one_shard(4, 2, checkpoint_dir=str(tmp_path), **cfg)
    for clock in range(5):
        for r in (0, 1):
            shard.pull(r, 0, -1, clock, timeout=5)
            push(shard, r, shard.store.version, ONES, clock=clock)
    shard.checkpoint(0)
    restored = Shard(ServerConfig(restore=str(tmp_path), num_workers=2, **cfg))
    for r in (0, 1):
        restored.register(r, 2, 0, 1, Layout.of([("w", (4,))]))
    started = time.monotonic()
    restored.pull(0, 0, -1, 6, timeout=30)            # 6 - s = 5 <= the slowest clock
    # Without the clocks it waits for --step-timeout (20 s) and marks worker 1 dead; the
    # bound is that, not a speed: a busy machine may take a while to answer.
    assert time.monotonic() - started < 10.0
    assert restored.status()["counters"]["workers_marked_dead"] == 0


def test_an_ssp_pull_at_clock_c_proves_c_pushes():
    """After a restart with no checkpointed clocks, a worker's pull at clock c shows it has
    pushed c times: the others may then run up to c + s without waiting for it."""
    shard = one_shard(4, 2, mode="ssp", staleness=0, optimizer="sgd", lr=0.1, step_timeout=20.0)
    t, out = pull_in_thread(shard, 1, -1, clock=3, timeout=30)   # worker 1 is at clock 3
    t.join(0.5)
    started = time.monotonic()
    shard.pull(0, 0, -1, 3, timeout=30)               # worker 0 at clock 3 too: both proved 3
    t.join(10.0)
    # Without the proof both wait for --step-timeout (20 s); 10 s leaves room for a busy machine.
    assert time.monotonic() - started < 10.0 and out.get("version") == 0


def test_a_refused_backup_register_fixes_no_layout():
    """Catches a Register refused for N <= b that still fixed the layout, leaving the shard
    refusing the real workers' model."""
    shard = Shard(ServerConfig(mode="backup", backup_workers=1))
    try:
        shard.register(0, 1, 0, 1, Layout.of([("w", (7,))]))
    except Exception as e:  # noqa: BLE001
        assert "backup_workers" in str(e)
    else:
        raise AssertionError("a backup shard with b=1 accepted N=1")
    assert shard.store.signature == "" and shard.store.params is None
    shard.register(0, 2, 0, 1, Layout.of([("w", (4,))]))   # the real model still fits
    assert shard.store.total == 4


def test_dropped_gradients_are_not_counted_as_trained_samples():
    """Catches samples_pushed counting the gradients a backup run drops at its end."""
    shard = one_shard(4, 3, mode="backup", backup_workers=1, optimizer="sgd", lr=1.0)
    shard.push(push_request(ONES, samples=10))                       # held for step 0
    shard.leave(1)
    shard.leave(2)                                                   # no step can complete now
    c = shard.status()["counters"]
    assert shard.policy.finished and c["pushes_dropped_late"] == 1
    assert c["samples_pushed"] == 0, "the dropped gradient's 10 samples were counted as trained"


def test_a_completed_sync_step_counts_every_pusher_samples():
    shard = one_shard(4, 2, mode="sync", optimizer="sgd", lr=1.0)
    shard.push(push_request(ONES, samples=10))
    assert shard.status()["counters"]["samples_pushed"] == 0          # not trained yet
    shard.push(push_request(ONES, rank=1, samples=7))
    assert shard.status()["counters"]["samples_pushed"] == 17


@SETTINGS
@given(num_workers=st.integers(2, 6), data=st.data())
def test_backup_never_aggregates_fewer_than_min_n_minus_b_and_live(num_workers, data):
    """Workers die at random moments; every applied update averages at least
    min(N-b, live) distinct workers, and exactly that many when all live ones push."""
    b = data.draw(st.integers(1, num_workers - 1))
    shard = one_shard(4, num_workers, mode="backup", backup_workers=b, optimizer="sgd", lr=1.0)
    sizes = []
    real_apply = shard.store.apply
    shard.store.apply = lambda g, *rows: (sizes.append(len(shard.policy.pending)), real_apply(g, *rows))[1]
    for step in range(4):
        live = sorted(set(range(num_workers)) - shard.members.dead)
        if len(live) > 1 and data.draw(st.booleans()):
            with shard.store.cond:
                shard.members.mark_dead([data.draw(st.sampled_from(live))], "test")
            live = sorted(set(range(num_workers)) - shard.members.dead)
        need = min(num_workers - b, len(live))
        for r in data.draw(st.permutations(live)):
            if shard.store.version > step:
                break
            push(shard, r, step, ONES)
        assert shard.store.version == step + 1
        assert sizes[-1] == need, (sizes, need, live)


def test_a_pull_whose_wait_runs_out_on_the_shard_is_tried_again(shard_server):
    """ssp: worker 0's pull waits for a slow worker 1 longer than --rpc-deadline but less
    than the shard's --step-timeout. The pull's DEADLINE_EXCEEDED killed the worker; it is
    tried again while the shard may still end the wait (2 x --step-timeout)."""
    from pserver.worker.client import PSClient
    addr, shard = shard_server(mode="ssp", staleness=0, optimizer="sgd", lr=0.1, step_timeout=4.0)
    layout = Layout.of([("w", (4,))])
    fast, slow = (PSClient([addr], rank=r, num_workers=2, rpc_deadline=1.5, data_plane="grpc")
                  for r in (0, 1))
    for c in (fast, slow):
        c.connect(5)
        c.register(layout)
    fast.init(np.zeros(4, np.float32))
    w = np.empty(4, np.float32)
    for c in (fast, slow):
        c.pull(w)
    fast.push(ONES, 1, clock=0)
    late = threading.Timer(2.5, lambda: slow.push(ONES, 1, clock=0))
    late.start()
    started = time.monotonic()
    fast.pull(w, clock=1)                   # clock 1 - s waits for the slow worker's push
    assert 2.0 < time.monotonic() - started < 8.0
    assert shard.status()["counters"]["workers_marked_dead"] == 0
    late.join(30)                           # its push answered before the channels close (CI at
    for c in (fast, slow):                  # d9a4840 warned: "Channel closed!" in the timer's thread)
        c.close()


def test_only_the_chief_ends_the_shard_and_only_once_every_worker_has_left(tmp_path):
    """stop_after_checkpoint (worker --stop-shards, pserver slurm): refused while a worker
    trains or for another rank; then a checkpoint is written and `ended` is set."""
    shard = Shard(ServerConfig(num_workers=2, checkpoint_dir=str(tmp_path)))
    layout = Layout.of([("w", (4,))])
    s0, s1 = (shard.register(r, 2, 0, 1, layout).session for r in (0, 1))
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.ones(4, np.float32)), s0)
    shard.leave(0, s0)
    with pytest.raises(FailedPrecondition, match=r"worker\(s\) \[1\] are still training"):
        shard.stop_after_checkpoint(0, s0)
    with pytest.raises(FailedPrecondition, match="only the chief"):
        shard.stop_after_checkpoint(1, s1)
    assert not shard.ended.is_set()
    shard.leave(1, s1)
    path, version = shard.stop_after_checkpoint(0, s0)
    assert shard.ended.is_set() and path.startswith(str(tmp_path)) and version == shard.status()["version"]


# --- positions: where each worker stands, for a restart to resume from (docs/semantics.md) ---

def register(shard, rank, num_workers, seed=7, steps=10):
    """Register `rank` again (one_shard registered it with no data order) with this one."""
    if shard.members.session_live(rank):
        shard.leave(rank)
    return shard.register(rank, num_workers, 0, 1, Layout.of([("w", (4,))]), data_seed=seed,
                          steps_per_epoch=steps).position


@pytest.mark.parametrize("mode", ["sync", "backup", "async", "ssp"])
def test_a_position_counts_the_steps_taken_in_and_survives_a_checkpoint(tmp_path, mode):
    """Catches a position counted at arrival in sync (a checkpoint between a push and its
    step's completion would skip a batch that was never applied), a position lost by the
    checkpoint, and a rank's position handed to another rank."""
    cfg = dict(mode=mode, optimizer="sgd", lr=0.1, step_timeout=20.0, checkpoint_dir=str(tmp_path),
               **({"backup_workers": 1} if mode == "backup" else {}))
    shard = one_shard(4, 2, **cfg)
    assert register(shard, 0, 2) == (0, 0, 0)             # one_shard's Register, before any push
    register(shard, 1, 2, seed=8, steps=20)
    for clock in range(3):
        for r in (0, 1):
            push(shard, r, shard.store.version, ONES, clock=clock)
    push(shard, 0, shard.store.version, ONES, clock=3)     # aggregated, step 3 not complete in sync
    expected = {0: 3 if mode == "sync" else 4, 1: 3}
    if mode == "backup":
        expected[0] = 4                                    # b=1: one push completes a step of 2 workers
    shard.checkpoint(0)
    restored = Shard(ServerConfig(restore=str(tmp_path), num_workers=2, **cfg))
    assert register(restored, 0, 2) == (expected[0], 7, 10)
    fresh = Shard(ServerConfig(num_workers=2, **dict(cfg, checkpoint_dir=None)))
    assert register(fresh, 0, 2) is None                  # nothing recorded: no position at all
    assert register(restored, 1, 2, seed=8, steps=20) == (expected[1], 8, 20)


def test_a_rank_back_with_another_data_order_is_told_the_old_one_and_counts_anew():
    """Catches a clock counted in one data order taken as a position in another: a worker
    restarted with a new --seed (or batch size) must start its data over, and a later restart
    must not resume from the old count."""
    shard = one_shard(4, 1, mode="async", optimizer="sgd", lr=0.1)
    register(shard, 0, 1)
    for clock in (0, 1, 2, 3, 4, 1):                       # the last: a step counted before, again
        push(shard, 0, shard.store.version, ONES, clock=clock)
    assert register(shard, 0, 1, seed=9) == (5, 7, 10)    # what it was, for the worker to compare
    assert register(shard, 0, 1, seed=9) == (0, 9, 10)    # counted anew in the new order


# -- the membership's own checks (pserver/server/membership.py; mutmut survivors) -------------

def test_a_rank_outside_the_cluster_is_refused_at_register_and_at_leave():
    """Catches `rank < num_workers` loosened to `<=`: rank N of N workers is not a worker."""
    shard = Shard(ServerConfig())
    layout = Layout.of([("w", (4,))])
    with pytest.raises(FailedPrecondition, match=r"^rank: 2 is not a worker of this cluster \(ranks 0..1\)"):
        shard.register(2, 2, 0, 1, layout)
    shard.register(0, 2, 0, 1, layout)
    with pytest.raises(FailedPrecondition, match=r"^rank: 2 is not a worker of this cluster \(ranks 0..1\)"):
        shard.leave(2)
    with pytest.raises(FailedPrecondition, match=r"^rank: worker 1 has not registered with shard 0; "):
        shard.leave(1)


def test_a_live_rank_cannot_be_registered_again_and_a_left_one_can(caplog):
    """Catches the live-session check looking at the wrong rank, and the log naming why the
    previous session ended."""
    from pserver.errors import AlreadyExists
    shard = Shard(ServerConfig())
    layout = Layout.of([("w", (4,))])
    first = shard.register(0, 2, 0, 1, layout).session
    shard.register(1, 2, 0, 1, layout)
    with pytest.raises(AlreadyExists, match=r"^rank: worker 0 is already registered with shard 0 and its "
                                            r"session is live \(last seen 0\.\d s ago"):
        shard.register(0, 2, 0, 1, layout)
    shard.leave(0, first)
    with caplog.at_level("INFO", logger="pserver.modes"):
        again = shard.register(0, 2, 0, 1, layout).session
    assert again != first and shard.members.sessions[0] == again
    assert "worker 0 registered again (its previous session left)" in caplog.text


def test_marking_workers_dead_logs_which_and_why(caplog):
    shard = one_shard(4, 3, mode="sync")
    with caplog.at_level("WARNING", logger="pserver.modes"):
        with shard.store.cond:
            shard.members.mark_dead([2, 1], "a test's reason")
    assert "shard 0: marked worker(s) [1, 2] dead: a test's reason" in caplog.text
    assert shard.members.dead == {1, 2} and shard.store.counters.snapshot()["workers_marked_dead"] == 2
    with caplog.at_level("INFO", logger="pserver.modes"):
        shard.pull(1, 0, -1, 0, timeout=5)
    assert "shard 0: worker 1 pushed or pulled again and rejoins at version 0" in caplog.text
    assert shard.members.dead == {2}


def test_a_rank_whose_session_expired_registers_again_and_the_log_says_expired(caplog):
    shard = Shard(ServerConfig(step_timeout=0.05))
    layout = Layout.of([("w", (4,))])
    first = shard.register(0, 1, 0, 1, layout).session
    assert len(first) == 32                            # secrets.token_hex(16)
    time.sleep(0.2)
    with caplog.at_level("INFO", logger="pserver.modes"):
        assert shard.register(0, 1, 0, 1, layout).session != first
    assert "worker 0 registered again (its previous session expired)" in caplog.text


# --- a restarted worker takes its live session over (issue: "a minute of silence") ----------
def test_a_register_with_the_live_sessions_credential_takes_the_rank_over_at_once(caplog):
    """Catches a takeover that waits for expiry, that accepts any credential, or that leaves the
    old credential usable."""
    from pserver.errors import AlreadyExists, Unauthenticated
    shard = Shard(ServerConfig(step_timeout=60))
    layout = Layout.of([("w", (4,))])
    first = shard.register(0, 1, 0, 1, layout)
    assert not first.took_over
    with pytest.raises(AlreadyExists):                  # a wrong credential is no takeover
        shard.register(0, 1, 0, 1, layout, previous_session="0" * 32)
    with caplog.at_level("INFO", logger="pserver.modes"):
        second = shard.register(0, 1, 0, 1, layout, previous_session=first.session)
    assert second.took_over and second.session not in ("", first.session)
    assert shard.members.sessions[0] == second.session
    assert shard.store.counters.snapshot()["sessions_taken_over"] == 1
    assert "worker 0 registered again with its previous session's credential" in caplog.text
    for call in (lambda: shard.heartbeat(0, first.session), lambda: shard.leave(0, first.session)):
        with pytest.raises(Unauthenticated, match=r"^session: rank 0 was taken over by a restarted process"):
            call()
    with pytest.raises(Unauthenticated, match="does not carry that worker's session"):
        shard.heartbeat(0, "f" * 32)                   # never anyone's: the usual refusal
    shard.heartbeat(0, second.session)
    with pytest.raises(AlreadyExists):                  # the displaced credential takes nothing back
        shard.register(0, 1, 0, 1, layout, previous_session=first.session)


def test_a_takeover_discards_the_old_sessions_gradient_for_the_open_step():
    """The new process trains the batch again (its position was not advanced), so the step
    averages its gradient and the other worker's, never the old session's."""
    shard = one_shard(3, 2, mode="sync", optimizer="sgd", lr=1.0, step_timeout=60)
    sessions = {r: shard.members.sessions[r] for r in (0, 1)}
    old = np.array([100.0, 100.0, 100.0], np.float32)
    shard.push(push_request(old, rank=1, samples=8, session=sessions[1]))
    assert shard.policy.pending.keys() == {1}
    layout = Layout.of([("w", (3,))])
    taken = shard.register(1, 2, 0, 1, layout, previous_session=sessions[1])   # the same data order
    assert taken.took_over and not shard.policy.pending and shard.store.clocks.get(1, 0) == 0
    assert shard.store.counters.snapshot()["pushes_aggregated"] == 0
    g0, g1 = np.array([1.0, 2.0, 3.0], np.float32), np.array([3.0, 2.0, 1.0], np.float32)
    shard.push(push_request(g0, samples=8, session=sessions[0]))
    assert shard.store.version == 0                     # still waiting for rank 1's new push
    shard.push(push_request(g1, rank=1, samples=8, session=taken.session))
    assert shard.store.version == 1
    np.testing.assert_array_equal(shard.store.params, -(g0 + g1) / np.float32(2))


def test_a_left_rank_is_registered_again_without_a_takeover():
    shard = Shard(ServerConfig())
    layout = Layout.of([("w", (4,))])
    first = shard.register(0, 1, 0, 1, layout)
    shard.leave(0, first.session)
    again = shard.register(0, 1, 0, 1, layout, previous_session=first.session)
    assert not again.took_over
    assert shard.store.counters.snapshot()["sessions_replaced"] == 1
    assert shard.store.counters.snapshot()["sessions_taken_over"] == 0


def test_register_reports_the_shards_training_settings():
    cfg = ServerConfig(mode="backup", backup_workers=1, optimizer="adam", lr=0.003, beta2=0.99,
                       step_timeout=7, lr_schedule="constant")
    reg = Shard(cfg).register(0, 3, 0, 1, Layout.of([("w", (4,))]))
    assert reg.settings == {"mode": "backup", "backup_workers": 1, "staleness": 0, "optimizer": "adam",
                            "lr": 0.003, "lr_schedule": "constant", "momentum": 0.9, "nesterov": False,
                            "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0,
                            "step_timeout": 7, "rho": 0.9, "centered": False, "initial_accumulator": 0.1,
                            "clipvalue": 0.0, "num_workers": 3}


def test_a_silent_session_is_marked_dead_at_step_timeout_after_its_last_call_not_a_tick_later():
    """Catches a reaper that only looks every tick (min(1, T/4)): a killed worker's leases would go
    up to a tick after --step-timeout. Three workers fall silent 0.15 s apart; each must be marked
    dead within 0.1 s after T of silence (a tick of 0.5 s passes that for all three ~1% of the time)."""
    timeout = 2.0
    shard = one_shard(4, 3, mode="async", optimizer="sgd", lr=1.0, step_timeout=timeout)
    last = {}
    for r in range(3):
        push(shard, r, 0, ONES)
        last[r] = time.monotonic()
        time.sleep(0.15)
    marked: dict[int, float] = {}
    deadline = time.monotonic() + timeout + 3
    while len(marked) < 3 and time.monotonic() < deadline:
        for r in shard.members.dead - set(marked):
            marked[r] = time.monotonic()
        time.sleep(0.002)
    assert sorted(marked) == [0, 1, 2]
    late = {r: round(marked[r] - last[r] - timeout, 3) for r in marked}
    assert all(0 <= s < 0.1 for s in late.values()), late


def test_a_job_after_every_worker_left_waits_for_every_starting_rank_again(caplog):
    """Catches the first worker of a second job on the same shards (a second fit under pserver
    run, a job run again) training its steps alone: its ranks had all left, so none was expected
    until it registered again, and the step applied one gradient (CI saw the two ranks of a
    second Keras fit end with different weights)."""
    shard = Shard(ServerConfig(num_workers=2, mode="sync", optimizer="sgd", lr=1.0))
    layout = Layout.of([("w", (4,))])
    s = [shard.register(r, 2, 0, 1, layout).session for r in (0, 1)]
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.zeros(4, np.float32)), s[0])
    for r in (0, 1):
        shard.push(push_request(ONES * (r + 1), rank=r, step=0, session=s[r]))
    assert shard.store.version == 1
    for r in (0, 1):
        shard.leave(r, s[r])
    caplog.set_level("INFO", logger="pserver.modes")
    s[1] = shard.register(1, 2, 0, 1, layout).session
    assert "every worker of the last job left; worker 1 begins another" in caplog.text
    shard.push(push_request(ONES * 4, rank=1, step=1, session=s[1]))
    assert shard.store.version == 1, "a step applied before rank 0 registered for the new job"
    assert shard.members.expected() == {0, 1}
    s[0] = shard.register(0, 2, 0, 1, layout).session
    assert "worker 0 registered again (its previous session left)" in caplog.text
    shard.push(push_request(ONES * 2, rank=0, step=1, session=s[0]))
    assert shard.store.version == 2
    np.testing.assert_allclose(shard.store.params, -1.5 * ONES - 3 * ONES)


def test_a_worker_back_after_the_others_left_without_it_trains_alone():
    """The rule above only for a job every worker left: a rank marked dead that comes back after
    the others finished and left goes on alone (docs/semantics.md: a worker that leaves is done),
    and a left rank's old credential takes nothing over."""
    shard = Shard(ServerConfig(num_workers=2, mode="sync", optimizer="sgd", lr=1.0))
    layout = Layout.of([("w", (4,))])
    s = [shard.register(r, 2, 0, 1, layout).session for r in (0, 1)]
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.zeros(4, np.float32)), s[0])
    with shard.store.cond:
        shard.members.mark_dead([1], "a test")
    shard.push(push_request(ONES, rank=0, step=0, session=s[0]))
    assert shard.store.version == 1
    shard.leave(0, s[0])
    shard.members.last_seen[1] -= 120               # its session expired: it may register again
    s[1] = shard.register(1, 2, 0, 1, layout).session
    assert shard.members.expected() == {1}
    shard.push(push_request(ONES, rank=1, step=1, session=s[1]))
    assert shard.store.version == 2
    again = shard.register(0, 2, 0, 1, layout, previous_session=s[0])
    assert not again.took_over


def test_a_rank_marked_dead_that_then_left_is_waited_for_again_in_the_next_job():
    """Catches the new job keeping the old one's dead set: a rank marked dead, then stopped and
    left, would never be waited for in the next job (its steps one gradient short)."""
    shard = Shard(ServerConfig(num_workers=2, mode="sync", optimizer="sgd", lr=1.0))
    layout = Layout.of([("w", (4,))])
    s = [shard.register(r, 2, 0, 1, layout).session for r in (0, 1)]
    with shard.store.cond:
        shard.members.mark_dead([1], "a test")
    for r in (0, 1):
        shard.leave(r, s[r])
    shard.register(0, 2, 0, 1, layout)
    assert shard.members.expected() == {0, 1} and not shard.members.dead


def test_a_starting_rank_that_registers_after_the_others_left_is_late_not_another_job(caplog):
    """Catches the late rank of an async job on slices beginning another job: rank 1's process
    started after rank 0 trained and left; the shards forgot rank 0, and the chief, waiting
    for rank 1 to train its slice, then waited for a rank 0 that had not come."""
    shard = Shard(ServerConfig(num_workers=2, mode="async", optimizer="sgd", lr=1.0))
    layout = Layout.of([("w", (4,))])
    s0 = shard.register(0, 2, 0, 1, layout).session
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.zeros(4, np.float32)), s0)
    shard.push(push_request(ONES, rank=0, step=0, session=s0))
    shard.leave(0, s0)
    caplog.set_level("INFO", logger="pserver.modes")
    shard.register(1, 2, 0, 1, layout)
    assert "begins another" not in caplog.text
    assert shard.members.registered == {0, 1} and shard.members.left == {0}
    assert shard.status()["registered_workers"] == [0, 1] and shard.status()["live_workers"] == [1]


def test_a_second_fit_s_late_worker_joins_the_run_its_chief_finished_rather_than_starting_it_over():
    """Catches the flake of tests/test_keras.py's async second fit (seen 2026-12-02): the chief's
    first ask (restart: a second fit starts the data over) began the new run and, in async, trained
    all of it before rank 1's first ask; that ask's restart then found a finished run and began a
    third, which rank 1 trained alone, waiting at epoch 1 for logs the chief, gone, never gave."""
    from pserver.server.coordinator import Plan
    shard = Shard(ServerConfig(num_workers=2, mode="async", optimizer="sgd", lr=1.0))
    layout = Layout.of([("w", (4,))])
    plan = Plan(2, 1, 0, "fp", 1)

    def job():
        return [shard.register(r, 2, 0, 1, layout).session for r in (0, 1)]

    def train_alone(session, restart):
        lease, _ = shard.lease(0, session, plan, restart=restart)
        assert lease.epoch == 0, "a fit's first ask starts the data over"
        while lease is not None:
            lease, _ = shard.lease(0, session, plan, finished=(lease.epoch, lease.chunk))

    s = job()                                        # the first fit
    shard.init(0, layout.signature(), 4, "float32", fill_with(np.zeros(4, np.float32)), s[0])
    train_alone(s[0], False)
    for r in (0, 1):
        shard.leave(r, s[r])
    assert shard.store.coordinator.finished
    s = job()                                        # the second fit: a new job
    train_alone(s[0], True)                          # async: the chief trains every chunk alone
    shard.epoch_logs(0, s[0], 0, (["loss"], [0.5], False))
    shard.leave(0, s[0])
    late, _ = shard.lease(1, s[1], plan, restart=True)
    assert late is None and shard.store.coordinator.finished, "rank 1's restart began another run"
    logs, _, _ = shard.epoch_logs(1, s[1], 0)
    assert logs == (["loss"], [0.5], False)
    shard.leave(1, s[1])
    again = job()                                    # a third job's restart starts over again
    assert shard.lease(0, again[0], plan, restart=True)[0].epoch == 0


def test_close_waits_for_the_heartbeat_so_no_beat_meets_a_closed_channel(shard_server):
    """The heartbeat thread beats every 50 ms here (a 0.2 s session timeout / 4). close() used to
    close the channels while that thread was still running: a beat started then raised 'Cannot
    invoke RPC on closed channel!' in it (a warning in CI). Now close() stops and joins it first."""
    from pserver.worker.client import PSClient
    addr, shard = shard_server(mode="async", optimizer="sgd", lr=0.1, step_timeout=0.2)
    layout = Layout.of([("w", (4,))])
    died, hook = [], threading.excepthook
    threading.excepthook = died.append
    try:
        for i in range(10):
            c = PSClient([addr], rank=0, num_workers=1, rpc_deadline=5, data_plane="grpc")
            c.connect(5)
            c.register(layout)
            time.sleep(0.01 * (i % 7))          # close at a different point of the beat each time
            c.close()
            assert not c._heartbeat.is_alive(), f"the heartbeat outlived close() (round {i})"
    finally:
        threading.excepthook = hook
    assert [str(d.exc_value) for d in died] == []
