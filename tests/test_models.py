"""Models: gradients against finite differences, cpu against reference, layouts, errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pserver.errors import ConfigError
from pserver.models import Functional, Layout, Model, Sequential, make_model
from pserver.optim import make_optimizer
from tests.support.gradients import assert_fd

# The dense built-ins take flat inputs of any width; cnn is tested with images in test_layers.
DENSE = ("mlp", "logreg", "linreg")
# Small sizes with distinct widths, so a transposed gradient has the wrong shape or values.
IN, CLASSES, HIDDEN = 5, 3, (4, 6)


def small(name, backend="reference"):
    return make_model(name, IN, CLASSES, hidden=HIDDEN, backend=backend)


def batch(model, n, rng, dtype=np.float32):
    x = rng.standard_normal((n, model.in_features)).astype(dtype)
    if model.task == "classification":
        return x, rng.integers(0, model.num_classes, n).astype(np.int32)
    return x, rng.standard_normal(n).astype(dtype)


def random_params(model, rng, dtype=np.float32):
    # Nonzero biases too, so that bias gradients and ReLU masks are exercised.
    return (rng.standard_normal(model.layout.total) * 0.7).astype(dtype)


# -- gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("n", [1, 7])
def test_gradient_matches_central_differences(name, n):
    """Every coordinate, in float64 through the reference kernels: a missing 1/n, a
    transposed weight gradient or a wrong ReLU mask all fail this by far more than the tolerance."""
    model, rng = small(name), np.random.default_rng(n)
    w = random_params(model, rng, np.float64)
    x, y = batch(model, n, rng, np.float64)
    grad = np.full_like(w, np.nan)
    loss = model.loss_and_grad(w, x, y, grad)
    eps, fd = 1e-6, np.empty_like(w)
    for j in range(w.size):
        wp, wm = w.copy(), w.copy()
        wp[j] += eps
        wm[j] -= eps
        fd[j] = (model.loss_and_grad(wp, x, y, np.empty_like(w))
                 - model.loss_and_grad(wm, x, y, np.empty_like(w))) / (2 * eps)
    assert np.isfinite(loss)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", DENSE)
def test_gradient_float32_cpu_spot_check(name):
    """The numba path on its own, in float32, on a few coordinates of a mid-size model."""
    model = make_model(name, 20, 4, hidden=(16, 8), backend="cpu")
    rng = np.random.default_rng(3)
    w, (x, y) = random_params(model, rng), batch(model, 16, rng)
    grad = np.empty_like(w)
    model.loss_and_grad(w, x, y, grad)
    eps = 1e-3  # big enough to beat float32 rounding, small enough to rarely cross a ReLU kink
    for j in rng.choice(w.size, 8, replace=False):
        wp, wm = w.copy(), w.copy()
        wp[j] += eps
        wm[j] -= eps
        fd = (model.loss_and_grad(wp, x, y, np.empty_like(w))
              - model.loss_and_grad(wm, x, y, np.empty_like(w))) / (2 * eps)
        assert grad[j] == pytest.approx(fd, rel=1e-2, abs=1e-3), j


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("n", [1, 33])
def test_cpu_equals_reference(name, n):
    cpu_m, ref_m = small(name, "cpu"), small(name, "reference")
    rng = np.random.default_rng(n)
    w, (x, y) = random_params(cpu_m, rng), batch(cpu_m, n, rng)
    g_c, g_r = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c, loss_r = cpu_m.loss_and_grad(w, x, y, g_c), ref_m.loss_and_grad(w, x, y, g_r)
    assert loss_c == pytest.approx(loss_r, rel=1e-5)
    np.testing.assert_allclose(g_c, g_r, rtol=1e-4, atol=1e-6)


def test_gradient_is_written_in_place_and_buffers_are_reused():
    model, rng = small("mlp", "cpu"), np.random.default_rng(0)
    w = model.init_params(0)
    x1, y1 = batch(model, 8, rng)
    x2, y2 = batch(model, 8, rng)
    g1, g2, again = (np.full_like(w, np.nan) for _ in range(3))
    model.loss_and_grad(w, x1, y1, g1)
    model.loss_and_grad(w, x2, y2, g2)   # same batch size: the same buffers, reused
    model.loss_and_grad(w, x1, y1, again)
    assert np.isfinite(g1).all() and not np.array_equal(g1, g2)
    np.testing.assert_array_equal(g1, again)


def test_threads_do_not_share_buffers():
    model, rng = small("mlp", "cpu"), np.random.default_rng(1)
    w = model.init_params(1)
    batches = [batch(model, 16, rng) for _ in range(4)]
    want = []
    for x, y in batches:
        want.append(np.empty_like(w))
        model.loss_and_grad(w, x, y, want[-1])
    got = [np.empty_like(w) for _ in batches]

    def run(i):
        for _ in range(50):
            model.loss_and_grad(w, *batches[i], got[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, h in zip(got, want):
        np.testing.assert_array_equal(g, h)


# -- layouts and init -------------------------------------------------------------------------

def test_layouts():
    mlp = make_model("mlp", 784, 10)
    assert [(t.name, t.shape) for t in mlp.layout.tensors] == [
        ("dense/kernel", (784, 256)), ("dense/bias", (256,)), ("dense_1/kernel", (256, 256)),
        ("dense_1/bias", (256,)), ("dense_2/kernel", (256, 10)), ("dense_2/bias", (10,))]
    assert mlp.layout.total == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert (mlp.task, mlp.num_classes, mlp.in_features) == ("classification", 10, 784)
    logreg = make_model("logreg", 7, 3)
    assert logreg.layout == Layout.of([("dense/kernel", (7, 3)), ("dense/bias", (3,))])
    linreg = make_model("linreg", 7, 99)
    assert linreg.layout == Layout.of([("dense/kernel", (7, 1)), ("dense/bias", (1,))])
    assert (linreg.task, linreg.num_classes) == ("regression", 0)
    assert all(isinstance(m, Model) for m in (mlp, logreg, linreg))


@pytest.mark.parametrize("name", DENSE)
def test_init_params_deterministic(name):
    model = make_model(name, 784, 10)
    a, b, c = model.init_params(7), model.init_params(7), model.init_params(8)
    assert a.dtype == np.float32 and a.shape == (model.layout.total,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    views = model.layout.views(a)
    assert all(not views[t.name].any() for t in model.layout.tensors if t.name.endswith("/bias"))


def test_init_scale():
    views = make_model("mlp", 784, 10).layout.views(make_model("mlp", 784, 10).init_params(0))
    assert views["dense/kernel"].std() == pytest.approx(np.sqrt(2 / 784), rel=0.02)  # He, into a ReLU
    assert views["dense_1/kernel"].std() == pytest.approx(np.sqrt(2 / 256), rel=0.02)
    assert views["dense_2/kernel"].std() == pytest.approx(np.sqrt(1 / 256), rel=0.05)  # LeCun, the logits


# -- evaluate ---------------------------------------------------------------------------------

def logits_by_hand(model, w, x):
    """The dense models' forward pass in plain NumPy: Dense layers dense, dense_1, ... with a ReLU
    between them (mlp), or one Dense layer (logreg)."""
    views = model.layout.views(w)
    layers = [k.removesuffix("/kernel") for k in views if k.endswith("/kernel")]
    h = x.astype(np.float64)
    for i, name in enumerate(layers):
        h = h @ views[f"{name}/kernel"] + views[f"{name}/bias"]
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    return h


@pytest.mark.parametrize("name", ["mlp", "logreg"])
def test_evaluate_classification(name):
    """Fails for an accuracy taken from anything but the model's logits (for the mlp, e.g. a hidden
    layer's output): labels the parameters predict on 40 of 50 samples must give >= 0.8, 4 chances
    in 10 above chance (1/3), and exactly the share of matching argmaxes."""
    model, rng = small(name, "cpu"), np.random.default_rng(0)
    w, (x, y) = random_params(model, rng), batch(model, 50, rng)
    logits = logits_by_hand(model, w, x)
    y[:40] = logits[:40].argmax(1)          # data these parameters have learned, the rest random
    res = model.evaluate(w, x, y, batch_size=16)   # 3 full batches and a short one
    assert set(res) == {"loss", "accuracy"}
    assert res["loss"] == pytest.approx(model.loss_and_grad(w, x, y, np.empty_like(w)), rel=1e-5)
    assert res["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == y))
    assert res["accuracy"] >= 0.8


def test_evaluate_regression_r2():
    model, rng = make_model("linreg", 4, 0), np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    w = model.init_params(0)
    views = model.layout.views(w)
    y = (x @ views["dense/kernel"][:, 0] + 0.5).astype(np.float32)
    views["dense/bias"][:] = 0.5
    perfect = model.evaluate(w, x, y, batch_size=7)
    assert set(perfect) == {"loss", "r2"}
    assert perfect["r2"] == pytest.approx(1.0, abs=1e-6) and perfect["loss"] < 1e-10
    views["dense/kernel"][:] = 0
    views["dense/bias"][:] = y.mean()    # predicting the mean explains nothing
    assert model.evaluate(w, x, y)["r2"] == pytest.approx(0.0, abs=1e-6)


# -- errors -----------------------------------------------------------------------------------

def test_make_model_errors():
    with pytest.raises(ConfigError,
                       match="--model: unknown model 'x'; choose one of mlp, logreg, linreg, cnn, lr, fm, "
                             "wide_deep, deepfm, dcn, dlrm, or FILE.py"):
        make_model("x", 4, 2)
    for hidden in [(256, 0), (-3,), (), (2.5,)]:
        with pytest.raises(ConfigError, match="--hidden"):
            make_model("mlp", 4, 2, hidden=hidden)
    with pytest.raises(ConfigError, match="--device"):
        make_model("mlp", 4, 2, backend="tpu")
    with pytest.raises(ConfigError, match="classes"):
        make_model("logreg", 4, 1)
    with pytest.raises(ConfigError, match="input features"):
        make_model("linreg", 0, 0)
    make_model("logreg", 4, 2, hidden=(0,))   # hidden means nothing to logreg


def test_bad_batches():
    model, rng = small("mlp"), np.random.default_rng(0)
    w = model.init_params(0)
    g = np.empty_like(w)
    x, y = batch(model, 4, rng)
    with pytest.raises(ValueError, match="x has shape"):
        model.loss_and_grad(w, x[:, :-1], y, g)
    with pytest.raises(ValueError, match="x has shape"):
        model.loss_and_grad(w, x[:0], y[:0], g)
    with pytest.raises(ValueError, match="y has shape"):
        model.loss_and_grad(w, x, y[:-1], g)
    with pytest.raises(ValueError, match="w has shape"):
        model.loss_and_grad(w[:-1], x, y, g)
    with pytest.raises(ValueError, match="label out of range"):
        model.loss_and_grad(w, x, y + CLASSES, g)
    with pytest.raises(ValueError, match="grad_out must be a C-contiguous"):
        model.loss_and_grad(w, x, y, np.empty(2 * w.size, np.float32)[::2])


# -- it learns --------------------------------------------------------------------------------

def test_logreg_with_sgd_learns_a_separable_problem():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 256).astype(np.int32)
    x = (rng.standard_normal((256, 2)) + np.where(y[:, None] == 1, 3.0, -3.0)).astype(np.float32)
    model = make_model("logreg", 2, 2)
    opt = make_optimizer("sgd", model.layout.total, lr=0.5)
    w, g = model.init_params(0), np.empty(model.layout.total, np.float32)
    first = model.evaluate(w, x, y)
    for t in range(60):
        idx = rng.choice(256, 32, replace=False)
        model.loss_and_grad(w, x[idx], y[idx], g)
        opt.step(w, g, t)
    last = model.evaluate(w, x, y)
    assert last["loss"] < 0.1 * first["loss"] and last["loss"] < 0.05
    assert last["accuracy"] >= 0.99


def test_mlp_with_adam_fits_xor():
    # XOR is not linearly separable: only the hidden ReLU layers can fit it.
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (512, 2)).astype(np.float32)
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).astype(np.int32)
    model = make_model("mlp", 2, 2, hidden=(32, 32))
    opt = make_optimizer("adam", model.layout.total, lr=1e-2)
    w, g = model.init_params(0), np.empty(model.layout.total, np.float32)
    for t in range(300):
        idx = rng.choice(512, 64, replace=False)
        model.loss_and_grad(w, x[idx], y[idx], g)
        opt.step(w, g, t)
    assert model.evaluate(w, x, y)["accuracy"] > 0.95


# -- Sequential: the chain case of the graph model --------------------------------------------

def _chain(name):
    """The layers of the seeds' CNN, the MLP, or a chain of Embedding, Flatten and Dropout."""
    from pserver.layers import Dense, Dropout, Embedding, Flatten
    if name == "drop":
        return Sequential([Embedding(50, 8, input_shape=(6,)), Flatten(), Dense(32, activation="relu"),
                           Dropout(0.5, seed=3), Dense(10)], name="drop")
    return make_model(name, (28, 28, 1) if name == "cnn" else (784,), 10)


