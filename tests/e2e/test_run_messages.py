"""What a worker tells its user while a run goes wrong and recovers, and what the summary
counts: real shard and worker processes."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.support.processes import LOGREG, free_port, read_json, run, wait_until

pytestmark = pytest.mark.e2e

SLOW = ["--model", "logreg", "--samples", "9600", "--features", "40", "--batch-size", "32",
        "--epochs", "3", "--delay", "fixed:0.02", "--log-every", "0.5", "--rpc-deadline", "120"]


def serve(procs, port: int, *extra: str):
    shard = procs("serve", "--port", str(port), "--num-workers", "2", "--optimizer", "sgd", "--lr", "0.1",
                  *extra)
    shard.address()
    return shard


NOTICE_EVERY = 3    # seconds between "still unreachable" lines ($PSERVER_NOTICE_EVERY; 10 by default)


def two_workers(procs, addr: str, *extra: str):
    return [procs("worker", "--ps", addr, "--rank", str(r), "--num-workers", "2", *SLOW, *extra,
                  env={"PSERVER_NOTICE_EVERY": str(NOTICE_EVERY)}) for r in range(2)]


def kill_and_restart(procs, shard, port: int, away: float, *extra: str):
    shard.popen.send_signal(signal.SIGKILL)
    shard.popen.wait()
    wait_until(lambda: False, away)                  # the shard stays away this long
    return serve(procs, port, *extra)


def test_workers_say_at_once_that_a_shard_is_gone_keep_saying_it_and_say_what_came_back(procs):
    port = free_port()
    shard = serve(procs, port)
    workers = two_workers(procs, f"127.0.0.1:{port}")
    assert wait_until(lambda: "epoch 1/3 step" in workers[0].output, 120), workers[0].output
    # away > NOTICE_EVERY + the first failure's gap + the longest retry gap (3 s) + a rejoin try
    kill_and_restart(procs, shard, port, NOTICE_EVERY + 6)
    for w in workers:
        assert w.wait(240) == 0, w.output[-3000:]
    label = f"shard 0 at 127.0.0.1:{port}"
    for w in workers:
        out = w.output
        assert f"{label} unreachable, retrying for up to 120 s" in out, out
        after = int(re.search(f"{label} still unreachable after (\\d+) s", out).group(1))
        assert NOTICE_EVERY <= after <= NOTICE_EVERY + 9, out   # 10-19 s at the default 10
        assert re.search(f"{label} is back after \\d+\\.\\d s; restarted at version 0; "
                         "re-seeded from", out), out
        assert out.index("unreachable, retrying") < out.index("still unreachable") < out.index("is back")
    # Both workers found it empty; exactly one of them gave it its weights.
    assert sum("re-seeded from this worker's weights" in w.output for w in workers) == 1, \
        [w.output[-1500:] for w in workers]


def test_a_shard_restored_from_its_checkpoint_is_named_with_that_checkpoint(procs, tmp_path):
    port, ckpt = free_port(), tmp_path / "ckpt"
    restore = ("--checkpoint-every", "20", "--restore", str(ckpt))
    ckpt.mkdir()
    shard = serve(procs, port, *restore)
    workers = two_workers(procs, f"127.0.0.1:{port}")
    assert wait_until(lambda: list(ckpt.glob("shard0-*.ckpt")), 120), shard.output
    restarted = kill_and_restart(procs, shard, port, 0.5, *restore)
    for w in workers:
        assert w.wait(240) == 0, w.output[-3000:]
    path = re.search(r"restored version \d+ from (\S+)", restarted.output).group(1)
    for w in workers:
        assert re.search(f"is back after .*; restarted at version [1-9]\\d*; restored from checkpoint {path}",
                         w.output), w.output[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_worker_leaves_so_the_chief_goes_on_without_waiting_for_it(procs, tmp_path, sig):
    shard = serve(procs, free_port(), "--step-timeout", "120")
    summary = tmp_path / "summary.json"
    chief, other = two_workers(procs, shard.address(), "--summary-json", str(summary))
    assert wait_until(lambda: "epoch 1/3 step" in other.output, 120), other.output
    other.popen.send_signal(sig)
    assert other.wait(30) == 128 + sig, other.output
    status = run("status", "--ps", shard.address(), "--json")
    assert json.loads(status.stdout)["shards"][0]["live_workers"] == [0], status.stdout
    assert chief.wait(240) == 0, chief.output[-3000:]
    assert read_json(summary)["workers_marked_dead"] == 0      # nobody waited for it to time out


def test_a_second_run_on_trained_shards_counts_only_itself_says_it_continues_and_can_refuse(procs, tmp_path):
    shard = serve(procs, 0, "--num-workers", "1")
    steps = 2 * -(-6000 // 32)                        # LOGREG: 2 epochs of 6000 (last batch 16), 1 worker
    summaries, chiefs = [], []
    # The second run trains its epochs again on purpose (--no-resume): without it, it would
    # resume at the end of the first run's data and find nothing left (tests/e2e/test_resume.py).
    for name, again in (("first", []), ("second", ["--no-resume"])):
        summaries.append(tmp_path / f"{name}.json")
        chief = procs("worker", "--ps", shard.address(), *LOGREG, *again,
                      "--summary-json", str(summaries[-1]))
        assert chief.wait() == 0, chief.output
        chiefs.append(chief)
    first, second = map(read_json, summaries)
    for s in (first, second):
        assert s["steps"] == s["updates_applied"] == s["pushes_aggregated"] == steps, s
        assert s["samples_trained"] == 2 * 6000 and s["pushes_rejected"] == 0
    assert "already holds" not in chiefs[0].output
    assert re.search(f"shard 0 at \\S+ already holds trained state \\(version {steps}\\): this run continues "
                     "from it, not from new initial weights", chiefs[1].output), chiefs[1].output
    assert second["test_accuracy"] >= first["test_accuracy"] - 0.01   # it went on from the trained weights
    r = run("worker", "--ps", shard.address(), *LOGREG, "--require-fresh")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"pserver worker: error: --require-fresh: shard 0 at {shard.address()} already holds trained "
        f"state (version {2 * steps}); start fresh shards, or drop --require-fresh to continue from it"]


def test_summary_status_and_shard_log_count_pushes_and_updates_in_the_same_words(procs):
    shard = serve(procs, 0)
    workers = [procs("worker", "--ps", shard.address(), "--rank", str(r), "--num-workers", "2", *LOGREG)
               for r in range(2)]
    for w in workers:
        assert w.wait() == 0, w.output
    # Leased data (the default): 2 x 187 batches, and at each epoch's end the worker without a chunk
    # pushes empty contributions to the last steps, so the counts are read from the summary.
    got = re.search(r"(\d+) updates from (\d+) pushes: \2 averaged into a step, "
                    r"0 applied on arrival, 0 dropped late, 0 rejected", workers[0].output)
    assert got, workers[0].output
    steps, pushes = int(got.group(1)), int(got.group(2))
    assert 2 * 187 <= pushes <= 2 * steps and steps >= 187, got.group(0)
    said = got.group(0)
    table = run("status", "--ps", shard.address()).stdout.splitlines()
    header = table[0].split()
    assert header[6:12] == ["updates", "pushes", "averaged", "on_arrival", "late", "rejected"], table
    assert table[1].split()[6:12] == [str(steps), str(pushes), str(pushes), "0", "0", "0"], table
    shards = json.loads(run("status", "--ps", shard.address(), "--json").stdout)["shards"]
    assert shards[0]["version"] == steps and shards[0]["counters"]["pushes_received"] == pushes
    assert shards[0]["counters"]["staleness_histogram"][0] == 0    # numbers, not strings
    shard.stop()
    assert f"at version {steps}: {said}" in shard.output, shard.output
