"""keras.regularizers on Dense, Conv2D and Embedding: the penalty in the loss (training's and
evaluate's, as Keras's), its gradient against finite differences, and the layers' configs
through model.save / load_model. Each test names the bug it catches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pserver.keras as keras
from pserver.errors import ConfigError
from pserver.keras import layers

R = keras.regularizers


def keras_penalty(reg, w):      # keras/src/regularizers/regularizers.py: L1, L2, L1L2
    w = w.astype(np.float64)
    return getattr(reg, "l1", 0.0) * np.sum(np.abs(w)) + getattr(reg, "l2", 0.0) * np.sum(w ** 2)


def models(l1, l2, regularized=True):
    """A Dense, a Conv2D and an Embedding model, each with weight regularizers (or, the same
    model, none)."""
    def reg(cls, *args):
        return cls(*args) if regularized else None
    dense = keras.Sequential([keras.Input(shape=(3,)),
                              layers.Dense(4, activation="tanh", kernel_regularizer=reg(R.L1L2, l1, l2),
                                           bias_regularizer=reg(R.L2, l2)),
                              layers.Dense(1, kernel_regularizer="l1" if regularized else None)])
    conv = keras.Sequential([keras.Input(shape=(4, 4, 1)),
                             layers.Conv2D(2, 3, activation="tanh", kernel_regularizer=reg(R.L2, l2),
                                           bias_regularizer=reg(R.L1, l1)),
                             layers.Flatten(), layers.Dense(1)])
    embed = keras.Sequential([keras.Input(shape=(3,), dtype="int32"),
                              layers.Embedding(5, 2, embeddings_regularizer=reg(R.L1L2, l1, l2)),
                              layers.Flatten(), layers.Dense(1)])
    return {"dense": dense, "conv": conv, "embed": embed}


def data(kind, rng, n=6):
    x = {"dense": lambda: rng.standard_normal((n, 3)), "conv": lambda: rng.standard_normal((n, 4, 4, 1)),
         "embed": lambda: rng.integers(0, 5, (n, 3))}[kind]()
    x = x if kind == "embed" else x.astype(np.float32)
    return x, rng.standard_normal((n, 1)).astype(np.float32)


def penalty(model, w) -> float:
    """Keras's sum of the weights' penalties, by the layers' own arguments."""
    total, views = 0.0, model._core.layout.views(w)
    for layer in model.layers:
        for arg, weight in (("kernel_regularizer", "kernel"), ("bias_regularizer", "bias"),
                            ("embeddings_regularizer", "embeddings")):
            reg = R.get(getattr(layer, arg, None), arg)
            if reg is not None:
                total += keras_penalty(reg, views[f"{layer.name}/{weight}"])
    return total


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["dense", "conv", "embed"]), st.integers(0, 2**31), st.floats(0.0, 0.5),
       st.floats(0.0, 0.5))
def test_the_penalty_joins_the_loss_and_its_gradient_matches_finite_differences(kind, seed, l1, l2):
    """Catches: a penalty left out of the loss or the gradient, L2's gradient without its 2,
    L1's sign wrong, a regularizer put on another tensor (the bias's on the kernel)."""
    model, plain = models(l1, l2)[kind], models(l1, l2, regularized=False)[kind]
    for m in (model, plain):
        m.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(seed)
    x, y = data(kind, rng)
    core = model._core
    w = core.init_params(seed)
    w += np.where(np.abs(w) < 1e-2, 0.05, 0).astype(np.float32)       # away from L1's kink
    g = np.empty_like(w)
    loss = core.loss_and_grad(w, x, y, g, seed=1)
    want = plain._core.evaluate(w, x, y)["loss"] + penalty(model, w)
    assert loss == pytest.approx(want, rel=1e-5)
    assert core.evaluate(w, x, y)["loss"] == pytest.approx(want, rel=1e-5)
    finite_differences(core, w, x, y, g, rng)


def finite_differences(core, w, x, y, g, rng, eps=1e-2):
    for i in rng.choice(w.size, size=min(12, w.size), replace=False):
        up, down = w.copy(), w.copy()
        up[i] += eps
        down[i] -= eps
        fd = (core.loss_and_grad(up, x, y, np.empty_like(w), seed=1)
              - core.loss_and_grad(down, x, y, np.empty_like(w), seed=1)) / (2 * eps)
        assert g[i] == pytest.approx(fd, rel=2e-2, abs=2e-3), i


@settings(max_examples=9, deadline=None)
@given(st.sampled_from(["dense", "conv", "embed"]), st.integers(0, 2**31), st.floats(0.0, 0.5),
       st.floats(0.0, 0.5))
