"""--dataset PATH.parquet (issue 50: list columns in Parquet inputs): a record field per column,
lists of ids padded with -1 and read with padding_id=-1, bad files and columns one clear line,
and a model file over the records training under `pserver launch`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pserver.data import load_dataset
from pserver.errors import DataError
from pserver.keras import Input, layers
from pserver.layers import Dense, Embedding
from pserver.models import Functional
from tests.support.processes import env_with


def planted(n: int, rng) -> dict:
    """Clicks when a user's history holds one of the ids 0-4 (of 0-49); histories of 0 to 6 ids."""
    hist = [list(rng.integers(0, 50, rng.integers(0, 7))) for _ in range(n)]
    label = np.array([int(any(v < 5 for v in h)) for h in hist])
    return {"hist": hist, "age": rng.random(n).astype(np.float32), "user": rng.integers(0, 9, n),
            "w": [list(rng.random(len(h))) for h in hist], "label": label}


def write(path, columns: dict, schema=None) -> str:
    pq.write_table(pa.table(columns, schema=schema), path)
    return str(path)


def test_columns_become_record_fields_and_lists_are_padded_with_minus_1(tmp_path):
    rng = np.random.default_rng(0)
    cols = planted(200, rng)
    cols["hist"][3] = None                                   # a null list: an empty one
    ds = load_dataset(write(tmp_path / "d.parquet", cols), seed=1)
    x = np.concatenate([ds.x_train, ds.x_test])
    assert ds.x_train.dtype.names == ("hist", "age", "user", "w") and ds.num_classes == 2
    assert ds.x_train.dtype["hist"] == np.dtype((np.int64, (6,))) and ds.x_train.dtype["w"].base == np.float32
    assert (len(ds.x_train), len(ds.x_test)) == (180, 20) and ds.padded == ("hist",)
    assert ds.x_train.dtype["age"] == np.dtype((np.float32, (1,))) and ds.x_train.dtype["user"] == np.int64
    rows = sorted((tuple(r["hist"]), float(r["age"][0])) for r in x)
    want = sorted((tuple(list(h or []) + [-1] * (6 - len(h or []))), float(a))
                  for h, a in zip(cols["hist"], cols["age"]))
    assert rows == want                                       # every row once, padded after its ids
    assert set(np.concatenate([ds.y_train, ds.y_test]).tolist()) == {0, 1}


@pytest.mark.parametrize("columns, match", [
    ({"a": [1, 2]}, r"no column 'label' \(the labels\); it has a"),
    ({"a": [1, None], "label": [0, 1]}, r"column 'a' has 1 null value\(s\), the first in row 1"),
    ({"a": [[1, None], [2]], "label": [0, 1]}, r"column 'a', row 0: a list with a null value"),
    ({"a": ["x", "y"], "label": [0, 1]}, r"column 'a' holds string; columns hold numbers"),
    ({"a": [["x"], ["y"]], "label": [0, 1]}, r"column 'a' holds lists of string"),
    ({"label": [0, 1]}, r"no feature column beside 'label'"),
])
def test_a_bad_column_is_one_line_naming_it(tmp_path, columns, match):
    with pytest.raises(DataError, match=match):
        load_dataset(write(tmp_path / "d.parquet", columns))


def test_a_missing_or_unreadable_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset(str(tmp_path / "none.parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_dataset(str(tmp_path / "bad.parquet"))


def _model(**padding) -> Functional:
    hist = Input(shape=(6,), dtype="int64", name="hist")
    w, age, user = (Input(shape=(6,), name="w"), Input(shape=(1,), name="age"),
                    Input(shape=(), dtype="int64", name="user"))
    e = Embedding(None, 4, sparse=True, combiner="sum", **padding)([hist, w])
    u = Embedding(None, 4, sparse=True, name="users")(user)
    return Functional({"hist": hist, "w": w, "age": age, "user": user},
                      Dense(1, activation="sigmoid")(layers.Concatenate()([e, u, age])),
                      loss="binary_crossentropy")


def test_a_model_must_read_a_padded_column_with_padding_id_minus_1(tmp_path):
    """Read with mask_zero (padding 0) or none, the -1s would be ids: rows on the shards."""
    rng = np.random.default_rng(0)
    path = write(tmp_path / "d.parquet", planted(100, rng))
    ds = load_dataset(path)
    ds.fit(_model(padding_id=-1))
    with pytest.raises(DataError, match=r"column 'hist' holds lists of ids padded with -1; the model reads "
                                        r"input 'hist' with padding 0: give its Embedding padding_id=-1"):
        ds.fit(_model(mask_zero=True))
    with pytest.raises(DataError, match=r"reads input 'hist' with no padding"):
        ds.fit(_model())


MODEL_FILE = '''
from pserver.keras import Input, layers
from pserver.layers import Dense, Embedding
from pserver.models import Functional


def build(input_shape, num_classes):
    hist = Input(shape=(6,), dtype="int64", name="hist")
    w, age = Input(shape=(6,), name="w"), Input(shape=(1,), name="age")
    user = Input(shape=(), dtype="int64", name="user")
    e = Embedding(None, 8, sparse=True, combiner="mean", padding_id=-1, lr=0.2)([hist, w])
    u = Embedding(None, 4, sparse=True, name="users")(user)
    h = Dense(16, activation="relu")(layers.Concatenate()([e, u, age]))
    return Functional({"hist": hist, "w": w, "age": age, "user": user}, Dense(1, activation="sigmoid")(h),
                      loss="binary_crossentropy")
'''


@pytest.mark.e2e
def test_a_model_file_over_a_parquet_files_lists_trains_under_launch(tmp_path):
    """Real processes: the records from the file, lists and weights pooled on the shards, to an
    AUC no model without the lists reaches (the label is whether the history holds ids 0-4)."""
    rng = np.random.default_rng(3)
    cols = planted(6000, rng)
    cols["w"] = [[1.0] * len(h) for h in cols["hist"]]
    path = write(tmp_path / "clicks.parquet", cols)
    (tmp_path / "m.py").write_text(MODEL_FILE)
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "pserver", "launch", "--ps", "2", "--workers", "2",
                        "--model", f"{tmp_path / 'm.py'}:build", "--dataset", path, "--epochs", "4",
                        "--batch-size", "64", "--optimizer", "adam", "--lr", "0.01",
                        "--summary-json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env_with({}), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["dataset"] == path and summary["test_auc"] > 0.9, summary
