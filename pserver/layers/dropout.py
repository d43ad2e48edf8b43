"""Dropout(rate): in training, zero each input with probability `rate` and scale the rest by
1 / (1 - rate) (inverted dropout, as Keras); at inference, the identity.

The mask comes from a seed the worker derives from (run seed, rank, step), so a run repeats
exactly and no two workers or steps share a mask.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer


class Dropout(Layer):
    kind = "dropout"

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ConfigError(f"Dropout: rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)
        self.seed = 0 if seed is None else int(seed)   # mixed into the per-step seed

    def output_shape_for(self, input_shape):
        return input_shape

    def scratch(self, n, dtype):
        return {"mask": np.empty((n, *self.output_shape), dtype)}

    def forward(self, k, p, x, out, s, run):
        if run.training and self.rate > 0:
            k.dropout_forward(x, out, s["mask"], self.rate, (run.seed + self.seed) % (1 << 63))
        else:
            k.copy(x, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is None:
            return
        if self.rate > 0:
            k.dropout_backward(dout, s["mask"], dx)
        else:
            k.copy(dout, dx)
