"""Flatten: (n, d1, d2, ...) -> (n, d1*d2*...), a view in both directions (no kernel, no copy)."""

from __future__ import annotations

import math

from pserver.layers.base import Layer


class Flatten(Layer):
    kind = "flatten"
    reshapes_only = True

    def output_shape_for(self, input_shape):
        return (math.prod(input_shape),)
