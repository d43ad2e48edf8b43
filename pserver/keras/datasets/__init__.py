"""keras.datasets: mnist."""

from pserver.keras._names import missing as _missing
from pserver.keras.datasets import mnist

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["mnist"]
