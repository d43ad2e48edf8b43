"""Layers and Sequential: shapes as Keras computes them, gradients against finite differences,
the numba kernels against the NumPy twins, initialisers, the reference CNN, and bad models."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.errors import ConfigError, DataError
from pserver.layers import AveragePooling2D, Conv2D, Dense, Dropout, Embedding, Flatten, MaxPooling2D
from pserver.models import Sequential, make_model

FAST = settings(max_examples=20, deadline=None)


def keras_out(size, window, stride, padding):
    """Keras's output length, written independently of pserver.kernels.conv_output."""
    if padding == "same":
        return math.ceil(size / stride)
    return math.floor((size - window) / stride) + 1


# -- shapes -------------------------------------------------------------------------------

@FAST
@given(h=st.integers(3, 12), w=st.integers(3, 12), c=st.integers(1, 3), f=st.integers(1, 4),
       k=st.integers(1, 3), s=st.integers(1, 3), padding=st.sampled_from(["valid", "same"]),
       pool=st.integers(1, 2))
def test_conv_and_pool_shapes_are_keras(h, w, c, f, k, s, padding, pool):
    model = Sequential([Conv2D(f, k, strides=s, padding=padding, input_shape=(h, w, c)),
                        MaxPooling2D(pool, padding="same"), Flatten(), Dense(2)]).build()
    oh, ow = keras_out(h, k, s, padding), keras_out(w, k, s, padding)
    conv, pooling, flat, _ = model.layers
    assert conv.output_shape == (oh, ow, f)
    assert pooling.output_shape == (keras_out(oh, pool, pool, "same"),
                                    keras_out(ow, pool, pool, "same"), f)
    assert flat.output_shape == (math.prod(pooling.output_shape),)
    assert [(t.name, t.shape) for t in model.layout.tensors] == [
        ("conv2d/kernel", (k, k, c, f)), ("conv2d/bias", (f,)),
        ("dense/kernel", (flat.output_shape[0], 2)), ("dense/bias", (2,))]


def test_keras_defaults_and_names():
    model = Sequential([Dense(4, input_shape=(3,)), Dense(4, use_bias=False), Dense(2, name="out")])
    assert [layer.name for layer in model.layers] == ["dense", "dense_1", "out"]
    assert model.layout.describe() == "dense/kernel[3, 4], dense/bias[4], dense_1/kernel[4, 4], " \
                                      "out/kernel[4, 2], out/bias[2]"
    pool = MaxPooling2D()
    assert (pool.pool_size, pool.strides, pool.padding) == ((2, 2), (2, 2), "valid")
    conv = Conv2D(8, 3)
    assert (conv.kernel_size, conv.strides, conv.padding, conv.activation) == \
        ((3, 3), (1, 1), "valid", "linear")


def test_reference_cnn_is_the_tutorial_model():
    model = make_model("cnn", (28, 28, 1), 10)
    assert [type(layer).__name__ for layer in model.layers] == [
        "Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
    assert [(t.name, t.shape) for t in model.layout.tensors] == [
        ("conv2d/kernel", (3, 3, 1, 32)), ("conv2d/bias", (32,)), ("dense/kernel", (5408, 64)),
        ("dense/bias", (64,)), ("dense_1/kernel", (64, 10)), ("dense_1/bias", (10,))]
    assert model.layout.total == 347_146      # Keras's model.summary() for the same model
    assert model.layers[0].activation == "relu" and model.layers[3].activation == "relu"
    assert model.layers[4].activation == "linear" and model.loss.name == "sparse_categorical_crossentropy"


def test_evaluation_runs_in_cache_sized_chunks_with_the_same_results():
    # keras.io's mnist_convnet: ~315 KB of outputs and im2col rows per image, so 4 MiB
    # chunks of 13 (4096 at once thrashed the cache: 2.2x the CPU time). A chunk that ignores
    # the budget, or results that depend on it (a remainder chunk lost or counted twice), fail.
    from pserver.models.functional import EVAL_CHUNK_BYTES
    model = Sequential([Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), MaxPooling2D(),
                        Conv2D(64, 3, activation="relu"), MaxPooling2D(), Flatten(), Dropout(0.5),
                        Dense(10)])
    per_image = 4 * (26 * 26 * (32 + 9) + 13 * 13 * 32 + 11 * 11 * (64 + 288) + 5 * 5 * 64 * 2 + 10)
    assert model._chunk(4096, np.float32) == EVAL_CHUNK_BYTES // per_image == 13
    assert model._chunk(5, np.float32) == 5
    assert Sequential([Dense(3, input_shape=(4,))])._chunk(4096, np.float32) == 4096
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    x, y = rng.random((30, 28, 28, 1), np.float32), rng.integers(0, 10, 30)
    one_by_one = np.concatenate([model.predict(w, x[i:i + 1]) for i in range(30)])
    np.testing.assert_allclose(model.predict(w, x), one_by_one, rtol=1e-5, atol=1e-6)
    ev = model.evaluate(w, x, y)
    assert ev["accuracy"] == np.mean(one_by_one.argmax(1) == y)


