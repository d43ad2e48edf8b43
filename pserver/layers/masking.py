"""Keras's Masking: marks the padded steps of a sequence of features for the layers after it.

A step (n, t) whose features all equal `mask_value` is masked: the layer's output there is zeros,
and the output carries the mask (Symbolic.mask, 0 at masked steps) that the recurrent layers,
MultiHeadAttention and GlobalAveragePooling1D read, through layers that pass masks on (Dense,
Dropout, activations, normalizations), as Keras's. Made of ops (its gradient passes where a step
is kept).
"""

from __future__ import annotations

from pserver.errors import ConfigError
from pserver.layers.traced import TracedLayer
from pserver.ops import reduce
from pserver.ops.core import Symbolic
from pserver.ops.math import cast, not_equal
from pserver.ops.shape import expand_dims


class Masking(TracedLayer):
    """Masking(mask_value=0.0) on sequences (steps, features)."""

    kind = "masking"

    def __init__(self, mask_value=0.0, **kwargs):
        super().__init__(**kwargs)
        try:
            self.mask_value = float(mask_value)
        except (TypeError, ValueError):
            raise ConfigError(f"Masking: mask_value must be a number, got {mask_value!r}") from None

    def __call__(self, inputs, training=None, **kwargs):
        if isinstance(inputs, Symbolic) and len(inputs.shape) != 3:
            raise ConfigError(f"{self.label}: takes sequences (steps, features), got shape "
                              f"{inputs.shape[1:]}")
        return super().__call__(inputs, training=training, **kwargs)

    def _kept(self, x):
        """(batch, steps): 1 where a step has a feature other than mask_value."""
        return reduce.max(cast(not_equal(x, self.mask_value), "float32"), axis=-1)

    def call(self, inputs, training=None):
        return inputs * expand_dims(self._kept(inputs), -1)

    def compute_mask(self, inputs, previous_mask):
        return self._kept(inputs)


__all__ = ["Masking"]
