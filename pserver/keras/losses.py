"""keras.losses: the losses by Keras's class names (from_logits follows the last layer unless given)."""

from pserver.keras._names import missing as _missing
from pserver.models.losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
)

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Loss", "SparseCategoricalCrossentropy", "CategoricalCrossentropy", "BinaryCrossentropy",
           "MeanSquaredError"]
