"""Flatten: (n, d1, d2, ...) -> (n, d1*d2*...), a view in both directions (no kernel, no copy)."""

from __future__ import annotations

import math

from pserver.layers.base import Layer


class Flatten(Layer):
    kind = "flatten"
    reshapes_only = True

    def output_shape_for(self, input_shape):
        return (math.prod(input_shape),)

    # Sequential passes views through a layer that only reshapes (reshapes_only) and never
    # calls these; they say what the layer computes, for a caller that gives it buffers.
    def forward(self, k, p, x, out, s, run) -> None:
        out[...] = x.reshape(out.shape)

    def backward(self, k, p, g, x, out, dout, dx, s) -> None:
        if dx is not None:
            dx[...] = dout.reshape(dx.shape)