@pytest.mark.parametrize("loss, units, labels", [("sparse_categorical_crossentropy", 10, 10),
                                                  ("binary_crossentropy", 1, 2), ("mse", 1, 0)])
def test_evaluation_on_threads_gives_one_thread_s_result_exactly(loss, units, labels):
    # The chief evaluates on every core when the other workers wait (worker.loop.eval_threads):
    # each thread its own buffers, the chunks' sums added in chunk order. Threads sharing one
    # buffer set, a chunk skipped or counted twice, or sums in thread order differ from one
    # thread's result (compared bit for bit); a chunk's error raises in the caller.
    model = Sequential([Conv2D(4, 3, activation="relu", input_shape=(8, 8, 2)), MaxPooling2D(), Flatten(),
                        Dense(units)], loss=loss)
    rng = np.random.default_rng(1)
    w = model.init_params(0)
    x = rng.random((53, 8, 8, 2), np.float32)
    y = rng.integers(0, labels, 53) if labels else rng.standard_normal(53).astype(np.float32)
    one = model.evaluate(w, x, y, batch_size=4)
    for threads in (2, 3, 64):
        assert model.evaluate(w, x, y, batch_size=4, threads=threads) == one
    metric = {10: "accuracy", 2: "auc", 0: "r2"}[labels]
    assert set(one) == {"loss", metric} | ({"accuracy"} if labels else set())

    def fails(*args):
        raise DataError("chunk 3 failed")
    model.layers[0].forward = fails
    with pytest.raises(DataError, match="chunk 3"):
        model.evaluate(w, x, y, batch_size=4, threads=2)


