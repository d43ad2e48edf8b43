"""A CTR model leaves its cluster: `pserver export` builds the model directory from the checkpoints
of a real wide_deep run (on 1, 2 or 3 shards alike), `pserver evaluate --model-file` and
`pserver.load_model(...).predict` run it with the tables memory-mapped, and the AUC on the
held-out rows is the chief's own, to the last bit (docs/model-file.md)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

import pserver
from pserver import sparse
from pserver.data import load_dataset
from pserver.models import metrics
from pserver.persist import checkpoint, checkpoint_dir, reshard
from tests.support.processes import pserver_cmd, read_json, run

pytestmark = pytest.mark.e2e

DATA = ["--dataset", "criteo-synthetic", "--samples", "4000", "--test-samples", "2000"]
# --min-count 2: ids seen once are never stored, so the test set reads many initial rows;
# --max-rows: rows are evicted (ids a later delta removes).
JOB = ["--workers", "1", "--model", "wide_deep", *DATA, "--batch-size", "256", "--optimizer", "adam",
       "--lr", "0.001", "--mode", "sync", "--seed", "5", "--min-count", "2", "--max-rows", "2300"]
EXPORT = ["--model", "wide_deep", *DATA]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One run on 2 shards with checkpoints and --save (live); the same checkpoints resharded
    onto 1 and 3; the run continued for an epoch more (ckpt-later, --save live-later)."""
    base = tmp_path_factory.mktemp("export")
    ckpt, summary = str(base / "ckpt2"), str(base / "summary.json")
    r = run("launch", "--ps", "2", *JOB, "--epochs", "1", "--checkpoint-dir", ckpt, "--summary-json", summary,
            "--save", str(base / "live"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    r = run("launch", "--ps", "2", *JOB, "--epochs", "2", "--restore", ckpt, "--checkpoint-dir",
            str(base / "ckpt-later"), "--save", str(base / "live-later"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    for s in (1, 3):
        r = run("checkpoint", "reshard", "--from", ckpt, "--to", str(base / f"ckpt{s}"),
                "--num-shards", str(s))
        assert r.returncode == 0, r.stdout + r.stderr
    return base, read_json(summary)


def export(ckpt: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    return run("export", "--restore", ckpt, *EXPORT, "--out", out, *extra)


def test_the_exported_model_evaluates_as_the_chief_did(job):
    base, summary = job
    out = str(base / "model")
    r = export(str(base / "ckpt2"), out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "from the checkpoints of 2 shard(s)" in r.stdout, r.stdout
    assert sorted(os.listdir(out)) == ["model.npz", "tables"]
    assert sorted(os.listdir(os.path.join(out, "tables"))) == [
        "factors.ids.npy", "factors.rows.npy", "linear.ids.npy", "linear.rows.npy"]

    r = run("evaluate", "--model-file", out, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    ev = json.loads(r.stdout)
    # The same rows, weights, batches and kernels as the chief's final evaluation: equal exactly.
    assert ev["test_auc"] == summary["test_auc"] and ev["test_loss"] == summary["test_loss"], (ev, summary)
    assert ev["test_samples"] == 2000

    model = pserver.load_model(out)
    assert [type(t.ids).__name__ for t in model.tables] == ["memmap", "memmap"]
    ds = load_dataset("criteo-synthetic", seed=5, samples=4000, test_samples=2000)
    logits = model.predict(ds.x_test, batch_size=512)
    assert logits.shape == (2000, 1) and logits.dtype == np.float32
    assert metrics.auc(logits[:, 0], ds.y_test.astype(np.float32)) == pytest.approx(summary["test_auc"],
                                                                                    abs=1e-12)
    # Many test ids were never stored (admission, or unseen): they read their initial rows.
    factors = model.tables[1]
    test_ids = np.unique(ds.x_test["cat"].astype(np.uint64))
    absent = test_ids[~np.isin(test_ids, np.asarray(factors.ids))]
    assert len(absent) > 1000


def test_tables_read_as_a_shards_table_does(job):
    """Each mapped table against a real SparseTable loaded with the combined checkpoint's rows:
    the same row for ids it holds and for ids it does not (their initial values)."""
    base, _ = job
    out = str(base / "model-lookup")
    assert export(str(base / "ckpt2"), out).returncode == 0
    model = pserver.load_model(out)
    whole = reshard.combine(checkpoint_dir.newest_shape(str(base / "ckpt2"), "sync", shape=2).ckpts, 1, 0)
    rng = np.random.default_rng(0)
    for i, mapped in enumerate(model.tables):
        table = sparse.SparseTable(whole.tables[i], i)
        table.load(whole.rows[mapped.name])
        ids = np.concatenate([rng.choice(np.asarray(mapped.ids), 500), rng.integers(0, 2**63, 500,
                                                                                     dtype=np.uint64)])
        want, got = (np.empty((1000, mapped.dim), np.float32) for _ in range(2))
        table.lookup(ids, want)
        mapped.lookup(ids, got)
        assert want.tobytes() == got.tobytes()
        if mapped.name == "factors":
            assert np.abs(got[500:]).max() > 0          # initial values, not zeros


def test_any_number_of_shards_exports_the_same_model(job):
    base, _ = job
    outs = []
    for s in (1, 2, 3):
        out = str(base / f"same{s}")
        r = export(str(base / f"ckpt{s}"), out)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"of {s} shard(s)" in r.stdout
        outs.append(out)
    files = sorted(os.listdir(os.path.join(outs[0], "tables")))
    for out in outs[1:]:
        for name in files:
            with open(os.path.join(outs[0], "tables", name), "rb") as a, \
                    open(os.path.join(out, "tables", name), "rb") as b:
                assert a.read() == b.read(), (out, name)
        dense = [dict(np.load(os.path.join(o, "model.npz"))) for o in (outs[0], out)]
        for name in dense[0]:
            if name != "pserver_model":
                assert dense[0][name].tobytes() == dense[1][name].tobytes(), name
    ids = np.load(os.path.join(outs[0], "tables", "factors.ids.npy"))
    assert ids.dtype == np.uint64 and (np.diff(ids.astype(np.float64)) > 0).all() and len(ids) > 1000


def same_model(a: str, b: str) -> None:
    """Two sparse model directories with byte-identical tables and dense weights."""
    names = sorted(os.listdir(os.path.join(a, "tables")))
    assert names == sorted(os.listdir(os.path.join(b, "tables")))
    for name in names:
        with open(os.path.join(a, "tables", name), "rb") as f, \
                open(os.path.join(b, "tables", name), "rb") as g:
            assert f.read() == g.read(), (a, b, name)
    dense = [dict(np.load(os.path.join(o, "model.npz"))) for o in (a, b)]
    assert dense[0].keys() == dense[1].keys()
    assert all(dense[0][k].tobytes() == dense[1][k].tobytes() for k in dense[0] if k != "pserver_model")


def test_save_gathers_the_tables_live_as_the_checkpoints_export_them(job):
    # Catches rows the chief did not gather from one shard, a merge out of order, rows of
    # another version than the dense weights', and a refusal of --save left in place.
    base, summary = job
    out = str(base / "from-ckpt")
    assert export(str(base / "ckpt2"), out).returncode == 0
    same_model(str(base / "live"), out)
    live = pserver.load_model(str(base / "live"))
    # an epoch is ceil(4,000 / 256) = 16 steps: the last, partial batch is trained
    assert live.meta["origin"]["live"] and live.meta["origin"]["versions"] == [16, 16]
    assert live.meta["trained"]["test_auc"] == summary["test_auc"]
    assert live.meta["origin"]["job"] == pserver.load_model(out).meta["origin"]["job"]
    assert sorted(os.listdir(base)).count("live") == 1 and not glob.glob(str(base / "live.*"))


def test_a_delta_applied_reads_as_a_fresh_export(job):
    # Catches rows changed at the model's own version left out (last_update >= version, not >),
    # removed ids that still read their old rows, and a compact() that differs from an export.
    base, _ = job
    delta = str(base / "delta")
    r = export(str(base / "ckpt-later"), delta, "--since", str(base / "live"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "delta of wide_deep since" in r.stdout and "at version 32" in r.stdout, r.stdout
    fresh = pserver.load_model(str(base / "live-later"))
    before = {name: open(os.path.join(base, "live", "tables", name), "rb").read()
              for name in os.listdir(base / "live" / "tables")}
    serving = pserver.load_model(str(base / "live"))
    counts = serving.apply(delta)
    assert all(c["changed"] > 0 and c["removed"] > 0 for c in counts.values()), counts
    ids = np.unique(np.concatenate([np.asarray(t.ids) for t in serving.tables + fresh.tables]
                                   + [np.arange(50, dtype=np.uint64)]))
    for a, b in zip(serving.tables, fresh.tables):
        got, want = (np.empty((ids.size, a.dim), np.float32) for _ in range(2))
        a.lookup(ids, got)
        b.lookup(ids, want)
        assert got.tobytes() == want.tobytes(), a.name
    assert serving.weights.tobytes() == fresh.weights.tobytes()
    ds = load_dataset("criteo-synthetic", seed=5, samples=4000, test_samples=2000)
    assert serving.predict(ds.x_test[:512]).tobytes() == fresh.predict(ds.x_test[:512]).tobytes()
    assert before == {name: open(os.path.join(base, "live", "tables", name), "rb").read() for name in before}

    # Applied twice, or a delta of another model: refused, nothing changed.
    for bad, words in ((delta, "apply the deltas of this model, in the order"),
                       (str(base / "live"), "not a delta")):
        with pytest.raises(pserver.DataError, match=words):
            serving.apply(bad)
    err = one_line_error(run("evaluate", "--model-file", delta))
    assert "a delta" in err and ".apply(" in err

    serving.compact(str(base / "compacted"))
    same_model(str(base / "compacted"), str(base / "live-later"))
    assert serving.meta["export_id"] == pserver.load_model(str(base / "compacted")).meta["export_id"]
    # a delta since the compacted model: empty, and it applies to the serving copy
    r = export(str(base / "ckpt-later"), str(base / "delta2"), "--since", str(base / "compacted"))
    assert r.returncode == 0 and "0 ids removed" in r.stdout, r.stdout + r.stderr
    nothing = {"changed": 0, "removed": 0}
    assert serving.apply(str(base / "delta2")) == {"linear": nothing, "factors": nothing}
    err = one_line_error(export(str(base / "ckpt2"), str(base / "delta3"), "--since",
                                str(base / "live-later")))
    assert "newer than the checkpoints" in err


def test_kill_9_during_an_export_leaves_no_half_model(job):
    base, _ = job
    out = str(base / "killed")
    left = 0
    for _ in range(8):
        p = subprocess.Popen(pserver_cmd("export", "--restore", str(base / "ckpt2"), *EXPORT, "--out", out),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp = f"{out}.{p.pid}.tmp"
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp) and p.poll() is None and time.monotonic() < deadline:
            pass                                    # poll hard: the write takes milliseconds
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        if os.path.exists(out):        # it got as far as the rename: then the model is whole
            pserver.load_model(out)
            shutil.rmtree(out)
        else:
            assert os.path.isdir(tmp)
            left += 1
        if left >= 2:
            break
    assert left >= 1, "no kill landed during a write"
    assert glob.glob(f"{out}.*.tmp")
    r = export(str(base / "ckpt2"), out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert glob.glob(f"{out}.*.tmp") == [] and glob.glob(f"{out}.*.old") == []
    assert pserver.load_model(out).evaluate is not None and len(pserver.load_model(out).tables) == 2
    # Exported again over a model: replaced whole, nothing left beside it.
    r = export(str(base / "ckpt2"), out)
    assert r.returncode == 0 and sorted(os.listdir(base)).count("killed") == 1
    assert glob.glob(f"{out}.*") == []


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def test_bad_input_is_one_line_and_exit_2(job, tmp_path):
    base, _ = job
    assert "is not a directory" in one_line_error(export(str(tmp_path / "nowhere"), str(tmp_path / "m")))
    os.mkdir(tmp_path / "empty")
    assert "holds no checkpoint" in one_line_error(export(str(tmp_path / "empty"), str(tmp_path / "m")))

    # Two runs' files in one directory: shard 1's from a run of another model.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    files = sorted(glob.glob(str(base / "ckpt2" / "shard*-of2-*.ckpt")))
    shutil.copy(files[0], mixed)
    other = checkpoint.load(files[1])
    checkpoint.save(str(mixed), dataclasses.replace(other, signature="0123456789abcdef"))
    assert "files of two runs" in one_line_error(export(str(mixed), str(tmp_path / "m")))

    # (deepfm has wide_deep's weights and tables exactly: the checkpoints cannot tell them apart.)
    for model in (["--model", "fm"], ["--model", "wide_deep", "--hidden", "64"]):
        err = one_line_error(run("export", "--restore", str(base / "ckpt2"), *model, *DATA,
                                 "--out", str(tmp_path / "m")))
        assert "another model" in err
    err = one_line_error(run("export", "--restore", str(base / "ckpt2"), "--model", "mlp",
                             "--out", str(tmp_path / "m")))
    assert "sparse tables" in err
    os.mkdir(tmp_path / "mine")
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert "not a pserver model" in one_line_error(export(str(base / "ckpt2"), str(tmp_path / "mine")))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert not os.path.exists(tmp_path / "m")

    # A dense model file where the sparse model is expected.
    out = str(tmp_path / "model")
    assert export(str(base / "ckpt2"), out).returncode == 0
    shutil.copy(os.path.join(out, "model.npz"), tmp_path / "dense.npz")
    err = one_line_error(run("evaluate", "--model-file", str(tmp_path / "dense.npz")))
    assert "a model with sparse tables is a directory" in err
    err = one_line_error(run("evaluate", "--checkpoint", str(base / "ckpt2"), "--model", "wide_deep", *DATA))
    assert "pserver export" in err


def test_a_dense_model_exports_to_one_file(tmp_path):
    """The same command for a model without tables: the single .npz of `--save`, version 1; a
    delta since the --save'd model (main: refused, "written before deltas existed": a dense
    --save recorded no versions) is one file, and applied it reads as the export."""
    ckpt, summary, out = str(tmp_path / "ckpt"), str(tmp_path / "s.json"), str(tmp_path / "m.npz")
    live, delta = str(tmp_path / "live.npz"), str(tmp_path / "delta")
    data = ["--model", "logreg", "--dataset", "synthetic", "--samples", "3000", "--features", "20"]
    r = run("launch", "--ps", "2", "--workers", "1", *data, "--epochs", "1", "--checkpoint-dir", ckpt,
            "--summary-json", summary, "--save", live, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    r = run("export", "--restore", ckpt, *data, "--out", out)
    assert r.returncode == 0 and os.path.isfile(out), r.stdout + r.stderr
    r = run("evaluate", "--model-file", out, "--json")
    ev, s = json.loads(r.stdout), read_json(summary)
    assert (ev["test_accuracy"], ev["test_loss"]) == (s["test_accuracy"], s["test_loss"])
    assert pserver.load_model(out).meta["version"] == 1 and pserver.load_model(out).tables == []
    origin = pserver.load_model(live).meta["origin"]
    assert origin["num_shards"] == 2 and len(origin["versions"]) == 2 and origin["version"] > 0, origin
    r = run("export", "--restore", ckpt, *data, "--since", live, "--out", delta)
    assert r.returncode == 0 and os.path.isfile(delta), r.stdout + r.stderr
    applied = pserver.load_model(live)
    applied.apply(delta)
    assert applied.weights.tobytes() == pserver.load_model(out).weights.tobytes()
