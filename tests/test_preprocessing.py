"""Normalization (adapt), Resizing, CenterCrop and the augmentation layers: each forward against
an independent twin written from Keras's and TensorFlow's formulas (loops over pixels, not the
layers' matrices), each backward against central finite differences in float64 for the same
draw (hypothesis over shapes), augmentation only in training, its draws seeded per (run seed,
rank, step), and keras.io's mnist_convnet with augmentation in front training locally."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError, DataError
from pserver.kernels import reference
from pserver.layers import (
    CenterCrop,
    Dense,
    Normalization,
    RandomContrast,
    RandomFlip,
    RandomRotation,
    RandomTranslation,
    RandomZoom,
    Resizing,
)
from pserver.layers.augmentation import affine_matrix, sampling
from pserver.layers.base import Pass
from pserver.models import Functional
from pserver.ops.core import Symbolic
from pserver.worker.loop import gradient_fn

FAST = settings(max_examples=12, deadline=None)
EPS = 1e-6
sizes = st.integers(1, 6)


def built(layer, shape):
    layer(Symbolic((None, *shape)))
    return layer


def forward(layer, x, seed=0, training=True, p=None):
    out = np.empty((len(x), *layer.output_shape), x.dtype)
    s = layer.scratch(len(x), x.dtype)
    layer.forward(reference, p or {}, x, out, s, Pass(training=training, seed=seed))
    return out, s


def assert_fd(layer, x, seed=0, p=None):
    """<G, d out> by central differences along a random direction against the backward's dx,
    the draw fixed by the seed."""
    r = np.random.default_rng(seed)
    out, s = forward(layer, x, seed, p=p)
    G = r.standard_normal(out.shape)
    dx = np.empty_like(x)
    layer.backward(reference, p or {}, {}, x, out, G.copy(), dx, s)
    d = r.standard_normal(x.shape)

    def loss(x_):
        return float(np.sum(forward(layer, x_, seed, p=p)[0] * G))
    fd = (loss(x + EPS * d) - loss(x - EPS * d)) / (2 * EPS)
    assert abs(fd - np.sum(dx * d)) <= 1e-6 * (1 + abs(fd))


# -- Normalization --------------------------------------------------------------------------------

def test_normalization_adapts_to_the_population_statistics_in_float64_from_arrays_and_batches():
    """Catches: the sample variance (ddof=1), float32 sums, a wrong merge of batches, the
    reduced axes taken for the kept ones, a tuple batch's y counted as data."""
    x = (np.random.default_rng(0).normal(size=(40, 3, 4)) * [1, 5, 2, 9] + 3).astype(np.float32)
    for axis, reduce in ((-1, (0, 1)), ((1, 2), (0,)), (None, (0, 1, 2)), (1, (0, 2))):
        want = (x.astype(np.float64).mean(axis=reduce), x.astype(np.float64).var(axis=reduce))

        class Batches:                     # a PyDataset: read by index
            def __len__(self):
                return 3

            def __getitem__(self, i):
                return x[[0, 11, 30][i]:[11, 30, 40][i]], np.zeros(3)

        for data in (x, [x[:7], x[7:]], ((b, None) for b in (x[:25], x[25:])), Batches()):
            layer = Normalization(axis=axis)
            layer.adapt(data)
            np.testing.assert_allclose(layer.adapted[0], want[0], rtol=1e-12)
            np.testing.assert_allclose(layer.adapted[1], want[1], rtol=1e-12)
            assert layer.adapted[2] == math.prod(x.shape[a] for a in reduce)


