"""Keras's masks: Embedding(mask_zero=True) and Masking mark a sequence's padded steps, layers that
support masking pass the mark on, and the recurrent layers (a masked step keeps the states and
outputs the last one, or zeros with zero_output_for_mask, as in Bidirectional's sequences) and
GlobalAveragePooling1D (the mean over kept steps) read it. Kernels against their twins and the
twins against finite differences with masks (hypothesis), outputs equal to Keras 3's for the same
weights, a masked sequence equal to the same sequence without its padding, save/load, training."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.layers import GRU, LSTM, Bidirectional, SimpleRNN
from pserver.layers.base import Pass
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_directional

FAST = settings(max_examples=25, deadline=None)
CELLS = {"SimpleRNN": SimpleRNN, "LSTM": LSTM, "GRU": GRU}
REF, CPU = get_backend("reference"), get_backend("cpu")
L = keras.layers


def masked_layer(layer, steps, features):
    """`layer` built as a call with a mask makes it: its inputs [x, mask]."""
    layer.masked = layer.takes_list = True
    layer.build_once([(steps, features), (steps,)])
    return layer


def run(layer, k, p, x, mask):
    out = np.empty((x.shape[0], *layer.output_shape), x.dtype)
    s = layer.scratch(x.shape[0], x.dtype)
    layer.forward(k, p, [x, mask], out, s, Pass(training=True))
    return out, s


def grads(layer, k, p, x, mask, G):
    out, s = run(layer, k, p, x, mask)
    g = {n: np.empty_like(v) for n, v in p.items()}
    dx, dmask = np.empty_like(x), np.full_like(mask, 7.0)
    layer.backward(k, p, g, [x, mask], out, G.copy(), [dx, dmask], s)
    assert not dmask.any()                     # a mask takes no gradient
    return out, g, dx


def case(data, cell):
    """A masked layer of `cell` for drawn shapes and flags, its weights, a batch and a 0/1 mask
    (some rows all masked, some not at all), in float64."""
    n, steps, features, units = (data.draw(st.integers(1, hi)) for hi in (4, 5, 3, 3))
    flags = {f: data.draw(st.booleans()) for f in ("return_sequences", "return_state", "go_backwards",
                                                    "use_bias", "zero_output_for_mask")}
    flags["recurrent_dropout"] = data.draw(st.sampled_from([0.0, 0.3]))     # the same masks in every pass
    flags["dropout"] = data.draw(st.sampled_from([0.0, 0.4]))
    layer = masked_layer(CELLS[cell](units, **flags), steps, features)
    r = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    mask = (r.random((n, steps)) < data.draw(st.sampled_from([0.0, 0.5, 1.0]))).astype(np.float64)
    return layer, p, r.standard_normal((n, steps, features)), mask, r


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), data=st.data())
def test_the_twin_s_masked_backward_against_finite_differences(cell, data):
    """Catches a masked step whose state's gradient is not carried to the step before (or LSTM's
    dc), one that still sends gradient to its input or the weights, and zero_output_for_mask's
    zeroed outputs still passing gradient."""
    layer, p, x, mask, r = case(data, cell)
    G = r.standard_normal((x.shape[0], *layer.output_shape))
    _, g, dx = grads(layer, REF, p, x, mask, G)

    assert_directional(lambda p_, x_: float(np.sum(run(layer, REF, p_, x_, mask)[0] * G)), x, p, dx, g, r)


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), data=st.data())
def test_the_numba_kernels_with_a_mask_against_the_twins_in_float32(cell, data):
    """Catches a compiled kernel that reads the mask at the wrong step (go_backwards) or does not
    carry a masked step's states, forward or backward."""
    layer, p, x, mask, r = case(data, cell)
    p = {n: v.astype(np.float32) for n, v in p.items()}
    x, mask = x.astype(np.float32), mask.astype(np.float32)
    G = r.standard_normal((x.shape[0], *layer.output_shape)).astype(np.float32)
    want, got = grads(layer, REF, p, x, mask, G), grads(layer, CPU, p, x, mask, G)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name in p:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-4)


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_a_padded_sequence_gives_what_its_unpadded_steps_give(cell, lengths, seed):
    """Keras's masking, as a user counts on it: ids padded with 0 at the end under
    Embedding(mask_zero=True) give each sample the last state of its own steps alone (a model on
    that sample's unpadded ids). Catches padding read as steps (pserver before masks) and a
    mask applied at the wrong end."""
    r = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), 6), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = r.integers(1, 9, n)

    def model(steps):
        inp = keras.Input((steps,), dtype="int64")
        return keras.Model(inp, CELLS[cell](3)(L.Embedding(9, 4, mask_zero=True)(inp)))
    padded = model(6)
    weights = [r.standard_normal(w.shape).astype(np.float32) for w in padded.get_weights()]
    padded.set_weights(weights)
    got = padded.predict(ids, verbose=0)
    for i, n in enumerate(lengths):
        alone = model(n)
        alone.set_weights(weights)
        want = alone.predict(ids[i:i + 1, :n], verbose=0)[0]
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


