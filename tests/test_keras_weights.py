"""Keras's sample_weight and class_weight (pserver.keras fit and evaluate, pserver.models.losses.
weighted): the loss sum(w_i * l_i) / n and its gradient, as Keras 3's "sum_over_batch_size"
reduction. Each test names the bug it catches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pserver.keras as keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers
from pserver.kernels import cpu, reference
from pserver.models import losses
from pserver.models.functional import Functional
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_fd

LOSSES = [(losses.SparseCategoricalCrossentropy(), 3), (losses.BinaryCrossentropy(), 1),
          (losses.MeanSquaredError(), 1)]


def _labels(loss, rng, n):
    if loss.task == "regression":
        return rng.normal(size=n)
    return rng.integers(0, 2 if isinstance(loss, losses.BinaryCrossentropy) else 3, n).astype(
        np.float64 if isinstance(loss, losses.BinaryCrossentropy) else np.int32)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(LOSSES), st.integers(1, 9), st.integers(0, 2**16),
       st.sampled_from(["few", "each", "zeros"]), st.sampled_from([reference, cpu]))
def test_a_weighted_loss_is_the_weighted_sum_of_each_sample_s_loss_over_n(loss_units, n, seed, kind, k):
    """Catches: dividing by the sum of the weights (Keras's default divides by n), a weight
    applied to the loss but not to its row's gradient (or twice), a kernel's row losses
    (row_loss) wrong or not doubled for MSE, a zero weight's rows counted."""
    loss, units = loss_units
    rng = np.random.default_rng(seed)
    out, y = rng.normal(size=(n, units)), _labels(loss, rng, n)
    sw = {"few": rng.choice([0.5, 2.0], n), "each": rng.uniform(0, 3, n),
          "zeros": np.where(rng.random(n) < 0.5, 0.0, 1.5)}[kind]
    dout = np.empty_like(out)
    value = losses.weighted(loss, k, out, y, dout, sw)
    each, grads = [], []
    for i in range(n):           # one sample at a time: its own loss and gradient
        d = np.empty_like(out[i:i + 1])
        each.append(loss(reference, out[i:i + 1], y[i:i + 1], d))
        grads.append(d[0])
    assert np.isclose(value, np.sum(sw * np.array(each)) / n, rtol=1e-10, atol=1e-12)
    assert np.allclose(dout, sw[:, None] * np.array(grads) / n, rtol=1e-10, atol=1e-12)


def test_weights_of_one_leave_the_loss_and_gradient_as_they_are():
    """Catches: weights of 1 computing the loss another way (a per-group sum), which differs
    in the last bits from today's unweighted mean."""
    rng = np.random.default_rng(0)
    out, y = rng.normal(size=(7, 3)).astype(np.float32), rng.integers(0, 3, 7).astype(np.int32)
    loss = losses.SparseCategoricalCrossentropy()
    d0, d1 = np.empty_like(out), np.empty_like(out)
    assert losses.weighted(loss, reference, out, y, d1, np.ones(7, np.float32)) == loss(reference, out, y, d0)
    assert np.array_equal(d0, d1)


def _graph():
    x = Symbolic((None, 4), name="x")
    return Functional(x, layers.Dense(3)(layers.Dense(5, activation="tanh")(x)))


def test_a_weighted_batch_s_gradient_equals_finite_differences_of_the_weighted_loss():
    """Catches: the model's gradient not weighted as its loss is (Functional.loss_and_grad
    passing the weights to one and not the other), y's weight column read as a label."""
    rng = np.random.default_rng(3)
    model = _graph()
    model.sample_weighted = True
    y = np.column_stack([rng.integers(0, 3, 6), [0.0, 2.0, 0.5, 1.0, 3.0, 0.0]])
    assert_fd(model, rng.normal(size=(6, 4)), y)


def blobs(n=192, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, d))
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(size=(n, d))).astype(np.float32), y


def _fit(x, y, w0=None, **kwargs):
    model = keras.Sequential([keras.Input(shape=(6,)), layers.Dense(8, activation="relu"),
                              layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if w0 is not None:
        model.set_weights(w0)
    kwargs.setdefault("epochs", 2)
    history = model.fit(x, y, batch_size=32, verbose=0, shuffle=False, **kwargs)
    return model, history.history


def test_fit_with_weights_of_one_equals_fit_without_and_class_weight_its_sample_weight():
    """Catches: the weight column changing the data's path (labels as floats, another
    batching), class_weight looked up by the wrong class or its missing classes not 1."""
    x, y = blobs()
    plain, h = _fit(x, y)
    w0 = plain.get_weights()
    plain, h = _fit(x, y, _initial(w0))
    ones, h1 = _fit(x, y, _initial(w0), sample_weight=np.ones(len(y)))
    assert h1 == h
    assert all(np.array_equal(a, b) for a, b in zip(plain.get_weights(), ones.get_weights()))
    by_class, hc = _fit(x, y, _initial(w0), class_weight={0: 3.0, 2: 0.25})
    per_sample = np.array([{0: 3.0, 2: 0.25}.get(c, 1.0) for c in y])
    by_sample, hs = _fit(x, y, _initial(w0), sample_weight=per_sample)
    assert hc == hs and hc["loss"] != h["loss"]
    assert all(np.array_equal(a, b) for a, b in zip(by_class.get_weights(), by_sample.get_weights()))


def _initial(w0):
    return [a.copy() for a in w0]


def test_evaluate_weighs_the_loss_and_not_accuracy_as_keras():
    """Catches: the weights dropped in evaluate, accuracy weighted (Keras 3 weighs only
    weighted_metrics), a validation_data's third item ignored."""
    x, y = blobs()
    model, _ = _fit(x, y)
    sw = np.where(y == 1, 3.0, 0.0)
    loss, acc = model.evaluate(x, y, verbose=0)
    wloss, wacc = model.evaluate(x, y, sample_weight=sw, verbose=0)
    each = [model.evaluate(x[i:i + 1], y[i:i + 1], verbose=0)[0] for i in range(len(y))]
    assert wacc == acc
    assert np.isclose(wloss, np.sum(sw * np.array(each)) / len(y), rtol=1e-6)
    _, h = _fit(x, y, _initial(model.get_weights()), validation_data=(x, y, sw), epochs=1)
    assert h["val_loss"] != _fit(x, y, _initial(model.get_weights()), validation_data=(x, y),
                                 epochs=1)[1]["val_loss"]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"sample_weight": np.ones(5), "class_weight": {0: 1.0}}, ConfigError, "not both"),
    ({"sample_weight": np.ones(5)}, DataError, "one weight per sample"),
    ({"sample_weight": np.full(192, np.nan)}, DataError, "NaN"),
    ({"class_weight": [1.0, 2.0]}, ConfigError, "class_weight must be a dict"),
])
def test_bad_weights_are_refused_in_one_line(kwargs, error, words):
    """Catches: weights of the wrong length broadcast (or silently cut) over the samples."""
    x, y = blobs()
    with pytest.raises(error, match=words):
        _fit(x, y, **kwargs)
