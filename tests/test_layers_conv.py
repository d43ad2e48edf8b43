"""Conv1D, Conv2DTranspose, DepthwiseConv2D and the padding, cropping and up-sampling layers: outputs against
Keras's formulas (written here with NumPy, independently of the layers), gradients against central finite
differences (float64, hypothesis), the numba kernels against their twins, arguments and
refusals, configs and files, the CUDA check, and a Conv1D model that learns with fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pserver.keras as keras
from pserver.errors import ConfigError
from pserver.keras import layers
from pserver.layers import (
    Conv1D,
    Conv2DTranspose,
    Cropping1D,
    Cropping2D,
    Dense,
    DepthwiseConv2D,
    Flatten,
    Reshape,
    SeparableConv2D,
    UpSampling1D,
    UpSampling2D,
    ZeroPadding1D,
    ZeroPadding2D,
)
from pserver.models import on_device
from pserver.models.functional import Functional
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_fd


def keras_conv1d(x, w, b, stride, padding):
    """Keras's Conv1D: x padded (nothing for 'valid'; TF's split for 'same', the smaller half
    first; kernel_size - 1 steps first for 'causal'), then out[t] = b + sum_i xp[t*stride+i] @ w[i]."""
    steps, k = x.shape[1], w.shape[0]
    if padding == "valid":
        out_len, before = (steps - k) // stride + 1, 0
    else:
        out_len = -(-steps // stride)
        total = max((out_len - 1) * stride + k - steps, 0)
        before = k - 1 if padding == "causal" else total // 2
    xp = np.zeros((x.shape[0], max(before + steps, (out_len - 1) * stride + k), x.shape[2]))
    xp[:, before:before + steps] = x
    return np.stack([b + np.einsum("nkc,kcf->nf", xp[:, t * stride:t * stride + k], w)
                     for t in range(out_len)], axis=1)


def keras_conv2d_transpose(x, w, b, strides, padding):
    """Keras's Conv2DTranspose (checked against Keras 3.15.1 when written): each input pixel
    (i, j) adds x[i, j] @ w[a, c].T at (i*s + a, j*s + c), for a kernel w (kh, kw, filters, in);
    the output is in*s + max(k - s, 0) long ('valid', from 0) or in*s ('same', from
    max(k - s, 0) // 2)."""
    (n, h, width, _), (kh, kw, f, _) = x.shape, w.shape
    size, begin = [], []
    for d, k, s in zip((h, width), (kh, kw), strides):
        size.append(d * s + (max(k - s, 0) if padding == "valid" else 0))
        begin.append(0 if padding == "valid" else max(k - s, 0) // 2)
    y = np.zeros((n, h * strides[0] + kh, width * strides[1] + kw, f))
    for i in range(h):
        for j in range(width):
            for a in range(kh):
                for c in range(kw):
                    y[:, i * strides[0] + a, j * strides[1] + c] += x[:, i, j] @ w[a, c].T
    return y[:, begin[0]:begin[0] + size[0], begin[1]:begin[1] + size[1]] + b


def keras_depthwise(x, w, b, strides, padding):
    """Keras's DepthwiseConv2D (checked against Keras 3.15.1 when written, equal strides, which
    TensorFlow's kernel requires): out[p, q, c*m + j] = b + sum over the window of x[.., c] *
    w[.., c, j], the image padded as Conv2D's ('same': TensorFlow's split, the smaller half first)."""
    (n, h, width, c), (kh, kw, _, m) = x.shape, w.shape
    sizes, before = [], []
    for d, k, s in zip((h, width), (kh, kw), strides):
        out = (d - k) // s + 1 if padding == "valid" else -(-d // s)
        sizes.append(out)
        before.append(0 if padding == "valid" else max((out - 1) * s + k - d, 0) // 2)
    xp = np.pad(x, ((0, 0), (before[0], kh + h), (before[1], kw + width), (0, 0)))
    y = np.empty((n, *sizes, c, m))
    for p in range(sizes[0]):
        for q in range(sizes[1]):
            patch = xp[:, p * strides[0]:p * strides[0] + kh, q * strides[1]:q * strides[1] + kw]
            y[:, p, q] = np.einsum("nijc,ijcm->ncm", patch, w)
    return y.reshape(n, *sizes, c * m) + b


def forward(layer, x, backend, training=False):
    """`layer` built for x and run on it by `backend`'s kernels, its weights drawn:
    (its output, kernel, bias)."""
    from pserver.kernels import get_backend
    from pserver.layers.base import Pass
    layer.build(x.shape[1:])
    rng = np.random.default_rng(x.size)
    p = {w.name: rng.normal(size=w.shape).astype(x.dtype) for w in layer.weights()}
    out = np.empty((x.shape[0], *layer.output_shape), x.dtype)
    layer.forward(get_backend(backend), p, x, out, layer.scratch(x.shape[0], x.dtype), Pass(training))
    return out, p["kernel"], p["bias"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), steps=st.integers(1, 9), c=st.integers(1, 3), f=st.integers(1, 3),
       k=st.integers(1, 4), stride=st.integers(1, 3), padding=st.sampled_from(["valid", "same", "causal"]))
def test_conv1d_computes_keras_s_formula(n, steps, c, f, k, stride, padding):
    """Catches: causal padding put after the sequence (or split as 'same'), TF's 'same' split
    the wrong way round, the kernel's (k, in, filters) axes read in another order, a stride
    applied to the wrong axis of the one-row image."""
    if padding == "valid" and k > steps:
        return
    x = np.random.default_rng(steps * 7 + k).normal(size=(n, steps, c))
    for backend, dtype, training in (("reference", np.float64, False), ("cpu", np.float32, False),
                                     ("cpu", np.float32, True)):
        got, w, b = forward(layers.Conv1D(f, k, strides=stride, padding=padding), x.astype(dtype), backend,
                            training)
        np.testing.assert_allclose(got, keras_conv1d(x, w, b, stride, padding), rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2), h=st.integers(1, 4), w=st.integers(1, 4), c=st.integers(1, 2),
       f=st.integers(1, 3), kh=st.integers(1, 4), kw=st.integers(1, 3), sh=st.integers(1, 3),
       sw=st.integers(1, 2), padding=st.sampled_from(["valid", "same"]))
def test_conv2d_transpose_computes_keras_s_formula(n, h, w, c, f, kh, kw, sh, sw, padding):
    """Catches: the output length wrong for a kernel shorter than its stride, 'same' cropping
    the wrong side, the kernel's (filters, in) axes swapped, the twin and the numba kernels
    disagreeing."""
    x = np.random.default_rng(h * 11 + kw).normal(size=(n, h, w, c))
    for backend, dtype in (("reference", np.float64), ("cpu", np.float32)):
        layer = Conv2DTranspose(f, (kh, kw), strides=(sh, sw), padding=padding)
        got, kernel, bias = forward(layer, x.astype(dtype), backend)
        want = keras_conv2d_transpose(x, kernel, bias, (sh, sw), padding)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2), h=st.integers(3, 6), w=st.integers(3, 6), c=st.integers(1, 3),
       m=st.integers(1, 3), kh=st.integers(1, 3), kw=st.integers(1, 3), sh=st.integers(1, 2),
       sw=st.integers(1, 2), padding=st.sampled_from(["valid", "same"]))
