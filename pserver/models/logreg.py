"""Multinomial logistic regression: one Dense layer to num_classes logits, softmax cross-entropy."""

from __future__ import annotations

from pserver.layers import Dense
from pserver.models.mlp import lecun
from pserver.models.sequential import Sequential


def logreg(input_shape: tuple[int, ...], num_classes: int) -> Sequential:
    return Sequential([Dense(num_classes, kernel_initializer=lecun())], input_shape=input_shape,
                      name="logreg")
