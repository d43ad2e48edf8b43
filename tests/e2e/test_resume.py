"""Restart means resume: a job stopped mid-run (SIGTERM, as Kubeflow, a Slurm requeue or Ray
do) and started again with the same command goes on from the step each worker had reached,
read from the shards' checkpoint (docs/semantics.md, "Resuming")."""

from __future__ import annotations

import re
import signal

import pytest

from pserver.persist import checkpoint
from tests.support.processes import LOGREG, read_json, wait_until

pytestmark = pytest.mark.e2e

# 3 epochs of ~90 steps per worker, slowed down so that the stop lands inside epoch 2. The
# positions resumed here are each rank's own (slices); leased data resumes from shard 0's
# coordinator, checkpointed with it (tests/test_coordinator.py).
TRAIN = [*LOGREG, "--epochs", "3", "--delay", "fixed:0.01", "--mode", "sync", "--optimizer", "sgd",
         "--lr", "0.1", "--seed", "3", "--data-assignment", "slices"]


def test_a_stopped_job_started_again_resumes_from_its_checkpointed_position(procs, tmp_path):
    ckpt, summary = str(tmp_path / "ckpt"), tmp_path / "summary.json"

    def launch(*extra):
        return procs("launch", "--ps", "1", "--workers", "2", "--checkpoint-dir", ckpt, "--restore", ckpt,
                     *TRAIN, "--summary-json", str(summary), *extra)

    first = launch()
    assert wait_until(lambda: "[worker0] epoch 2/3 step" in first.output, 240), first.output[-3000:]
    first.popen.send_signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output[-3000:]
    steps = int(re.search(r"\[worker0\] epoch 1/3 step \d+/(\d+)", first.output).group(1))
    saved = checkpoint.load_latest(ckpt, 0, 1)
    clock = saved.clocks[0]
    # sync: both ranks took part in every completed step but maybe the last, which the one
    # still there completes alone once the other left; the position names this data order.
    assert abs(saved.clocks[1] - clock) <= 1 and steps < clock < 2 * steps, (saved.clocks, steps)
    assert saved.positions == {0: (3, steps), 1: (3, steps)}

    second = launch()
    assert second.wait(300) == 0, second.output[-3000:]
    epoch, step = divmod(clock, steps)
    assert f"[worker0] resuming rank 0 at epoch {epoch + 1}/3, step {step + 1}/{steps} (step {clock} " \
           in second.output, second.output[-3000:]
    assert f"[worker1] resuming rank 1 at epoch {epoch + 1}/3, step {saved.clocks[1] - epoch * steps + 1}/" \
           in second.output, second.output[-3000:]
    s = read_json(summary)
    assert s["resumed_at_step"] == clock and s["chief"]["steps"] == 3 * steps - clock, s["chief"]
    assert [e["epoch"] for e in s["per_epoch"]] == [2, 3] and s["test_accuracy"] >= 0.9

    third = launch()                                   # the run is complete: nothing to redo
    assert third.wait(300) == 0, third.output[-3000:]
    assert "nothing is left to train" in third.output
    s = read_json(summary)
    assert s["resumed_at_step"] == 3 * steps and s["chief"]["steps"] == 0 and s["per_epoch"] == []

    fourth = launch("--no-resume", "--max-steps", "5")  # fine-tuning the restored weights anew
    assert fourth.wait(300) == 0, fourth.output[-3000:]
    assert "--no-resume: starting at epoch 1" in fourth.output
    s = read_json(summary)
    assert s["resumed_at_step"] == 0 and s["chief"]["steps"] == 5


def test_a_finished_run_started_again_with_more_epochs_trains_exactly_the_epochs_left(procs, tmp_path):
    """45.6: one worker writing a checkpoint every step: the last step's file is written before the
    worker reports its last chunk done, and the write the run asks for at its end (same version)
    was skipped, so the coordinator's finished state never reached the directory: --epochs 2
    was refused ('2 vs 1 epochs', exit 1; 2 of 2 runs on main). Now it trains epoch 2 alone:
    as many steps and samples as the first run, none of epoch 1 again."""
    ckpt, summary = str(tmp_path / "ckpt"), tmp_path / "summary.json"

    def launch(epochs: str):
        run = procs("launch", "--ps", "1", "--workers", "1", "--checkpoint-dir", ckpt, "--restore", ckpt,
                    "--model", "logreg", "--dataset", "synthetic", "--samples", "2000", "--features", "40",
                    "--batch-size", "32", "--epochs", epochs, "--checkpoint-every", "1", "--mode", "sync",
                    "--summary-json", str(summary))
        assert run.wait(120) == 0, run.output[-3000:]
        return read_json(summary)

    first = launch("1")
    steps, samples = first["chief"]["steps"], first["chief"]["samples"]
    second = launch("2")
    assert [e["epoch"] for e in second["per_epoch"]] == [2], second["per_epoch"]
    assert (second["chief"]["steps"], second["chief"]["samples"]) == (steps, samples), second["chief"]
