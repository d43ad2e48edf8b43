"""--data-assignment leases with real processes: a worker stopped past --step-timeout learns its lease
is gone, and shard 0 restored mid-epoch counts what was trained twice. A worker SIGKILLed in epoch 2,
every chunk still done, is tests/e2e/test_elastic_mnist.py (with joiners, on MNIST)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.processes import read_json, wait_until

pytestmark = pytest.mark.e2e

STEP_TIMEOUT = 3.0
SAMPLES, BATCH, CHUNK, EPOCHS = 8640, 32, 8, 2
CHUNKS = -(-(SAMPLES // BATCH) // CHUNK)          # 270 batches per epoch in chunks of 8: 34
TRAIN = ["--model", "logreg", "--samples", str(SAMPLES), "--features", "20", "--batch-size", str(BATCH),
         "--epochs", str(EPOCHS), "--delay", "fixed:0.01", "--data-assignment", "leases",
         "--chunk-batches", str(CHUNK)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_stopped_past_step_timeout_learns_its_lease_is_gone(procs, tmp_path, mode):
    """SIGSTOP a worker longer than --step-timeout (it is marked dead, its lease released and leased
    again), then SIGCONT: its next push carries the old lease, shard 0 refuses it (lease_gone), and the
    worker drops that chunk and asks for another. Fails if the stale worker goes on training its old
    chunk (every further push of it would count in batches_retrained: above 1), if the refusal kills the
    worker (exit code), or if a chunk is lost or done twice (chunks_done != 34)."""
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--step-timeout", "1.5",
                  "--optimizer", "sgd", "--lr", "0.1", "--mode", mode)
    addr = shard.address()
    summary = tmp_path / "summary.json"
    # one epoch, about 5 s: worker 1 is stopped in it and comes back before it ends
    train = [*(a if a != "fixed:0.01" else "fixed:0.03" for a in TRAIN), "--epochs", "1"]
    workers = [procs("worker", "--ps", addr, "--rank", str(r), "--num-workers", "2", *train, "--log-every",
                     "0.2", *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(2)]
    assert wait_until(lambda: any("epoch 1/1 step" in ln for ln in workers[1].lines), 120), workers[1].output
    workers[1].popen.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: "marked worker(s) [1] dead" in shard.output, 30), shard.output
    workers[1].popen.send_signal(signal.SIGCONT)
    assert workers[0].wait() == 0 and workers[1].wait() == 0, workers[0].output + workers[1].output
    s = read_json(summary)
    assert s["chunks_done"] == CHUNKS, s
    assert s["chunks_released"] == 1 and s["batches_retrained"] <= 1, s
    assert "no longer holds chunk" in workers[1].output, workers[1].output


def test_shard_0_restored_mid_epoch_counts_the_chunks_done_since_its_checkpoint(procs, tmp_path):
    """Shard 0 SIGKILLed a while after a checkpoint and restarted with --restore: the workers see a
    new coordinator, report what they trained under the old one, and the batches done after the
    checkpoint count in batches_retrained (more than the two batches in flight at the checkpoint,
    which is all the old code counted); the epochs still end with every chunk done once."""
    from tests.support.processes import free_port
    port, ckpt = free_port(), tmp_path / "ckpt"
    ckpt.mkdir()
    serve = ["serve", "--port", str(port), "--num-workers", "2", "--mode", "async", "--step-timeout", "5",
             "--optimizer", "sgd", "--lr", "0.1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "100",
             "--restore", str(ckpt)]
    shard = procs(*serve)
    addr = shard.address()
    summary = tmp_path / "summary.json"
    train = [*(a if a != "fixed:0.01" else "fixed:0.02" for a in TRAIN), "--epochs", "1"]
    workers = [procs("worker", "--ps", addr, "--rank", str(r), "--num-workers", "2", *train, "--rpc-deadline",
                     "60", *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(2)]
    assert wait_until(lambda: any(ckpt.glob("shard0-*.ckpt")), 60), shard.output
    time.sleep(0.6)                                   # about 30 batches past version 100's checkpoint
    shard.popen.send_signal(signal.SIGKILL)
    shard.popen.wait()
    restarted = procs(*serve)
    restarted.address()
    assert workers[0].wait() == 0 and workers[1].wait() == 0, workers[0].output + workers[1].output
    assert "restored version" in restarted.output, restarted.output
    s = read_json(summary)
    told = [w.output for w in workers if "data coordinator restored from a checkpoint" in w.output]
    assert told, workers[0].output
    assert s["chunks_done"] == CHUNKS, s
    assert s["batches_retrained"] > 2, s
    print(f"retrained {s['batches_retrained']}, released {s['chunks_released']}")
