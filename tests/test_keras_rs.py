"""pserver.keras_rs: Keras-RS's TableConfig, FeatureConfig, DistributedEmbedding and EmbedReduce
as written in its examples, with the tables on the shards: a ranking model over one-id and list
features trains, saves and loads; each config maps to the table the shards get; bad configs are
one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pserver import keras, keras_rs
from pserver.errors import ConfigError


@pytest.fixture(autouse=True)
def run_seed(monkeypatch):
    from pserver.launch.run import SEED

    monkeypatch.setenv(SEED, "0")


def _data(n=768, seed=0):
    """user and movie ids (from 0), a genre list per sample (0 to 3 ids, as Python lists), and a
    rating that the user, the movie and the genres decide."""
    rng = np.random.default_rng(seed)
    user, movie = rng.integers(0, 40, n), rng.integers(0, 60, n)
    genres = [list(rng.integers(0, 8, rng.integers(0, 4))) for _ in range(n)]
    rating = (user % 3 + (movie % 4) * 0.5 + np.array([sum(g) % 2 for g in genres])).astype("float32")
    return {"user": user, "movie": movie, "genres": genres}, rating


def _model(combiner="mean", optimizer="adagrad"):
    tables = {
        name: keras_rs.layers.TableConfig(
            name=f"{name}_table",
            vocabulary_size=v,
            embedding_dim=8,
            optimizer=keras.optimizers.Adagrad(0.1) if optimizer == "adagrad" else optimizer,
            combiner=combiner,
        )
        for name, v in [("user", 40), ("movie", 60), ("genres", 8)]
    }
    features = {
        name: keras_rs.layers.FeatureConfig(
            name=name,
            table=tables[name],
            input_shape=(None, 3) if name == "genres" else (None,),
            output_shape=(None, 8),
        )
        for name in tables
    }
    inputs = {
        "user": keras.Input(shape=(), dtype="int64", name="user"),
        "movie": keras.Input(shape=(), dtype="int64", name="movie"),
        "genres": keras.Input(shape=(3,), dtype="int64", name="genres"),
    }
    embedded = keras_rs.layers.DistributedEmbedding(features)(inputs)
    assert set(embedded) == set(inputs)
    x = keras.layers.Concatenate()([embedded[k] for k in ("user", "movie", "genres")])
    x = keras_rs.layers.FeatureCross(projection_dim=6)(x)
    out = keras.layers.Dense(1)(keras.layers.Dense(32, activation="relu")(x))
    model = keras.Model(inputs, out)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=[keras.metrics.RootMeanSquaredError()]
    )
    return model


def test_a_ranking_model_over_keras_rs_tables_trains_saves_and_loads(tmp_path):
    """Keras-RS's config objects on one-id features and a ragged list feature (ids from 0: id 0 is
    a real id, padding is -1), its FeatureCross, compile/fit/evaluate: the RMSE falls well below
    the labels' spread, and the saved model predicts the same after load_model. Catches a list's
    id 0 taken for padding (genre 0 would never train), or the tables lost at save."""
    keras.utils.set_random_seed(1)
    x, y = _data()
    model = _model()
    history = model.fit(x, y, epochs=12, batch_size=32, verbose=0)
    rmse = model.evaluate(x, y, verbose=0, return_dict=True)["root_mean_squared_error"]
    assert rmse < 0.35 * float(np.std(y)) and history.history["loss"][-1] < history.history["loss"][0] / 5
    got = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    assert np.array_equal(keras.models.load_model(tmp_path / "m.keras").predict(x, verbose=0), got)
    from pserver.persist.model_file import load

    genres = next(t for t in load(str(tmp_path / "m.keras")).tables if t.config.name == "genres_table")
    assert 0 in genres.ids.astype(np.int64) and np.all(genres.ids.astype(np.int64) < 8)


def test_each_table_config_is_the_shards_table():
    """Name, dim, row optimizer and rate (Keras's default rate for a name), the start's scale (the
    uniform of VarianceScaling(fan_out)'s variance: sqrt(3 / embedding_dim)), and the combiner
    for a list feature only."""
    table = keras_rs.layers.TableConfig(
        name="t", vocabulary_size=100, embedding_dim=12, optimizer="sgd", combiner="sqrtn"
    )
    one = keras_rs.layers.FeatureConfig(name="f", table=table, input_shape=(None,), output_shape=(None, 12))
    emb = keras_rs.layers.DistributedEmbedding(one)
    out = emb(keras.Input(shape=(), dtype="int64", name="f"))
    layer = emb._layers[()]
    config = layer.table_config()
    assert (config.name, config.dim, config.optimizer, config.lr) == ("t", 12, "sgd", 0.01)
    assert config.init_scale == pytest.approx(math.sqrt(3 / 12), rel=1e-6)
    assert layer.combiner is None and out.shape == (None, 12)
    lists = keras_rs.layers.FeatureConfig(
        name="g", table=table, input_shape=(None, 5), output_shape=(None, 12)
    )
    emb = keras_rs.layers.DistributedEmbedding([lists])
    assert emb([keras.Input(shape=(5,), dtype="int64")])[0].shape == (None, 12)
    assert emb._layers[(0,)].combiner == "sqrtn" and emb._layers[(0,)].padding == -1


def test_embed_reduce_pools_by_mean_by_default():
    layer = keras_rs.layers.EmbedReduce(10, 4)
    assert layer.combiner == "mean" and layer(keras.Input(shape=(6,), dtype="int64")).shape == (None, 4)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: keras_rs.layers.TableConfig(name="t", vocabulary_size=0, embedding_dim=4),
            r"TableConfig 't': vocabulary_size must be an integer >= 1, got 0",
        ),
        (
            lambda: keras_rs.layers.TableConfig(name="t", vocabulary_size=9, embedding_dim=4, combiner="max"),
            r"combiner must be one of mean, sum, sqrtn, got 'max'",
        ),
        (
            lambda: keras_rs.layers.TableConfig(
                name="t", vocabulary_size=9, embedding_dim=4, optimizer="rmsprop"
            ),
            r"optimizer must be one of SGD, Adagrad, Adam or FTRL",
        ),
        (
            lambda: keras_rs.layers.TableConfig(
                name="t", vocabulary_size=9, embedding_dim=4, initializer="orthogonal"
            ),
            r"initializer must be zeros, a symmetric RandomUniform",
        ),
        (
            lambda: keras_rs.layers.FeatureConfig(
                name="f",
                table=keras_rs.layers.TableConfig("t", 9, 4),
                input_shape=(None,),
                output_shape=(None, 5),
            ),
            r"FeatureConfig 'f': output_shape must be \(batch, 4\)",
        ),
        (
            lambda: keras_rs.layers.DistributedEmbedding(
                {
                    a: keras_rs.layers.FeatureConfig(
                        name=a,
                        table=keras_rs.layers.TableConfig("shared", 9, 4, combiner=c),
                        input_shape=(None,),
                        output_shape=(None, 4),
                    )
                    for a, c in (("a", "mean"), ("b", "sum"))
                }
            ),
            r"two TableConfigs are named 'shared'",
        ),
    ],
)
def test_bad_configs_are_one_line(make, match):
    with pytest.raises(ConfigError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def test_inputs_of_another_structure_or_shape_are_refused():
    table = keras_rs.layers.TableConfig("t", 9, 4)
    emb = keras_rs.layers.DistributedEmbedding(
        {"f": keras_rs.layers.FeatureConfig("f", table, (None, 3), (None, 4))}
    )
    with pytest.raises(ConfigError, match=r"the inputs' structure \[\('g',\)\] is not the feature_configs'"):
        emb({"g": keras.Input(shape=(3,), dtype="int64")})
    with pytest.raises(ConfigError, match=r"feature 'f' takes inputs of shape \(None, 3\)"):
        emb({"f": keras.Input(shape=(4,), dtype="int64")})


def test_count_params_counts_the_dense_weights_as_keras_does():
    """The keras.io DCN example prints count_params: each dense table's rows and every layer's
    weights, here the sum of get_weights' sizes, and Keras's count for the same model."""
    i = keras.Input(shape=(), dtype="int32", name="ids")
    x = keras_rs.layers.FeatureCross(projection_dim=2)(keras.layers.Embedding(7, 4)(i))
    model = keras.Model({"ids": i}, keras.layers.Dense(1)(x))
    # Keras: 7*4 embedding + FeatureCross (4*2 down, 2*4 up, 4 bias) + Dense 4+1
    assert model.count_params() == sum(w.size for w in model.get_weights()) == 28 + 20 + 5


def test_ids_outside_a_tables_vocabulary_are_refused_before_fit_trains():
    """Keras-RS's vocabulary_size bounds a table's ids: one past it (or negative: -1 is a list's
    padding only) is a DataError naming the table and the id, before any step."""
    from pserver.errors import DataError
    x, y = _data(n=64)
    model = _model()
    x["movie"] = x["movie"].copy()
    x["movie"][5] = 60                                   # movie_table has 60 rows: ids 0..59
    with pytest.raises(DataError, match=r"layer movie_table .*: id 60 at \(5,\) is not an integer in "
                                        r"\[0, input_dim=60\)"):
        model.fit(x, y, epochs=1, batch_size=32, verbose=0)


def test_features_sharing_a_table_look_it_up_together_on_the_shards(tmp_path):
    """Keras-RS's shared TableConfig: a user's history (a list) and the candidate movie (one id)
    read one table "movies": the shards hold one table, its rows hold both features' ids, and
    the model learns whether the candidate is in the history, which needs both to be one row's.
    Catches a table per feature (two tables), or a shared table's gradients overwritten."""
    from pserver.persist.model_file import load

    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(2)
    history = [list(rng.integers(0, 30, rng.integers(1, 5))) for _ in range(1024)]
    candidate = np.where(rng.random(1024) < 0.5, [h[0] for h in history], rng.integers(0, 30, 1024))
    y = np.array([float(c in h) for c, h in zip(candidate, history)], np.float32)
    movies = keras_rs.layers.TableConfig("movies", 30, 8, optimizer=keras.optimizers.Adagrad(0.2))
    features = {
        "history": keras_rs.layers.FeatureConfig("history", movies, (None, 4), (None, 8)),
        "candidate": keras_rs.layers.FeatureConfig("candidate", movies, (None,), (None, 8)),
    }
    inputs = {
        "history": keras.Input(shape=(4,), dtype="int64", name="history"),
        "candidate": keras.Input(shape=(), dtype="int64", name="candidate"),
    }
    e = keras_rs.layers.DistributedEmbedding(features)(inputs)
    dot = keras.ops.sum(keras.ops.multiply(e["history"], e["candidate"]), axis=1)
    score = keras.ops.reshape(dot, (-1, 1))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(score))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"])
    logs = model.fit({"history": history, "candidate": candidate}, y, epochs=8, batch_size=64, verbose=0)
    assert logs.history["accuracy"][-1] > 0.85
    assert [t.name for t in model._core.sparse_tables] == ["movies"]
    model.save(tmp_path / "m.keras")
    (table,) = load(str(tmp_path / "m.keras")).tables
    seen = set(candidate.tolist()) | {i for h in history for i in h}
    assert set(table.ids.astype(np.int64).tolist()) == seen