def test_depthwise_conv2d_computes_keras_s_formula(n, h, w, c, m, kh, kw, sh, sw, padding):
    """Catches: output channels ordered (m, c) rather than TensorFlow's (c, m), a channel mixed
    into another's output, 'same' padded on the wrong side."""
    x = np.random.default_rng(h * 13 + c).normal(size=(n, h, w, c))
    layer = DepthwiseConv2D((kh, kw), strides=(sh, sw), padding=padding, depth_multiplier=m)
    got, kernel, bias = forward(layer, x, "reference")
    want = keras_depthwise(x, kernel, bias, (sh, sw), padding)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), h=st.integers(1, 5), w=st.integers(1, 5), c=st.integers(1, 3),
       a=st.integers(0, 2), b=st.integers(0, 2), p=st.integers(0, 2), q=st.integers(0, 2),
       sh=st.integers(1, 3), sw=st.integers(1, 3))
def test_padding_cropping_and_up_sampling_compute_keras_s_formulas(n, h, w, c, a, b, p, q, sh, sw):
    """Catches: (top, bottom) or (left, right) swapped, a pair of ints read as one side each,
    up-sampling that tiles the whole image rather than repeating each pixel, or repeats the
    wrong axis."""
    rng = np.random.default_rng(h * 31 + w)
    image, seq = rng.normal(size=(n, h, w, c)), rng.normal(size=(n, h, c))
    pad = ((a, b), (p, q))
    assert np.array_equal(ZeroPadding2D(pad)(image), np.pad(image, ((0, 0), *pad, (0, 0))))
    assert np.array_equal(ZeroPadding2D((a, p))(image), np.pad(image, ((0, 0), (a, a), (p, p), (0, 0))))
    assert np.array_equal(ZeroPadding1D((a, b))(seq), np.pad(seq, ((0, 0), (a, b), (0, 0))))
    big, long = np.pad(image, ((0, 0), *pad, (0, 0))), np.pad(seq, ((0, 0), (a, b), (0, 0)))
    assert np.array_equal(Cropping2D(pad)(big), image)
    assert np.array_equal(Cropping1D((a, b))(long), seq)
    assert np.array_equal(Cropping2D(a)(np.pad(image, ((0, 0), (a, a), (a, a), (0, 0)))), image)
    assert np.array_equal(UpSampling2D((sh, sw))(image), image.repeat(sh, axis=1).repeat(sw, axis=2))
    assert np.array_equal(UpSampling1D(sh)(seq), seq.repeat(sh, axis=1))


