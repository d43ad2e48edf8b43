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


def test_shard_0_restored_after_the_data_ended_has_the_chief_train_what_it_lost(procs, tmp_path):
    """Shard 0 SIGKILLed after the chief's last push and before the chief's checkpoint of the end
    (the worker SIGSTOPped during its long final evaluation), restarted with --restore from a
    checkpoint 41+ steps older: the chief learns shard 0 restarted, asks its coordinator again, and
    trains the chunks the checkpoint lacks, so the run ends with every chunk done and a checkpoint
    past the restored one. Before, the worker evaluated the restored weights, summarized 6 of 9
    chunks done and exited 0 (CI's flake in test_checkpoint_faults' delta test was this)."""
    from pserver.persist import checkpoint
    from tests.support.processes import free_port
    port, ckpt, summary = free_port(), tmp_path / "ckpt", tmp_path / "summary.json"
    serve = ["serve", "--port", str(port), "--num-workers", "1", "--optimizer", "adam", "--lr", "0.001",
             "--checkpoint-every", "50", "--restore", str(ckpt)]
    shard = procs(*serve)
    addr = shard.address()
    worker = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "1", "--model", "wide_deep",
                   "--dataset", "criteo-synthetic", "--samples", "9000", "--test-samples", "300000",
                   "--batch-size", "64", "--seed", "5", "--epochs", "1", "--rpc-deadline", "60",
                   "--summary-json", str(summary))
    deadline = time.monotonic() + 120
    while "step 141/141" not in worker.output and worker.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    worker.popen.send_signal(signal.SIGSTOP)          # in its evaluation of 300,000 samples
    newest = checkpoint.candidates(str(ckpt), 0, 1)[0][0]
    assert newest <= 100, f"the chief's checkpoint of the end came first: {newest}\n{worker.output}"
    shard.popen.send_signal(signal.SIGKILL)
    shard.popen.wait()
    restarted = procs(*serve)
    restarted.address()
    worker.popen.send_signal(signal.SIGCONT)
    assert worker.wait() == 0, worker.output
    assert f"restored version {newest}" in restarted.output, restarted.output
    assert "shard 0 restarted after the data's end" in worker.output, worker.output
    s = read_json(summary)
    after = checkpoint.candidates(str(ckpt), 0, 1)[0][0]
    # every chunk done once, and each step after the restore trained a batch the checkpoint lacked
    assert s["chunks_done"] == 9 and after - newest == s["batches_retrained"] > 0, (s, newest, after)
    assert worker.output.count("epoch 1/1 done") == 2, worker.output   # evaluated again, logged once
    assert [e["epoch"] for e in s["per_epoch"]] == [1] and s["per_epoch"][0]["auc"] == s["test_auc"], s
