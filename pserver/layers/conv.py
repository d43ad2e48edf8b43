"""Conv2D on channels-last images: x (n, h, w, c), kernel (kh, kw, c, filters), Keras's padding."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import activations, base
from pserver.layers.base import KernelLayer, Layer, pair, positive_int


class Conv2D(KernelLayer):
    kind = "conv2d"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", activation=None,
                 use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        self.filters = positive_int("Conv2D", "filters", filters)
        super().__init__(self.filters, activation, use_bias, kernel_initializer, bias_initializer,
                         **kwargs)
        self.kernel_size = pair("Conv2D", "kernel_size", kernel_size)
        self.strides = pair("Conv2D", "strides", strides)
        self.padding = base.padding("Conv2D", padding)

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        (oh, self.pad_top), (ow, self.pad_left) = window_output(
            self, input_shape, self.kernel_size, self.strides, self.padding, "kernel")
        return (oh, ow, self.filters)

    def kernel_shape(self):
        return (*self.kernel_size, self.input_shape[2], self.filters)

    def forward_elements(self):
        oh, ow, _ = self.output_shape
        return super().forward_elements() + oh * ow * int(np.prod(self.kernel_shape()[:3]))

    def forward(self, k, p, x, out, s, run):
        relu = self.activation == "relu"
        # In training, a backend with conv2d_forward_cols (the CPU ones: CPU_KERNELS) keeps the
        # im2col matrix of x for the backward pass, in a scratch buffer made at the first
        # training step of this batch size (evaluation and the GPU never make one).
        keep = getattr(k, "conv2d_forward_cols", None) if run.training else None
        if keep is None:
            s["cols_of"] = None
            k.conv2d_forward(x, p["kernel"], self.bias(p, s), out, *self.strides, self.pad_top,
                             self.pad_left, relu)
        else:
            if "cols" not in s:
                s["cols"] = np.empty((out.size // self.filters, int(np.prod(self.kernel_shape()[:3]))),
                                     out.dtype)
            keep(x, p["kernel"], self.bias(p, s), out, s["cols"], *self.strides, self.pad_top,
                 self.pad_left, relu)
            s["cols_of"] = x
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if s.get("cols_of") is x:          # this step's forward kept them; used once
            s["cols_of"] = None
            relu = self.activation == "relu"              # fused into the kernel's pass over dout
            if not relu:
                activations.backward(k, self.activation, out, dout)
            k.conv2d_backward_cols(s["cols"], p["kernel"], out, dout, dx, g["kernel"], self.dbias(g, s),
                                   *self.strides, self.pad_top, self.pad_left, relu)
            return
        activations.backward(k, self.activation, out, dout)
        k.conv2d_backward(x, p["kernel"], dout, dx, g["kernel"], self.dbias(g, s), *self.strides,
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