def _twin(model):
    """The same chain written Functionally: fresh layers of the same configs called in order."""
    from pserver.layers import deserialize, serialize
    from pserver.ops.core import Symbolic
    h = x = Symbolic((None, *model.input_shape), "int32" if model._takes_ids else "float32")
    for layer in model.layers:
        h = deserialize(serialize(layer, model.name))(h)
    return Functional(x, h, name=model.name)


def _chain_batch(model, n, rng):
    if model._takes_ids:
        return rng.integers(0, 50, (n, *model.input_shape)), rng.integers(0, 10, n)
    return rng.random((n, *model.input_shape), dtype=np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("name", ["cnn", "mlp", "drop"])
def test_a_sequential_equals_its_functional_twin(name):
    """A Sequential is its layers called in a chain: the same layout (names, shapes, order of first
    use), initial weights, loss and gradient, bit for bit, as the Functional model of the same
    chain, with the same dropout draws for the same step seed; another step seed draws another
    mask. Catches: a Sequential whose layout order or names differ from the graph's, or its
    dropout seed drawn differently (or ignored: the last assert)."""
    seq = _chain(name)
    twin = _twin(seq)
    assert [(t.name, t.shape) for t in seq.layout.tensors] == [(t.name, t.shape) for t in twin.layout.tensors]
    w = seq.init_params(4)
    assert np.array_equal(w, twin.init_params(4))
    x, y = _chain_batch(seq, 64, np.random.default_rng(0))
    g_seq, g_twin = np.full_like(w, np.nan), np.full_like(w, np.nan)
    assert seq.loss_and_grad(w, x, y, g_seq, seed=11) == twin.loss_and_grad(w, x, y, g_twin, seed=11)
    assert np.array_equal(g_seq, g_twin) and np.isfinite(g_seq).all()
    other = np.empty_like(w)
    seq.loss_and_grad(w, x, y, other, seed=12)
    assert np.array_equal(other, g_seq) == (name != "drop")


@pytest.mark.parametrize("layers", ["conv", "drop"])
def test_sequential_gradient_matches_central_differences(layers):
    """Float64 through the reference kernels, a fixed dropout seed: a small CNN (Conv2D, pooling,
    Flatten, Dense) and an Embedding, Flatten, Dropout chain. Catches a Flatten whose gradient is
    lost or misshapen on its way down, a dropout mask that differs between forward and backward,
    and an Embedding's gradient written to the wrong rows."""
    from pserver.layers import Conv2D, Dense, Dropout, Embedding, Flatten, MaxPooling2D
    rng = np.random.default_rng(5)
    if layers == "conv":
        model = Sequential([Conv2D(2, 3, activation="relu", input_shape=(6, 6, 1)), MaxPooling2D(), Flatten(),
                            Dense(4, activation="relu"), Dense(3)])
        x = rng.normal(size=(3, 6, 6, 1))
    else:
        model = Sequential([Embedding(7, 3, input_shape=(4,)), Flatten(), Dense(5, activation="tanh"),
                            Dropout(0.5), Dense(3)])
        x = rng.integers(0, 7, (3, 4))
    assert_fd(model, x, np.array([0, 2, 1]), step=9)


def test_a_flatten_in_a_sequential_costs_nothing():
    """Its output is a view of the layer's below, and the Dense above writes d loss / d input
    straight into that layer's d loss / d output (no buffer of its own, no copy). Catches a
    chain that copies at each reshape."""
    model = make_model("cnn", (28, 28, 1), 10)
    w = model.init_params(0)
    x, y = _chain_batch(model, 8, np.random.default_rng(1))
    model.loss_and_grad(w, x, y, np.empty_like(w))
    plan = model._plan(True)
    bufs = model._buffers(8, np.float32).of(plan)
    assert bufs.dxs == {}                                  # every dx is a layer's dout (or a view)
    flatten = next(i for i, s in enumerate(plan.steps) if plan.layers[s.layer].reshapes_only)
    pool_dout = bufs.douts[flatten - 1]
    assert np.shares_memory(bufs.direct(plan.steps[flatten].out), pool_dout)
