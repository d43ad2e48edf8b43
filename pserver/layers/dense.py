"""Dense: y = activation(x @ kernel + bias), kernel (in, units), on a flat input (n, in)."""

from __future__ import annotations

import numpy as np

from pserver.layers import activations, initializers
from pserver.layers.base import Layer, Weight, positive_int


class Dense(Layer):
    kind = "dense"

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.units = positive_int("Dense", "units", units)
        self.activation = activations.get(activation, "Dense")
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer, "Dense: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, "Dense: bias_initializer")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 1, "a flat (features,)")   # put Flatten() before it
        return (self.units,)

    def weights(self):
        w = [Weight("kernel", (self.input_shape[0], self.units), self.kernel_initializer)]
        if self.use_bias:
            w.append(Weight("bias", (self.units,), self.bias_initializer))
        return w

    def scratch(self, n, dtype):
        # Without a bias the kernels still add one and write its gradient: zeros, and a sink.
        return {} if self.use_bias else {"bias": np.zeros(self.units, dtype),
                                         "dbias": np.empty(self.units, dtype)}

    def forward(self, k, p, x, out, s, run):
        bias = p["bias"] if self.use_bias else s["bias"]
        k.dense_forward(x, p["kernel"], bias, out, self.activation == "relu")
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        activations.backward(k, self.activation, out, dout)
        dbias = g["bias"] if self.use_bias else s["dbias"]
        if dx is None:
            k.dense_param_grads(x, dout, g["kernel"], dbias)
        else:
            k.dense_backward(x, p["kernel"], dout, g["kernel"], dbias, dx, False)
