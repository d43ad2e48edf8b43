"""Sessions and dead workers with real processes: a killed worker never hangs the run, a
restarted one rejoins, a second worker cannot take a live rank (docs/semantics.md, "Dead
workers" and "Security")."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.support.processes import read_json, wait_for_steps, wait_until

pytestmark = pytest.mark.e2e

STEP_TIMEOUT = "2"
# ~6 s of training per worker at 3 workers: long enough to kill one and restart it.
TRAIN = ["--model", "logreg", "--samples", "9000", "--features", "20", "--batch-size", "32",
         "--epochs", "2", "--delay", "fixed:0.02", "--log-every", "0.2", "--rpc-deadline", "40"]


def cluster(procs, tmp_path, mode, n=3, extra=(), step_timeout=STEP_TIMEOUT, train=TRAIN):
    shard = procs("serve", "--port", "0", "--num-workers", str(n), "--step-timeout", step_timeout,
                  "--mode", mode, "--optimizer", "sgd", "--lr", "0.1", *extra)
    addr = shard.address()
    summary = tmp_path / "summary.json"
    workers = [start_worker(procs, addr, r, n, summary, train) for r in range(n)]
    return shard, addr, workers, summary


def start_worker(procs, addr, rank, n, summary, train=TRAIN):
    return procs("worker", "--ps", addr, "--rank", str(rank), "--num-workers", str(n), *train,
                 *(["--summary-json", str(summary)] if rank == 0 else []))


@pytest.mark.parametrize("mode", ["backup", "async"])
def test_a_killed_worker_never_keeps_the_chief_waiting(procs, tmp_path, mode):
    """backup and async never marked a killed worker dead: the chief waited --rpc-deadline
    for it at the end, exited 1 and wrote no summary."""
    extra = ("--backup-workers", "1") if mode == "backup" else ()
    shard, _, workers, summary = cluster(procs, tmp_path, mode, extra=extra)
    wait_for_steps(workers[2], 3)
    started = time.monotonic()
    workers[2].popen.send_signal(signal.SIGKILL)
    assert workers[0].wait(120) == 0 and workers[1].wait(120) == 0, workers[0].output
    assert time.monotonic() - started < 30, "the chief waited for the killed worker"
    s = read_json(summary)
    assert s["workers_marked_dead"] >= 1 and s["test_accuracy"] >= 0.85
    assert "marked worker(s) [2] dead" in shard.output


def test_a_killed_chief_does_not_stop_the_others_and_they_say_it_is_gone(procs, tmp_path):
    shard, _, workers, _ = cluster(procs, tmp_path, "backup", extra=("--backup-workers", "1"))
    wait_for_steps(workers[0], 3)
    workers[0].popen.send_signal(signal.SIGKILL)
    for w in workers[1:]:
        assert w.wait(120) == 0, w.output
        last = [ln for ln in w.lines if ln.strip()][-1]
        assert "the chief (rank 0) is gone" in last, w.output


def test_a_restarted_chief_without_a_session_file_waits_for_its_old_session_then_rejoins(procs, tmp_path):
    # A session that outlives the restart of the process (20 s, on a busy machine too).
    train = [*TRAIN[:TRAIN.index("--epochs")], "--epochs", "5", *TRAIN[TRAIN.index("--epochs") + 2:],
             "--session-dir", "none"]
    shard, addr, workers, summary = cluster(procs, tmp_path, "backup", extra=("--backup-workers", "1"),
                                            step_timeout="20", train=train)
    wait_for_steps(workers[0], 3)
    workers[0].popen.send_signal(signal.SIGKILL)
    workers[0].wait()
    chief = start_worker(procs, addr, 0, 3, summary, train)   # the same flags, at once
    assert chief.wait(120) == 0, chief.output
    assert "waiting for that session to expire" in chief.output, chief.output
    assert all(w.wait(120) == 0 for w in workers[1:])
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.85
    assert "worker 0 registered again" in shard.output


def test_a_second_worker_with_a_live_rank_is_refused_and_waits(procs, tmp_path):
    """Two workers started with --rank 0 were both accepted, both acted as chief and both
    exited 0."""
    shard, addr, workers, summary = cluster(procs, tmp_path, "sync", n=2)
    wait_for_steps(workers[0], 2)
    twin = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "2", *TRAIN[:-2],
                 "--rpc-deadline", "3", "--session-dir", "none")   # no credential: no takeover
    assert twin.wait(60) != 0
    assert "already registered" in twin.output and "waiting for that session to expire" in twin.output
    assert not any("epoch " in ln or "loss" in ln for ln in twin.lines), twin.output
    assert all(w.wait(120) == 0 for w in workers)
    assert read_json(summary)["test_accuracy"] >= 0.85


def test_a_stopped_worker_is_marked_dead_and_rejoins_when_it_continues(procs, tmp_path):
    """SIGSTOP freezes a worker, heartbeats included: the others go on without it after
    --step-timeout; SIGCONT brings it back into the steps, and every worker finishes."""
    shard, _, workers, summary = cluster(procs, tmp_path, "sync")
    wait_for_steps(workers[2], 3)
    workers[2].popen.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while "marked worker(s) [2] dead" not in shard.output and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "marked worker(s) [2] dead" in shard.output, shard.output
    workers[2].popen.send_signal(signal.SIGCONT)
    assert all(w.wait(120) == 0 for w in workers), [w.output for w in workers]
    assert "worker 2 pushed or pulled again and rejoins" in shard.output, shard.output
    s = read_json(summary)
    assert s["workers_marked_dead"] >= 1 and s["test_accuracy"] >= 0.85


def shard_version(addr: str) -> int:
    from pserver.worker.client import PSClient
    client = PSClient([addr])
    try:
        return client.status(5.0)[0].version
    finally:
        client.close()


def wait_for_version(addr: str, n: int, timeout: float = 60) -> None:
    assert wait_until(lambda: shard_version(addr) >= n, timeout), f"the shard never reached version {n}"


def test_a_worker_restarted_after_kill_9_takes_its_rank_back_at_once(procs, tmp_path):
    """The minute of silence: a sync job with --step-timeout 60 stalled about 61 s when a
    killed worker was restarted with the same command, waiting for its own old session."""
    shard, addr, workers, summary = cluster(procs, tmp_path, "sync", n=2, step_timeout="60")
    wait_for_version(addr, 5)
    workers[1].popen.send_signal(signal.SIGKILL)
    workers[1].wait()
    killed = time.monotonic()
    again = start_worker(procs, addr, 1, 2, summary)          # the same command
    assert again.wait(120) == 0 and workers[0].wait(120) == 0, again.output + workers[0].output
    assert time.monotonic() - killed < 40, "the restart waited for the old session (--step-timeout 60)"
    assert "took its rank back at once on 1 of 1 shard(s)" in again.output, again.output
    assert "waiting for that session to expire" not in again.output
    first = re.search(r"first push after the takeover taken in (\d+\.\d) s after this process started",
                      again.output)
    assert first, again.output
    assert "takes the rank over at once" in shard.output and "marked worker" not in shard.output
    s = read_json(summary)
    assert s["workers_marked_dead"] == 0 and s["test_accuracy"] >= 0.85


def test_a_displaced_worker_that_wakes_up_is_told_it_was_taken_over_and_stops(procs, tmp_path):
    """SIGSTOP a worker, start its rank again (it takes the rank over), SIGCONT the old one: its
    next call is refused with "taken over" and it exits at once without retrying."""
    shard, addr, workers, summary = cluster(procs, tmp_path, "sync", n=2, step_timeout="60")
    wait_for_version(addr, 5)
    workers[1].popen.send_signal(signal.SIGSTOP)
    again = start_worker(procs, addr, 1, 2, summary)
    assert wait_until(lambda: "took its rank back at once" in again.output, 60), again.output
    workers[1].popen.send_signal(signal.SIGCONT)
    woke = time.monotonic()
    assert workers[1].wait(60) == 1, workers[1].output
    assert time.monotonic() - woke < 20
    assert "rank 1 was taken over by a restarted process" in workers[1].output, workers[1].output
    assert "retrying" not in workers[1].output
    assert again.wait(120) == 0 and workers[0].wait(120) == 0, again.output + workers[0].output
    assert read_json(summary)["test_accuracy"] >= 0.85
