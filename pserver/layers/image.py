"""Resizing and CenterCrop, Keras's (TensorFlow's resize: half-pixel centers, no antialiasing),
channels-last images. Each is linear in its input and separable: out = A_h @ x @ A_w^T per channel,
with A_h (out_height, in_height) and A_w (out_width, in_width) the interpolation matrices
(`axis_matrix`); the VJP is the transpose. NumPy in both passes (memory-bound); no CUDA:
--device cuda refuses them (pserver.models.cuda_support)."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import base
from pserver.layers.base import Layer, positive_int

INTERPOLATIONS = ("bilinear", "nearest")


def axis_matrix(out_size: int, in_size: int, interpolation: str, start: int = 0,
                span: int | None = None) -> np.ndarray:
    """(out_size, in_size): row i weighs the input positions output i reads, resizing the
    window [start, start + span) of the axis to out_size as tf.image.resize does: output i
    sits at (i + 0.5) * scale - 0.5 of the window, scale = span / out_size; 'bilinear' mixes the
    two positions around it (clamped to the window), 'nearest' takes floor((i + 0.5) * scale)."""
    span = in_size if span is None else span
    scale = span / out_size
    m = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    if interpolation == "nearest":
        m[rows, start + np.minimum(np.floor((rows + 0.5) * scale).astype(int), span - 1)] = 1
        return m
    at = (rows + 0.5) * scale - 0.5
    low = np.floor(at)
    lerp = at - low
    lo = np.clip(low, 0, span - 1).astype(int) + start
    hi = np.clip(low + 1, 0, span - 1).astype(int) + start
    np.add.at(m, (rows, lo), 1 - lerp)
    np.add.at(m, (rows, hi), lerp)
    return m


def aspect_window(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int, int, int]:
    """(top, rows, left, columns): the largest centred window of the target's aspect ratio, at
    least one pixel a side (Keras's crop_to_aspect_ratio and smart_resize)."""
    rows = max(min(height, int(float(width * target_h) / target_w)), 1)
    cols = max(min(width, int(float(height * target_w) / target_h)), 1)
    return int((height - rows) / 2), rows, int((width - cols) / 2), cols


class _Linear2D(Layer):
    """An image layer that applies `self.matrices` (A_h, A_w), set at build, to each channel."""

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        self.matrices = self.plan(*input_shape[:2])
        return (self.height, self.width, input_shape[2])

    def forward(self, k, p, x, out, s, run):
        a_h, a_w = (m.astype(x.dtype) for m in self.matrices)
        out[...] = np.einsum("ih,nhwc,jw->nijc", a_h, x, a_w, optimize=True)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            a_h, a_w = (m.astype(dout.dtype) for m in self.matrices)
            dx[...] = np.einsum("ih,nijc,jw->nhwc", a_h, dout, a_w, optimize=True)


class Resizing(_Linear2D):
    """Resizing(height, width, interpolation='bilinear', crop_to_aspect_ratio=False): each image
    resized to (height, width); crop_to_aspect_ratio first crops the largest centred window of
    the output's aspect ratio."""

    kind = "resizing"

    def __init__(self, height, width, interpolation="bilinear", crop_to_aspect_ratio=False,
                 pad_to_aspect_ratio=False, fill_mode="constant", fill_value=0.0, antialias=False,
                 data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last("Resizing", data_format)
        for what, v in (("pad_to_aspect_ratio", pad_to_aspect_ratio), ("antialias", antialias)):
            if v:
                raise ConfigError(f"Resizing: {what}=True is not supported (docs/guide/keras.md)")
        if interpolation not in INTERPOLATIONS:
            raise ConfigError(f"Resizing: interpolation={interpolation!r} is not supported ('bilinear' or "
                              "'nearest')")
        self.height = positive_int("Resizing", "height", height)
        self.width = positive_int("Resizing", "width", width)
        self.interpolation, self.crop_to_aspect_ratio = interpolation, bool(crop_to_aspect_ratio)

    def plan(self, height: int, width: int):
        top, rows, left, cols = (aspect_window(height, width, self.height, self.width)
                                 if self.crop_to_aspect_ratio else (0, height, 0, width))
        return (axis_matrix(self.height, height, self.interpolation, top, rows),
                axis_matrix(self.width, width, self.interpolation, left, cols))


class CenterCrop(_Linear2D):
    """CenterCrop(height, width): the centred (height, width) window of each image; an image
    smaller than that in either side is resized to it instead, bilinear, after cropping its
    largest centred window of that aspect ratio (Keras's smart_resize)."""

    kind = "center_crop"

    def __init__(self, height, width, data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last("CenterCrop", data_format)
        self.height = positive_int("CenterCrop", "height", height)
        self.width = positive_int("CenterCrop", "width", width)

    def plan(self, height: int, width: int):
        if height >= self.height and width >= self.width:
            return (np.eye(self.height, height, (height - self.height) // 2),
                    np.eye(self.width, width, (width - self.width) // 2))
        top, rows, left, cols = aspect_window(height, width, self.height, self.width)
        return (axis_matrix(self.height, height, "bilinear", top, rows),
                axis_matrix(self.width, width, "bilinear", left, cols))


__all__ = ["Resizing", "CenterCrop", "axis_matrix", "aspect_window"]
