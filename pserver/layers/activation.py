"""Activation(activation): a Keras activation by name as a layer of its own."""

from __future__ import annotations

from pserver.layers import activations
from pserver.layers.base import Layer


class Activation(Layer):
    kind = "activation"
    supports_masking = True

    def __init__(self, activation, **kwargs):
        super().__init__(**kwargs)
        # A softmax is fused into the loss, on the model's output only (see Sequential._link_loss).
        self.activation = activations.get(activation, "Activation")

    def output_shape_for(self, input_shape):
        return input_shape

    def forward(self, k, p, x, out, s, run):
        k.activation_forward(self.activation, x, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.activation_backward(self.activation, out, dout, dx)
