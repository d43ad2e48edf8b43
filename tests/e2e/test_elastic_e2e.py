"""Elastic workers with real processes: the Python cluster object's add_workers, and a --rank auto
worker restarted with its command (docs/operations.md, "Elastic workers"). The whole scenario (2
workers, 2 joining in epoch 1, one SIGKILLed in epoch 2) is tests/e2e/test_elastic_mnist.py."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.processes import read_json

pytestmark = pytest.mark.e2e

STEP_TIMEOUT = 3.0
# 2 epochs of 90 steps of >= 40 ms each on the first two workers (slices of 2); a joiner (a slice of
# 4) has 45 steps an epoch.
TRAIN = ["--model", "logreg", "--samples", "5760", "--features", "20", "--batch-size", "32",
         "--epochs", "2", "--delay", "fixed:0.04", "--log-every", "0.2"]


def wait_for(proc, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in ln for ln in proc.lines):
            return
        if proc.popen.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in:\n{proc.output}")


def test_the_python_cluster_object_adds_a_worker_that_trains():
    # catches: add_workers starting workers that cannot join (no room, no token, a taken rank):
    # wait() would raise with their exit codes, or the summary would show one worker's samples.
    # With --min-workers 2 the first worker's steps wait for the joiner, which starts for longer
    # than --step-timeout; catches (issue 46.4) that step's timer counting while it waited, which
    # marked the joiner dead as it joined (the job stalled), and (issue 46.3) the job's end
    # hanging: the worker that finishes first leaves, and the other's last step waited below
    # the minimum for ever. Either makes wait() time out.
    import pserver
    cluster = pserver.start_cluster(ps=1, workers=1, max_workers=2, min_workers=2, step_timeout=STEP_TIMEOUT,
                                    model="logreg", samples=2880, features=20, epochs=2, delay="fixed:0.03")
    try:
        assert len(cluster.add_workers(1)) == 1
        s = cluster.wait(timeout=120)
    finally:
        cluster.stop()
    assert [e["epoch"] for e in s["per_epoch"]] == [1, 2]
    # Leased data (the default): every batch once, whoever trains it, a push refused for a stale step
    # (the joiner's first) trained again; the added worker trained too when some sync steps
    # averaged two pushes (one worker alone pushes once a step).
    assert s["samples_trained"] == 2 * (2880 // 64) * 64 and s["pushes_aggregated"] > s["steps"], s
    # The summary's header counts the workers that trained: 2, where the chief's --num-workers says
    # 1 (on 3de5e7b it said "1 worker(s)").
    from pserver.observe.metrics import format_summary
    assert s["workers_registered"] == [0, 1], s
    assert "1 shard(s), 2 worker(s) (1 at the start) ==" in format_summary(s).splitlines()[0]


def test_a_rank_auto_worker_restarted_with_the_same_command_gets_its_old_rank_back(procs, tmp_path):
    """Two --rank auto joiners (ranks 1, 2); the second is SIGKILLed and started again with the same
    command: it takes the slot its dead process held (the first's slot is locked by the live first)
    and shard 0 gives it rank 2 back at once (--step-timeout 60: its old session is still live).
    Fails if an auto worker keeps no session (the restart gets rank 3, a fresh one), or if the
    restart takes the live first joiner's slot (it would take rank 1 over: that worker exits 1)."""
    sessions = str(tmp_path / "sessions")
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--max-workers", "4", "--mode", "async",
                  "--step-timeout", "60", "--optimizer", "sgd", "--lr", "0.1")
    addr = shard.address()
    summary = tmp_path / "summary.json"
    train = [*TRAIN, "--epochs", "1", "--data-assignment", "leases", "--session-dir", sessions]
    chief = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "1", *train,
                  "--summary-json", str(summary))
    auto = ["worker", "--ps", addr, "--rank", "auto", "--num-workers", "4", *train]
    first = procs(*auto)
    wait_for(first, "shard 0 assigned rank 1")
    second = procs(*auto)
    wait_for(second, "shard 0 assigned rank 2")
    wait_for(second, "first push after joining taken in")
    second.popen.send_signal(signal.SIGKILL)
    second.wait()
    again = procs(*auto)                                # the same command
    # the takeover line comes after the rank line: wait for it, not the first (a process that
    # trains without taking over ends, and wait_for fails with its output)
    wait_for(again, "took its rank back at once on 1 of 1 shard(s)")
    assert "shard 0 assigned rank 2 (--rank auto; the rank kept in" in again.output, again.output
    assert again.wait() == 0 and first.wait() == 0 and chief.wait() == 0, first.output + again.output
    assert read_json(summary)["workers_marked_dead"] == 0
