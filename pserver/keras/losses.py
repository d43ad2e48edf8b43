"""keras.losses: the losses by Keras's class names (from_logits follows the last layer unless given)."""

from pserver.models.losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
)

__all__ = ["Loss", "SparseCategoricalCrossentropy", "CategoricalCrossentropy", "BinaryCrossentropy",
           "MeanSquaredError"]
