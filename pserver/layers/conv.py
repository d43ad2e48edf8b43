"""Convolutions on channels-last data: Conv2D on images x (n, h, w, c) with a kernel (kh, kw, c,
filters), Conv1D on sequences x (n, steps, c) with a kernel (k, c, filters), Conv2DTranspose,
DepthwiseConv2D and SeparableConv2D (a DepthwiseConv2D, then a 1x1 Conv2D); Keras's padding.
Both run the backend's conv2d kernels: a sequence is a one-row image and a (k, c, filters)
kernel a (1, k, c, filters) one, which is exact (the same products, summed in the same order)."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import activations, base
from pserver.layers.base import KernelLayer, Layer, Weight, pair, positive_int, rows


class _Convolution(KernelLayer):
    """The backend's conv2d kernels (on the CPU im2col + GEMM, or Winograd's F(2x2, 3x3) for a
    3x3 kernel of stride 1 from 16 channels or more). A subclass sets `strides2d` (along
    height and width) and, at build, pad_top and pad_left; `image` views an array (the input,
    the output or a gradient) as (n, h, w, c) and `kernel4d` the kernel as (kh, kw, c, f)."""

    def __init__(self, filters: int, activation, use_bias: bool, kernel_initializer, bias_initializer,
                 **kwargs):
        self.filters = positive_int(type(self).__name__, "filters", filters)
        super().__init__(self.filters, activation, use_bias, kernel_initializer, bias_initializer,
                         **kwargs)

    def image(self, a):
        return a

    def kernel4d(self, w):
        return w

    def forward_elements(self):
        window = int(np.prod(self.kernel_shape()[:-1]))
        return super().forward_elements() + int(np.prod(self.output_shape[:-1])) * window

    def forward(self, k, p, x, out, s, run):
        relu = self.activation == "relu"
        w, b, x4, out4 = self.kernel4d(p["kernel"]), self.bias(p, s), self.image(x), self.image(out)
        # In training, a backend with conv2d_forward_cols (the CPU ones: CPU_KERNELS) keeps the
        # im2col matrix of x (or its Winograd transform, which fits in the same buffer) for the
        # backward pass, in a scratch buffer made at the first training step of this batch size
        # (evaluation and the GPU never make one).
        keep = getattr(k, "conv2d_forward_cols", None) if run.training else None
        if keep is None:
            s["cols_of"] = None
            k.conv2d_forward(x4, w, b, out4, *self.strides2d, self.pad_top, self.pad_left, relu)
        else:
            if "cols" not in s:
                s["cols"] = np.empty((out.size // self.filters, int(np.prod(self.kernel_shape()[:-1]))),
                                     out.dtype)
            keep(x4, w, b, out4, s["cols"], *self.strides2d, self.pad_top, self.pad_left, relu)
            s["cols_of"] = x
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        w, dw, db = self.kernel4d(p["kernel"]), self.kernel4d(g["kernel"]), self.dbias(g, s)
        dx4 = None if dx is None else self.image(dx)
        if s.get("cols_of") is x:          # this step's forward kept them; used once
            s["cols_of"] = None
            relu = self.activation == "relu"              # fused into the kernel's pass over dout
            if not relu:
                activations.backward(k, self.activation, out, dout)
            k.conv2d_backward_cols(s["cols"], w, self.image(out), self.image(dout), dx4, dw, db,
                                   *self.strides2d, self.pad_top, self.pad_left, relu)
            return
        activations.backward(k, self.activation, out, dout)
        k.conv2d_backward(self.image(x), w, self.image(dout), dx4, dw, db, *self.strides2d,
                          self.pad_top, self.pad_left)


class Conv2D(_Convolution):
    kind = "conv2d"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", activation=None,
                 use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        super().__init__(filters, activation, use_bias, kernel_initializer, bias_initializer, **kwargs)
        self.kernel_size = pair("Conv2D", "kernel_size", kernel_size)
        self.strides = self.strides2d = pair("Conv2D", "strides", strides)
        self.padding = base.padding("Conv2D", padding)

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        (oh, self.pad_top), (ow, self.pad_left) = window_output(
            self, input_shape, self.kernel_size, self.strides, self.padding, "kernel")
        return (oh, ow, self.filters)

    def kernel_shape(self):
        return (*self.kernel_size, self.input_shape[2], self.filters)


class Conv1D(_Convolution):
    """Keras's Conv1D on (steps, channels); padding 'causal' pads kernel_size - 1 steps before
    the sequence and none after (an output step sees its own input step and earlier ones)."""
    kind = "conv1d"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", data_format=None,
                 dilation_rate=1, groups: int = 1, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(filters, activation, use_bias, kernel_initializer, bias_initializer, **kwargs)
        self.kernel_size = (single("Conv1D", "kernel_size", kernel_size),)
        self.strides = (single("Conv1D", "strides", strides),)
        self.strides2d = (1, self.strides[0])
        if not isinstance(padding, str) or padding.lower() not in ("valid", "same", "causal"):
            raise ConfigError(f"Conv1D: padding must be 'valid', 'same' or 'causal', got {padding!r}")
        self.padding = padding.lower()
        base.channels_last("Conv1D", data_format)
        for what, value in (("dilation_rate", dilation_rate), ("groups", groups)):
            if single("Conv1D", what, value) != 1:
                raise ConfigError(f"Conv1D: {what}={value!r} is not supported (1 only)")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 2, "a sequence (steps, channels)")
        from pserver.kernels import conv_output
        (size,), (stride,), steps = self.kernel_size, self.strides, input_shape[0]
        causal = self.padding == "causal"
        out, self.pad_left = ((-(-steps // stride), size - 1) if causal
                              else conv_output(steps, size, stride, self.padding))
        if out < 1:
            raise ConfigError(f"{self.label}: kernel_size {size} is larger than its input {input_shape} "
                              f"(steps {steps}) with padding 'valid'")
        self.pad_top = 0
        return (out, self.filters)

    def kernel_shape(self):
        return (*self.kernel_size, self.input_shape[1], self.filters)

    def image(self, a):
        # a view either way: a device array (--device cuda) takes no None index, and a host
        # array's reshape could copy where the kernel must write in place
        return a[:, None] if isinstance(a, np.ndarray) else a.reshape(a.shape[0], 1, *a.shape[1:])

    def kernel4d(self, w):
        return w[None] if isinstance(w, np.ndarray) else w.reshape(1, *w.shape)


class Conv2DTranspose(KernelLayer):
    """Keras's Conv2DTranspose: the transpose (the input gradient) of the Conv2D with this
    kernel, strides and padding that maps the output's shape to the input's. The kernel is
    (kh, kw, filters, in_channels), Keras's, which is that Conv2D's own layout; the output is
    in * stride + max(kernel - stride, 0) long ('valid') or in * stride ('same'), as Keras's
    without output_padding. Forward is conv2d_backward's input gradient (its weight gradient,
    into a sink, doubles the cost: the price of no kernel of its own), backward a conv2d_forward
    and a conv2d_backward's weight gradient."""
    kind = "conv2d_transpose"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", output_padding=None,
                 data_format=None, dilation_rate=1, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        self.filters = positive_int("Conv2DTranspose", "filters", filters)
        super().__init__(self.filters, activation, use_bias, kernel_initializer, bias_initializer,
                         **kwargs)
        self.kernel_size = pair("Conv2DTranspose", "kernel_size", kernel_size)
        self.strides = pair("Conv2DTranspose", "strides", strides)
        self.padding = base.padding("Conv2DTranspose", padding)
        base.channels_last("Conv2DTranspose", data_format)
        if output_padding is not None:
            raise ConfigError(f"Conv2DTranspose: output_padding={output_padding!r} is not supported (None "
                              "only)")
        if pair("Conv2DTranspose", "dilation_rate", dilation_rate) != (1, 1):
            raise ConfigError(f"Conv2DTranspose: dilation_rate={dilation_rate!r} is not supported (1 only)")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        from pserver.kernels import conv_output
        dims = [size * stride + (max(k - stride, 0) if self.padding == "valid" else 0)
                for size, k, stride in zip(input_shape[:2], self.kernel_size, self.strides)]
        # The Conv2D this layer transposes maps dims back to the input's (height, width).
        self.pad_top, self.pad_left = (conv_output(d, k, stride, self.padding)[1]
                                       for d, k, stride in zip(dims, self.kernel_size, self.strides))
        return (*dims, self.filters)

    def kernel_shape(self):
        return (*self.kernel_size, self.filters, self.input_shape[2])

    def scratch(self, n, dtype):
        # Zeros in place of the transposed Conv2D's input, sinks for the gradients not wanted.
        return {**super().scratch(n, dtype), "zeros": np.zeros((n, *self.output_shape), dtype),
                "dw": np.empty(self.kernel_shape(), dtype), "db": np.empty(self.input_shape[2], dtype),
                "no_bias": np.zeros(self.input_shape[2], dtype)}

    @property
    def _window(self):
        return (*self.strides, self.pad_top, self.pad_left)

    def forward(self, k, p, x, out, s, run):
        k.conv2d_backward(s["zeros"], p["kernel"], x, out, s["dw"], s["db"], *self._window)
        k.elementwise("add", out, self.bias(p, s), out)
        activations.forward_unfused(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        activations.backward(k, self.activation, out, dout)
        k.sum_to(rows(dout), self.dbias(g, s).reshape(1, self.filters))
        k.conv2d_backward(dout, p["kernel"], x, None, g["kernel"], s["db"], *self._window)
        if dx is not None:
            k.conv2d_forward(dout, p["kernel"], s["no_bias"], dx, *self._window, False)


class DepthwiseConv2D(KernelLayer):
    """Keras's DepthwiseConv2D: each channel convolved with its own depth_multiplier kernels,
    kernel (kh, kw, c, m), output channel c * m + j (TensorFlow's order). A few products per
    output value, so memory-bound: NumPy in both passes (a loop over the kernel's offsets, as
    pserver.kernels.reference's convolution), on any backend but the GPU (refused)."""
    kind = "depthwise_conv2d"

    def __init__(self, kernel_size, strides=1, padding="valid", depth_multiplier: int = 1,
                 data_format=None, dilation_rate=1, activation=None, use_bias: bool = True,
                 depthwise_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        self.depth_multiplier = positive_int("DepthwiseConv2D", "depth_multiplier", depth_multiplier)
        super().__init__(0, activation, use_bias, depthwise_initializer, bias_initializer, **kwargs)
        self.kernel_size = pair("DepthwiseConv2D", "kernel_size", kernel_size)
        self.strides = pair("DepthwiseConv2D", "strides", strides)
        self.padding = base.padding("DepthwiseConv2D", padding)
        base.channels_last("DepthwiseConv2D", data_format)
        if pair("DepthwiseConv2D", "dilation_rate", dilation_rate) != (1, 1):
            raise ConfigError(f"DepthwiseConv2D: dilation_rate={dilation_rate!r} is not supported (1 only)")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        (oh, self.pad_top), (ow, self.pad_left) = window_output(
            self, input_shape, self.kernel_size, self.strides, self.padding, "kernel")
        self.width = input_shape[2] * self.depth_multiplier        # the bias's
        return (oh, ow, self.width)

    def kernel_shape(self):
        return (*self.kernel_size, self.input_shape[2], self.depth_multiplier)

    def _padded(self, n, dtype):
        """Zeros holding the image at (pad_top, pad_left) and every window, and that region."""
        (oh, ow, _), (kh, kw), (sh, sw), (h, w, c) = (self.output_shape, self.kernel_size, self.strides,
                                                      self.input_shape)
        hp, wp = max(self.pad_top + h, (oh - 1) * sh + kh), max(self.pad_left + w, (ow - 1) * sw + kw)
        inner = (slice(None), slice(self.pad_top, self.pad_top + h), slice(self.pad_left, self.pad_left + w))
        return np.zeros((n, hp, wp, c), dtype), inner

    def _windows(self, xp):
        """(i, j, the (n, oh, ow, c) view of xp at kernel offset (i, j)) for every offset."""
        (oh, ow, _), (sh, sw) = self.output_shape, self.strides
        for i in range(self.kernel_size[0]):
            for j in range(self.kernel_size[1]):
                yield i, j, xp[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw]

    def _split(self, a):
        return a.reshape(*a.shape[:3], self.input_shape[2], self.depth_multiplier)

    def forward(self, k, p, x, out, s, run):
        xp, inner = self._padded(x.shape[0], x.dtype)
        xp[inner] = x
        out4 = self._split(out)
        out4[...] = self.bias(p, s).reshape(self.kernel_shape()[2:])
        for i, j, window in self._windows(xp):
            out4 += window[..., None] * p["kernel"][i, j]
        activations.forward_unfused(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        activations.backward(k, self.activation, out, dout)
        np.sum(dout.reshape(-1, self.width), axis=0, out=self.dbias(g, s))
        xp, inner = self._padded(x.shape[0], x.dtype)
        xp[inner] = x
        d4 = self._split(dout)
        for i, j, window in self._windows(xp):
            g["kernel"][i, j] = np.einsum("nhwc,nhwcm->cm", window, d4)
        if dx is not None:
            xp[...] = 0                                   # now the padded image's gradient
            for i, j, window in self._windows(xp):
                window += np.einsum("nhwcm,cm->nhwc", d4, p["kernel"][i, j])
            dx[...] = xp[inner]


class SeparableConv2D(Layer):
    """Keras's SeparableConv2D: a DepthwiseConv2D (kernel_size, strides, padding, depth_multiplier;
    no bias) then a 1x1 Conv2D to `filters` with the bias and the activation, each through its
    own layer's kernels here. Weights depthwise_kernel (kh, kw, c, m), pointwise_kernel
    (1, 1, c * m, filters), bias (filters,), as Keras's."""
    kind = "separable_conv2d"

    def __init__(self, filters: int, kernel_size, strides=1, padding="valid", data_format=None,
                 dilation_rate=1, depth_multiplier: int = 1, activation=None, use_bias: bool = True,
                 depthwise_initializer="glorot_uniform", pointwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None, pointwise_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, depthwise_constraint=None,
                 pointwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(**kwargs)
        given = dict(depthwise_regularizer=depthwise_regularizer, pointwise_regularizer=pointwise_regularizer,
                     bias_regularizer=bias_regularizer, activity_regularizer=activity_regularizer,
                     depthwise_constraint=depthwise_constraint, pointwise_constraint=pointwise_constraint,
                     bias_constraint=bias_constraint)
        bad = {k: v for k, v in given.items() if v is not None}
        if bad:
            k = sorted(bad)[0]
            raise ConfigError(f"SeparableConv2D: {k}={bad[k]!r} is not supported (docs/guide/keras.md)")
        base.channels_last("SeparableConv2D", data_format)
        self.depthwise = DepthwiseConv2D(kernel_size, strides, padding, depth_multiplier,
                                         dilation_rate=dilation_rate, use_bias=False,
                                         depthwise_initializer=depthwise_initializer)
        self.pointwise = Conv2D(filters, 1, activation=activation, use_bias=use_bias,
                                kernel_initializer=pointwise_initializer, bias_initializer=bias_initializer)
        self.filters, self.use_bias = self.pointwise.filters, self.pointwise.use_bias

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 3, "an image (height, width, channels)")
        self.depthwise.name = self.pointwise.name = self.name       # errors name this layer
        return self.pointwise.build(self.depthwise.build(input_shape))

    def weights(self):
        depthwise, pointwise = self.depthwise.weights()[0], self.pointwise.weights()
        return [Weight("depthwise_kernel", depthwise.shape, depthwise.initializer),
                Weight("pointwise_kernel", pointwise[0].shape, pointwise[0].initializer), *pointwise[1:]]

    def forward_elements(self):
        return self.depthwise.forward_elements() + self.pointwise.forward_elements()

    def scratch(self, n, dtype):
        return {"mid": np.empty((n, *self.depthwise.output_shape), dtype),
                "dmid": np.empty((n, *self.depthwise.output_shape), dtype),
                "depthwise": self.depthwise.scratch(n, dtype), "pointwise": self.pointwise.scratch(n, dtype)}

    def _pointwise(self, weights: dict) -> dict:
        return {"kernel": weights["pointwise_kernel"], **({"bias": weights["bias"]} if self.use_bias else {})}

    def forward(self, k, p, x, out, s, run):
        self.depthwise.forward(k, {"kernel": p["depthwise_kernel"]}, x, s["mid"], s["depthwise"], run)
        self.pointwise.forward(k, self._pointwise(p), s["mid"], out, s["pointwise"], run)

    def backward(self, k, p, g, x, out, dout, dx, s):
        self.pointwise.backward(k, self._pointwise(p), self._pointwise(g), s["mid"], out, dout, s["dmid"],
                                s["pointwise"])
        self.depthwise.backward(k, {"kernel": p["depthwise_kernel"]}, {"kernel": g["depthwise_kernel"]}, x,
                                s["mid"], s["dmid"], dx, s["depthwise"])


def single(owner: str, what: str, value) -> int:
    """Keras's int-or-1-tuple arguments of a 1-D layer (kernel_size, strides) as an int."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return positive_int(owner, what, value)


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
