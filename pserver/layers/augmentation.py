"""Keras's image augmentation layers: RandomFlip, RandomRotation, RandomZoom, RandomTranslation,
RandomContrast. Active only in training (the identity at inference: predict, evaluate, a
validation pass); each draws its transforms per sample from the step's seed, which the worker
derives from (run seed, rank, step) as Dropout's (pserver.worker.loop.gradient_fn), mixed with
the layer's seed and name: a rerun draws the same, two workers or steps or layers different ones.

For a given draw every transform is linear in the image (RandomContrast up to its clip, the
affine ones up to the constant fill), so each has its VJP, the adjoint of the draw it made, and
may sit anywhere in a model. The affine ones (rotation, zoom, translation) are TensorFlow's
ImageProjectiveTransform, as Keras's: an output pixel (row y, column x) reads the input at
(b0 x + b1 y + b2, a0 x + a1 y + a2), mapped into the image by the fill mode (reflect, wrap,
nearest; constant reads fill_value outside), then bilinear (its four neighbours) or nearest.
NumPy in both passes (memory-bound); no CUDA (--device cuda refuses them).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import base
from pserver.layers.base import Layer, Pass

FILL_MODES = ("reflect", "wrap", "constant", "nearest")
INTERPOLATIONS = ("bilinear", "nearest")
FLIP_MODES = ("horizontal", "vertical", "horizontal_and_vertical")


def factor_range(owner: str, what: str, value, low: float, high: float, *, open_low=False) -> tuple:
    """Keras's factor as (lower, upper): a number f gives (max(-f, low), f), a pair itself
    sorted; each value given in [low, high] (above `low` when open_low: RandomZoom's -1 would
    leave no image)."""
    values = list(value) if isinstance(value, (tuple, list)) else [value]

    def fits(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            return False
        return (low < v if open_low else low <= v) and v <= high
    if len(values) not in (1, 2) or not all(fits(v) for v in values):
        opening = "(" if open_low else "["
        raise ConfigError(f"{owner}: {what} must be a number or a pair of numbers in {opening}{low:g}, "
                          f"{high:g}], got {value!r}")
    if len(values) == 2:
        return tuple(sorted(float(v) for v in values))
    f = abs(float(values[0]))
    return max(-f, low), f


class _Augmentation(Layer):
    """An image layer that transforms in training only: `draw` the batch's transforms,
    `apply` them (into out), `adjoint` (dout into dx). An eager call on arrays transforms, as
    Keras's (training=True unless given)."""

    def __init__(self, seed=None, data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last(type(self).__name__, data_format)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ConfigError(f"{type(self).__name__}: seed must be an integer or None, got {seed!r}")
        self.seed = seed
        self._eager_seeds = itertools.count()

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        return input_shape

    def eager_pass(self, training) -> Pass:
        return Pass(training=training is not False, seed=next(self._eager_seeds))

    def rng(self, run: Pass) -> np.random.Generator:
        """The step's generator: (its seed, the layer's seed, the layer's name)."""
        name = zlib.crc32((self.name or self.kind).encode())
        return np.random.default_rng([run.seed % (1 << 64), (self.seed or 0) % (1 << 64), name])

    def forward(self, k, p, x, out, s, run):
        s["draw"] = self.draw(self.rng(run), x) if run.training else None
        if s["draw"] is None:
            out[...] = x
        else:
            self.apply(x, out, s["draw"])

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is None:
            return
        if s.get("draw") is None:
            dx[...] = dout
        else:
            self.adjoint(dout, dx, s["draw"])


class RandomFlip(_Augmentation):
    """RandomFlip(mode='horizontal_and_vertical', seed=None): each image flipped with
    probability 1/2; 'horizontal_and_vertical' flips both axes on one draw, as Keras 3's."""

    kind = "random_flip"

    def __init__(self, mode="horizontal_and_vertical", seed=None, data_format=None, **kwargs):
        super().__init__(seed, data_format, **kwargs)
        if mode not in FLIP_MODES:
            raise ConfigError(f"RandomFlip: mode must be one of {', '.join(FLIP_MODES)}, got {mode!r}")
        self.mode = mode
        self.axes = tuple(a for a, word in ((1, "vertical"), (2, "horizontal")) if word in mode)

    def draw(self, rng, x):
        return rng.uniform(size=len(x)) <= 0.5

    def apply(self, x, out, flips):
        out[...] = x
        out[flips] = np.flip(x[flips], axis=self.axes)

    def adjoint(self, dout, dx, flips):
        self.apply(dout, dx, flips)          # a flip is its own adjoint


class RandomContrast(_Augmentation):
    """RandomContrast(factor, value_range=(0, 255), seed=None): each image's channels moved
    from their mean by a factor drawn in [1 - lower, 1 + upper] ((lower, upper) from factor, in
    [0, 1], as Keras's: a number f gives [1, 1 + f]), then clipped to value_range."""

    kind = "random_contrast"

    def __init__(self, factor, value_range=(0, 255), seed=None, **kwargs):
        super().__init__(seed, **kwargs)
        self.factor = factor_range("RandomContrast", "factor", factor, 0.0, 1.0)
        if not isinstance(value_range, (tuple, list)) or len(value_range) != 2 or \
                not value_range[0] < value_range[1]:
            raise ConfigError(f"RandomContrast: value_range must be (low, high) with low < high, got "
                              f"{value_range!r}")
        self.value_range = tuple(float(v) for v in value_range)

    def draw(self, rng, x):
        lower, upper = self.factor
        return {"f": rng.uniform(1.0 - lower, 1.0 + upper, (len(x), 1, 1, 1)).astype(x.dtype)}

    def apply(self, x, out, draw):
        mean = x.mean(axis=(1, 2), keepdims=True)
        y = (x - mean) * draw["f"] + mean
        draw["inside"] = (y >= self.value_range[0]) & (y <= self.value_range[1])     # the clip's VJP
        np.clip(y, *self.value_range, out=out)

    def adjoint(self, dout, dx, draw):
        f, g = draw["f"], np.where(draw["inside"], dout, 0)
        dx[...] = g * f + (1 - f) * g.mean(axis=(1, 2), keepdims=True)


class _Affine(_Augmentation):
    """A layer whose draw is an affine map per image (`matrices`: (n, 6), a0 a1 a2 b0 b1 b2)."""

    def __init__(self, fill_mode, interpolation, seed, fill_value, data_format, **kwargs):
        super().__init__(seed, data_format, **kwargs)
        owner = type(self).__name__
        if fill_mode not in FILL_MODES:
            raise ConfigError(f"{owner}: fill_mode must be one of {', '.join(FILL_MODES)}, got {fill_mode!r}")
        if interpolation not in INTERPOLATIONS:
            raise ConfigError(f"{owner}: interpolation must be 'bilinear' or 'nearest', got "
                              f"{interpolation!r}")
        if isinstance(fill_value, bool) or not isinstance(fill_value, (int, float)):
            raise ConfigError(f"{owner}: fill_value must be a number, got {fill_value!r}")
        self.fill_mode, self.interpolation, self.fill_value = fill_mode, interpolation, float(fill_value)

    def draw(self, rng, x):
        h, w = x.shape[1:3]
        return sampling(self.matrices(rng, len(x)), h, w, self.fill_mode, self.interpolation, x.dtype)

    def apply(self, x, out, draw):
        index, weight, outside = draw
        n, h, w, c = x.shape
        flat = x.reshape(n * h * w, c)
        out.reshape(n, h * w, c)[...] = np.einsum("npk,npkc->npc", weight, flat[index]) + \
            (self.fill_value * outside)[..., None]

    def adjoint(self, dout, dx, draw):
        index, weight, _ = draw
        n, h, w, c = dx.shape
        g = dout.reshape(n, h * w, 1, c) * weight[..., None]
        flat = dx.reshape(n * h * w, c)
        for ch in range(c):
            flat[:, ch] = np.bincount(index.ravel(), g[..., ch].ravel(), minlength=n * h * w)


def sampling(m: np.ndarray, h: int, w: int, fill_mode: str, interpolation: str, dtype=np.float32):
    """What each output pixel reads under the maps `m` (n, 6): (index, weight, outside), the
    flat indices into the batch's (n * h * w) pixels (n, h * w, k) with their weights (k = 4
    bilinear, 1 nearest; 0 for a neighbour outside the image) and the weight of fill_value (n, h * w)."""
    n = len(m)
    ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    xs, ys = xs.ravel()[None], ys.ravel()[None]
    a0, a1, a2, b0, b1, b2 = (m[:, i:i + 1] for i in range(6))
    sx = _fill(a0 * xs + a1 * ys + a2, w, fill_mode)
    sy = _fill(b0 * xs + b1 * ys + b2, h, fill_mode)
    if interpolation == "nearest":
        points = [(_round(sy), _round(sx), np.ones_like(sx))]
    else:
        y0, x0 = np.floor(sy), np.floor(sx)
        points = [(y0 + dy, x0 + dx, (1 - abs(sy - y0 - dy)) * (1 - abs(sx - x0 - dx)))
                  for dy in (0, 1) for dx in (0, 1)]
    base_index = (np.arange(n) * h * w)[:, None]
    index, weight = [], []
    for py, px, wt in points:
        inside = (py >= 0) & (py < h) & (px >= 0) & (px < w)
        index.append(base_index + np.where(inside, py * w + px, 0).astype(np.int64))
        weight.append(np.where(inside, wt, 0.0))
    index, weight = np.stack(index, -1), np.stack(weight, -1)
    outside = sum(wt for _, _, wt in points) - weight.sum(-1)
    return index, weight.astype(dtype), outside.astype(dtype)


def _round(v):
    """C's round: halves away from zero (TensorFlow's nearest)."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _fill(c: np.ndarray, size: int, mode: str) -> np.ndarray:
    """Input coordinates mapped into [0, size - 1] as TensorFlow's fill modes do (constant:
    unchanged; what falls outside reads fill_value)."""
    if mode == "constant":
        return c
    if size <= 1:
        return np.zeros_like(c)
    if mode == "reflect":
        period = 2 * size
        c = np.where(c < -period, period * np.trunc(-c / period) + c, c)
        c = np.where(c < 0, np.where(c < -size, c + period, -c - 1), c)
        high = c - period * np.trunc(c / period)
        c = np.where(c > size - 1, np.where(high >= size, period - high - 1, high), c)
    elif mode == "wrap":
        c = np.where(c < 0, c + size * (np.trunc(-c / (size - 1)) + 1),          # TensorFlow's, its
                     np.where(c > size - 1, c - size * np.trunc(c / (size - 1)), c))   # size - 1 too
    return np.clip(c, 0, size - 1)


def affine_matrix(angle, scale_x, scale_y, translate_x, translate_y, h: int, w: int) -> np.ndarray:
    """(n, 6): per image, output (x, y) -> input (a0 x + a1 y + a2, b0 x + b1 y + b2), rotating
    by `angle` (degrees) and scaling about the centre ((w - 1) / 2, (h - 1) / 2), then shifting:
    Keras's _compute_affine_matrix (no shear) and its zoom matrix."""
    theta = np.deg2rad(angle)
    cos, sin = np.cos(theta), np.sin(theta)
    cx, cy = (w - 1) / 2, (h - 1) / 2
    a0, a1 = scale_x * cos, -scale_x * sin
    b0, b1 = scale_y * sin, scale_y * cos
    return np.stack([a0, a1, translate_x + cx - cx * a0 - cy * a1,
                     b0, b1, translate_y + cy - cx * b0 - cy * b1], axis=1)


