"""MaxPooling2D and AveragePooling2D on channels-last images, with Keras's defaults
(pool_size 2, strides = pool_size, padding 'valid')."""

from __future__ import annotations

import numpy as np

from pserver.layers import base
from pserver.layers.base import Layer, pair
from pserver.layers.conv import window_output
from pserver.ops import reduce
from pserver.ops.shape import expand_dims


class _Pooling2D(Layer):
    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.pool_size = pair(owner, "pool_size", pool_size)
        self.strides = self.pool_size if strides is None else pair(owner, "strides", strides)
        self.padding = base.padding(owner, padding)

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        (oh, self.pad_top), (ow, self.pad_left) = window_output(
            self, input_shape, self.pool_size, self.strides, self.padding, "pool_size")
        return (oh, ow, input_shape[2])

    @property
    def window(self) -> tuple[int, int, int, int, int, int]:
        return (*self.pool_size, *self.strides, self.pad_top, self.pad_left)


class MaxPooling2D(_Pooling2D):
    kind = "max_pooling2d"

    def scratch(self, n, dtype):
        # Where each output's maximum came from, so backward routes its gradient there.
        return {"argmax": np.empty((n, *self.output_shape), np.int32)}

    def forward(self, k, p, x, out, s, run):
        k.maxpool2d_forward(x, out, s["argmax"], *self.window)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.maxpool2d_backward(dout, s["argmax"], dx)


class AveragePooling2D(_Pooling2D):
    kind = "average_pooling2d"

    def forward(self, k, p, x, out, s, run):
        k.avgpool2d_forward(x, out, *self.window)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.avgpool2d_backward(dout, dx, *self.window)


class _GlobalPooling(Layer):
    """Over every position of a sequence (n, steps, c) or an image (n, h, w, c): (n, c), or
    with keepdims=True (n, 1, c) / (n, 1, 1, c), as Keras's."""
    rank = 2

    def __init__(self, data_format=None, keepdims: bool = False, **kwargs):
        super().__init__(**kwargs)
        base.channels_last(type(self).__name__, data_format)
        self.keepdims = bool(keepdims)

    def output_shape_for(self, input_shape):
        what = "a sequence (steps, channels)" if self.rank == 2 else "an image (height, width, channels)"
        self.expect_rank(input_shape, self.rank, what)
        return (*(1,) * (self.rank - 1), input_shape[-1]) if self.keepdims else (input_shape[-1],)

    @property
    def _axes(self) -> tuple[int, ...]:
        return tuple(range(1, self.rank))

    # The channels from the layer's own shape: a device array's shape takes no negative index.
    def _columns(self, x):
        """x as (n, positions, c)."""
        c = self.output_shape[-1]
        return x.reshape(x.shape[0], x.size // (x.shape[0] * c), c)

    def _flat(self, out):
        """out as (n, c), with keepdims too."""
        return out.reshape(out.shape[0], self.output_shape[-1])


class _GlobalAverage(_GlobalPooling):
    def forward(self, k, p, x, out, s, run):
        k.global_avgpool_forward(self._columns(x), self._flat(out))

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.global_avgpool_backward(self._flat(dout), self._columns(dx))


class _GlobalMax(_GlobalPooling):
    def scratch(self, n, dtype):
        # The first position holding each (sample, channel)'s maximum, where its gradient goes.
        return {"argmax": np.empty((n, self.output_shape[-1]), np.int32)}

    def forward(self, k, p, x, out, s, run):
        k.global_maxpool_forward(self._columns(x), self._flat(out), s["argmax"])

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.global_maxpool_backward(self._flat(dout), s["argmax"], self._columns(dx))


class GlobalAveragePooling1D(_GlobalAverage):
    kind = "global_average_pooling1d"

    def __call__(self, inputs, training=None, mask=None, **kwargs):
        """With a mask (mask=, or the one the sequence carries: Embedding(mask_zero=True)), Keras's
        masked mean: sum(x * mask) / sum(mask) over the steps (NaN for a sample with no step, as
        Keras's), made of ops; without, the layer's kernel."""
        mask = base.sequence_mask(self.label, inputs, base.mask_of(inputs, mask))
        if mask is None:
            return super().__call__(inputs, training=training, **kwargs)
        self.build_once(inputs.shape[1:])
        m = expand_dims(mask, -1)
        return reduce.sum(inputs * m, axis=1, keepdims=self.keepdims) / reduce.sum(m, axis=1,
                                                                                  keepdims=self.keepdims)


class GlobalAveragePooling2D(_GlobalAverage):
    kind = "global_average_pooling2d"
    rank = 3


class GlobalMaxPooling1D(_GlobalMax):
    kind = "global_max_pooling1d"


class GlobalMaxPooling2D(_GlobalMax):
    kind = "global_max_pooling2d"
    rank = 3
