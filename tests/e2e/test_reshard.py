"""A CTR job trained on 2 shards, stopped, and started again on 3 shards from the same directory:
every weight and row comes back as it was, and training goes on to where an uninterrupted run
gets (docs/semantics.md, "Restore onto another number of shards")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pserver import sparse
from pserver.config import ServerConfig
from pserver.persist import checkpoint_dir
from pserver.server.shard import Shard
from tests.support.processes import read_json, run

pytestmark = pytest.mark.e2e

JOB = ["--workers", "2", "--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", "12000",
       "--test-samples", "4000", "--batch-size", "256", "--optimizer", "adam", "--lr", "0.001",
       "--row-lr", "0.05", "--mode", "sync", "--seed", "5"]


def held(shards: list[Shard]) -> tuple[bytes, dict]:
    """The dense vector, and {table: {id: row and optimizer state}} over a cluster's shards."""
    dense = np.concatenate([s.store.params for s in shards]).tobytes()
    tables: dict = {}
    for s in shards:
        for name, table in s.store.tables.items():
            st = table.state().arrays()
            keys = sorted(k for k in st if k not in ("ids", "counters") and not k.startswith("pending_"))
            for n, i in enumerate(st["ids"].tolist()):
                tables.setdefault(name, {})[i] = tuple(st[k][n].tobytes() for k in keys)
    return dense, tables


def test_a_ctr_job_stopped_on_2_shards_goes_on_on_3(tmp_path):
    ckpt, first, second, whole = (str(tmp_path / n) for n in ("ckpt", "a.json", "b.json", "c.json"))
    r = run("launch", "--ps", "2", *JOB, "--epochs", "1", "--checkpoint-dir", ckpt, "--summary-json", first,
            timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    (made,) = checkpoint_dir.inspect(ckpt)["sets"]
    version = made["consistent_cuts"][0]

    # What the 2 shards held when they stopped, against what 3 shards restored from their files hold.
    def cluster(s):
        return [Shard(ServerConfig(shard=j, num_shards=s, num_workers=2, optimizer="adam", lr=0.001,
                                   restore=ckpt)) for j in range(s)]
    before, after = cluster(2), cluster(3)
    assert {s.store.version for s in before + after} == {version}
    assert held(after) == held(before)
    rows = held(after)[1]
    assert len(rows) == 2 and all(len(t) > 1000 for t in rows.values())     # the deep and the wide table
    for j, s in enumerate(after):
        for table in s.store.tables.values():
            assert (sparse.shard_of(table.state().ids, 3) == j).all()
    for s in before + after:
        s.close()

    # The same offline, through the command: three files whose rows add up to the same tables.
    r = run("checkpoint", "reshard", "--from", ckpt, "--to", str(tmp_path / "three"), "--num-shards", "3")
    assert r.returncode == 0 and "wrote 3 checkpoint(s)" in r.stdout, r.stdout + r.stderr
    r = run("checkpoint", "inspect", "--json", str(tmp_path / "three"))
    (three,) = json.loads(r.stdout)["sets"]
    assert three["consistent_cuts"] == [version] and three["num_shards"] == 3
    assert {name: sum(f["rows"][name] for f in three["files"]) for name in rows} == \
        {name: len(t) for name, t in rows.items()}
    r = run("checkpoint", "inspect", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and r.stderr.strip().endswith("not a directory"), r.stderr

    r = run("launch", "--ps", "3", *JOB, "--epochs", "2", "--checkpoint-dir", ckpt, "--restore", ckpt,
            "--summary-json", second, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "written by 2 shards, now 3" in r.stdout + r.stderr
    r = run("launch", "--ps", "2", *JOB, "--epochs", "2", "--summary-json", whole, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    resumed, uninterrupted = read_json(second), read_json(whole)
    assert [e["epoch"] for e in resumed["per_epoch"]] == [2]
    assert abs(resumed["test_auc"] - uninterrupted["test_auc"]) <= 0.005, (resumed, uninterrupted)
    assert resumed["test_auc"] > read_json(first)["test_auc"] - 0.005
