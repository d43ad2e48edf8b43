"""Layers that move a sequence's or an image's values without arithmetic beyond sums, channels
last, Keras's arguments: ZeroPadding1D/2D, Cropping1D/2D, UpSampling1D/2D ('nearest').
Memory-bound, so NumPy in both passes on the host (no backend kernel; no CUDA: --device cuda
refuses them, pserver.models.cuda_support)."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import base
from pserver.layers.base import Layer, pair, positive_int

_WHAT = {1: "a sequence (steps, channels)", 2: "an image (height, width, channels)"}


def sides(owner: str, what: str, value, rank: int) -> tuple[tuple[int, int], ...]:
    """Keras's padding or cropping as a (before, after) pair per axis: an int (every side); for
    rank 1 a pair (before, after); for rank 2 an int per axis (both its sides) or a pair of pairs
    ((top, bottom), (left, right))."""
    forms = ("an int or a (before, after) pair" if rank == 1
             else "an int, a pair of ints or a pair of (before, after) pairs")

    def bad():
        return ConfigError(f"{owner}: {what} must be {forms} of non-negative ints, got {value!r}")

    def count(v) -> int:
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise bad()
        return int(v)

    if not isinstance(value, (tuple, list)):
        return ((count(value),) * 2,) * rank
    if len(value) != 2:
        raise bad()
    if rank == 1:
        return ((count(value[0]), count(value[1])),)
    return tuple((count(v[0]), count(v[1])) if isinstance(v, (tuple, list)) and len(v) == 2
                 else (count(v),) * 2 for v in value)


class _Spatial(Layer):
    """A layer on (steps, c) sequences (rank 1) or (h, w, c) images (rank 2)."""
    rank = 2

    def check_rank(self, input_shape):
        self.expect_rank(input_shape, self.rank + 1, _WHAT[self.rank])


class _Margins(_Spatial):
    """ZeroPadding and Cropping: the smaller array is the larger one's inner region, which
    `self.sides` ((before, after) per axis) surround."""
    grows = True              # ZeroPadding: the output is the larger array; Cropping: the input

    def output_shape_for(self, input_shape):
        self.check_rank(input_shape)
        sign = 1 if self.grows else -1
        dims = tuple(d + sign * (a + b) for d, (a, b) in zip(input_shape, self.sides))
        if min(dims) < 1:
            raise ConfigError(f"{self.label}: cropping {self.sides} leaves nothing of its input "
                              f"{input_shape}")
        return (*dims, input_shape[-1])

    def _images(self, a):
        """a as (n, h, w, c): a sequence (n, steps, c) as one-row images."""
        return a if len(a.shape) == 4 else a.reshape(a.shape[0], 1, a.shape[1], a.shape[2])

    def _starts(self) -> tuple[int, int]:
        """Where the smaller array starts in the larger one, as (row, column) of the images."""
        befores = [a for a, _ in self.sides]
        return (0, befores[0]) if self.rank == 1 else (befores[0], befores[1])

    def forward(self, k, p, x, out, s, run):
        if self.grows:
            k.fill(out, 0.0)
            k.window_into(self._images(x), self._images(out), self._starts())
        else:
            k.window_from(self._images(x), self._starts(), self._images(out))

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is None:
            return
        if self.grows:
            k.window_from(self._images(dout), self._starts(), self._images(dx))
        else:
            k.fill(dx, 0.0)
            k.window_into(self._images(dout), self._images(dx), self._starts())


class ZeroPadding1D(_Margins):
    """ZeroPadding1D(padding=1): zeros before and after a sequence's steps."""
    kind = "zero_padding1d"
    rank = 1

    def __init__(self, padding=1, data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last("ZeroPadding1D", data_format)
        self.sides = sides("ZeroPadding1D", "padding", padding, 1)


class ZeroPadding2D(_Margins):
    """ZeroPadding2D(padding=(1, 1)): rows of zeros above and below an image, columns left and right."""
    kind = "zero_padding2d"

    def __init__(self, padding=(1, 1), data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last("ZeroPadding2D", data_format)
        self.sides = sides("ZeroPadding2D", "padding", padding, 2)


class Cropping1D(_Margins):
    """Cropping1D(cropping=(1, 1)): steps cut from a sequence's start and end."""
    kind = "cropping1d"
    rank, grows = 1, False

    def __init__(self, cropping=(1, 1), **kwargs):
        super().__init__(**kwargs)
        self.sides = sides("Cropping1D", "cropping", cropping, 1)


class Cropping2D(_Margins):
    """Cropping2D(cropping=((0, 0), (0, 0))): rows cut from an image's top and bottom, columns
    from its left and right."""
    kind = "cropping2d"
    grows = False

    def __init__(self, cropping=((0, 0), (0, 0)), data_format=None, **kwargs):
        super().__init__(**kwargs)
        base.channels_last("Cropping2D", data_format)
        self.sides = sides("Cropping2D", "cropping", cropping, 2)


class _UpSampling(_Spatial):
    """Each step (each pixel) repeated `self.size` times along each axis ('nearest')."""

    def output_shape_for(self, input_shape):
        self.check_rank(input_shape)
        return (*(d * f for d, f in zip(input_shape, self.size)), input_shape[-1])

    def _blocks(self, a, copies: bool = True):
        """`a` as (n, d1, f1, d2, f2, ..., c): each input element's copies (the output), or with
        copies=False (n, d1, 1, d2, 1, ..., c) (the input), which broadcasts to them."""
        dims = [x for d, f in zip(self.input_shape, self.size) for x in (d, f if copies else 1)]
        return a.reshape(a.shape[0], *dims, self.input_shape[-1])

    def forward(self, k, p, x, out, s, run):
        k.broadcast_to(self._blocks(x, copies=False), self._blocks(out))

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.sum_to(self._blocks(dout), self._blocks(dx, copies=False))


class UpSampling1D(_UpSampling):
    """UpSampling1D(size=2): each step repeated size times."""
    kind = "up_sampling1d"
    rank = 1

    def __init__(self, size=2, **kwargs):
        super().__init__(**kwargs)
        self.size = (positive_int("UpSampling1D", "size", size),)


class UpSampling2D(_UpSampling):
    """UpSampling2D(size=(2, 2), interpolation='nearest'): each pixel repeated size[0] times
    down and size[1] times across."""
    kind = "up_sampling2d"

    def __init__(self, size=(2, 2), data_format=None, interpolation="nearest", **kwargs):
        super().__init__(**kwargs)
        base.channels_last("UpSampling2D", data_format)
        if interpolation != "nearest":
            raise ConfigError(f"UpSampling2D: interpolation={interpolation!r} is not supported ('nearest' "
                              "only)")
        self.size = pair("UpSampling2D", "size", size)
