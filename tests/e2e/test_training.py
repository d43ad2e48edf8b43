"""Real shard and worker processes train a model end to end."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import LOGREG, free_port, read_json, run, wait_until

pytestmark = pytest.mark.e2e

SUMMARY_KEYS = {"mode", "num_shards", "num_workers", "dataset", "model", "optimizer", "batch_size",
                "epochs", "steps", "test_accuracy", "test_loss", "wall_seconds",
                "train_samples_per_second", "updates_applied", "pushes_rejected",
                "pushes_dropped_late", "staleness_mean", "staleness_max"}


def test_serve_and_worker_processes_train_logreg(procs, tmp_path):
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--optimizer", "sgd", "--lr", "0.1")
    addr = shard.address()
    summary = tmp_path / "summary.json"
    chief = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "2", *LOGREG,
                  "--summary-json", str(summary))
    other = procs("worker", "--ps", addr, "--rank", "1", "--num-workers", "2", *LOGREG)
    assert chief.wait() == 0, chief.output
    assert other.wait() == 0, other.output
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.9, s
    # Leased data (the default): 2 epochs of 188 batches of 32 (the last of 16), every one trained
    # once; at an epoch's end the worker without a chunk pushes empty contributions (0 samples) to
    # the last steps.
    assert s["samples_trained"] == 2 * 6000 and s["chunks_done"] == 2 * 12, s
    assert s["steps"] == s["updates_applied"] >= 188 and s["pushes_rejected"] == 0, s
    assert 2 * 188 <= s["pushes_aggregated"] <= 2 * s["steps"], s
    assert "epoch 2/2 done" in chief.output and "samples/s" in other.output
    assert "payloads through shared memory" in chief.output
    status = run("status", "--ps", addr)
    assert status.returncode == 0, status.stderr
    assert "version" in status.stdout and str(s["steps"]) in status.stdout
    shard.stop()                                   # SIGTERM: exit 128+15
    assert shard.popen.returncode == 143 and "stopped by SIGTERM at version" in shard.output


def test_sync_workers_with_different_batch_sizes_finish_and_every_sample_counts(procs, tmp_path):
    """Rank 0 on batches of 16 (30 steps), rank 1 on batches of 48 (10 steps) of 480 samples
    each: both finish, the first 10 steps weigh 16 and 48 samples, the last 20 rank 0's alone,
    and the shard counted each push's true samples (960), none refused."""
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--optimizer", "sgd", "--lr", "0.1")
    addr = shard.address()
    summary = tmp_path / "summary.json"
    # Each rank its own batch size over its own slice: slices (leases number one plan's batches).
    common = ["--model", "logreg", "--dataset", "synthetic", "--samples", "960", "--features", "10",
              "--epochs", "1", "--log-every", "0.5", "--num-workers", "2", "--ps", addr,
              "--data-assignment", "slices"]
    chief = procs("worker", "--rank", "0", *common, "--batch-size", "16", "--summary-json", str(summary))
    other = procs("worker", "--rank", "1", *common, "--batch-size", "48")
    assert chief.wait() == 0, chief.output
    assert other.wait() == 0, other.output
    s = read_json(summary)
    assert s["steps"] == s["updates_applied"] == 30, s
    assert s["pushes_aggregated"] == 40 and s["pushes_rejected"] == 0
    assert s["samples_trained"] == 30 * 16 + 10 * 48


def test_an_async_chief_on_slices_waits_for_a_rank_that_starts_after_it_finished(procs, tmp_path):
    """--data-assignment slices: rank 1's slice is rank 1's to train. A chief that trained its
    own before rank 1's process started waits for it (saying so) and summarizes both slices;
    it used to summarize its half and leave, and the late rank began another job alone."""
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--mode", "async", "--optimizer", "sgd",
                  "--lr", "0.1")
    addr = shard.address()
    summary = tmp_path / "summary.json"
    common = ("--ps", addr, "--num-workers", "2", "--data-assignment", "slices", *LOGREG)
    chief = procs("worker", *common, "--rank", "0", "--summary-json", str(summary))
    assert wait_until(lambda: "the chief waits for worker(s) [1] to register" in chief.output, 120), \
        chief.output
    assert chief.popen.poll() is None and not summary.exists()
    late = procs("worker", *common, "--rank", "1")
    assert chief.wait() == 0 and late.wait() == 0, chief.output + late.output
    s = read_json(summary)
    # 6000 samples in 2 slices of 3000, 94 batches of 32 each an epoch, 2 epochs: 376 pushes
    assert s["samples_trained"] == 2 * 6000 and s["pushes_received"] == s["steps"] == 2 * 2 * 94, s
    assert s["workers_registered"] == [0, 1], s


def test_a_chief_on_slices_names_the_rank_that_never_came(procs, tmp_path):
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--mode", "async")
    chief = procs("worker", "--ps", shard.address(), "--num-workers", "2", "--data-assignment", "slices",
                  *LOGREG, "--rank", "0", "--rpc-deadline", "3")
    assert chief.wait() != 0
    assert "worker(s) [1] never registered within 3 s of the chief's end" in chief.output, chief.output


def test_launch_two_shards_three_workers(tmp_path):
    summary = tmp_path / "s.json"
    r = run("launch", "--ps", "2", "--workers", "3", *LOGREG, "--optimizer", "sgd", "--lr", "0.1",
            "--data-plane", "grpc", "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    s = read_json(summary)
    assert SUMMARY_KEYS <= s.keys()
    assert s["test_accuracy"] >= 0.9
    assert (s["mode"], s["num_shards"], s["num_workers"], s["model"]) == ("sync", 2, 3, "logreg")
    for role in ("[ps0]", "[ps1]", "[worker0]", "[worker1]", "[worker2]"):
        assert role in r.stdout
    assert "payloads over gRPC streams" in r.stdout


def test_tf_config_alone_configures_shard_and_workers(procs, tmp_path):
    ps = f"127.0.0.1:{free_port()}"
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [ps]}

    def tf_config(kind, index):
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}

    shard = procs("serve", "--optimizer", "sgd", "--lr", "0.1", env=tf_config("ps", 0))
    assert shard.address() == ps
    summary = tmp_path / "s.json"
    chief = procs("worker", *LOGREG, "--summary-json", str(summary), env=tf_config("chief", 0))
    worker = procs("worker", *LOGREG, env=tf_config("worker", 0))
    assert chief.wait() == 0 and worker.wait() == 0, chief.output + worker.output
    s = read_json(summary)
    assert s["num_workers"] == 2 and s["test_accuracy"] >= 0.9
    assert "rank 1/2" in worker.output


def test_a_uint8_npz_is_scaled_saying_so_once_per_worker(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 4000)
    bright = np.where(np.arange(64) < 32, 1, -1) * np.where(y[:, None] == 1, 1, -1)   # class sets the halves
    x = np.clip(128 + 60 * bright + rng.normal(0, 40, (4000, 64)), 0, 255).astype(np.uint8)
    data = tmp_path / "pixels.npz"
    np.savez(data, x=x, y=y)
    summary = tmp_path / "s.json"
    r = run("launch", "--ps", "1", "--workers", "2", "--model", "logreg", "--dataset", str(data),
            "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.1", "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    said = f"{data}: x is uint8: scaled from 0-255 to [0, 1] (--scale-uint8 none keeps the raw values)"
    assert sorted(ln.split("] ", 1)[0] for ln in r.stdout.splitlines()
                  if said in ln) == ["[worker0", "[worker1"]
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.95 and s["test_loss"] < 0.5, s