# Keras 3.15.1's outputs (TensorFlow 2.18 backend, CPU) of Embedding(10, d, mask_zero=True) then the
# layers named, for these ids and the i-th weight 0.5 sin(0.7 j + i) over its elements j, in Keras's
# weight order: bench/tf_baseline/keras_masks.py (in bench/tf_baseline's environment) prints them.
IDS = np.array([[1, 2, 3, 0, 0], [0, 0, 4, 5, 6], [7, 0, 8, 0, 9]])
KERAS = {
    "lstm": np.reshape([
        -0.122437, -0.04675, -0.085008, 0.091518, -0.046244, 0.028744, -0.046244, 0.028744,
        -0.046244, 0.028744, 0, 0, 0, 0, -0.123153, -0.045406, -0.084098, 0.092143, -0.046637,
        0.027232, -0.123856, -0.044035, -0.123856, -0.044035, -0.083195, 0.092761, -0.083195,
        0.092761, -0.047041, 0.025723], (3, 5, 2)),
    "gru_back": np.reshape([
        0, 0, 0, 0, -0.112785, 0.054189, -0.210744, -0.002475, -0.255841, -0.102846, -0.112692,
        0.053101, -0.210483, -0.001446, -0.256053, -0.102811, -0.256053, -0.102811, -0.256053,
        -0.102811, -0.112606, 0.051987, -0.112606, 0.051987, -0.210221, -0.000418, -0.210221,
        -0.000418, -0.256261, -0.102757], (3, 5, 2)),
    "rnn_last": np.reshape([
        0.05527, -0.371868, 0.059372, -0.367417, 0.063496, -0.362905], (3, 2)),
    "bi_lstm_seq": np.reshape([
        -0.122437, -0.04675, 0.131609, -0.009433, -0.085008, 0.091518, 0.057765, -0.054944,
        -0.046244, 0.028744, 0.019259, 0.003138, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        -0.123153, -0.045406, 0.131428, -0.009738, -0.084098, 0.092143, 0.057584, -0.054747,
        -0.046637, 0.027232, 0.019554, 0.004442, -0.123856, -0.044035, 0.131238, -0.010042, 0, 0, 0,
        0, -0.083195, 0.092761, 0.05741, -0.054543, 0, 0, 0, 0, -0.047041, 0.025723, 0.019863,
        0.00574], (3, 5, 4)),
    "gap": np.reshape([
        0.001408, 0.001587, 0.00102, 0.001421, 0.001582, 0.000999, 0.001434, 0.001576, 0.000977], (3, 3)),
    "attention": np.reshape([
        0.578182, 0.211352, -0.25488, -0.601238, 0.352524, 0.119394, -0.169888, -0.379269, 0.552192,
        0.362695, 0.002617, -0.358692], (3, 4)),
}
KERAS_LAYERS = {
    "lstm": (3, lambda e: L.LSTM(2, return_sequences=True)(e)),
    "gru_back": (3, lambda e: L.GRU(2, return_sequences=True, go_backwards=True)(e)),
    "rnn_last": (3, lambda e: L.SimpleRNN(2)(e)),
    "bi_lstm_seq": (3, lambda e: L.Bidirectional(L.LSTM(2, return_sequences=True))(e)),
    "gap": (3, lambda e: L.GlobalAveragePooling1D()(e)),
    "attention": (4, lambda e: L.GlobalAveragePooling1D()(
        L.Add()([e, L.MultiHeadAttention(num_heads=2, key_dim=2)(e, e)]))),
}


