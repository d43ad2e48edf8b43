"""Dense: y = activation(x @ kernel + bias), kernel (in, units), on a flat input (n, in)."""

from __future__ import annotations

from pserver.layers import activations
from pserver.layers.base import KernelLayer, positive_int


class Dense(KernelLayer):
    kind = "dense"

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        self.units = positive_int("Dense", "units", units)
        super().__init__(self.units, activation, use_bias, kernel_initializer, bias_initializer,
                         **kwargs)

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 1, "a flat (features,)")   # put Flatten() before it
        return (self.units,)

    def kernel_shape(self):
        return (self.input_shape[0], self.units)

    def forward(self, k, p, x, out, s, run):
        k.dense_forward(x, p["kernel"], self.bias(p, s), out, self.activation == "relu")
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        activations.backward(k, self.activation, out, dout)
        if dx is None:
            k.dense_param_grads(x, dout, g["kernel"], self.dbias(g, s))
        else:
            k.dense_backward(x, p["kernel"], dout, g["kernel"], self.dbias(g, s), dx, False)
