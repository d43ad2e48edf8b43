"""keras.activations: the activation functions by Keras's names, as pserver.ops (so that a
layer's call may write keras.activations.relu(x), as keras.io's guides do)."""

from pserver.keras._names import missing as _missing
from pserver.ops import relu, sigmoid, softmax, tanh


def linear(x):
    """The identity, as Keras's."""
    return x


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["relu", "sigmoid", "tanh", "softmax", "linear"]
