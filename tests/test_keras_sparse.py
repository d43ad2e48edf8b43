"""A Keras model with a sparse Embedding (its rows a table on the shards): fit, then evaluate,
predict, save and load_model, with x a dict by input name, a list, or one array (its records
built from them, pserver.models.sparse_graph), in this process's own shards."""

from __future__ import annotations

import numpy as np
import pytest

from pserver import keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 500, (n, 3))
    dense = rng.normal(size=(n, 2)).astype("float32")
    return ids, dense, (ids[:, 0] % 2).astype("float32")


def _functional():
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    dense = keras.Input(shape=(2,), name="dense")
    e = layers.Flatten()(layers.Embedding(None, 4, sparse=True, name="emb")(ids))
    out = layers.Dense(1, activation="sigmoid")(layers.Concatenate()([e, dense]))
    model = keras.Model({"ids": ids, "dense": dense}, out)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


@pytest.fixture(autouse=True)
def seed_undone(monkeypatch):
    """keras.utils.set_random_seed sets PSERVER_RUN_SEED: set here first so that it is undone."""
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")


def test_a_functional_model_with_a_sparse_table_fits_evaluates_predicts_and_round_trips(tmp_path):
    """Fails if fit refuses a dict of arrays (it took float arrays only), if the trained rows are
    not kept (evaluate needed rows=), if the per-epoch accuracy is not counted for a sparse model
    (it read 0.0), or if save/load_model loses the table (predictions would differ)."""
    keras.utils.set_random_seed(3)
    ids, dense, y = _data()
    model = _functional()
    with pytest.raises(ConfigError, match=r"^predict: the model's sparse tables \(emb\) hold rows only once"):
        model.predict({"ids": ids, "dense": dense})
    history = model.fit({"ids": ids, "dense": dense}, y, epochs=3, batch_size=32, verbose=0)
    assert history.history["accuracy"][-1] > 0.6
    loss, accuracy = model.evaluate({"ids": ids, "dense": dense}, y, verbose=0)
    assert accuracy > 0.6 and loss < history.history["loss"][0]
    as_list = model.predict([ids, dense])
    assert np.array_equal(model.predict({"ids": ids, "dense": dense}), as_list)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    assert np.array_equal(again.predict({"ids": ids, "dense": dense}), as_list)
    with pytest.raises(DataError, match=r"^predict: x has inputs ids; .* takes records with fields ids"):
        model.predict({"ids": ids})


def test_a_sequential_with_a_sparse_table_takes_one_array_of_ids():
    """keras.Sequential([Input(int64), Embedding(None, ..., sparse=True), ...]) on a plain array of
    ids. Fails if the ids are cast to float (the records' field is integer) or the model's one
    input is not made a record field (its Embedding took None for input_dim and crashed)."""
    keras.utils.set_random_seed(4)
    ids, _, y = _data()
    model = keras.Sequential([keras.Input(shape=(3,), dtype="int64"), layers.Embedding(None, 4, sparse=True),
                              layers.Flatten(), layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(ids, y, epochs=3, batch_size=32, verbose=0)
    assert model.evaluate(ids, y, verbose=0)[1] > 0.9


def test_a_layer_of_the_scripts_own_need_not_be_registered_until_the_model_is_saved(tmp_path):
    """fit keeps the trained rows in a file of its own: catches that file asking for the layers'
    configs, so that fit trained, then raised at its end (the rows lost) for an unregistered
    layer. Saving the model still asks for the registration, as Keras does."""
    class Shift(keras.layers.Layer):
        def build(self, input_shape):
            self.b = self.add_weight(shape=(1,), initializer="zeros")

        def call(self, x):
            return x + self.b

    user = keras.Input(shape=(), dtype="int64", name="user")
    model = keras.Model({"user": user}, layers.Activation("sigmoid")(
        Shift()(layers.Embedding(None, 1, sparse=True, lr=0.5)(user))))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    u = np.random.default_rng(0).integers(0, 20, 400)
    model.fit({"user": u}, (u < 10).astype("float32"), epochs=3, batch_size=40, verbose=0)
    p = model.predict({"user": np.array([1, 15])}, verbose=0).ravel()
    assert p[0] > 0.5 > p[1]                                      # the rows trained and were kept
    with pytest.raises(ConfigError, match=r"register it with @pserver.keras.saving.register_keras_"):
        model.save(tmp_path / "m.keras")
