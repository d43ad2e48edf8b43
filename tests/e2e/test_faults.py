"""Shards killed with SIGKILL mid-run and restarted from their checkpoints."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.support.processes import free_port, read_json

pytestmark = pytest.mark.e2e

TRAIN = ["--model", "mlp", "--hidden", "64", "--samples", "9600", "--features", "40", "--batch-size", "32",
         "--epochs", "2", "--delay", "fixed:0.01", "--seed", "3", "--log-every", "0.5",
         "--rpc-deadline", "60"]


def serve_args(shard: int, port: int, ckpt_dir) -> list[str]:
    return ["serve", "--port", str(port), "--shard", str(shard), "--num-shards", "2", "--num-workers", "2",
            "--optimizer", "sgd", "--lr", "0.1", "--checkpoint-every", "1", "--restore", str(ckpt_dir)]


def run_cluster(procs, tmp_path, name, kills: int, seed: int = 0):
    ports = [free_port(), free_port()]
    ckpt = tmp_path / f"{name}-ckpt"
    ckpt.mkdir()
    shards = [procs(*serve_args(j, ports[j], ckpt)) for j in range(2)]
    for s in shards:
        s.address()
    ps = ",".join(f"127.0.0.1:{p}" for p in ports)
    summary = tmp_path / f"{name}.json"
    workers = [procs("worker", "--ps", ps, "--rank", str(r), "--num-workers", "2", *TRAIN,
                     *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(2)]
    rnd, restarted = random.Random(seed), []
    deadline = time.monotonic() + 60
    while kills and not list(ckpt.glob("shard1-*.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.05)                              # kill only once there is something to restore
    for _ in range(kills):
        time.sleep(rnd.uniform(0.3, 1.2))
        if workers[0].popen.poll() is not None:
            break
        victim = shards[1]
        victim.popen.send_signal(signal.SIGKILL)     # at a random moment: maybe mid-write
        victim.popen.wait()
        time.sleep(rnd.uniform(0.1, 0.6))             # the shard is away; workers retry
        shards[1] = procs(*serve_args(1, ports[1], ckpt))
        shards[1].address()
        restarted.append(shards[1])
    for w in workers:
        assert w.wait(240) == 0, w.output[-3000:]
    return read_json(summary) | {"chief_output": workers[0].output}, restarted


def test_killed_shard_restarts_from_its_checkpoint_and_the_run_completes(procs, tmp_path):
    clean, _ = run_cluster(procs, tmp_path, "clean", kills=0)
    hurt, restarted = run_cluster(procs, tmp_path, "hurt", kills=3)
    assert len(restarted) >= 2, "the run ended before the shard could be killed twice"
    for shard in restarted:
        log = shard.output
        assert "restored version" in log and ".tmp" not in log.split("restored version")[1].splitlines()[0]
    assert abs(hurt["test_accuracy"] - clean["test_accuracy"]) <= 0.01, (hurt["test_accuracy"],
                                                                        clean["test_accuracy"])
    assert clean["test_accuracy"] >= 0.9
    # The summary says what the restarts did: the chief counts those it rode out, a lower bound (two
    # kills while it was away from the shard, evaluating or backing off, are one rejoin; a kill
    # while it writes the summary comes after its last call), and shard 1 holds the updates since
    # its checkpoints fewer than shard 0 (lost on it; none in the clean run).
    assert clean["shard_restarts"] == []
    [entry] = hurt["shard_restarts"]
    assert entry["shard"] == 1 and 1 <= entry["restarts"] <= len(restarted), entry
    assert entry["updates_behind"] == hurt["steps"] - entry["version"] >= 0
    assert "shard1-of2-" in entry["restored_from"], entry
    said = f"shard 1 restarted at least {entry['restarts']} time(s) during the run (restored from "
    assert said in hurt["chief_output"]
