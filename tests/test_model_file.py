"""The model file (`--save`, `pserver.load_model`, `pserver.predict`): written by a real training
run against in-process shards, read back by pserver and by numpy alone."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import pserver
from pserver.build import fit_data
from pserver.config import WorkerConfig
from pserver.data import load_dataset
from pserver.errors import ConfigError, DataError
from pserver.layers import Conv2D, Dense, Flatten, MaxPooling2D
from pserver.models import make_model
from pserver.persist.model_file import META, definition, load, read_tables, save


def blobs(n=600, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = (rng.standard_normal((n, 6)) + 3.0 * np.eye(3, 6)[y]).astype(np.float32)
    return x, y


def python_model():
    return pserver.Sequential([Dense(16, activation="relu", input_shape=(6,)), Dense(3)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model built in Python, trained on 1 in-process shard and saved by the chief."""
    path = tmp_path_factory.mktemp("saved") / "model.npz"
    x, y = blobs()
    summary = pserver.train(python_model(), x[:500], y[:500], ps=1, optimizer="adam", lr=1e-2,
                            epochs=3, batch_size=25, log_every=60, validation_data=(x[500:], y[500:]),
                            save=str(path))
    return path, summary, x[500:], y[500:]


def test_numpy_alone_reads_the_definition_and_every_tensor(trained):
    path, summary, _, _ = trained
    with np.load(path, allow_pickle=False) as z:            # no pickle anywhere
        meta = json.loads(str(z[META]))
        tensors = {t["name"]: z[t["name"]] for t in meta["layout"]}
    assert (meta["format"], meta["version"], meta["model"]) == ("pserver-model", 1, None)
    assert [(t["name"], t["shape"]) for t in meta["layout"]] == [
        ("dense/kernel", [6, 16]), ("dense/bias", [16]), ("dense_1/kernel", [16, 3]), ("dense_1/bias", [3])]
    assert all(a.dtype == np.float32 for a in tensors.values())
    assert meta["num_params"] == sum(a.size for a in tensors.values()) == 6 * 16 + 16 + 16 * 3 + 3
    assert meta["trained"]["test_accuracy"] == summary["test_accuracy"]
    assert meta["trained"]["steps"] == summary["steps"] == 3 * (500 // 25)
    with zipfile.ZipFile(path) as zf:                          # nothing but .npy members
        assert sorted(zf.namelist()) == sorted(f"{k}.npy" for k in [META, *tensors])


def test_a_python_built_model_is_rebuilt_from_its_layers_configs_then_predicts_what_it_learnt(trained):
    path, summary, x_test, y_test = trained
    rebuilt = pserver.load_model(str(path))            # the file holds the layers' get_config()
    assert [type(layer).__name__ for layer in rebuilt.model.layers] == ["Dense", "Dense"]
    saved = pserver.load_model(str(path), model=python_model())
    np.testing.assert_array_equal(rebuilt.predict(x_test), saved.predict(x_test))
    logits = saved.predict(x_test)
    assert logits.shape == (100, 3) and logits.dtype == np.float32
    # The chief's final evaluation saw these very weights on this very test set.
    assert np.mean(np.argmax(logits, axis=1) == y_test) == summary["test_accuracy"] > 0.9
    assert saved.evaluate(x_test, y_test)["accuracy"] == summary["test_accuracy"]
    # predict() in its three forms gives the same numbers, in batches or not.
    np.testing.assert_array_equal(pserver.predict(saved, x_test, batch_size=7), logits)
    np.testing.assert_array_equal(pserver.predict(python_model(), x_test, weights=saved.weights), logits)


def test_a_model_of_another_layout_is_refused_naming_both(trained):
    path, *_ = trained
    other = pserver.Sequential([Dense(8, activation="relu", input_shape=(6,)), Dense(3)])
    with pytest.raises(DataError, match=r"dense/kernel\[6, 16\].*dense/kernel\[6, 8\]"):
        pserver.load_model(str(path), model=other)


def test_a_builtin_model_is_rebuilt_from_the_file_alone(tmp_path):
    cfg = WorkerConfig(model="mlp", hidden=(7, 5), dataset="synthetic", samples=200, test_samples=50,
                       features=12, classes=4, seed=3)
    ds = load_dataset("synthetic", samples=200, test_samples=50, features=12, classes=4, seed=3)
    model = make_model("mlp", ds.sample_shape, ds.num_classes, hidden=(7, 5))
    w = model.init_params(1)
    save(str(tmp_path / "m.npz"), model, w, definition(cfg, model, ds), {"test_accuracy": 0.5})
    saved = load(str(tmp_path / "m.npz"))
    assert saved.meta["arguments"] == {"input_shape": [12], "num_classes": 4, "hidden": [7, 5]}
    assert saved.model.layout == model.layout
    np.testing.assert_array_equal(saved.weights, w)
    ds = fit_data(model, ds)
    np.testing.assert_array_equal(saved.predict(ds.x_test), model.predict(w, ds.x_test))


def test_predict_equals_a_numpy_forward_pass_of_the_cnn():
    model = pserver.Sequential([Conv2D(4, 3, activation="relu", input_shape=(8, 8, 1)), MaxPooling2D(),
                                Flatten(), Dense(3)])
    w = model.init_params(0)
    x = np.random.default_rng(1).standard_normal((5, 8, 8, 1)).astype(np.float32)
    ref = model.use_backend("reference").predict(w, x)
    np.testing.assert_allclose(model.use_backend("cpu").predict(w, x), ref, rtol=1e-5, atol=1e-5)
    p = model.layout.views(w)                     # by hand: conv (valid), relu, 2x2 max, dense
    conv = np.zeros((5, 6, 6, 4), np.float32)
    for i in range(6):
        for j in range(6):
            conv[:, i, j] = np.einsum("nhwc,hwcf->nf", x[:, i:i + 3, j:j + 3], p["conv2d/kernel"])
    conv = np.maximum(conv + p["conv2d/bias"], 0)
    pooled = conv.reshape(5, 3, 2, 3, 2, 4).max(axis=(2, 4))
    np.testing.assert_allclose(ref, pooled.reshape(5, -1) @ p["dense/kernel"] + p["dense/bias"],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"x has shape \(5, 9\)"):
        model.predict(w, np.zeros((5, 9), np.float32))


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(b"not a zip"), "not a readable pserver model file"),
    (lambda p: np.savez(p, x=np.zeros(3)), "no 'pserver_model' entry"),
    (lambda p: np.savez(p, pserver_model=np.array('{"format": "other"}')), "format 'other'"),
    (lambda p: np.savez(p, pserver_model=np.array('{"format": "pserver-model", "version": 9}')),
     "version 9"),
])
def test_a_file_that_is_not_a_model_file_is_one_clear_error(tmp_path, damage, words):
    path = tmp_path / "bad.npz"
    damage(path)
    with pytest.raises(DataError) as err:
        pserver.load_model(str(path), model=python_model())
    assert words in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_tensor_of_the_wrong_shape_or_with_nan_is_refused(trained, tmp_path):
    path, *_ = trained
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    bad = dict(arrays, **{"dense_1/bias": np.zeros(4, np.float32)})
    np.savez(tmp_path / "shape.npz", **bad)
    with pytest.raises(DataError, match=r"tensor dense_1/bias is float32 \(4,\); expected float32 \(3,\)"):
        pserver.load_model(str(tmp_path / "shape.npz"), model=python_model())
    nan = dict(arrays, **{"dense_1/bias": np.full(3, np.nan, np.float32)})
    np.savez(tmp_path / "nan.npz", **nan)
    with pytest.raises(DataError, match="NaN or Inf"):
        pserver.load_model(str(tmp_path / "nan.npz"), model=python_model())


