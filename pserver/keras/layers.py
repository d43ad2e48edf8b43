"""keras.layers: pserver's layers by Keras's names (pserver.layers), and Input."""

from pserver.keras._names import missing as _missing
from pserver.keras.models import Input
from pserver.layers import (
    FM,
    AveragePooling2D,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    Layer,
    MaxPooling2D,
)

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Input", "Layer", "Dense", "Conv2D", "MaxPooling2D", "AveragePooling2D", "Flatten", "Dropout",
           "Embedding", "FM"]