def test_an_activity_regularizer_is_keras_s_penalty_over_the_batch_with_its_gradient(kind, seed, l1, l2):
    """Keras's: the penalty of the layer's output divided by the batch size. Catches: no
    division by the batch (a loss n times too large), the penalty on the input or before the
    activation, its gradient not reaching the weights below (finite differences)."""
    # L1's kink: an output near 0 moved across it by the finite difference. An Embedding's outputs
    # are its weights, kept away from 0 below; the others' outputs are not, so they take l2 only.
    activity = R.L1L2(l1 if kind == "embed" else 0.0, l2)
    first = {"dense": layers.Dense(4, activation="tanh", activity_regularizer=activity),
             "conv": layers.Conv2D(2, 3, activation="tanh", activity_regularizer=activity),
             "embed": layers.Embedding(5, 2, activity_regularizer=activity)}[kind]
    shape, dtype = {"dense": ((3,), "float32"), "conv": ((4, 4, 1), "float32"),
                    "embed": ((3,), "int32")}[kind]
    rest = [] if kind == "dense" else [layers.Flatten()]
    model = keras.Sequential([keras.Input(shape=shape, dtype=dtype), first, *rest, layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(seed)
    x, y = data(kind, rng)
    core = model._core
    w = core.init_params(seed)
    w += np.where(np.abs(w) < 1e-2, 0.05, 0).astype(np.float32)
    g = np.empty_like(w)
    loss = core.loss_and_grad(w, x, y, g, seed=1)
    assert core.evaluate(w, x, y)["loss"] == pytest.approx(loss, rel=1e-5)
    if kind == "dense":
        kernel, bias = core.layout.views(w)["dense/kernel"], core.layout.views(w)["dense/bias"]
        h = np.tanh(x.astype(np.float64) @ kernel + bias)
        k2, b2 = core.layout.views(w)["dense_1/kernel"], core.layout.views(w)["dense_1/bias"]
        mse = np.mean((h @ k2 + b2 - y) ** 2)
        assert loss == pytest.approx(mse + keras_penalty(activity, h) / len(x), rel=1e-5)
    finite_differences(core, w, x, y, g, rng, eps=1e-3)


def test_a_fit_reports_the_loss_with_the_penalty_and_trains_on_its_gradient():
    """Keras's SGD in NumPy, one full batch per epoch: the epoch's loss is the regularized one
    at the step's weights. Catches the loop's loss, or the shards' update, without the penalty."""
    model = models(0.01, 0.05)["dense"]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data("dense", np.random.default_rng(3), n=16)
    w = np.concatenate([a.ravel() for a in model.get_weights()]).astype(np.float32)
    want = []
    for _ in range(2):
        g = np.empty_like(w)
        want.append(model._core.loss_and_grad(w, x, y, g))
        w = w - np.float32(0.1) * g
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert history.history["loss"] == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(np.concatenate([a.ravel() for a in model.get_weights()]), w, rtol=1e-5,
                               atol=1e-6)
    assert want[0] > model._core.evaluate(w, x, y)["loss"] - penalty(model, w) + 1e-4


def test_regularizers_round_trip_through_save_and_load_model(tmp_path):
    """Catches: a regularizer lost by get_config (the loaded model trains without it), or a
    model file with one that load_model cannot read."""
    for kind, model in models(0.02, 0.03).items():
        model.compile(optimizer="adam", loss="mse")
        x, y = data(kind, np.random.default_rng(0))
        model.save(tmp_path / f"{kind}.npz")
        again = keras.models.load_model(tmp_path / f"{kind}.npz")
        assert [layer.get_config() for layer in again.layers][1:] == \
            [layer.get_config() for layer in model.layers][1:]
        assert again.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), rel=1e-6)


@pytest.mark.parametrize("make, message", [
    (lambda: layers.Dense(2, activation="softmax", activity_regularizer="l2"), "the loss fuses it"),
    (lambda: layers.Dense(2, kernel_regularizer=lambda w: 0.0), "kernel_regularizer: .* is not supported"),
    (lambda: layers.Conv2D(2, 3, bias_regularizer="l3"), "bias_regularizer: 'l3' is not supported"),
    (lambda: R.L2(-1.0), "l2 must be a number >= 0"),
    (lambda: layers.Embedding(None, 2, sparse=True, embeddings_regularizer="l2"), "sparse=True"),
])
def test_what_is_not_supported_is_refused_naming_it(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_keras_s_strings_give_keras_s_defaults():
    """Catches: "l1_l2" at 0.01 (Keras's get gives L1L2() at 0 and 0), L1 and L2 not at 0.01."""
    assert (R.get("l1", "").l1, R.get("l2", "").l2) == (0.01, 0.01)
    assert (R.get("l1_l2", "").l1, R.get("l1_l2", "").l2) == (0.0, 0.0)


def test_device_cuda_refuses_an_activity_regularizer_in_one_line():
    """Catches: the GPU model training without the output's penalty (its kernels have no
    hook for it); weight regularizers run there (tests/cuda_sim/check_model_cuda.py)."""
    from pserver.models import cuda_support
    model = keras.Sequential([keras.Input(shape=(3,)), layers.Dense(4, activity_regularizer="l2"),
                              layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ConfigError, match="has an activity_regularizer. Use --device cpu"):
        cuda_support.check(model._core.build())
