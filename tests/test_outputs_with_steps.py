"""Dense on inputs of rank > 2 and models whose output has steps, (n, ..., units): Dense equal to
the per-step loop of a flat Dense (hypothesis) and to finite differences in float64; the losses
and accuracy averaged over every element as Keras's; labels given per step (integers, one-hot, a
last axis of 1); keras.io's addition_rnn and a convolutional autoencoder trained with compile/fit;
refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.layers import Dense
from pserver.layers.base import Pass
from pserver.models import Functional, cuda_support
from tests.support.gradients import assert_fd
from tests.support.sequences import addition_data

L = keras.layers


def dense_on(shape, units, activation="tanh", loss="sparse_categorical_crossentropy"):
    x = keras.Input(shape=shape)
    return Functional(x, Dense(units, activation=activation)(x), loss=loss)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3), steps=st.lists(st.integers(1, 3), min_size=1, max_size=2), d=st.integers(1, 4),
       units=st.integers(1, 4), activation=st.sampled_from(["linear", "relu", "tanh", "sigmoid"]),
       seed=st.integers(0, 2**16))
def test_dense_on_steps_is_the_flat_dense_at_each_step(n, steps, d, units, activation, seed):
    """Forward and backward of Dense on (n, *steps, d) against the same weights applied to each
    step's (n, d) by a flat Dense, on the cpu kernels. Catches a kernel over the wrong axis, a
    reshape that copies (the output or a gradient lost), dkernel/dbias summed over samples only."""
    k, rng = get_backend("cpu"), np.random.default_rng(seed)
    deep, flat = Dense(units, activation=activation), Dense(units, activation=activation)
    deep.build_once((*steps, d))
    flat.build_once((d,))
    assert deep.output_shape == (*steps, units) and deep.kernel_shape() == (d, units)
    p = {w.name: rng.standard_normal(w.shape) for w in deep.weights()}
    x, dout = rng.standard_normal((n, *steps, d)), rng.standard_normal((n, *steps, units))
    out, dx = np.empty((n, *steps, units)), np.empty_like(x)
    g = {name: np.empty_like(v) for name, v in p.items()}
    deep.forward(k, p, x, out, {}, Pass())
    deep.backward(k, p, g, x, out, dout.copy(), dx, {})
    rows, drows = x.reshape(-1, d), dout.reshape(-1, units)
    want, dwant = np.empty((len(rows), units)), np.empty_like(rows)
    gwant = {name: np.empty_like(v) for name, v in p.items()}
    flat.forward(k, p, rows, want, {}, Pass())
    flat.backward(k, p, gwant, rows, want, drows.copy(), dwant, {})
    np.testing.assert_allclose(out.reshape(-1, units), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx.reshape(-1, d), dwant, rtol=1e-12, atol=1e-12)
    for name in p:
        np.testing.assert_allclose(g[name], gwant[name], rtol=1e-10, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(loss=st.sampled_from(["sparse_categorical_crossentropy", "binary_crossentropy", "mse"]),
       seed=st.integers(0, 2**16))
def test_a_model_with_steps_gradient_is_finite_differences(loss, seed):
    """Dense (tanh) then Dense to the output's units on (2, 3, 2) inputs, each loss averaged over the
    6 steps: the gradient against central differences in float64 (the NumPy twins). Catches a
    gradient scaled per sample instead of per element, or a step's labels read against another's."""
    rng = np.random.default_rng(seed)
    units = 3 if loss.startswith("sparse") else 1
    x = keras.Input(shape=(3, 2))
    model = Functional(x, Dense(units)(Dense(3, activation="tanh")(x)), loss=loss)
    xs = rng.standard_normal((2, 3, 2))
    y = rng.integers(0, 3, (2, 3)) if units == 3 else (rng.random((2, 3, 1)) > 0.5).astype(np.float64)
    assert_fd(model, xs, model.labels(y), seed=seed)


def test_a_softmax_dense_on_steps_is_keras_s_loss_and_accuracy():
    """Dense(4, softmax) on (n, 5, 3) with one-hot labels (n, 5, 4): evaluate is Keras's
    categorical cross-entropy and accuracy averaged over all n x 5 steps (Keras 3.15 gave the same
    on these weights: 1.6129 / 0.275 for a seeded case), predict the softmax over the last axis.
    Catches a mean over samples (5x the loss), one-hot labels not decoded per step, a softmax
    over the wrong axis."""
    rng = np.random.default_rng(1)
    inputs = keras.Input(shape=(5, 3))
    model = keras.Model(inputs, L.Dense(4, activation="softmax")(inputs))
    model.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"])
    x, classes = rng.normal(size=(40, 5, 3)).astype(np.float32), rng.integers(0, 4, (40, 5))
    kernel, bias = model.get_weights()
    logits = x.astype(np.float64) @ kernel + bias
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    want_loss = -np.mean(np.log(np.take_along_axis(prob, classes[..., None], -1)))
    loss, accuracy = model.evaluate(x, np.eye(4, dtype=np.float32)[classes], verbose=0)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert accuracy == pytest.approx(np.mean(prob.argmax(-1) == classes), abs=1e-12)
    np.testing.assert_allclose(model.predict(x, verbose=0), prob, rtol=1e-5, atol=1e-6)
    assert model.evaluate(x, classes, verbose=0) == [loss, accuracy]      # classes per step, as given


def test_keras_io_s_addition_rnn_learns_with_fit():
    """keras.io's addition_rnn: LSTM -> RepeatVector(4) -> LSTM(return_sequences=True) ->
    Dense(12, softmax), one-hot answers (n, 4, 12), categorical_crossentropy, Adam, accuracy per
    character; 2,000 samples, 2 epochs of compile/fit (48 units, not 128, and a rate of 0.01: 7 s of
    CPU). Catches an output with steps that does not train (gradients not reaching the per-step head
    or the recurrence) or an accuracy over samples (up to 4x): the loss falls and the accuracy rises,
    well above chance (1/12). Measured: loss 1.77 then 1.55, accuracy 0.405 then 0.445 (each
    position's most frequent character alone gives 0.427)."""
    rng = np.random.default_rng(0)
    x, classes = addition_data(2000, rng)
    model = keras.Sequential([keras.Input(shape=(7, 12)), L.LSTM(48), L.RepeatVector(4),
                              L.LSTM(48, return_sequences=True), L.Dense(12, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="categorical_crossentropy",
                  metrics=["accuracy"])
    h = model.fit(x, keras.utils.to_categorical(classes, 12), batch_size=32, epochs=2, verbose=0)
    (loss0, loss1), (acc0, acc1) = h.history["loss"], h.history["accuracy"]
    assert loss1 < loss0 and 0.3 < acc0 < acc1 <= 1, h.history
    assert model.predict(x[:3], verbose=0).shape == (3, 4, 12)


def test_a_convolutional_autoencoder_trains_per_pixel():
    """Conv2D -> Conv2DTranspose -> Conv2D(1, sigmoid) on (n, 8, 8, 1) images with
    binary_crossentropy per pixel (labels the images themselves: bars), with (n, 8, 8, 1) or (n, 8, 8)
    labels: the loss falls (measured 0.63, 0.45, 0.25). Catches labels of an image output not taken
    per pixel, or a per-pixel gradient that does not train."""
    rng = np.random.default_rng(0)
    bars = (np.arange(8)[:, None] + np.zeros((1, 8), int)) % rng.integers(2, 5, (128, 1, 1)) == 0
    images = np.where(rng.random((128, 1, 1)) < 0.5, bars, bars.transpose(0, 2, 1))
    images = images[..., None].astype(np.float32)
    model = keras.Sequential([keras.Input(shape=(8, 8, 1)),
                              L.Conv2D(8, 3, activation="relu", padding="same", strides=2),
                              L.Conv2DTranspose(8, 3, strides=2, activation="relu", padding="same"),
                              L.Conv2D(1, 3, activation="sigmoid", padding="same")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    h = model.fit(images, images, batch_size=16, epochs=3, verbose=0)
    assert h.history["loss"][-1] < 0.8 * h.history["loss"][0], h.history
    assert model.evaluate(images, images[..., 0], verbose=0) == pytest.approx(
        model.evaluate(images, images, verbose=0))


def test_binary_crossentropy_takes_soft_labels_as_keras_does():
    """keras.io's denoising autoencoder fits grey pixels (labels in [0, 1], not 0/1), as Keras's
    binary_crossentropy takes them: the loss evaluate reports is the mean over pixels of
    -(y log p + (1 - y) log(1 - p)) from predict's p, one fit step moves it down, and labels
    outside [0, 1] or NaN are still refused. Catches labels refused for not being whole
    (it was: "label out of range: y[0, 0] = 0.3") or rounded to 0/1 on their way."""
    rng = np.random.default_rng(0)
    images = rng.random((64, 6, 6, 1)).astype(np.float32)
    model = keras.Sequential([keras.Input(shape=(6, 6, 1)),
                              L.Conv2D(4, 3, activation="relu", padding="same"),
                              L.Conv2D(1, 3, activation="sigmoid", padding="same")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    p = model.predict(images, verbose=0).astype(np.float64)
    want = np.mean(-(images * np.log(p) + (1 - images) * np.log(1 - p)))
    assert model.evaluate(images, images, verbose=0) == pytest.approx(want, rel=1e-5)
    h = model.fit(images, images, batch_size=64, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0], h.history
    flat = keras.Sequential([keras.Input(shape=(3,)), L.Dense(1, activation="sigmoid")])
    flat.compile(optimizer="sgd", loss="binary_crossentropy")
    x, soft = rng.random((8, 3)).astype(np.float32), np.linspace(0, 1, 8).astype(np.float32)
    q = flat.predict(x, verbose=0)[:, 0].astype(np.float64)
    assert flat.evaluate(x, soft, verbose=0) == pytest.approx(
        np.mean(-(soft * np.log(q) + (1 - soft) * np.log(1 - q))), rel=1e-5)
    for bad in (1.5, -0.1, np.nan):
        y = soft.copy()
        y[2] = bad
        with pytest.raises(ValueError, match=r"label out of range: y\[2\]"):
            flat.evaluate(x, y, verbose=0)


def test_what_outputs_with_steps_refuse():
    """Each refusal in one line: sample weights, several outputs with steps, a label per sample for
    an output with steps, a label out of range at a step, sparse tables, the GPU. Catches a weight
    per sample read as a weight per step, or labels of the wrong shape trained silently."""
    inputs = keras.Input(shape=(5, 3))
    model = keras.Model(inputs, L.Dense(4, activation="softmax")(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = np.zeros((8, 5, 3), np.float32), np.zeros((8, 5), np.int64)
    for kwargs in ({"sample_weight": np.ones(8)}, {"class_weight": {0: 1.0}}):
        with pytest.raises(ConfigError, match="without steps") as e:
            model.fit(x, y, verbose=0, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"y has shape \(8,\); x has 8 rows and 5 labels per sample"):
        model.evaluate(x, y[:, 0], verbose=0)
    with pytest.raises(ValueError, match=r"label out of range: y\[2, 3\] = 4"):
        bad = y.copy()
        bad[2, 3] = 4
        model.evaluate(x, bad, verbose=0)
    with pytest.raises(ConfigError, match="outputs with steps are supported for a model with one output"):
        Functional(inputs, [Dense(2)(inputs), Dense(3)(inputs)]).build()
    ids = keras.Input(shape=(3,), dtype="int64")
    with pytest.raises(ConfigError, match=r"sparse tables has a flat output .* \(its output is \(3, 2\)"):
        keras.Model(ids, L.Dense(2)(L.Embedding(None, 4, sparse=True)(ids)))._core.build()
    # An output with steps (Dense at each step, or a Reshape) runs on the GPU, its loss on the
    # host, each step (tests/cuda_sim/check_graph_cuda.py runs both).
    for per_step in (dense_on((5, 3), 4).build(),
                     Functional(inputs, L.Reshape((5, 4))(Dense(20)(L.Flatten()(inputs)))).build()):
        cuda_support.check(per_step)
        assert not cuda_support.loss_on_device(per_step)
    assert cuda_support.loss_on_device(Functional(inputs, Dense(2)(L.Flatten()(Dense(4)(inputs)))).build())
