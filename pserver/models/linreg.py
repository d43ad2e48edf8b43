"""Linear regression: one Dense layer to a single output, mean squared error."""

from __future__ import annotations

from pserver.layers import Dense
from pserver.models.mlp import lecun
from pserver.models.sequential import Sequential


def linreg(input_shape: tuple[int, ...]) -> Sequential:
    return Sequential([Dense(1, kernel_initializer=lecun())], input_shape=input_shape,
                      name="linreg", loss="mean_squared_error")
