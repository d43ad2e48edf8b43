"""A checkpoint directory belongs to one run (pserver.persist.checkpoint_dir, `check_start`): a
new run pointed at a finished run's directory without restoring it, a mistyped --restore and
a restore of another model's checkpoints are refused before any process starts, in one line,
and the old run's files are left byte for byte and still restore."""

from __future__ import annotations

import hashlib
import os

import pytest

from pserver.config import ServerConfig
from pserver.persist import checkpoint, checkpoint_dir
from pserver.server.shard import Shard
from tests.support.processes import LOGREG, run

pytestmark = pytest.mark.e2e

JOB = ["--ps", "2", "--workers", "1", *LOGREG, "--samples", "1000", "--epochs", "1", "--mode", "sync",
       "--optimizer", "sgd", "--lr", "0.1", "--seed", "2", "--checkpoint-every", "10"]


def digests(directory: str) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def refused_before_anything_starts(r, *words) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert "[ps0]" not in r.stdout and "listening" not in r.stdout, r.stdout   # no shard was started


def test_a_second_run_in_a_finished_runs_directory_is_refused_and_the_old_run_still_restores(tmp_path):
    d = str(tmp_path / "ck")
    first = run("launch", *JOB, "--checkpoint-dir", d, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    before = digests(d)

    again = run("launch", *JOB, "--checkpoint-dir", d, timeout=120)
    refused_before_anything_starts(again, f"--checkpoint-dir: {d} holds another run's checkpoints",
                                   f"--restore {d}", "another --checkpoint-dir")
    owner = checkpoint_dir.run_of(d)
    assert owner and f"run {owner}" in again.stderr and "RUN" in before
    typo = run("launch", *JOB, "--checkpoint-dir", d, "--restore", d + "_typo", timeout=120)
    refused_before_anything_starts(typo, f"--restore: {d}_typo does not exist")
    other = run("launch", *JOB, "--model", "mlp", "--hidden", "8", "--checkpoint-dir", d, "--restore", d,
                timeout=120)
    refused_before_anything_starts(other, "is of another model", "check --model")
    assert digests(d) == before and not os.path.exists(d + "_typo")

    # The old run restores whole: each shard its file at the run's last version.
    last = {max(v for v, _ in checkpoint.candidates(d, j, 2)) for j in range(2)}
    assert len(last) == 1
    for j in range(2):
        shard = Shard(ServerConfig(shard=j, num_shards=2, num_workers=1, optimizer="sgd", lr=0.1,
                                   checkpoint_dir=d, restore=d))
        assert {shard.store.version} == last and shard.store.initialized
        shard.close()
    assert digests(d) == before and checkpoint_dir.run_of(d) == owner
