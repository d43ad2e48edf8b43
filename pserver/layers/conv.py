"""Conv2D on channels-last images: x (n, h, w, c), kernel (kh, kw, c, filters), Keras's padding."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import activations, initializers
from pserver.layers import base
from pserver.layers.base import Layer, Weight, pair, positive_int


class Conv2D(Layer):
    kind = "conv2d"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", activation=None,
                 use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.filters = positive_int("Conv2D", "filters", filters)
        self.kernel_size = pair("Conv2D", "kernel_size", kernel_size)
        self.strides = pair("Conv2D", "strides", strides)
        self.padding = base.padding("Conv2D", padding)
        self.activation = activations.get(activation, "Conv2D")
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer, "Conv2D: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, "Conv2D: bias_initializer")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        (oh, self.pad_top), (ow, self.pad_left) = window_output(
            self, input_shape, self.kernel_size, self.strides, self.padding, "kernel")
        return (oh, ow, self.filters)

    def weights(self):
        kh, kw = self.kernel_size
        w = [Weight("kernel", (kh, kw, self.input_shape[2], self.filters), self.kernel_initializer)]
        if self.use_bias:
            w.append(Weight("bias", (self.filters,), self.bias_initializer))
        return w

    def scratch(self, n, dtype):
        return {} if self.use_bias else {"bias": np.zeros(self.filters, dtype),
                                         "dbias": np.empty(self.filters, dtype)}

    def forward(self, k, p, x, out, s, run):
        bias = p["bias"] if self.use_bias else s["bias"]
        k.conv2d_forward(x, p["kernel"], bias, out, *self.strides, self.pad_top, self.pad_left,
                         self.activation == "relu")
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        activations.backward(k, self.activation, out, dout)
        dbias = g["bias"] if self.use_bias else s["dbias"]
        k.conv2d_backward(x, p["kernel"], dout, dx, g["kernel"], dbias, *self.strides,
                          self.pad_top, self.pad_left)


def window_output(layer: Layer, input_shape, window, strides, pad: str, what: str):
    """((out_h, pad_top), (out_w, pad_left)) of a sliding window, as Keras computes them;
    a window larger than an unpadded input is an error naming the layer and the shapes."""
    from pserver.kernels import conv_output
    dims = []
    for axis, size, win, stride in zip(("height", "width"), input_shape[:2], window, strides):
        out, before = conv_output(size, win, stride, pad)
        if out < 1:
            raise ConfigError(f"{layer.label}: {what} {window[0]}x{window[1]} is larger than its "
                              f"input {input_shape} ({axis} {size}) with padding 'valid'")
        dims.append((out, before))
    return tuple(dims)
