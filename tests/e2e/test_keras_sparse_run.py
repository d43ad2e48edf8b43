"""A Keras model with a sparse Embedding under `pserver run --ps 1 --workers 2`: every rank
keeps the same trained rows (read from the shards at fit's end), so each rank's evaluate and
predict agree, and the chief's saved model predicts the same. Once with one id per field, once
with a list feature (Python lists of 0 to 5 ids out of 19, pooled by a mean, padding left out)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import json, os
import numpy as np
from pserver import keras
from pserver.keras import layers
keras.utils.set_random_seed(5)
rng = np.random.default_rng(0)
ids = rng.integers(0, 500, (512, 3)); dense = rng.normal(size=(512, 2)).astype("float32")
y = (ids[:, 0] % 2).astype("float32")
d = keras.Input(shape=(2,), name="dense")
if os.environ["LISTS"] == "1":
    ids = [list(rng.integers(1, 20, rng.integers(0, 6))) for _ in range(512)]
    y = np.array([float(any(v % 2 for v in a)) for a in ids], np.float32)
    i = keras.Input(shape=(5,), dtype="int64", name="ids")
    e = layers.Embedding(None, 4, sparse=True, mask_zero=True, combiner="mean", name="emb")(i)
else:
    i = keras.Input(shape=(3,), dtype="int64", name="ids")
    e = layers.Flatten()(layers.Embedding(None, 4, sparse=True, name="emb")(i))
out = layers.Dense(1, activation="sigmoid")(layers.Concatenate()([e, d]))
model = keras.Model({"ids": i, "dense": d}, out)
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
model.fit({"ids": ids, "dense": dense}, y, epochs=2, batch_size=64, verbose=0)
out = os.environ["OUT_DIR"]
rank = int(os.environ["PSERVER_RUN_RANK"])
model.save(os.path.join(out, "model.keras"))          # the chief's to write
np.save(os.path.join(out, f"pred{rank}.npy"), model.predict({"ids": ids, "dense": dense}))
with open(os.path.join(out, f"eval{rank}.json"), "w") as f:
    json.dump(model.evaluate({"ids": ids, "dense": dense}, y, verbose=0), f)
"""


@pytest.mark.parametrize("lists", ["0", "1"], ids=["one_id_per_field", "list_feature"])
def test_every_rank_keeps_the_trained_rows_and_agrees(tmp_path, lists):
    """Fails if a rank other than the chief has no rows after fit (its evaluate would refuse or
    differ), if the ranks read the rows at different versions, or if the chief's file lacks them."""
    script = tmp_path / "sparse.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                       env=env_with({"OUT_DIR": str(tmp_path), "LISTS": lists}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = [json.loads((tmp_path / f"eval{k}.json").read_text()) for k in range(2)]
    preds = [np.load(tmp_path / f"pred{k}.npy") for k in range(2)]
    assert evals[0] == evals[1] and evals[0][1] > 0.6
    assert np.array_equal(preds[0], preds[1])
    check = ("import sys, numpy as np; from pserver import keras; m = keras.models.load_model(sys.argv[1]); "
             "rng = np.random.default_rng(0); ids = rng.integers(0, 500, (512, 3)); "
             "dense = rng.normal(size=(512, 2)).astype('float32'); "
             "ids = [list(rng.integers(1, 20, rng.integers(0, 6))) for _ in range(512)] "
             "if sys.argv[3] == '1' else ids; np.save(sys.argv[2], m.predict({'ids': ids, 'dense': dense}))")
    subprocess.run([sys.executable, "-c", check, str(tmp_path / "model.keras"), str(tmp_path / "loaded.npy"),
                    lists], check=True, timeout=120)
    assert np.array_equal(np.load(tmp_path / "loaded.npy"), preds[0])
