"""keras.datasets: mnist."""

from pserver.keras.datasets import mnist

__all__ = ["mnist"]