@st.composite
def layers_and_shapes(draw):
    """One of the new layers with drawn arguments, and an input shape it takes."""
    kind = draw(st.sampled_from(["conv1d", "transpose", "depthwise", "zero1", "zero2", "crop1", "crop2",
                                 "up1", "up2"]))
    steps, c, two = draw(st.integers(4, 6)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    small, side = st.integers(0, 2), st.integers(1, 2)
    if kind == "conv1d":
        return Conv1D(draw(st.integers(1, 3)), draw(st.integers(1, 3)), strides=draw(st.integers(1, 2)),
                      padding=draw(st.sampled_from(["valid", "same", "causal"])),
                      activation=draw(st.sampled_from([None, "tanh", "relu"])),
                      use_bias=draw(st.booleans())), (steps, c)
    image = (steps, draw(st.integers(2, 4)), c)
    if kind == "depthwise":
        return DepthwiseConv2D((draw(st.integers(1, 3)), 2), strides=(draw(side), draw(side)),
                               padding=draw(st.sampled_from(["valid", "same"])), depth_multiplier=draw(side),
                               activation=draw(st.sampled_from([None, "relu"])),
                               use_bias=draw(st.booleans())), image
    if kind == "transpose":
        kernel, strides = (draw(st.integers(1, 3)), draw(st.integers(1, 3))), (draw(side), draw(side))
        return Conv2DTranspose(draw(st.integers(1, 2)), kernel, strides=strides,
                               padding=draw(st.sampled_from(["valid", "same"])),
                               activation=draw(st.sampled_from([None, "tanh", "relu"])),
                               use_bias=draw(st.booleans())), (2, 2, c)
    return {"zero1": lambda: (ZeroPadding1D((draw(small), draw(small))), (steps, c)),
            "zero2": lambda: (ZeroPadding2D(((draw(small), draw(small)), (draw(small), two))), image),
            "crop1": lambda: (Cropping1D((draw(side), 1)), (steps, c)),
            "crop2": lambda: (Cropping2D(((1, draw(small)), (0, 1))), image),
            "up1": lambda: (UpSampling1D(draw(side)), (steps, c)),
            "up2": lambda: (UpSampling2D((draw(side), two)), image)}[kind]()


@settings(max_examples=25, deadline=None)
@given(layers_and_shapes(), st.integers(0, 2**16))
# Always: the two layers whose kernels fuse no ReLU, with one (a forward without it was caught so).
@example((Conv2DTranspose(2, 3, strides=2, padding="same", activation="relu"), (2, 2, 1)), 0)
@example((DepthwiseConv2D(2, depth_multiplier=2, activation="relu"), (4, 3, 2)), 0)
def test_each_layer_s_backward_equals_central_finite_differences(made, seed):
    """Catches: a wrong VJP (a cropping's gradient put back at the wrong offset, the padded
    border's gradient not dropped, up-sampling's gradient not summed over each pixel's copies,
    Conv1D's kernel gradient through the wrong view), every weight and input coordinate."""
    layer, shape = made
    x = Symbolic((None, 4), name="x")
    inner = Reshape(shape)(Dense(int(np.prod(shape)), activation="tanh")(x))
    model = Functional(x, Dense(2)(Flatten()(layer(inner))))
    rng = np.random.default_rng(seed)
    assert_fd(model, rng.normal(size=(3, 4)), rng.integers(0, 2, 3), seed)


@pytest.mark.parametrize("padding", ["valid", "same", "causal"])
def test_conv1d_s_numba_kernels_equal_the_twins(padding):
    """Catches: the kept im2col matrix (training) or the one-row image views wrong in the
    compiled kernels only (the twins are what finite differences check)."""
    def model():
        x = Symbolic((None, 9, 3), name="x")
        h = Conv1D(4, 3, strides=2, padding=padding, activation="relu")(x)
        return Functional(x, Dense(3)(Flatten()(Conv1D(2, 2, padding=padding)(h))))
    cpu_m, ref_m = model(), model().use_backend("reference")
    rng = np.random.default_rng(2)
    w = cpu_m.init_params(1)
    x, y = rng.normal(size=(5, 9, 3)).astype(np.float32), rng.integers(0, 3, 5)
    g_c, g_r = np.full_like(w, np.nan), np.full_like(w, np.nan)
    assert cpu_m.loss_and_grad(w, x, y, g_c) == pytest.approx(ref_m.loss_and_grad(w, x, y, g_r), rel=1e-5)
    np.testing.assert_allclose(g_c, g_r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cpu_m.predict(w, x), ref_m.predict(w, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make, match", [
    (lambda: Conv1D(2, 3, padding="full"),
     r"^Conv1D: padding must be 'valid', 'same' or 'causal', got 'full'$"),
    (lambda: Conv1D(2, 3, dilation_rate=2), r"^Conv1D: dilation_rate=2 is not supported \(1 only\)$"),
    (lambda: Conv1D(2, 3, groups=2), r"^Conv1D: groups=2 is not supported \(1 only\)$"),
    (lambda: Conv1D(2, (3, 3)), r"^Conv1D: kernel_size must be a positive integer"),
    (lambda: Conv1D(2, 3, data_format="channels_first"),
     r"^Conv1D: data_format='channels_first': pserver's images and sequences are channels_last$"),
    (lambda: layers.Conv2D(2, 3, padding="causal"), r"^Conv2D: padding must be 'valid' or 'same'"),
    (lambda: ZeroPadding2D(data_format="channels_first"), r"^ZeroPadding2D: data_format='channels_first'"),
    (lambda: ZeroPadding2D(((1, 2, 3), 1)),
     r"^ZeroPadding2D: padding must be an int, a pair of ints or a pair"),
    (lambda: ZeroPadding1D(-1), r"^ZeroPadding1D: padding must be an int or a \(before, after\) pair"),
    (lambda: Cropping1D((1, 2, 3)), r"^Cropping1D: cropping must be an int or a \(before, after\) pair"),
    (lambda: UpSampling2D(interpolation="bilinear"),
     r"^UpSampling2D: interpolation='bilinear' is not supported \('nearest' only\)$"),
    (lambda: UpSampling1D(0), r"^UpSampling1D: size must be a positive integer, got 0$"),
    (lambda: Conv2DTranspose(2, 3, output_padding=1),
     r"^Conv2DTranspose: output_padding=1 is not supported \(None only\)$"),
    (lambda: DepthwiseConv2D(3, dilation_rate=(2, 2)),
     r"^DepthwiseConv2D: dilation_rate=\(2, 2\) is not supported \(1 only\)$"),
    (lambda: Conv2DTranspose(2, 3, dilation_rate=2),
     r"^Conv2DTranspose: dilation_rate=2 is not supported \(1 only\)$"),
])
def test_unsupported_arguments_are_refused_in_one_line(make, match):
    """Catches: an argument accepted and ignored (channels_first data read as channels_last,
    bilinear silently nearest, a dilated kernel run undilated)."""
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("layer, shape, match", [
    (Conv1D(2, 5), (3, 2), r"layer conv1d \(Conv1D\): kernel_size 5 is larger than its input \(3, 2\) "
                           r"\(steps 3\) with padding 'valid'$"),
    (Conv1D(2, 2), (4, 4, 1), r"layer conv1d \(Conv1D\): needs a sequence \(steps, channels\) input .*"
                              r"got \(4, 4, 1\)$"),
    (Cropping2D(((2, 2), (0, 0))), (4, 3, 1), r"layer cropping2d \(Cropping2D\): cropping \(\(2, 2\), "
                                              r"\(0, 0\)\) leaves nothing of its input \(4, 3, 1\)$"),
    (ZeroPadding2D(), (5, 2), r"layer zero_padding2d \(ZeroPadding2D\): needs an image \(height, width, "
                              r"channels\) input .*got \(5, 2\)$"),
    (UpSampling1D(), (2, 2, 2), r"layer up_sampling1d \(UpSampling1D\): needs a sequence"),
])
def test_a_shape_that_cannot_work_is_refused_at_build_naming_the_layer_and_shapes(layer, shape, match):
    x = keras.Input(shape=shape)
    with pytest.raises(ConfigError, match=match) as e:
        keras.Model(x, layers.Flatten()(layer(x)))
    assert "\n" not in str(e.value)


def all_layers_model():
    inp = keras.Input(shape=(8, 3))
    seq = layers.UpSampling1D(2)(layers.Cropping1D((2, 1))(layers.ZeroPadding1D((1, 2))(
        layers.Conv1D(4, 3, strides=2, padding="causal", activation="relu")(inp))))
    image = layers.Reshape((seq.shape[1], 4, 1))(seq)
    image = layers.UpSampling2D((1, 2))(layers.Cropping2D(((1, 0), (0, 1)))(
        layers.ZeroPadding2D(((1, 1), (0, 2)))(image)))
    image = layers.Conv2DTranspose(2, 3, strides=2, padding="same", activation="relu")(image)
    image = layers.DepthwiseConv2D(2, depth_multiplier=2, padding="same")(image)
    out = layers.Dense(3, activation="softmax")(layers.Flatten()(image))
    return keras.Model(inp, out)


def test_a_model_of_every_new_layer_is_saved_and_loaded_with_its_configs(tmp_path):
    """Catches: a config that JSON changes (nested tuples of Cropping2D), an argument dropped
    by get_config, weights of another shape after load_model."""
    model = all_layers_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(4).normal(size=(5, 8, 3)).astype(np.float32)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    assert np.array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    for a, b in zip(model.layers, again.layers):
        config = json.loads(json.dumps(a.get_config()))
        assert type(a).from_config(config).get_config() == a.get_config() == b.get_config()
    assert ZeroPadding2D(((1, 0), (2, 3))).get_config()["padding"] == [[1, 0], [2, 3]]


def test_cuda_refuses_a_model_with_these_layers_in_one_line():
    """Catches: a depthwise or separable convolution sent to kernels it has not got. (Conv1D,
    Conv2DTranspose and the padding, cropping and up-sampling layers run there:
    tests/cuda_sim/check_graph_cuda.py.)"""
    from pserver.models import cuda_support
    x = Symbolic((None, 6, 2))
    cuda_support.check(Functional(x, Dense(2)(Flatten()(UpSampling1D()(x)))).build())     # passes
    transposed = Conv2DTranspose(2, 2)(Reshape((6, 2, 1))(x))
    cuda_support.check(Functional(x, Dense(2)(Flatten()(transposed))).build())
    for make in (lambda x: DepthwiseConv2D(2)(Reshape((6, 2, 1))(x)),
                 lambda x: SeparableConv2D(2, 2)(Reshape((6, 2, 1))(x))):
        x = Symbolic((None, 6, 2))
        with pytest.raises(ConfigError, match=r"^--device cuda: .*; functional: layer \w+ "
                                              r"\(\w+\) has no CUDA "
                                              r"kernels\. Use --device cpu for this model$"):
            on_device(Functional(x, Dense(2)(Flatten()(make(x)))), "cuda")


def test_a_small_conv1d_model_learns_with_fit(monkeypatch):
    """Catches: Conv1D's gradient wrong in the training path (the kept im2col matrix through
    the views), which finite differences through the twins cannot see: the loss would not fall.
    The label is whether a rising edge comes before a falling one, which needs the order."""
    rng = np.random.default_rng(0)
    n, steps = 512, 16
    x = np.zeros((n, steps, 1), np.float32)
    y = rng.integers(0, 2, n)
    for i in range(n):
        a, b = sorted(rng.choice(steps - 2, 2, replace=False))
        x[i, a:b, 0] = 1 if y[i] else 0
        x[i, :, 0] = x[i, :, 0] if y[i] else 1 - x[i, :, 0]
    x += rng.normal(scale=0.1, size=x.shape).astype(np.float32)
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")            # set_random_seed's variable, undone after the test
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input(shape=(steps, 1)),
                              layers.Conv1D(8, 3, padding="causal", activation="relu"),
                              layers.Conv1D(8, 3, strides=2, activation="relu"),
                              layers.GlobalMaxPooling1D(), layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    h = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0] / 2
    assert h.history["accuracy"][-1] > 0.9


