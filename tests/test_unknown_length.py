"""keras.Input with a dimension of unknown size (`shape=(None,)`): the calls on it are recorded
and the model is made at its first data, for the data's size (pserver.ops.core.defer, replay).

The reference is always the same script with the size written in: the model made from the
data must be that model, weight for weight and step for step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pserver.keras as keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers, ops
from pserver.keras.cluster import SEED
from pserver.models.functional import Functional


def ids(n: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 300, size=(n, length))
    return x, (x[:, :3].mean(axis=1) > 150).astype("int64")


@keras.saving.register_keras_serializable(package="test_unknown_length")
class PositionEmbedding(layers.Layer):
    """keras.io's TokenAndPositionEmbedding: reads its input's length with ops.shape in call."""

    def __init__(self, maxlen, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab, self.dim = maxlen, vocab, dim
        self.token = layers.Embedding(vocab, dim)
        self.position = layers.Embedding(maxlen, dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token(x) + self.position(positions)

    def get_config(self):
        return {**super().get_config(), "maxlen": self.maxlen, "vocab": self.vocab, "dim": self.dim}


def text_model(length, kind: str) -> keras.Model:
    """keras.io's text models over an Input of `length` (None: unknown): conv (text
    classification from scratch), lstm (bidirectional LSTM on IMDB, with a mask), attention
    (the transformer example's block, a layer of our own and ops)."""
    inputs = keras.Input(shape=(length,), dtype="int64")
    if kind == "conv":
        h = layers.Dropout(0.5)(layers.Embedding(300, 8)(inputs))
        h = layers.Add()([h, h])             # one dropout mask read twice: made once, not per read
        h = layers.Conv1D(6, 3, padding="valid", activation="relu", strides=2)(h)
        h = layers.GlobalMaxPooling1D()(h)
    elif kind == "lstm":
        h = layers.Embedding(300, 8, mask_zero=True)(inputs)
        h = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(h)
        h = layers.LSTM(4)(h)
    else:
        h = PositionEmbedding(64, 300, 8)(inputs)
        h = layers.LayerNormalization()(h + layers.MultiHeadAttention(2, 4)(h, h))
        shared = layers.Dense(8, activation="relu")                # one layer on two branches
        h = ops.mean(shared(h) + shared(h * 0.5), axis=1)
    outputs = layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("kind", ["conv", "lstm", "attention"])
def test_a_model_made_from_the_data_trains_as_the_model_given_the_length(kind, monkeypatch):
    """Catches a replay that makes another graph (a layer called twice, one left out, the
    shared layer's weights doubled, a mask lost): the weights' names, shapes and values after
    two epochs must equal the fixed-length model's."""
    monkeypatch.setenv(SEED, "0")             # set_random_seed's, put back after the test
    x, y = ids(96, 12)
    fixed, unknown = text_model(12, kind), text_model(None, kind)
    for model in (fixed, unknown):
        keras.utils.set_random_seed(3)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert [(t.name, t.shape) for t in unknown._core.layout.tensors] == \
        [(t.name, t.shape) for t in fixed._core.layout.tensors]
    for a, b in zip(unknown.get_weights(), fixed.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(unknown.predict(x, verbose=0), fixed.predict(x, verbose=0))


@settings(max_examples=8, deadline=None)
@given(length=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_at_any_length_the_made_model_computes_what_the_fixed_one_does(length, seed):
    """Over lengths (1: a single step) and weights: the model made for the data's length gives
    the fixed-length model's predictions with the same weights."""
    x, _ = ids(5, length, seed)
    fixed, unknown = text_model(length, "attention"), text_model(None, "attention")
    unknown.predict(x, verbose=0)
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=w.shape).astype(np.float32) * 0.3 for w in fixed.get_weights()]
    fixed.set_weights(weights)
    unknown.set_weights(weights)
    np.testing.assert_allclose(unknown.predict(x, verbose=0), fixed.predict(x, verbose=0), rtol=1e-6)


def test_a_sequential_with_an_input_of_unknown_length_is_built_at_the_first_data():
    x, y = ids(64, 10)
    model = keras.Sequential([keras.Input(shape=(None,), dtype="int64"), layers.Embedding(300, 4),
                              layers.GlobalAveragePooling1D(), layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(x, y, epochs=1, verbose=0)
    assert model.layers[0].output_shape == (10, 4)


def test_several_inputs_one_of_unknown_length_by_name(monkeypatch):
    """A dict of inputs, one of unknown length and one of known shape: each bound to its data by
    name. Catches a binding by position (the dict's order here is not the data's)."""
    def model(length):
        words = keras.Input(shape=(length,), dtype="int64", name="words")
        extra = keras.Input(shape=(3,), name="extra")
        h = layers.GlobalAveragePooling1D()(layers.Embedding(300, 4)(words))
        out = layers.Dense(1, activation="sigmoid")(layers.Concatenate()([h, layers.Dense(4)(extra)]))
        m = keras.Model({"words": words, "extra": extra}, out)
        m.compile(optimizer="sgd", loss="binary_crossentropy")
        return m
    monkeypatch.setenv(SEED, "0")
    x, y = ids(32, 7)
    data = {"extra": np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32), "words": x}
    fixed, unknown = model(7), model(None)
    for m in (fixed, unknown):
        keras.utils.set_random_seed(5)
        m.fit(data, y, epochs=1, verbose=0)
    for a, b in zip(unknown.get_weights(), fixed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_saved_model_made_from_the_data_loads_at_that_length(tmp_path):
    x, y = ids(32, 9)
    model = text_model(None, "attention")
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))


def test_what_cannot_be_known_before_the_data_is_refused_in_one_line():
    """Each refusal names what to do; none is an AttributeError or a loop (unpacking a
    tensor that indexes itself forever)."""
    inputs = keras.Input(shape=(None,), dtype="int64")
    assert inputs.shape == (None, None)
    h = layers.Embedding(300, 4)(inputs)
    cases = [lambda: h.shape, lambda: tuple(h), lambda: ops.split(h, 2, axis=-1)]
    for case in cases:
        with pytest.raises(ConfigError) as e:
            case()
        assert "unknown size (None)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^layer embedding \(Embedding\)'s output is computed from"):
        h.shape
    other = keras.Input(shape=(None,), dtype="int64")           # used, but not among the inputs
    mine = keras.Input(shape=(None,), dtype="int64")
    both = layers.Embedding(300, 4)(mine) + layers.Embedding(300, 4)(other)
    stray = keras.Model(mine, layers.Dense(1)(layers.GlobalMaxPooling1D()(both)))
    with pytest.raises(ConfigError, match="used by the model but is not one of its inputs"):
        stray.predict(ids(2, 5)[0], verbose=0)
    out = layers.Dense(1)(layers.GlobalMaxPooling1D()(h))
    with pytest.raises(ConfigError, match="pserver.keras.Model makes such a graph at its first data"):
        Functional(inputs, out)                   # pserver's own graph class plans for one shape
    model = keras.Model(inputs, out)
    model.compile(optimizer="sgd", loss="mse")
    x, y = ids(16, 6)
    model.fit(x, y, epochs=1, verbose=0)
    for other in (model.predict, model.evaluate):                 # another length than the first's
        with pytest.raises(DataError, match=r"^functional: input 'input_layer\S*' is keras.Input\(shape="
                           r"\(None,\)\), and the model was made at its first data for samples of shape "
                           r"\(6,\); these have \(4,\): pad or cut them to \(6,\)"):
            other(x[:, :4], *([y] if other == model.evaluate else []), verbose=0)
    with pytest.raises(ConfigError, match=r"keras.Input\(shape=\(None, 3\)\), the data's samples have shape"):
        wide = keras.Input(shape=(None, 3))
        keras.Model(wide, layers.Dense(1)(wide)).predict(x, verbose=0)


def test_a_layer_that_returns_several_tensors_on_it_says_to_give_the_size():
    inputs = keras.Input(shape=(None,), dtype="int64")
    out = layers.LSTM(4, return_state=True)(layers.Embedding(300, 4)(inputs))
    model = keras.Model(inputs, layers.Dense(1)(out))
    with pytest.raises(ConfigError, match="several tensors.*give keras.Input the size"):
        model.predict(ids(4, 5)[0], verbose=0)


def test_a_summary_before_the_first_data_lists_the_layers_as_the_model_will_name_them():
    """keras.io's bidirectional LSTM example calls summary() before fit: a model of unknown
    length says what it can (its layers, in call order, named as they will be) rather than
    failing; after the data, Keras's table with Keras's count (2,757,761 for that example)."""
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(20000, 128)(inputs)
    x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(64))(x)
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x))
    before = model.summary_text()
    rows = [line.split("(")[0].strip() for line in before.splitlines() if "at the first data " in line]
    assert rows == ["embedding", "bidirectional", "bidirectional_1", "dense"], before
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.predict(ids(2, 7)[0], verbose=0)
    assert [layer.name for layer in model.layers] == rows
    assert "Total params: 2,757,761" in model.summary_text()
