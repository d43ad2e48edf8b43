"""Issue 34's combined elastic run, MLP on real MNIST with --data-assignment leases and --step-timeout 5:
2 workers start, 2 more join with `--rank auto` in epoch 1, one of them is SIGKILLed in epoch 2, and
every epoch ends with every chunk done, in sync and in async (this is the e2e test of the scenario: it
replaced a synthetic-data copy of it and a kill-only leases test, whose checks are here). The run is
bench/elastic_mnist.py's `grown`; that script also runs the reference (4 workers from the start, same
seed and epochs) and bench/results/elastic/elastic_mnist.json keeps both accuracies. Here: a floor under
the reference's."""

from __future__ import annotations

import re

import pytest

from bench.elastic_mnist import BATCH, CHUNKS, EPOCHS, SAMPLES, grown

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # about 25 s a mode

# bench/results/elastic/elastic_mnist.json (2 interleaved pairs a mode, load 5-9): 4 workers from the
# start 0.9523/0.9523 in sync, 0.9535/0.9545 in async; grown 0.9532/0.9519 and 0.9435/0.9579: medians
# +0.02 and -0.33 point. A single async run moves by a point, so the floor sits below its worst.
FLOOR = 0.93


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_mnist_two_workers_grow_to_four_one_killed_every_chunk_done(
        procs, tmp_path, monkeypatch, mnist_dir, mode):
    """Fails if a joiner is refused, gets rank 0 or a taken rank, or joins only after epoch 1; if the
    killed joiner's chunk is lost (chunks_done short of 2 x 59: the epoch never ends) or its lease not
    released (chunks_released 0); if a chunk is done twice (chunks_done above 118) or more than the dead
    worker's in-flight batch is retrained; if any sample of an epoch is not trained (a worker skipping
    the first batch of each lease passed on 3de5e7b, 12.6% of the data; so did the last partial batch
    of each epoch, dropped); if anyone but the killed joiner is marked dead (a join that held a step
    up); or if the grown job trains worse than the reference by more than noise."""
    monkeypatch.setenv("PSERVER_MNIST_DIR", str(mnist_dir))
    s = grown(procs, mode, tmp_path / "summary.json")
    assert sorted(s["joiner_ranks"]) == [2, 3], s["joiner_ranks"]
    assert s["workers_registered"] == [0, 1, 2, 3] and "4 worker(s) (2 at the start) ==" in s["chief_output"]
    assert s["joined_in_epoch_1"], s["chief_output"]
    assert [e["epoch"] for e in s["per_epoch"]] == list(range(1, EPOCHS + 1)), s["per_epoch"]
    assert s["chunks_done"] == EPOCHS * CHUNKS, s["chief_output"]
    assert s["chunks_released"] == 1 and s["batches_retrained"] <= 1, s["chief_output"]
    assert f"data leases: {EPOCHS * CHUNKS} chunk(s) done" in s["chief_output"]
    # The killed joiner's chunk went on from the first batch not done, which its pushes told shard 0
    # (over the data plane, in the frame's lease fields): a progress lost on the way would have the
    # chunk trained again from its start, several batches more than the one in flight. And every
    # sample is trained once an epoch: DESIGN.md section 5 allows more (the batch in flight when the
    # joiner died, counted as retrained), never fewer, in sync and async (no batch is dropped late).
    assert EPOCHS * SAMPLES <= s["samples_trained"] <= EPOCHS * SAMPLES + s["batches_retrained"] * BATCH, \
        (s["samples_trained"], s["batches_retrained"], s["chief_output"])
    dead = re.findall(r"marked worker\(s\) \[([\d, ]+)\] dead", s["shard_output"])
    assert set(dead) <= {str(s["joiner_ranks"][0])}, s["shard_output"]
    if mode == "sync":       # each joiner is a member from a step every shard agreed on
        assert all("joins: a member from step" in out for out in s["joiner_outputs"]), s["joiner_outputs"]
        assert f"worker {s['joiner_ranks'][0]} joins, a member from step" in s["shard_output"]
        assert dead == [str(s["joiner_ranks"][0])], s["shard_output"]   # the open step waited, went on
    assert s["test_accuracy"] >= FLOOR, s["test_accuracy"]