def test_conv_backward_uses_kept_windows_only_from_this_step_s_training_forward():
    # Conv2D keeps the training forward's im2col matrix for its backward pass. After an
    # inference forward of other images in the same input buffer (same batch size, same
    # scratch), the backward pass must not use the training images' matrix: its gradient is
    # that of the images given (caught with the inference pass not dropping the kept one).
    from pserver.kernels import cpu, reference
    from pserver.layers.base import Pass
    conv = Conv2D(4, 3, activation="relu")
    conv.build((6, 6, 2))
    rng = np.random.default_rng(3)
    x1, x2 = rng.standard_normal((2, 3, 6, 6, 2)).astype(np.float32)
    p = {"kernel": rng.standard_normal((3, 3, 2, 4)).astype(np.float32), "bias": np.zeros(4, np.float32)}
    out, s = np.empty((3, 4, 4, 4), np.float32), conv.scratch(3, np.float32)
    x = x1.copy()     # one input buffer, as a layer's inside a model: its contents change
    conv.forward(cpu, p, x, out, s, Pass(training=True))
    x[:] = x2
    conv.forward(cpu, p, x, out, s, Pass(training=False))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    got = {"kernel": np.empty_like(p["kernel"]), "bias": np.empty(4, np.float32)}
    dx = np.empty_like(x2)
    conv.backward(cpu, p, got, x, out, dout.copy(), dx, s)
    want_out = np.empty_like(out)
    reference.conv2d_forward(x2, p["kernel"], p["bias"], want_out, 1, 1, 0, 0, True)
    d = dout * (want_out > 0)
    want = {"kernel": np.empty_like(p["kernel"]), "bias": np.empty(4, np.float32)}
    want_dx = np.empty_like(x2)
    reference.conv2d_backward(x2, p["kernel"], d, want_dx, want["kernel"], want["bias"], 1, 1, 0, 0)
    np.testing.assert_allclose(got["kernel"], want["kernel"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)


def test_glorot_uniform_kernels_zero_biases():
    w = make_model("cnn", (28, 28, 1), 10).init_params(0)
    views = make_model("cnn", (28, 28, 1), 10).layout.views(w)
    for name, fan_in, fan_out in [("conv2d/kernel", 9, 9 * 32), ("dense/kernel", 5408, 64),
                                  ("dense_1/kernel", 64, 10)]:
        limit = math.sqrt(6 / (fan_in + fan_out))
        v = views[name]
        assert v.max() <= limit and v.min() >= -limit
        # Uniform on [-limit, limit]: std limit / sqrt(3).
        assert v.std() == pytest.approx(limit / math.sqrt(3), rel=0.1)
    assert not any(views[n].any() for n in ("conv2d/bias", "dense/bias", "dense_1/bias"))


# -- gradients ----------------------------------------------------------------------------

def tiny_models():
    """Every layer kind, every activation, strides and padding, in float64-sized models."""
    return {
        "conv": lambda: Sequential([
            Conv2D(3, 3, strides=(2, 1), padding="same", activation="relu", input_shape=(7, 6, 2)),
            MaxPooling2D(), Conv2D(2, 2, activation="tanh"), AveragePooling2D(1), Flatten(),
            Dense(5, activation="sigmoid"), Dropout(0.3), Dense(4)]),
        "pool-same": lambda: Sequential([
            Conv2D(2, 2, use_bias=False, input_shape=(5, 5, 1)), AveragePooling2D(3, 2, "same"),
            MaxPooling2D(2, 1, "same"), Flatten(), Dense(3)]),
        "embedding": lambda: Sequential([Embedding(7, 3, input_shape=(4,)), Flatten(),
                                         Dense(2, activation="tanh"), Dense(3)]),
        "binary": lambda: Sequential([Dense(4, activation="relu", input_shape=(5,)), Dense(1)],
                                     loss="binary_crossentropy"),
        "mse": lambda: Sequential([Flatten(input_shape=(2, 3)), Dense(3, activation="sigmoid"),
                                   Dense(1)], loss="mse"),
    }


def tiny_batch(model, n, rng, dtype=np.float64):
    if isinstance(model.layers[0], Embedding):
        x = rng.integers(0, model.layers[0].input_dim, (n, *model.input_shape)).astype(dtype)
    else:
        x = rng.standard_normal((n, *model.input_shape)).astype(dtype)
    if model.task == "regression":
        return x, rng.standard_normal(n).astype(dtype)
    return x, rng.integers(0, model.num_classes if model.output_shape[0] > 1 else 2, n).astype(np.int32)


@pytest.mark.parametrize("kind", sorted(tiny_models()))
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_gradient_matches_central_differences(kind, n, seed):
    """Every coordinate, float64 through the NumPy twins, with a fixed dropout seed."""
    model = tiny_models()[kind]().use_backend("reference")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(model.layout.total) * 0.5
    x, y = tiny_batch(model, n, rng)
    grad = np.full_like(w, np.nan)
    loss = model.loss_and_grad(w, x, y, grad, seed=seed)

    def f(v):
        return model.loss_and_grad(v, x, y, np.empty_like(w), seed=seed)
    eps, fd = 1e-6, np.empty_like(w)
    for j in range(w.size):
        wp, wm = w.copy(), w.copy()
        wp[j] += eps
        wm[j] -= eps
        fd[j] = (f(wp) - f(wm)) / (2 * eps)
    assert np.isfinite(loss)
    # atol: a max-pool or ReLU kink within eps of a coordinate is rare but possible.
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(tiny_models()))
def test_cpu_kernels_equal_the_reference(kind):
    cpu_m, ref_m = tiny_models()[kind](), tiny_models()[kind]().use_backend("reference")
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(cpu_m.layout.total) * 0.5).astype(np.float32)
    x, y = tiny_batch(cpu_m, 9, rng, np.float32)
    g_c, g_r = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c, loss_r = cpu_m.loss_and_grad(w, x, y, g_c, seed=3), ref_m.loss_and_grad(w, x, y, g_r, seed=3)
    assert loss_c == pytest.approx(loss_r, rel=1e-5)
    np.testing.assert_allclose(g_c, g_r, rtol=1e-4, atol=1e-5)
    ev_c, ev_r = cpu_m.evaluate(w, x, y, batch_size=4), ref_m.evaluate(w, x, y, batch_size=4)
    assert ev_c.keys() == ev_r.keys() and ev_c["loss"] == pytest.approx(ev_r["loss"], rel=1e-5)