# -- a model with sparse tables: a directory ------------------------------------------------------

def ctr_tables(model, n=300, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, 2 * n, 2, dtype=np.uint64))     # odd ids, unsorted
    return {t.name: (ids, rng.standard_normal((n, t.dim)).astype(np.float32)) for t in model.sparse_tables}


def test_a_ctr_model_is_a_directory_of_sorted_tables_read_mapped(tmp_path):
    from pserver import sparse
    from pserver.persist.atomic import remove_stale
    model = make_model("fm", (), 2, embedding_dim=4, seed=7, init_scale=0.1)
    w = model.init_params(0)
    tables = ctr_tables(model)
    path = str(tmp_path / "ctr")
    fm = {"model": "fm", "arguments": {"input_shape": [], "num_classes": 2, "hidden": [], "embedding_dim": 4}}
    save(path, model, w, fm, {}, tables=tables)
    loaded = load(path)
    assert loaded.meta["version"] == 2 and [t["index"] for t in loaded.meta["tables"]] == [0, 1]
    assert [t.ids_as for t in loaded.tables] == [None, "linear"]     # one search serves both
    for i, t in enumerate(loaded.tables):
        ids, rows = tables[t.name]
        assert isinstance(t.ids, np.memmap) and t.ids.dtype == np.uint64
        assert (np.diff(t.ids.astype(np.int64)) > 0).all()
        order = np.argsort(ids)
        assert t.rows.tobytes() == rows[order].tobytes()
        # held ids read their rows; the even ids, never stored, their initial rows
        query = np.array([ids[5], 4, ids[0], 10**12], np.uint64)
        out = np.empty((4, t.dim), np.float32)
        t.lookup(query, out)
        init = np.empty((2, t.dim), np.float32)
        sparse.initial_rows(query[[1, 3]], t.dim, 7, i, loaded.meta["tables"][i]["init_scale"], init)
        assert out[[0, 2]].tobytes() == rows[[5, 0]].tobytes() and out[[1, 3]].tobytes() == init.tobytes()
    assert np.abs(load(path).tables[1].rows).sum() > 0
    x = np.zeros(3, model.record)
    x["cat"] = [[1] * 26, [3] * 26, [4] * 26]
    assert loaded.predict(x).shape == (3, 1)

    # a JSON that says two tables share ids that differ is refused (its checksums those of the files)
    meta = json.loads(json.dumps(loaded.meta))
    other = os.path.join(path, "tables", "other.npy")       # a new file: `loaded` maps the old one
    np.save(other, np.asarray(loaded.tables[1].ids) + np.uint64(1))
    os.replace(other, os.path.join(path, "tables", "factors.ids.npy"))
    meta.setdefault("files", {})["tables/factors.ids.npy"] = listed(os.path.join(path, "tables",
                                                                                 "factors.ids.npy"))
    with pytest.raises(DataError, match="says its ids are table 'linear'"):
        read_tables(path, meta)

    # written again over itself (no half state beside it), and a killed writer's leftovers go
    os.makedirs(f"{path}.tmp-999999999")
    save(path, model, w, fm, {}, tables=ctr_tables(model, seed=1))
    assert sorted(os.listdir(tmp_path)) == ["ctr"]
    assert remove_stale(path) == []
    with pytest.raises(ConfigError, match="rows of table 'factors'"):
        save(path, model, w, None, {}, tables={"linear": tables["linear"]})
    assert load(path).tables[1].rows.tobytes() != loaded.tables[1].rows.tobytes()    # the new rows
    with pytest.raises(DataError, match=r"holds sparse tables \[\('linear', 1\), \('factors', 4\)\]"):
        load(path, model="lr")          # lr has fm's dense weights, and the linear table only