class RandomRotation(_Affine):
    """RandomRotation(factor, fill_mode='reflect', interpolation='bilinear', seed=None,
    fill_value=0.0): each image rotated about its centre by an angle drawn in
    [lower, upper] * 360 degrees (factor f: [-f, f])."""

    kind = "random_rotation"

    def __init__(self, factor, fill_mode="reflect", interpolation="bilinear", seed=None, fill_value=0.0,
                 data_format=None, **kwargs):
        super().__init__(fill_mode, interpolation, seed, fill_value, data_format, **kwargs)
        self.factor = factor_range("RandomRotation", "factor", factor, -1.0, 1.0)

    def matrices(self, rng, n):
        h, w, _ = self.input_shape
        angle = rng.uniform(self.factor[0] * 360, self.factor[1] * 360, n)
        return affine_matrix(angle, np.ones(n), np.ones(n), np.zeros(n), np.zeros(n), h, w)


class RandomZoom(_Affine):
    """RandomZoom(height_factor, width_factor=None, fill_mode='reflect', interpolation='bilinear',
    seed=None, fill_value=0.0): each image zoomed about its centre; a factor f in (-1, 1] reads
    1 + f times the image's extent (positive: zoomed out), drawn in [1 + lower, 1 + upper];
    without width_factor the width takes the height's draw (the aspect ratio kept)."""

    kind = "random_zoom"

    def __init__(self, height_factor, width_factor=None, fill_mode="reflect", interpolation="bilinear",
                 seed=None, fill_value=0.0, data_format=None, **kwargs):
        super().__init__(fill_mode, interpolation, seed, fill_value, data_format, **kwargs)
        self.height_factor = factor_range("RandomZoom", "height_factor", height_factor, -1.0, 1.0,
                                          open_low=True)
        self.width_factor = None if width_factor is None else \
            factor_range("RandomZoom", "width_factor", width_factor, -1.0, 1.0, open_low=True)

    def matrices(self, rng, n):
        h, w, _ = self.input_shape
        zy = rng.uniform(1 + self.height_factor[0], 1 + self.height_factor[1], n)
        wide = self.width_factor
        zx = zy if wide is None else rng.uniform(1 + wide[0], 1 + wide[1], n)
        return affine_matrix(np.zeros(n), zx, zy, np.zeros(n), np.zeros(n), h, w)


class RandomTranslation(_Affine):
    """RandomTranslation(height_factor, width_factor, fill_mode='reflect', interpolation='bilinear',
    seed=None, fill_value=0.0): each image shifted by a fraction of its height and width drawn in
    [lower, upper] (a factor f in [0, 1]: [-f, f])."""

    kind = "random_translation"

    def __init__(self, height_factor, width_factor, fill_mode="reflect", interpolation="bilinear", seed=None,
                 fill_value=0.0, data_format=None, **kwargs):
        super().__init__(fill_mode, interpolation, seed, fill_value, data_format, **kwargs)
        self.height_factor = factor_range("RandomTranslation", "height_factor", height_factor, -1.0, 1.0)
        self.width_factor = factor_range("RandomTranslation", "width_factor", width_factor, -1.0, 1.0)

    def matrices(self, rng, n):
        h, w, _ = self.input_shape
        dy = rng.uniform(*self.height_factor, n) * h
        dx = rng.uniform(*self.width_factor, n) * w
        return affine_matrix(np.zeros(n), np.ones(n), np.ones(n), -dx, -dy, h, w)


__all__ = ["RandomFlip", "RandomContrast", "RandomRotation", "RandomZoom", "RandomTranslation",
           "affine_matrix", "sampling"]
