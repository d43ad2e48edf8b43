"""Keras-RS's API on real data under `pserver run --ps 2 --workers 2`: MovieLens-100K's ratings
(pserver.data.movielens) with one-id features and each movie's genres as a list feature, through
DistributedEmbedding (tables on the shards), FeatureCross and Dense. Both ranks end with the same
tables and weights, and the model rates held-out ratings better than their mean does."""

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
from pserver import keras, keras_rs
from pserver.data import movielens
keras.utils.set_random_seed(3)
data = movielens.load()
order = np.random.default_rng(0).permutation(100_000)[:25_000]
genres = [list(g) for g in data["movie_genres"][order]]
x = {"user": data["user_id"][order], "movie": data["movie_id"][order], "genres": genres}
y = data["user_rating"][order]
train = {k: v[:20_000] for k, v in x.items()}, y[:20_000]
test = {k: v[20_000:] for k, v in x.items()}, y[20_000:]
def table(name, size, dim=8):
    return keras_rs.layers.TableConfig(name=name, vocabulary_size=size, embedding_dim=dim,
                                       optimizer=keras.optimizers.Adagrad(0.05))
features = {
    "user": keras_rs.layers.FeatureConfig("user", table("users", 944), (None,), (None, 8)),
    "movie": keras_rs.layers.FeatureConfig("movie", table("movies", 1683), (None,), (None, 8)),
    "genres": keras_rs.layers.FeatureConfig("genres", table("genres", 20), (None, 6), (None, 8)),
}
inputs = {"user": keras.Input(shape=(), dtype="int64", name="user"),
          "movie": keras.Input(shape=(), dtype="int64", name="movie"),
          "genres": keras.Input(shape=(6,), dtype="int64", name="genres")}
e = keras_rs.layers.DistributedEmbedding(features)(inputs)
h = keras_rs.layers.FeatureCross()(keras.ops.concatenate([e["user"], e["movie"], e["genres"]], axis=1))
out = keras.layers.Dense(1)(keras.layers.Dense(32, activation="relu")(h))
model = keras.Model(inputs, out)
model.compile(optimizer=keras.optimizers.Adam(0.005), loss="mse",
              metrics=[keras.metrics.RootMeanSquaredError()])
model.fit(*train, epochs=3, batch_size=256, verbose=0)
rank = int(os.environ["PSERVER_RUN_RANK"])
logs = model.evaluate(*test, verbose=0, return_dict=True)
with open(os.path.join(os.environ["OUT_DIR"], f"eval{rank}.json"), "w") as f:
    json.dump({**logs, "mean_rmse": float(np.sqrt(np.mean((test[1] - train[1].mean()) ** 2)))}, f)
np.save(os.path.join(os.environ["OUT_DIR"], f"pred{rank}.npy"), model.predict(test[0], verbose=0))
"""


def test_keras_rs_tables_on_real_ratings_agree_and_beat_the_mean(tmp_path):
    """Fails if a rank ends with other rows or weights than the chief (its predictions would
    differ), if the genre lists (ids from 0, padded with -1) break the run, or if the model learns
    nothing (its RMSE would not beat the training mean's)."""
    script = tmp_path / "movielens_rs.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "2", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = [json.loads((tmp_path / f"eval{k}.json").read_text()) for k in range(2)]
    assert evals[0] == evals[1]
    assert np.array_equal(np.load(tmp_path / "pred0.npy"), np.load(tmp_path / "pred1.npy"))
    assert evals[0]["root_mean_squared_error"] < 0.97 * evals[0]["mean_rmse"], evals[0]