def test_normalization_standardizes_inverts_and_its_vjp_is_the_scale():
    """Catches: sqrt forgotten, Keras's 1e-7 floor on the deviation missing (a zero variance
    dividing by zero), invert applied the wrong way, the VJP not divided."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 2, 3))
    layer = built(Normalization(mean=[1.0, -2.0, 0.5], variance=[4.0, 0.0, 0.25]), (2, 3))
    out, _ = forward(layer, x)
    np.testing.assert_allclose(out, (x - [1.0, -2.0, 0.5]) / [2.0, 1e-7, 0.5])
    inverse = built(Normalization(mean=[1.0, -2.0, 0.5], variance=[4.0, 0.0, 0.25], invert=True), (2, 3))
    np.testing.assert_allclose(forward(inverse, out)[0], x, rtol=1e-9, atol=1e-9)
    assert layer.weights() == []                          # given statistics are constants, as Keras's
    adapted = built(Normalization(axis=(1, 2)), (2, 3))
    adapted.adapt(rng.normal(size=(9, 2, 3)) * 3 + 1)
    p = {"mean": adapted.adapted[0], "variance": adapted.adapted[1], "count": np.array(9.0)}
    assert_fd(adapted, x, p=p)
    p = {"mean": np.ones(3), "variance": np.full(3, 4.0), "count": np.array(0.0)}
    assert_fd(built(Normalization(invert=True), (2, 3)), x, p=p)


def test_normalization_s_adapted_statistics_are_its_weights_in_a_model_and_a_saved_file(tmp_path):
    """Keras's weights (mean, variance, count; non-trainable), set by an adapt after the model was
    built (keras.io's data_augmentation.layers[0].adapt), kept by save and load_model, and used by
    an eager call. Catches: the initial zeros and ones in the model, statistics trained."""
    x = np.random.default_rng(2).normal(size=(64, 3)).astype(np.float32) * [1, 2, 3] + [4, 5, 6]
    norm = keras.layers.Normalization()
    model = keras.Sequential([keras.Input(shape=(3,)), norm, keras.layers.Dense(2)])
    norm.adapt(x)
    names = [t.name for t in model._core.layout.tensors]
    assert names[:3] == ["normalization/mean", "normalization/variance", "normalization/count"]
    mean, var, count = model.get_weights()[:3]
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(var, x.var(0), rtol=1e-5)
    assert count.shape == () and count == 64
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, (x[:, 0] > 4).astype(int), batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], mean)       # not trained
    assert len(model.non_trainable_weights) == 3
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(again.get_weights()[1], var)
    np.testing.assert_allclose(norm(x), (x - x.mean(0)) / x.std(0), rtol=1e-4, atol=1e-5)


def test_normalization_refuses_what_it_cannot_do_in_one_line():
    for make in (lambda: Normalization(mean=1.0), lambda: Normalization(mean=[1, 2], variance=[1]),
                 lambda: Normalization(axis=None, mean=[1.0], variance=[1.0]),
                 lambda: built(Normalization(mean=[1.0, 2.0], variance=[1.0, 2.0]), (3,)),
                 lambda: built(Normalization(axis=0), (3,)), lambda: Normalization(axis="x"),
                 lambda: Normalization(mean=1.0, variance=1.0).adapt(np.ones((2, 2)))):
        with pytest.raises(ConfigError) as e:
            make()
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="no data"):
        Normalization().adapt(iter([]))


# -- Resizing, CenterCrop -------------------------------------------------------------------------

def resize_twin(x, out_h, out_w, interpolation):
    """tf.image.resize (half-pixel centres, no antialias), pixel by pixel."""
    n, h, w, c = x.shape
    out = np.zeros((n, out_h, out_w, c))
    sh, sw = h / out_h, w / out_w
    for i in range(out_h):
        for j in range(out_w):
            if interpolation == "nearest":
                yy, xx = min(math.floor((i + 0.5) * sh), h - 1), min(math.floor((j + 0.5) * sw), w - 1)
                out[:, i, j] = x[:, yy, xx]
                continue
            fy, fx = (i + 0.5) * sh - 0.5, (j + 0.5) * sw - 0.5
            y0, x0 = math.floor(fy), math.floor(fx)
            ly, lx = fy - y0, fx - x0
            ya, yb = max(y0, 0), min(math.ceil(fy), h - 1)
            xa, xb = max(x0, 0), min(math.ceil(fx), w - 1)
            top = x[:, ya, xa] * (1 - lx) + x[:, ya, xb] * lx
            bottom = x[:, yb, xa] * (1 - lx) + x[:, yb, xb] * lx
            out[:, i, j] = top * (1 - ly) + bottom * ly
    return out


@FAST
@given(sizes, sizes, sizes, sizes, st.sampled_from(["bilinear", "nearest"]), st.booleans())
def test_resizing_against_tensorflow_s_formula_and_finite_differences(h, w, oh, ow, interpolation, crop):
    """Catches: corner-aligned sampling (align_corners), a lerp against the wrong neighbour,
    nearest rounding instead of flooring, the aspect-ratio window off centre, a VJP that is not
    the transpose."""
    x = np.random.default_rng(h * 7 + w).normal(size=(2, h, w, 2))
    layer = built(Resizing(oh, ow, interpolation=interpolation, crop_to_aspect_ratio=crop), (h, w, 2))
    src = x
    if crop:
        rows = max(min(h, int(w * oh / ow)), 1)
        cols = max(min(w, int(h * ow / oh)), 1)
        src = x[:, (h - rows) // 2:(h - rows) // 2 + rows, (w - cols) // 2:(w - cols) // 2 + cols]
    np.testing.assert_allclose(forward(layer, x)[0], resize_twin(src, oh, ow, interpolation), atol=1e-12)
    assert_fd(layer, x)


@FAST
@given(sizes, sizes, sizes, sizes)
def test_center_crop_crops_or_resizes_as_keras_s(h, w, oh, ow):
    """Catches: the window off centre by one (Keras floors (in - out) / 2), a smaller image
    refused or cropped instead of resized (Keras's smart_resize)."""
    x = np.random.default_rng(h + 11 * w).normal(size=(2, h, w, 1))
    layer = built(CenterCrop(oh, ow), (h, w, 1))
    if h >= oh and w >= ow:
        want = x[:, (h - oh) // 2:(h - oh) // 2 + oh, (w - ow) // 2:(w - ow) // 2 + ow]
    else:
        want = forward(built(Resizing(oh, ow, crop_to_aspect_ratio=True), (h, w, 1)), x)[0]
    np.testing.assert_allclose(forward(layer, x)[0], want, atol=1e-12)
    assert_fd(layer, x)


# -- augmentation ---------------------------------------------------------------------------------

def fill_twin(c: float, size: int, mode: str) -> float:
    """TensorFlow's MapCoordinate (image_ops.h), one coordinate."""
    if mode == "constant":
        return c
    if size <= 1:
        return 0.0
    if mode == "reflect":
        period = 2 * size
        if c < 0:
            if c < -period:
                c = period * int(-c / period) + c
            c = c + period if c < -size else -c - 1
        elif c > size - 1:
            c -= period * int(c / period)
            if c >= size:
                c = period - c - 1
    elif mode == "wrap":
        if c < 0:
            c += size * (int(-c / (size - 1)) + 1)
        elif c > size - 1:
            c -= size * int(c / (size - 1))
    return min(max(c, 0.0), size - 1.0)


def affine_twin(x, m, fill_mode, interpolation, fill_value):
    """TensorFlow's ImageProjectiveTransformV3 (affine), pixel by pixel."""
    n, h, w, c = x.shape
    out = np.zeros_like(x)

    def read(b, yy, xx):
        inside = 0 <= yy < h and 0 <= xx < w
        return x[b, int(yy), int(xx)] if inside else np.full(c, fill_value)
    for b in range(n):
        a0, a1, a2, b0, b1, b2 = m[b]
        for i in range(h):
            for j in range(w):
                sx = fill_twin(a0 * j + a1 * i + a2, w, fill_mode)
                sy = fill_twin(b0 * j + b1 * i + b2, h, fill_mode)
                if interpolation == "nearest":
                    out[b, i, j] = read(b, math.copysign(math.floor(abs(sy) + 0.5), sy),
                                        math.copysign(math.floor(abs(sx) + 0.5), sx))
                    continue
                y0, x0 = math.floor(sy), math.floor(sx)
                top = (x0 + 1 - sx) * read(b, y0, x0) + (sx - x0) * read(b, y0, x0 + 1)
                bottom = (x0 + 1 - sx) * read(b, y0 + 1, x0) + (sx - x0) * read(b, y0 + 1, x0 + 1)
                out[b, i, j] = (y0 + 1 - sy) * top + (sy - y0) * bottom
    return out


@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from(["reflect", "wrap", "constant", "nearest"]),
       st.sampled_from(["bilinear", "nearest"]), st.integers(0, 1000))
def test_the_affine_sampler_against_tensorflow_s_transform_and_finite_differences(h, w, fill, interpolation,
                                                                                  seed):
    """Rotations, zooms and shifts far enough to leave the image. Catches: a fill mode folded
    twice (TensorFlow's wrap is one branch or the other), banker's rounding in nearest, the
    fill_value's weight lost, an adjoint that scatters to the wrong pixels."""
    r = np.random.default_rng(seed)
    x = r.normal(size=(3, h, w, 2))
    m = affine_matrix(r.uniform(-180, 180, 3), r.uniform(0.3, 2.5, 3), r.uniform(0.3, 2.5, 3),
                      r.uniform(-2 * w, 2 * w, 3), r.uniform(-2 * h, 2 * h, 3), h, w)
    layer = built(RandomRotation(0.5, fill_mode=fill, interpolation=interpolation, fill_value=0.7), (h, w, 2))
    out = np.empty_like(x)
    layer.apply(x, out, sampling(m, h, w, fill, interpolation, x.dtype))
    np.testing.assert_allclose(out, affine_twin(x, m, fill, interpolation, 0.7), atol=1e-9)
    assert_fd(layer, x, seed)


@pytest.mark.parametrize("layer", [RandomFlip(), RandomFlip("horizontal"),
                                   RandomRotation(0.3, fill_mode="constant"),
                                   RandomZoom(0.4, (-0.2, 0.5), fill_mode="wrap"),
                                   RandomTranslation(0.3, 0.2, interpolation="nearest"),
                                   RandomContrast(0.6, value_range=(-1, 1))],
                         ids=lambda layer: type(layer).__name__)
def test_augmentation_is_the_identity_at_inference_and_its_vjp_matches_finite_differences(layer):
    """Catches: a transform at inference (predict, evaluate), a draw not kept for the backward
    pass (the VJP of another draw), RandomContrast's clip or mean left out of its VJP."""
    x = np.random.default_rng(3).uniform(-0.9, 0.9, size=(4, 5, 6, 2))
    built(layer, (5, 6, 2))
    out, _ = forward(layer, x, training=False)
    np.testing.assert_array_equal(out, x)
    assert not np.allclose(forward(layer, x, seed=5)[0], x)
    assert_fd(layer, x, seed=5)


def test_the_draws_follow_keras_s_ranges_and_formulas():
    """Catches: a factor read as degrees (Keras's is a fraction of 360), zoom's width not taking
    the height's draw, a translation not scaled by the image's size, RandomContrast's scalar
    factor drawn below 1 (Keras 3's [1 - 0, 1 + f]), a horizontal flip flipping rows."""
    rng = np.random.default_rng(0)
    rot = built(RandomRotation((-0.1, 0.05)), (8, 8, 1)).matrices(rng, 500)
    angles = np.degrees(np.arctan2(rot[:, 3], rot[:, 0]))
    assert -36 <= angles.min() < -30 and 12 < angles.max() <= 18
    zoom = built(RandomZoom(0.3), (8, 8, 1)).matrices(rng, 500)
    np.testing.assert_array_equal(zoom[:, 0], zoom[:, 4])
    assert 0.7 <= zoom[:, 0].min() < 0.75 and 1.25 < zoom[:, 0].max() <= 1.3
    shift = built(RandomTranslation(0.25, (0.0, 0.5)), (8, 10, 1)).matrices(rng, 500)
    assert -5 <= shift[:, 2].min() < -4.5 and shift[:, 2].max() <= 0
    assert -2 <= shift[:, 5].min() < -1.8 and 1.8 < shift[:, 5].max() <= 2
    contrast = built(RandomContrast(0.5), (2, 2, 1))
    f = contrast.draw(rng, np.zeros((500, 2, 2, 1)))["f"]
    assert 1 <= f.min() < 1.02 and 1.48 < f.max() <= 1.5
    x = np.arange(24.0).reshape(4, 2, 3, 1)
    out, s = forward(built(RandomFlip("horizontal"), (2, 3, 1)), x, seed=9)
    for b, flipped in enumerate(s["draw"]):
        np.testing.assert_array_equal(out[b], x[b, :, ::-1] if flipped else x[b])
    assert 0 < s["draw"].sum() < 4


def test_draws_are_seeded_per_rank_and_step_and_a_rerun_repeats_them():
    """Through the worker's gradient_fn (seed from run seed, rank, step). Catches: every worker
    drawing the same transforms (an augmented cluster trains on copies), a run that does not
    repeat, two layers of one model drawing the same."""
    inputs = Symbolic((None, 6, 6, 1))
    h = RandomRotation(0.2, name="rot")(RandomFlip(name="flip")(inputs))
    model = Functional(inputs, Dense(1)(keras.layers.Flatten()(h)), loss="mse").build()
    w = model.init_params(0)
    x = np.random.default_rng(0).normal(size=(8, 6, 6, 1)).astype(np.float32)
    y = np.zeros((8, 1), np.float32)

    def gradient(rank, step):
        g = np.zeros_like(w)
        gradient_fn(model, 7, rank, None)(w, x, y, g, step, [])
        return g
    assert np.array_equal(gradient(0, 3), gradient(0, 3))
    assert not np.allclose(gradient(0, 3), gradient(1, 3))
    assert not np.allclose(gradient(0, 3), gradient(0, 4))
    a, b = built(RandomFlip(name="a"), (2, 2, 1)), built(RandomFlip(name="b"), (2, 2, 1))
    images = np.zeros((64, 2, 2, 1))
    assert not np.array_equal(a.draw(a.rng(Pass(True, 1)), images), b.draw(b.rng(Pass(True, 1)), images))


def test_predict_and_evaluate_see_the_identity_in_a_model():
    """Catches: a model's inference passes (predict, evaluate, validation) run with training on."""
    x = np.random.default_rng(1).normal(size=(32, 5, 5, 1)).astype(np.float32)
    augmented = keras.Sequential([keras.Input(shape=(5, 5, 1)), keras.layers.RandomRotation(0.4),
                                  keras.layers.RandomContrast(0.5, value_range=(-9, 9)),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
    plain = keras.Sequential([keras.Input(shape=(5, 5, 1)), keras.layers.Flatten(), keras.layers.Dense(1)])
    for model in (augmented, plain):
        model.compile(optimizer="sgd", loss="mse")
    plain.set_weights(augmented.get_weights())
    np.testing.assert_array_equal(augmented.predict(x, verbose=0), plain.predict(x, verbose=0))
    y = np.ones((32, 1), np.float32)
    assert augmented.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0)


def test_an_eager_call_transforms_unless_training_is_false_as_keras_s():
    x = np.random.default_rng(0).normal(size=(16, 4, 4, 1)).astype(np.float32)
    layer = RandomFlip()
    assert not np.array_equal(layer(x), x)
    np.testing.assert_array_equal(layer(x, training=False), x)


def test_augmentation_refuses_keras_s_bad_arguments_in_one_line():
    for make in (lambda: RandomFlip("diagonal"), lambda: RandomRotation(1.5), lambda: RandomZoom(-1.0),
                 lambda: RandomTranslation(0.1, (0.1, 0.2, 0.3)), lambda: RandomContrast(-0.2),
                 lambda: RandomRotation(0.1, fill_mode="mirror"),
                 lambda: RandomZoom(0.1, interpolation="cubic"), lambda: Resizing(4, 4, interpolation="area"),
                 lambda: Resizing(4, 4, pad_to_aspect_ratio=True), lambda: CenterCrop(0, 3),
                 lambda: RandomFlip(data_format="channels_first")):
        with pytest.raises(ConfigError) as e:
            make()
        assert "\n" not in str(e.value)


def test_cuda_refuses_the_preprocessing_layers_in_one_line():
    from pserver.models import cuda_support
    for layer in (RandomFlip(), Resizing(3, 3)):
        inputs = Symbolic((None, 4, 4, 1))
        model = Functional(inputs, Dense(2)(keras.layers.Flatten()(layer(inputs)))).build()
        with pytest.raises(ConfigError, match=f"{type(layer).__name__}.*has no CUDA kernels") as e:
            cuda_support.check(model)
        assert "\n" not in str(e.value)


@pytest.mark.mnist
def test_keras_io_mnist_convnet_with_augmentation_in_front_trains_locally(mnist_dir):
    """keras.io's mnist_convnet with `layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)`
    in front (as keras.io's image examples put them), on 512 MNIST images for 2 epochs: the loss
    falls and the test accuracy is well above chance (0.1; 0.48 measured). Catches: augmentation that breaks
    training (a wrong VJP, garbage images) or that reaches evaluation."""
    (x, y), (xt, yt) = keras.datasets.mnist.load_data(str(mnist_dir))
    x, xt = (np.expand_dims(a.astype("float32") / 255, -1) for a in (x[:512], xt[:500]))
    y, yt = keras.utils.to_categorical(y[:512], 10), keras.utils.to_categorical(yt[:500], 10)
    layers = keras.layers
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.RandomFlip("horizontal"),
        layers.RandomRotation(0.1),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.25