# -- every file of an export checked before use ----------------------------------------------------

def listed(file: str) -> dict:
    """A file's entry in a model's JSON "files", as the writer records it."""
    data = open(file, "rb").read()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rewrite_json(path: str, change) -> None:
    """MODEL/model.npz again with its JSON changed by change(meta) (the weights as they were)."""
    file = os.path.join(path, "model.npz")
    with np.load(file, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META]))
    change(meta)
    arrays[META] = np.array(json.dumps(meta))
    np.savez(file, **arrays)


def flip(file: str, at: int) -> None:
    """One byte of the file changed in place (`at` < 0: from the end): its size stays."""
    at %= os.path.getsize(file)
    with open(file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.fixture(scope="module")
def fm_saved(tmp_path_factory):
    """An fm model with tables of 400 rows, saved as `pserver export` saves one: a definition
    that `pserver evaluate` rebuilds, on a small criteo-synthetic set."""
    from pserver.build import table_options
    path = str(tmp_path_factory.mktemp("fm") / "ctr")
    cfg = WorkerConfig(model="fm", dataset="criteo-synthetic", samples=300, test_samples=200, seed=5)
    ds = load_dataset("criteo-synthetic", samples=300, test_samples=200, seed=5)
    model = make_model("fm", ds.sample_shape, ds.num_classes, hidden=cfg.hidden, **table_options(cfg))
    w = model.init_params(0)
    save(path, model, w, definition(cfg, model, ds), {}, tables=ctr_tables(model, 400))
    return path, model, w, ds


@pytest.fixture
def criteo_model(fm_saved):
    """criteo_model(path): a copy of fm_saved's model at path; (model, weights, dataset)."""
    def copy(path: str) -> tuple:
        shutil.copytree(fm_saved[0], path)
        return fm_saved[1:]
    return copy


def test_a_same_size_change_to_any_file_of_a_model_is_refused_before_a_prediction(tmp_path, criteo_model):
    # Catches tables mapped without their checksum checked (on main a flipped byte of a table's
    # rows loads and predicts other numbers), and a manifest that leaves a file out.
    path = str(tmp_path / "ctr")
    model, w, _ = criteo_model(path)
    good = load(path)
    files = [f"tables/{f}" for f in sorted(os.listdir(os.path.join(path, "tables")))]
    with open(os.path.join(path, "model.npz"), "rb") as f:      # a dense weight's bytes, inside the zip
        weight_at = f.read().find(model.layout.views(w)[model.layout.tensors[0].name].tobytes())
    assert weight_at > 0
    rows_first = sorted(files, key=lambda f: "ids" in f)
    for name, at in [*((f, -5) for f in rows_first), ("model.npz", weight_at + 2)]:
        bad = str(tmp_path / "bad")
        shutil.copytree(path, bad)
        size = os.path.getsize(os.path.join(bad, name))
        flip(os.path.join(bad, name), at)
        assert os.path.getsize(os.path.join(bad, name)) == size
        with pytest.raises(DataError) as err:
            load(bad)
        assert os.path.join(bad, name) in str(err.value) and "\n" not in str(err.value), (name, err.value)
        shutil.rmtree(bad)
    assert [t.rows.tobytes() for t in load(path).tables] == [t.rows.tobytes() for t in good.tables]
    assert len(files) == 4 and sorted(load(path).meta["files"]) == files     # every file listed

    # `pserver evaluate` refuses it in one line, exit 2, before evaluating
    flip(os.path.join(path, "tables", "factors.rows.npy"), -3)
    r = subprocess.run([sys.executable, "-m", "pserver", "evaluate", "--model-file", path, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "factors.rows.npy" in r.stderr and "sha256" in r.stderr, r.stderr


def test_ids_out_of_order_are_refused_even_with_their_checksums(tmp_path, criteo_model):
    # Ids and rows written in reverse order (a foreign writer, or an export from before checksums):
    # on main they load, and every lookup misses (binary search of unsorted ids).
    path = str(tmp_path / "ctr")
    criteo_model(path)
    for name, order in (("linear", slice(None, None, -1)), ("factors", np.r_[0, 2, 1, 3:400])):
        for stripped in (False, True):
            bad = str(tmp_path / f"{name}-{stripped}")
            shutil.copytree(path, bad)
            for what in ("ids", "rows"):
                file = os.path.join(bad, "tables", f"{name}.{what}.npy")
                np.save(file, np.load(file)[order])

            def resum(meta, bad=bad, stripped=stripped):
                if stripped:
                    meta.pop("files", None)
                else:
                    meta["files"] = {f: listed(os.path.join(bad, f)) for f in meta.get("files", {})}
                meta["tables"][1].pop("ids_as", None)       # each table's ids read on their own
            rewrite_json(bad, resum)
            with pytest.raises(DataError, match="ids not strictly ascending") as err:
                load(bad)
            assert f"{name}.ids.npy" in str(err.value), err.value
    # ids twice: not strictly ascending either
    file = os.path.join(path, "tables", "linear.ids.npy")
    ids = np.load(file)
    ids[7] = ids[6]
    np.save(file, ids)
    rewrite_json(path, lambda meta: meta.setdefault("files", {}).update({"tables/linear.ids.npy":
                                                                           listed(file)}))
    with pytest.raises(DataError, match=r"linear.ids.npy: ids not strictly ascending: id \d+ at row 7"):
        load(path)


def test_a_model_written_before_checksums_loads_unverified_and_says_so(tmp_path, caplog, criteo_model):
    # Catches a loader that refuses the exports already out there, or takes them in silently.
    path = str(tmp_path / "ctr")
    criteo_model(path)
    good = load(path)
    rewrite_json(path, lambda meta: meta.pop("files", None))
    with caplog.at_level(logging.WARNING, logger="pserver.model"):
        old = load(path)
    assert [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()] == [
        f"{path}: written before exports carried checksums: its files are not verified (their shapes and "
        "id order are checked); export it again to have them verified"]
    assert [(t.ids.tobytes(), t.rows.tobytes()) for t in old.tables] == [
        (t.ids.tobytes(), t.rows.tobytes()) for t in good.tables]
    assert old.weights.tobytes() == good.weights.tobytes()
    # listed, a file that the list leaves out is refused
    rewrite_json(path, lambda meta: meta.update(files={}))
    with pytest.raises(DataError, match=r"linear.ids.npy: not in the model's list of files"):
        load(path)


def test_a_corrupt_or_disordered_delta_is_refused_and_the_model_stays(tmp_path, criteo_model):
    # Catches a delta's files used unchecked: on main a flipped byte of its rows is served, and
    # its removed ids or changed ids out of order are taken in.
    path = str(tmp_path / "ctr")
    model, w, _ = criteo_model(path)
    base = load(path)
    ids = np.asarray(base.tables[0].ids)
    changed = {t.name: (ids[::3], np.full((ids[::3].shape[0], t.dim), 0.5, np.float32))
               for t in model.sparse_tables}
    gone = {t.name: ids[1::7] for t in model.sparse_tables}
    delta = str(tmp_path / "delta")
    save(delta, model, w + 1, None, {}, tables=changed, removed=gone,
         delta={"base_id": base.meta["export_id"], "base_version": 0, "base_versions": [0]})
    probe = np.concatenate([ids, np.arange(2, 40, 2, dtype=np.uint64)])

    def reads(m) -> list:
        out = []
        for t in m.tables:
            rows = np.empty((probe.shape[0], t.dim), np.float32)
            t.lookup(probe, rows)
            out.append(rows.tobytes())
        return [*out, m.weights.tobytes(), m.meta["export_id"]]
    before = reads(base)

    def damaged(label, change):
        bad = str(tmp_path / label)
        shutil.copytree(delta, bad)
        change(bad)
        return bad
    for bad, words in (
            (damaged("flipped", lambda d: flip(os.path.join(d, "tables", "factors.rows.npy"), -2)),
             r"factors.rows.npy: sha256"),
            (damaged("removed", lambda d: flip(os.path.join(d, "tables", "linear.removed.npy"), -1)),
             r"linear.removed.npy: sha256"),
            (damaged("reversed", lambda d: reverse_delta(d, "factors")),
             r"factors.ids.npy: ids not strictly ascending")):
        with pytest.raises(DataError, match=words):
            base.apply(bad)
        assert reads(base) == before, bad
    assert base.apply(delta) == {t.name: {"changed": ids[::3].shape[0], "removed": ids[1::7].shape[0]}
                                 for t in model.sparse_tables}
    assert reads(base) != before


def reverse_delta(d: str, name: str) -> None:
    """A delta's table written in reverse order, its JSON's checksums made to match."""
    for what in ("ids", "rows"):
        file = os.path.join(d, "tables", f"{name}.{what}.npy")
        np.save(file, np.load(file)[::-1])

    def resum(meta):
        meta["files"] = {f: listed(os.path.join(d, f)) for f in meta.get("files", {})}
        for t in meta["tables"]:
            t.pop("ids_as", None)
    rewrite_json(d, resum)