def test_dropout_is_seeded_and_off_at_evaluation():
    model = Sequential([Dense(8, input_shape=(6,)), Dropout(0.5), Dense(3)])
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    x, y = tiny_batch(model, 16, rng, np.float32)
    grads = [np.empty_like(w) for _ in range(3)]
    model.loss_and_grad(w, x, y, grads[0], seed=1)
    model.loss_and_grad(w, x, y, grads[1], seed=1)
    model.loss_and_grad(w, x, y, grads[2], seed=2)
    np.testing.assert_array_equal(grads[0], grads[1])
    assert not np.array_equal(grads[0], grads[2])
    # Evaluation is the identity through Dropout: the same as the model without it.
    plain = Sequential([Dense(8, input_shape=(6,)), Dense(3)])
    assert model.evaluate(w, x, y) == plain.evaluate(w, x, y)


def test_binary_metrics_accuracy_and_auc():
    model = Sequential([Dense(1, input_shape=(1,))], loss="binary_crossentropy")
    x = np.array([[-2.0], [-1.0], [0.5], [1.0], [3.0]], np.float32)
    y = np.array([0, 1, 0, 1, 1])
    w = np.array([1.0, 0.0], np.float32)            # the logit is x itself
    ev = model.evaluate(w, x, y)
    assert ev["accuracy"] == pytest.approx(3 / 5)   # predictions 0,0,1,1,1
    # Of the 6 (positive, negative) pairs, the positive scores higher in 5.
    assert ev["auc"] == pytest.approx(5 / 6)


# -- bad models and bad data: one error naming the layer and the shapes ----------------------

@pytest.mark.parametrize("build,match", [
    (lambda: Sequential([Conv2D(4, 5, input_shape=(3, 8, 1)), Flatten(), Dense(2)]),
     r"layer conv2d \(Conv2D\): kernel 5x5 is larger than its input \(3, 8, 1\)"),
    (lambda: Sequential([MaxPooling2D(4, input_shape=(3, 3, 2)), Flatten(), Dense(2)]),
     r"layer max_pooling2d \(MaxPooling2D\): pool_size 4x4 is larger than its input \(3, 3, 2\)"),
    (lambda: Sequential([Flatten(input_shape=(4, 4))]), "has no parameters to train"),
    (lambda: Sequential([Conv2D(2, 3, input_shape=(10,))]),
     r"layer conv2d \(Conv2D\): needs an image"),
    (lambda: Sequential([Dense(3)]), "no input shape"),
    (lambda: Sequential([Dense(1, input_shape=(3,))]),
     "sparse_categorical_crossentropy needs at least 2 outputs"),
    (lambda: Sequential([Dense(0, input_shape=(3,))]), "Dense: units must be a positive integer, got 0"),
    (lambda: Sequential([Dense(2, activation="gelu", input_shape=(3,))]), "unknown activation 'gelu'"),
    (lambda: Sequential([Conv2D(2, 3, padding="full", input_shape=(5, 5, 1))]),
     "padding must be 'valid' or 'same'"),
    (lambda: Sequential([Dropout(1.0, input_shape=(3,)), Dense(2)]), r"rate must be in \[0, 1\)"),
    (lambda: Sequential([Dense(2, input_shape=(3,), name="a"), Dense(2, name="a")]),
     "two layers are named 'a'"),
    (lambda: Sequential([Dense(2, input_shape=(3,))], loss="hinge"), "unknown loss 'hinge'"),
])
def test_bad_models_fail_at_build(build, match):
    with pytest.raises(ConfigError, match=match):
        build().build()


