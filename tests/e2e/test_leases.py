"""--data-assignment leases with real processes: a worker SIGKILLed in epoch 2, and every epoch still
ends with every chunk of the data done (shard 0's counters prove it), in sync and in async."""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.conftest import read_json, wait_until

pytestmark = pytest.mark.e2e

STEP_TIMEOUT = 3.0
SAMPLES, BATCH, CHUNK, EPOCHS = 8640, 32, 8, 2
CHUNKS = -(-(SAMPLES // BATCH) // CHUNK)          # 270 batches per epoch in chunks of 8: 34
TRAIN = ["--model", "logreg", "--samples", str(SAMPLES), "--features", "20", "--batch-size", str(BATCH),
         "--epochs", str(EPOCHS), "--delay", "fixed:0.01", "--data-assignment", "leases",
         "--chunk-batches", str(CHUNK)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_killed_in_epoch_2_its_chunk_goes_to_another_and_every_chunk_is_done(procs, tmp_path, mode):
    """Fails if a dead worker's chunk is lost (chunks_done short of 2 x 34: the epoch never ends, or
    the test's wait times out), if its lease is not released (chunks_released 0), if chunks are
    done twice (chunks_done above 68), more than its one in-flight batch is retrained, or leases are
    handed out past --epochs (the leaving workers' would be released too)."""
    shard = procs("serve", "--port", "0", "--num-workers", "3", "--step-timeout", str(STEP_TIMEOUT),
                  "--optimizer", "sgd", "--lr", "0.1", "--mode", mode)
    addr = shard.address()
    summary = tmp_path / "summary.json"
    workers = [procs("worker", "--ps", addr, "--rank", str(r), "--num-workers", "3", *TRAIN,
                     *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(3)]
    assert wait_until(lambda: any("epoch 1/2 done" in ln for ln in workers[0].lines), 120), workers[0].output
    time.sleep(0.3)
    workers[2].popen.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert workers[0].wait() == 0 and workers[1].wait() == 0, workers[0].output + workers[1].output
    s = read_json(summary)
    assert s["chunks_done"] == EPOCHS * CHUNKS, s
    assert s["chunks_released"] == 1 and s["batches_retrained"] <= 1, s   # the killed worker's lease only
    # Its chunk went on from the first batch not done, which its pushes told shard 0 (over the
    # data plane, in the frame's lease fields): a progress lost on the way would have the chunk
    # trained again from its start, several batches more than the one in flight.
    assert s["samples_trained"] <= (EPOCHS * (SAMPLES // BATCH) + s["batches_retrained"]) * BATCH, s
    assert [e["epoch"] for e in s["per_epoch"]] == [1, 2]
    assert s["test_accuracy"] >= 0.85, s
    assert "data leases: 68 chunk(s) done" in workers[0].output
    print(f"{mode}: the run went on {time.monotonic() - killed:.1f} s after the kill; "
          f"counters {[s[k] for k in ('chunks_done', 'chunks_released', 'batches_retrained')]}")