def keras_model(name):
    dim, head = KERAS_LAYERS[name]
    inp = keras.Input((5,), dtype="int32")
    model = keras.Model(inp, head(L.Embedding(10, dim, mask_zero=True)(inp)))
    model.set_weights([(0.5 * np.sin(np.arange(w.size) * 0.7 + i)).reshape(w.shape).astype(np.float32)
                       for i, w in enumerate(model.get_weights())])
    return model


@pytest.mark.parametrize("name", sorted(KERAS))
def test_masked_outputs_equal_keras_s_for_the_same_weights(name):
    """Catches a masked step that outputs anything but Keras's (the last state; zeros in a
    Bidirectional sequence), leading padding, go_backwards reading the mask reversed,
    GlobalAveragePooling1D averaging over padding, and attention to padded keys (the mask an
    attention's query and value carry, and Add passing it on)."""
    np.testing.assert_allclose(keras_model(name).predict(IDS, verbose=0), KERAS[name], atol=2e-6)


def test_a_masked_model_saves_loads_and_trains(tmp_path):
    """The mask is part of the saved graph (the recurrent node's last input, masked=True): a loaded
    model predicts bit for bit as the saved one; fit moves the weights and lowers the loss on
    a label that only the unpadded steps carry."""
    r = np.random.default_rng(0)
    lengths = r.integers(1, 8, 256)
    ids = np.where(np.arange(8)[None] < lengths[:, None], r.integers(1, 20, (256, 8)), 0)
    y = (lengths > 4).astype(np.float32)[:, None]      # the sequence's length: what padding hides
    inp = keras.Input((8,), dtype="int64")
    x = L.Embedding(20, 8, mask_zero=True)(inp)
    x = L.Bidirectional(L.GRU(8, return_sequences=True))(x)
    x = L.Dense(8, activation="relu")(x)                # passes the mask on
    x = L.LSTM(8, return_sequences=True)(x)
    model = keras.Model(inp, L.Dense(1, activation="sigmoid")(L.GlobalAveragePooling1D()(x)))
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    before = model.evaluate(ids, y, verbose=0)
    model.fit(ids, y, epochs=8, batch_size=32, verbose=0)
    after = model.evaluate(ids, y, verbose=0)
    assert after[0] < before[0] - 0.1 and after[1] > 0.85, (before, after)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(again.predict(ids, verbose=0), model.predict(ids, verbose=0))


def test_masking_zeros_the_steps_it_masks_and_the_layers_after_it_skip_them():
    """Masking(mask_value) on float sequences: a step of all mask_value is zeros out and skipped
    by an LSTM (its output equals the LSTM's on the other steps alone); a step with one other
    value is kept."""
    r = np.random.default_rng(1)
    x = r.standard_normal((3, 5, 2)).astype(np.float32)
    x[0, 3:] = -1.0
    x[1, :2] = -1.0
    x[2, 2] = [-1.0, 0.5]                              # one feature differs: kept
    out = np.asarray(L.Masking(mask_value=-1.0)(x))
    assert not out[0, 3:].any() and not out[1, :2].any() and np.array_equal(out[2], x[2])
    np.testing.assert_array_equal(out[0, :3], x[0, :3])
    inp = keras.Input((5, 2))
    model = keras.Model(inp, L.LSTM(3)(L.Masking(mask_value=-1.0)(inp)))
    last = model.predict(x, verbose=0)
    alone_in = keras.Input((3, 2))
    alone = keras.Model(alone_in, L.LSTM(3)(alone_in))
    alone.set_weights(model.get_weights())
    np.testing.assert_allclose(last[0], alone.predict(x[:1, :3], verbose=0)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last[1], alone.predict(x[1:2, 2:], verbose=0)[0], rtol=1e-5, atol=1e-6)