def test_compile_takes_keras_arguments_but_not_an_optimizer():
    model = Sequential([Dense(1, input_shape=(3,))]).compile(loss="binary_crossentropy",
                                                            metrics=["accuracy", "auc"])
    assert model.loss.name == "binary_crossentropy" and model.task == "classification"
    with pytest.raises(ConfigError, match="optimizer='adam': the optimizer runs on the shards"):
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ConfigError, match=r"metrics: 'mape' is not supported"):
        model.compile(loss="mse", metrics=["mape"])


def test_bad_data_names_the_layer_and_the_shapes():
    model = make_model("cnn", (28, 28, 1), 10)
    y = np.zeros(5, np.int32)
    with pytest.raises(DataError, match=r"train: x has shape \(5, 28, 27, 1\); layer conv2d \(Conv2D\) "
                                        r"takes \(n >= 1, 28, 28, 1\)"):
        model.check_data(np.zeros((5, 28, 27, 1), np.float32), y, "train")
    with pytest.raises(DataError, match=r"label out of range: y\[3\] = 10; the last layer \(layer "
                                        r"dense_1 \(Dense\)\) with sparse_categorical_crossentropy "
                                        r"takes 0..9"):
        model.check_data(np.zeros((5, 784), np.float32), np.array([0, 1, 2, 10, 4]), "train")
    x = np.zeros((5, 28, 28, 1), np.float32)
    x[2, 3, 4, 0] = np.nan
    with pytest.raises(DataError, match="x has NaN or Inf values in 1 samples, the first at index 2"):
        model.check_data(x, y, "train")
    emb = Sequential([Embedding(5, 2, input_shape=(3,)), Flatten(), Dense(2)])
    with pytest.raises(DataError, match=r"layer embedding \(Embedding\): id 5.0 at \(1, 2\) is not an "
                                        r"integer in \[0, input_dim=5\)"):
        emb.check_data(np.array([[0, 1, 2], [3, 4, 5]], np.float32), np.zeros(2, np.int32), "train")


def test_data_reshapes_to_the_input_only_when_it_fits():
    dense, conv = make_model("mlp", (784,), 10), make_model("cnn", (28, 28, 1), 10)
    y = np.zeros(2, np.int32)
    images, flat = np.zeros((2, 28, 28, 1), np.float32), np.zeros((2, 784), np.float32)
    assert dense.check_data(images, y).shape == (2, 784)       # images into a dense model: flat
    assert conv.check_data(flat, y).shape == (2, 28, 28, 1)    # flat rows into an image model
    assert conv.check_data(np.zeros((2, 28, 28), np.float32), y).shape == (2, 28, 28, 1)
    assert np.shares_memory(dense.check_data(images, y), images)    # a view, not a copy
    # Channels-first images have the right number of values but not the right shape.
    rgb = Sequential([Conv2D(2, 3, input_shape=(8, 8, 3)), Flatten(), Dense(2)])
    with pytest.raises(DataError, match=r"x has shape \(2, 3, 8, 8\); layer conv2d \(Conv2D\) takes"):
        rgb.check_data(np.zeros((2, 3, 8, 8), np.float32), y)
