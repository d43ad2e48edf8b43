"""Dense: y = activation(x @ kernel + bias), kernel (in, units), on the last axis of its input as
Keras's: (n, in) -> (n, units), (n, steps, in) -> (n, steps, units) (every row of the flattened
leading axes through the same kernels)."""

from __future__ import annotations

from pserver.layers import activations, base
from pserver.layers.base import KernelLayer, positive_int


class Dense(KernelLayer):
    kind = "dense"
    supports_masking = True

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        self.units = positive_int("Dense", "units", units)
        super().__init__(self.units, activation, use_bias, kernel_initializer, bias_initializer,
                         **kwargs)

    def output_shape_for(self, input_shape):
        return (*input_shape[:-1], self.units)

    def kernel_shape(self):
        return (self.input_shape[-1], self.units)

    rows = staticmethod(base.rows)

    def forward(self, k, p, x, out, s, run):
        x, out = self.rows(x), self.rows(out)
        k.dense_forward(x, p["kernel"], self.bias(p, s), out, self.activation == "relu")
        activations.forward(k, self.activation, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        x, out, dout, dx = self.rows(x), self.rows(out), self.rows(dout), self.rows(dx)
        activations.backward(k, self.activation, out, dout)
        if dx is None:
            k.dense_param_grads(x, dout, g["kernel"], self.dbias(g, s))
        else:
            k.dense_backward(x, p["kernel"], dout, g["kernel"], self.dbias(g, s), dx, False)
