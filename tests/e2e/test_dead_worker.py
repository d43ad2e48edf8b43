"""A worker killed with SIGKILL mid-run: the others finish, the shard counts it, it can rejoin."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.processes import read_json, wait_for_steps

pytestmark = pytest.mark.e2e

STEP_TIMEOUT = 3.0   # a session also expires after this: leave room for a busy machine
# ~90 steps of ~20 ms each per worker: long enough to kill one in the middle.
TRAIN = ["--model", "logreg", "--samples", "8640", "--features", "20", "--batch-size", "32",
         "--epochs", "1", "--delay", "fixed:0.02", "--log-every", "0.2"]


def cluster(procs, tmp_path, name):
    shard = procs("serve", "--port", "0", "--num-workers", "3", "--step-timeout", str(STEP_TIMEOUT),
                  "--optimizer", "sgd", "--lr", "0.1")
    addr = shard.address()
    summary = tmp_path / f"{name}.json"
    workers = [procs("worker", "--ps", addr, "--rank", str(r), "--num-workers", "3", *TRAIN,
                     *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(3)]
    return shard, addr, workers, summary


def test_sigkill_in_sync_mode_does_not_stop_the_others_and_the_worker_can_rejoin(procs, tmp_path):
    started = time.monotonic()
    _, _, workers, summary = cluster(procs, tmp_path, "baseline")
    assert all(w.wait() == 0 for w in workers)
    baseline = time.monotonic() - started
    assert read_json(summary)["workers_marked_dead"] == 0

    started = time.monotonic()
    shard, addr, workers, summary = cluster(procs, tmp_path, "killed")
    wait_for_steps(workers[2], 3)
    workers[2].popen.send_signal(signal.SIGKILL)
    assert workers[0].wait() == 0 and workers[1].wait() == 0, workers[0].output
    elapsed = time.monotonic() - started
    assert elapsed <= baseline + STEP_TIMEOUT + 5, (elapsed, baseline)
    s = read_json(summary)
    assert s["workers_marked_dead"] >= 1
    assert s["test_accuracy"] >= 0.85
    assert "marked worker(s) [2] dead" in shard.output

    # Leased data (the default): its chunk went to the others when it was marked dead, and every
    # chunk of the one epoch was done without it (270 batches in chunks of 16).
    assert s["chunks_done"] == -(-(8640 // 32) // 16) and s["chunks_released"] >= 1, s
    again = procs("worker", "--ps", addr, "--rank", "2", "--num-workers", "3", *TRAIN, "--max-steps", "60")
    assert again.wait() == 0, again.output
    assert "registered again and rejoins" in shard.output
    # It goes on from shard 0's coordinator, not from step 1: the job's data is done.
    said = "data coordinator has done all 1 epoch(s) of this data: nothing is left to train"
    assert said in again.output, again.output

