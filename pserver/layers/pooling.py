"""MaxPooling2D and AveragePooling2D on channels-last images, with Keras's defaults
(pool_size 2, strides = pool_size, padding 'valid')."""

from __future__ import annotations

import numpy as np

from pserver.layers import base
from pserver.layers.base import Layer, pair
from pserver.layers.conv import window_output


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
