"""Activation(activation): a Keras activation by name as a layer of its own; ReLU(), Keras's
layer of the rectifier (keras.io's timeseries classifier writes it)."""

from __future__ import annotations

from pserver.errors import ConfigError
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


class ReLU(Activation):
    """keras.layers.ReLU(): max(x, 0), as Activation("relu"). Keras's max_value, negative_slope
    and threshold are taken at their defaults only; another value is refused in one line."""
    kind = "re_lu"

    def __init__(self, max_value=None, negative_slope=0.0, threshold=0.0, **kwargs):
        given = {"max_value": max_value, "negative_slope": negative_slope, "threshold": threshold}
        defaults = {"max_value": None, "negative_slope": 0.0, "threshold": 0.0}
        for arg, value in given.items():
            if value != defaults[arg]:
                raise ConfigError(f"ReLU: {arg}={value!r} is not supported by pserver (only ReLU's "
                                  f"default, {defaults[arg]!r}: max(x, 0))")
        super().__init__("relu", **kwargs)
