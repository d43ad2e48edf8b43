"""Rescaling(scale, offset=0.0): x * scale + offset (Keras's; a list scales each channel)."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer


def _factor(what: str, value) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        a = None
    if a is None or a.ndim > 1 or not np.all(np.isfinite(a)):
        raise ConfigError(f"Rescaling: {what} must be a finite number or a list of them (one per "
                          f"channel), got {value!r}")
    return a


class Rescaling(Layer):
    """x * scale + offset; a list gives each channel (the last axis) its own."""

    kind = "rescaling"

    def __init__(self, scale, offset=0.0, **kwargs):
        super().__init__(**kwargs)
        self.scale, self.offset = _factor("scale", scale), _factor("offset", offset)

    def output_shape_for(self, input_shape):
        for what, a in (("scale", self.scale), ("offset", self.offset)):
            if a.ndim and a.size not in (1, input_shape[-1]):
                raise ConfigError(f"{self.label}: {what} has {a.size} values for {input_shape[-1]} channels")
        return input_shape

    def forward(self, k, p, x, out, s, run):
        np.multiply(x, self.scale.astype(x.dtype), out=out)
        out += self.offset.astype(x.dtype)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            np.multiply(dout, self.scale.astype(dout.dtype), out=dx)


__all__ = ["Rescaling"]