def test_a_layer_that_does_not_support_masking_drops_the_mask_with_keras_s_warning():
    """As Keras 3: Flatten after a masked Embedding warns, and an LSTM after it reads every step."""
    inp = keras.Input((4,), dtype="int64")
    with pytest.warns(UserWarning, match="does not support masking"):
        flat = L.Flatten()(L.Embedding(5, 2, mask_zero=True)(inp))
    assert flat.mask is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # Dense passes it on: no warning
        dense = L.Dense(3)(L.Embedding(5, 2, mask_zero=True)(inp))
    assert dense.mask is not None


def test_mask_refusals_are_one_line():
    """A mask of the wrong shape, or a layer called with and without one."""
    seq = Symbolic((None, 3, 2))
    for make, message in [
            (lambda: LSTM(2)(seq, mask=Symbolic((None, 4))), r"mask must be \(batch, steps\)"),
            (lambda: Bidirectional(GRU(2))(seq, mask=Symbolic((None, 2))), r"mask must be \(batch, steps\)"),
            (lambda: L.GlobalAveragePooling1D()(seq, mask=Symbolic((None, 2))), r"mask must be"),
            (lambda: L.Masking()(Symbolic((None, 3))), "takes sequences")]:
        with pytest.raises(ConfigError, match=message) as e:
            make()
        assert "\n" not in str(e.value)
    lstm = LSTM(2)
    lstm(seq, mask=Symbolic((None, 3)))
    with pytest.raises(ConfigError, match="with and without"):
        lstm(seq)


def test_a_layer_of_your_own_passes_or_makes_a_mask_as_keras_s():
    """supports_masking = True passes the input's mask on; compute_mask (made with ops) makes the
    output's, as Keras 3's (defining it is supporting masks). Catches a user's compute_mask
    ignored (the LSTM after it would read every step) and a mask passed where Keras drops it."""
    class Passes(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True

        def call(self, x):
            return x * 2.0

    class KeepsFirstTwo(keras.layers.Layer):
        def call(self, x):
            return x

        def compute_mask(self, inputs, previous_mask):
            return previous_mask * np.array([1, 1, 0, 0, 0], np.float32)     # the first two steps

    class Plain(keras.layers.Layer):
        def call(self, x):
            return x

    inp = keras.Input((5,), dtype="int64")
    e = L.Embedding(9, 3, mask_zero=True)(inp)
    assert Passes()(e).mask is e.mask
    with pytest.warns(UserWarning, match="does not support masking"):
        assert Plain()(e).mask is None
    ids = np.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]])
    lstm = L.LSTM(2)
    model = keras.Model(inp, lstm(KeepsFirstTwo()(e)))
    two = keras.Input((2,), dtype="int64")
    alone = keras.Model(two, L.LSTM(2)(L.Embedding(9, 3)(two)))
    alone.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(ids, verbose=0), alone.predict(ids[:, :2], verbose=0), atol=1e-6)


def test_a_layer_whose_call_takes_a_mask_is_refused_on_a_masked_input():
    """Keras would pass the mask to call(x, mask=None); pserver does not: one line, not a silent
    difference."""
    class UsesMask(keras.layers.Layer):
        def call(self, x, mask=None):
            return x

    e = L.Embedding(9, 3, mask_zero=True)(keras.Input((5,), dtype="int64"))
    with pytest.raises(ConfigError, match="call takes mask="):
        UsesMask()(e)
    UsesMask()(L.Embedding(9, 3)(keras.Input((5,), dtype="int64")))     # no mask: fine
