"""Dropout(rate): in training, zero each input with probability `rate` and scale the rest by
1 / (1 - rate) (inverted dropout, as Keras); at inference, the identity.

The mask comes from a seed the worker derives from (run seed, rank, step), so a run repeats
exactly and no two workers or steps share a mask.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer


def rate_of(owner: str, what: str, rate) -> float:
    """A dropout rate (Dropout's, MultiHeadAttention's, a recurrent layer's) in [0, 1), or one line."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ConfigError(f"{owner}: {what} must be in [0, 1), got {rate!r}")
    return float(rate)


def seed_of(seed) -> int:
    """A layer's `seed=`, mixed into each step's seed (step_seed)."""
    return 0 if seed is None else int(seed)


def step_seed(run, seed: int) -> int:
    """The seed of a layer's dropout mask in this pass: the step's (run seed, rank, step) and the
    layer's own."""
    return (run.seed + seed) % (1 << 63)


class Dropout(Layer):
    kind = "dropout"
    supports_masking = True

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate_of("Dropout", "rate", rate)
        self.seed = seed_of(seed)

    def output_shape_for(self, input_shape):
        return input_shape

    def scratch(self, n, dtype):
        return {"mask": np.empty((n, *self.output_shape), dtype)}

    def forward(self, k, p, x, out, s, run):
        if run.training and self.rate > 0:
            k.dropout_forward(x, out, s["mask"], self.rate, step_seed(run, self.seed))
        else:
            k.copy(x, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is None:
            return
        if self.rate > 0:
            k.dropout_backward(dout, s["mask"], dx)
        else:
            k.copy(dout, dx)