def test_conv1d_views_a_device_array_by_reshape_which_takes_no_none_index():
    """Catches Conv1D's one-row views taken as a[:, None] on the GPU: the simulator's device
    arrays are NumPy's and take it, a real DeviceNDArray does not (numba's dummyarray, which
    lays out its views, raises), so only a GPU run would have failed. `Device` stands for one:
    shape and reshape, and an index that refuses None as numba's does."""
    from numba.cuda.cudadrv import dummyarray
    with pytest.raises(TypeError):
        dummyarray.Array.from_desc(0, (4, 5, 3), (60, 12, 4), 4)[:, None]

    class Device:
        def __init__(self, a):
            self.a, self.shape = a, a.shape

        def reshape(self, *shape):
            return Device(self.a.reshape(*shape))

        def __getitem__(self, key):
            if key is None or (isinstance(key, tuple) and None in key):
                raise TypeError("a device array takes no None index")
            return Device(self.a[key])

    layer = Conv1D(2, 3)
    layer.build((5, 3))
    x = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    np.testing.assert_array_equal(layer.image(Device(x)).a, x[:, None])
    w = np.ones((3, 3, 2), np.float32)
    np.testing.assert_array_equal(layer.kernel4d(Device(w)).a, w[None])
    assert np.shares_memory(layer.image(x), x) and np.shares_memory(layer.kernel4d(w), w)   # host: views
